"""Async packed drafting: lossless output, packed logits equal single-hypothesis runs, hit/miss bookkeeping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sampling import _target_joint, chi_square_pvalue
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper

from conftest import FAMILIES, VOCAB, make_drafter, prompts, tiny_target
from hf_d3d import D3DCandidateGenerator
from hf_d3d.modeling import generation_d3d
from hf_d3d.modeling.attention_d3d import pack_blocks
from hf_d3d.modeling.generation_d3d import choose_hypotheses

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}


def async_drafter(target, block):
    drafter = make_drafter(target, block_size=block)
    drafter.config.async_drafting = True
    return drafter


DRAFTERS = {(fam, b): async_drafter(t, b) for fam, t in TARGETS.items() for b in (1, 2, 4, 8, 16)}


@settings(max_examples=40)
@given(
    family=FAMILIES,
    block=st.sampled_from([1, 2, 4, 8, 16]),
    prompt=prompts(24),
    max_new=st.integers(1, 40),
    eos_on=st.booleans(),
)
def test_async_greedy_is_lossless(family, block, prompt, max_new, eos_on):
    target, drafter = TARGETS[family], DRAFTERS[(family, block)]
    x = torch.tensor([prompt])
    kw = dict(
        attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, eos_token_id=3 if eos_on else None
    )
    drafter.last_stats = None
    assert torch.equal(target.generate(x, assistant_model=drafter, **kw), target.generate(x, **kw))
    stats = drafter.last_stats
    if stats is None:  # a single new token: transformers never asks the drafter
        assert max_new == 1
        return
    assert stats.hits + stats.misses <= stats.packed_passes <= stats.rounds


def _committed_logits(drafter, committed: torch.Tensor) -> torch.Tensor:
    """Sync draft logits for a block anchored at the last token of ``committed`` (no cache)."""
    n = committed.shape[1]
    ids, layout = pack_blocks(committed, 0, [n - 1], drafter.config.block_size, 0)
    return drafter(ids, layout=layout, use_cache=False).logits[:, n:]


@torch.no_grad()
def test_packed_hypotheses_equal_single_runs():
    target = TARGETS["qwen3"]
    drafter = async_drafter(target, 4)
    gen = D3DCandidateGenerator(drafter, num_hypotheses=6)
    x = torch.tensor([[5, 9, 13, 21, 34, 55]])
    seq, _ = gen.get_candidates(x)
    pending = gen._pending
    assert pending is not None and len(pending.outcomes) == 6
    draft = seq[:, x.shape[1] :]
    for i, (a, g) in enumerate(pending.outcomes):
        if g is None:  # bonus block: anchored after the full draft, no private token
            ids, layout = pack_blocks(seq, 0, [seq.shape[1] - 1], 4, 0)
            ref = drafter(ids, layout=layout, use_cache=False).logits[:, seq.shape[1] :]
        else:  # as if d_1..d_a were accepted and g committed, then drafted synchronously
            committed = torch.cat([x, draft[:, :a], torch.tensor([[g]])], dim=1)
            ref = _committed_logits(drafter, committed)
        torch.testing.assert_close(pending.logits[i : i + 1], ref, rtol=1e-4, atol=1e-4)


def test_choose_hypotheses_ranks_by_draft_confidence():
    probs = torch.tensor([[0.9, 0.06, 0.04, 0.0], [0.1, 0.2, 0.7, 0.0]])
    draft = [0, 2]
    outcomes = choose_hypotheses(probs, draft, budget=3)
    # P(all accepted) = 0.63 -> bonus; P(d1 ok, g=1 at slot 2) = 0.9 * 0.2 = 0.18; P(g=0) = 0.09; P(a=0, g=1) = 0.06
    assert outcomes == [(2, None), (1, 1), (1, 0)]
    assert (2, None) not in choose_hypotheses(probs, draft, budget=3, with_bonus=False)


def _fixed_outcomes(probs, draft, budget, with_bonus=True):
    """Outcomes independent of the drafter's confidence: a correction at slot 1, one at slot 3, and the bonus."""
    return [(0, (draft[0] + 1) % VOCAB), (2, (draft[2] + 1) % VOCAB), (len(draft), None)]


@torch.no_grad()
@pytest.mark.parametrize("case", ["hit_correction", "hit_bonus", "miss", "budget_exhausted"])
def test_hit_and_miss_bookkeeping(case, monkeypatch):
    monkeypatch.setattr(generation_d3d, "choose_hypotheses", _fixed_outcomes)
    target = TARGETS["llama"]
    drafter = async_drafter(target, 4)
    gen = D3DCandidateGenerator(drafter)
    x = torch.tensor([[7, 8, 9, 10, 11]])
    seq, _ = gen.get_candidates(x)
    pending = gen._pending
    draft = seq[0, 5:].tolist()
    assert gen.cache.get_seq_length() == 5 + 4  # the packed pass cached the draft as context
    if case == "hit_correction":
        i, (a, g) = 1, pending.outcomes[1]
        committed = torch.cat([x, torch.tensor([draft[:a] + [g]])], dim=1)
        expect = pending.logits[i, :]
    elif case == "hit_bonus":
        i = pending.outcomes.index((4, None))
        bonus = int(pending.logits[i, 0].argmax())
        committed = torch.cat([x, torch.tensor([draft + [bonus]])], dim=1)
        a, expect = 4, pending.logits[i, 1:]
    elif case == "miss":
        a = 1
        taken = {g for (aa, g) in pending.outcomes if aa == a}
        g = next(t for t in range(4, VOCAB) if t not in taken and t != draft[a])
        committed = torch.cat([x, torch.tensor([draft[:a] + [g]])], dim=1)
    else:  # max_new_tokens leaves no room: the pending pass is joined and dropped, nothing is drafted
        a, g = 0, pending.outcomes[0][1] if pending.outcomes[0][1] is not None else 4
        committed = torch.cat([x, torch.tensor([[g]])], dim=1)
    hits, misses = gen.stats.hits, gen.stats.misses
    seq2, scores = gen.get_candidates(committed, max_new_tokens=0 if case == "budget_exhausted" else None)
    assert gen._pending is not None or case == "budget_exhausted"
    if case.startswith("hit"):
        assert gen.stats.hits == hits + 1 and gen.stats.misses == misses
        n = expect.shape[0]
        assert torch.equal(seq2[0, committed.shape[1] :], expect.argmax(-1)[:n])
        torch.testing.assert_close(scores[0], expect.float()[: scores.shape[1]])
    elif case == "miss":
        assert gen.stats.misses == misses + 1 and gen.stats.hits == hits
        torch.testing.assert_close(scores, _committed_logits(drafter, committed).float(), rtol=1e-4, atol=1e-4)
    else:
        assert seq2.shape == committed.shape and scores.shape[1] == 0
        assert gen.cache.get_seq_length() == 5 + a  # speculative draft entries were cropped to the committed prefix


def test_async_sampling_matches_target_distribution():
    target = tiny_target("qwen3", vocab=12, seed=5)
    drafter = make_drafter(target, block_size=2)
    drafter.config.async_drafting = True
    x = torch.tensor([[4, 7, 9]])
    with torch.no_grad():
        joint = _target_joint(target, x, LogitsProcessorList([TemperatureLogitsWarper(0.5)]))
    torch.manual_seed(99)
    counts = torch.zeros(144)
    hits = 0
    for _ in range(2500):
        out = target.generate(
            x,
            attention_mask=torch.ones_like(x),
            assistant_model=drafter,
            do_sample=True,
            temperature=0.5,
            top_k=0,
            top_p=1.0,
            max_new_tokens=3,
            eos_token_id=None,
        )
        a, b = out[0, 3:5].tolist()
        counts[a * 12 + b] += 1
        hits += drafter.last_stats.hits
    assert hits > 50  # drafts served from the packed pass took part
    assert chi_square_pvalue(counts, joint) > 1e-3


def test_measure_tau_reports_the_hit_rate_of_async_drafting_only(oracle):
    from hf_d3d.evaluate import measure_tau

    target = TARGETS["llama"]
    oracle.target, oracle.noise = target, 0.3  # some rounds are rejected early, so outcomes vary
    prompts = [[5, 9, 17, 33], [40, 41, 7]]
    drafter = async_drafter(target, 4)
    res = measure_tau(target, drafter, prompts, 24)
    assert res["hit_rate"] is not None and 0.0 <= res["hit_rate"] <= 1.0
    assert drafter.last_stats.hits + drafter.last_stats.misses > 0
    drafter.config.async_drafting = False
    assert measure_tau(target, drafter, prompts, 24)["hit_rate"] is None


def test_measure_tau_counts_every_round_the_final_one_included(oracle):
    """Inside target.generate a round's outcome is read off the next round's input: the final round's is read off
    the output, so the histogram has one entry per round the drafter drafted for."""
    from hf_d3d.evaluate import measure_tau

    target = TARGETS["llama"]
    oracle.target, oracle.noise = target, 0.3
    prompts = [[5, 9, 17, 33], [40, 41, 7], [3, 4]]
    drafter = async_drafter(target, 4)
    drafter.config.async_drafting = False
    res = measure_tau(target, drafter, prompts, 24)
    stats = drafter.last_stats  # the last prompt's
    assert len(stats.acceptance_lengths) == stats.rounds and res["acceptance_histogram"]
    assert stats.committed_tokens == 24 and stats._pending is None  # every new token
    stats.observe(torch.tensor([[1, 2, 3]]))  # nothing pending: a second look records nothing
    assert stats.committed_tokens == 24
