"""Sampling stays lossless: the drafter reports the exact q it sampled from, and outputs follow the target's p."""

from __future__ import annotations

import torch
from transformers.generation import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from conftest import make_drafter, tiny_target
from hf_d3d import D3DCandidateGenerator
from hf_d3d.evaluate import count_forwards
from hf_d3d.modeling.attention_d3d import pack_blocks


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with tiny expectation are pooled so the test stays valid."""
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def test_reported_q_is_the_sampling_distribution():
    target = tiny_target("llama", vocab=16, seed=3)
    drafter = make_drafter(target, block_size=3)
    processors = LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8), TopKLogitsWarper(6)]
    )
    x = torch.tensor([[4, 5, 6, 7]])
    ids, layout = pack_blocks(x, 0, [3], 3, 0)
    with torch.no_grad():
        raw = drafter(ids, layout=layout, use_cache=False).logits[:, 4:].float()

    torch.manual_seed(0)
    first_counts = torch.zeros(16)
    reported = None
    for trial in range(3000):
        gen = D3DCandidateGenerator(drafter, processors, do_sample=True)
        seq, scores = gen.get_candidates(x)
        draft = seq[0, 4:]
        if trial < 20:
            # Each slot's scores are the processors applied to its raw logits given the tokens drafted before it.
            for i in range(3):
                torch.testing.assert_close(scores[:, i], processors(seq[:, : 4 + i], raw[:, i].clone()))
        first_counts[draft[0]] += 1
        reported = scores[0, 0].softmax(-1) if reported is None else reported
        torch.testing.assert_close(scores[0, 0].softmax(-1), reported)  # slot 0 does not depend on the draw
    assert chi_square_pvalue(first_counts, reported) > 1e-3
    assert (first_counts[reported == 0] == 0).all()  # top-k: nothing drawn outside the support


def _target_joint(target, x, processors):
    """Exact p(x1, x2 | x) of the target under the same logits processors."""
    p1 = processors(x, target(x).logits[:, -1].float()).softmax(-1)[0]
    vocab = p1.shape[0]
    joint = torch.zeros(vocab, vocab)
    for t in range(vocab):
        seq = torch.cat([x, torch.tensor([[t]])], dim=1)
        joint[t] = p1[t] * processors(seq, target(seq).logits[:, -1].float()).softmax(-1)[0]
    return joint.reshape(-1)


def sample_two_tokens(target, drafter, x, seed: int, draws: int = 2500) -> tuple[torch.Tensor, int]:
    """Counts of (x1, x2) drawn by assisted sampling at temperature 0.5, and how many draws accepted the draft."""
    vocab = target.config.vocab_size
    kw = dict(do_sample=True, temperature=0.5, top_k=0, top_p=1.0, max_new_tokens=2, eos_token_id=None)
    torch.manual_seed(seed)
    counts = torch.zeros(vocab * vocab)
    accepted_any = 0
    for _ in range(draws):
        with count_forwards(target) as calls:
            out = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=drafter, **kw)
        a, b = out[0, x.shape[1] : x.shape[1] + 2].tolist()
        counts[a * vocab + b] += 1
        accepted_any += calls["n"] == 1  # two tokens from one verification: the draft token was accepted
    return counts, accepted_any


def test_speculative_sampling_matches_target_distribution():
    target = tiny_target("qwen3", vocab=12, seed=5)
    drafter = make_drafter(target, block_size=2)
    x = torch.tensor([[4, 7, 9]])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5)])
    with torch.no_grad():
        joint = _target_joint(target, x, processors)
    counts, accepted_any = sample_two_tokens(target, drafter, x, seed=1234)
    assert accepted_any > 100  # drafts really were accepted, so the accept/resample path was exercised
    assert chi_square_pvalue(counts, joint) > 1e-3


def test_truncating_warpers_and_a_penalty_keep_both_paths_lossless():
    """Top-k and top-p that cut the vocabulary, with a repetition penalty: the first two tokens drawn through
    ``generate(assistant_model=...)`` and through the fast loop follow the target's own sampling distribution."""
    from transformers import GenerationConfig

    from hf_d3d import speculative_generate

    target = tiny_target("qwen3", vocab=12, seed=5)
    drafter = make_drafter(target, block_size=2)
    x = torch.tensor([[4, 7, 9, 7]])
    settings = dict(do_sample=True, temperature=0.7, top_k=4, top_p=0.9, repetition_penalty=1.3)
    # the processors generate builds for these settings, in its order
    processors = target._get_logits_processor(
        GenerationConfig(**settings), input_ids_seq_length=x.shape[1], encoder_input_ids=x
    )
    with torch.no_grad():
        joint = _target_joint(target, x, processors)
    assert (joint > 0).sum() < 40  # the cut is real: most of the 144 pairs cannot be drawn
    kw = dict(settings, max_new_tokens=3, eos_token_id=None)  # 3: the first round drafts two tokens
    runs = {
        "hub": lambda: target.generate(x, attention_mask=torch.ones_like(x), assistant_model=drafter, **kw),
        "fast": lambda: speculative_generate(target, drafter, x, **kw),
    }
    for name, run in runs.items():
        torch.manual_seed(7)
        counts, accepted = torch.zeros(144), 0
        for _ in range(1500):
            with count_forwards(target) as calls:
                out = run()
            a, b = out[0, x.shape[1] : x.shape[1] + 2].tolist()
            counts[a * 12 + b] += 1
            accepted += calls["n"] < 3  # 3 tokens in fewer target forwards: a draft token was accepted
        assert accepted > 100, name  # the accept rule ran, not only the draws after a rejection
        assert (counts[joint == 0] == 0).all(), name  # nothing outside the target's support
        assert chi_square_pvalue(counts, joint) > 1e-3, name
