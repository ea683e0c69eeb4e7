"""A draft vocabulary makes the drafter's head cheaper and changes nothing about the output."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from test_sampling import _target_joint, chi_square_pvalue, sample_two_tokens
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper

from conftest import EOS, FAMILIES, VOCAB, make_drafter, prompts, tiny_target
from hf_d3d import D3DCandidateGenerator, D3DDrafterModel, speculative_generate
from hf_d3d.draft_vocab import frequent_tokens, write_with_draft_vocab
from hf_d3d.modeling.attention_d3d import pack_blocks
from hf_d3d.modeling.generation_d3d import choose_hypotheses

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}
VOCAB_IDS = list(range(0, VOCAB, 3)) + [EOS]  # a third of the vocabulary


def restricted(target, block_size=4):
    drafter = make_drafter(target, block_size=block_size)
    drafter.set_draft_vocab(VOCAB_IDS)
    return drafter


def test_logits_are_the_full_heads_on_the_draft_vocab_and_minus_inf_elsewhere():
    target = TARGETS["qwen3"]
    full, small = make_drafter(target), restricted(target)
    ids, layout = pack_blocks(torch.tensor([[5, 9, 17, 33]]), 0, [3, 1], 4, 0)
    with torch.no_grad():
        want = full(ids, layout=layout, use_cache=False).logits
        got = small(ids, layout=layout, use_cache=False).logits
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[VOCAB_IDS] = True
    torch.testing.assert_close(got[..., inside], want[..., inside])
    assert torch.isneginf(got[..., ~inside]).all()
    small.train()  # training sees the full head, so the loss still covers the whole vocabulary
    with torch.no_grad():
        torch.testing.assert_close(small(ids, layout=layout, use_cache=False).logits, want)


def test_gathered_head_follows_in_place_updates_of_the_lm_head():
    drafter = restricted(TARGETS["qwen3"])
    x = torch.tensor([[5, 9, 17]])
    with torch.no_grad():
        before = drafter(x, use_cache=False).logits
        drafter.lm_head.weight.mul_(2.0)  # what an optimizer step does: same storage, new version
        after = drafter(x, use_cache=False).logits
    inside = torch.tensor(sorted(set(VOCAB_IDS)))
    torch.testing.assert_close(after[..., inside], 2 * before[..., inside])


@settings(max_examples=25)
@given(
    family=FAMILIES,
    block=st.sampled_from([1, 4, 8]),
    prompt=prompts(20),
    max_new=st.integers(1, 30),
    async_drafting=st.booleans(),
)
def test_greedy_is_lossless_and_drafts_stay_in_the_draft_vocab(family, block, prompt, max_new, async_drafting):
    target = TARGETS[family]
    drafter = restricted(target, block)
    x = torch.tensor([prompt])
    ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new)
    out = target.generate(
        x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, assistant_model=drafter
    )
    assert torch.equal(ref, out)
    drafted: list[int] = []
    fast = speculative_generate(
        target,
        drafter,
        x,
        max_new_tokens=max_new,
        async_drafting=async_drafting,
        on_round=lambda draft, a, new: drafted.extend(draft),
    )
    assert torch.equal(ref, fast)
    assert set(drafted) <= set(VOCAB_IDS)


@pytest.mark.parametrize("do_sample", [False, True])
def test_remove_invalid_values_never_draws_outside_the_draft_vocab(do_sample):
    """InfNanRemoveLogitsProcessor turns the -inf outside the draft vocabulary into a finite minimum; a draft token
    from there would crash the async packed pass, which indexes by the draft vocabulary."""
    from transformers.generation import InfNanRemoveLogitsProcessor

    drafter = restricted(TARGETS["llama"])
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[VOCAB_IDS] = True

    def ban_the_draft_vocab(ids, scores):  # say bad words that cover it
        return scores.masked_fill(allowed, float("-inf"))

    procs = LogitsProcessorList([ban_the_draft_vocab, InfNanRemoveLogitsProcessor()])
    x = torch.tensor([[5, 9, 17]])
    for _ in range(5):
        draft = D3DCandidateGenerator(drafter, procs, do_sample=do_sample).get_candidates(x)[0][0, x.shape[1] :]
        assert set(draft.tolist()) <= set(VOCAB_IDS)


def test_sampling_is_lossless_when_the_target_favours_tokens_the_drafter_cannot_propose():
    target = tiny_target("qwen3", vocab=12, seed=5)
    drafter = make_drafter(target, block_size=2)
    drafter.set_draft_vocab([0, 2, 4, 6, 8, 10])
    x = torch.tensor([[4, 7, 9]])
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5)])
    with torch.no_grad():
        joint = _target_joint(target, x, processors)
    assert joint.reshape(12, 12)[1::2].sum() > 0.2  # much of p lies where q is zero
    counts, accepted_any = sample_two_tokens(target, drafter, x, seed=4321)
    assert accepted_any > 100
    assert chi_square_pvalue(counts, joint) > 1e-3


def test_draft_vocab_survives_save_and_strict_load(tmp_path):
    target = TARGETS["llama"]
    drafter = restricted(target)
    drafter.save_pretrained(tmp_path / "d")
    loaded = D3DDrafterModel.from_pretrained(tmp_path / "d")
    assert loaded.config.draft_vocab_size == len(set(VOCAB_IDS))
    assert torch.equal(loaded.draft_vocab, drafter.draft_vocab)
    x = torch.tensor([[5, 9, 17]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, use_cache=False).logits, drafter(x, use_cache=False).logits)

    weights = load_file(str(tmp_path / "d" / "model.safetensors"))
    del weights["draft_vocab"]  # config promises a draft vocabulary the weights do not have
    save_file(weights, str(tmp_path / "d" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="draft_vocab"):
        D3DDrafterModel.from_pretrained(tmp_path / "d")


def test_set_draft_vocab_rejects_bad_ids_and_can_be_lifted():
    drafter = restricted(TARGETS["llama"])
    with pytest.raises(ValueError, match="draft vocabulary"):
        drafter.set_draft_vocab([1, VOCAB])
    with pytest.raises(ValueError, match="draft vocabulary"):
        drafter.set_draft_vocab([])
    drafter.set_draft_vocab(None)
    assert drafter.config.draft_vocab_size is None and not hasattr(drafter, "draft_vocab")
    with torch.no_grad():
        assert torch.isfinite(drafter(torch.tensor([[5, 9]]), use_cache=False).logits).all()


def test_frequent_tokens_counts_responses_keeps_eos_and_fills_with_low_ids():
    records = [
        {"prompt_ids": [50, 50, 50], "response_ids": [7, 7, 7, 8, 8, 9]},
        {"prompt_ids": [51], "response_ids": [7, 8, 10]},
    ]
    ids, coverage = frequent_tokens(records, 2, always=(EOS,))
    assert ids == sorted({EOS, 7})  # EOS always, then the most frequent; prompt tokens do not count
    assert coverage == pytest.approx(4 / 9)
    ids, coverage = frequent_tokens(records, 7)
    assert ids == [0, 1, 2, 7, 8, 9, 10] and coverage == 1.0  # data has 4 distinct tokens; the lowest ids fill up
    with pytest.raises(ValueError):
        frequent_tokens(records, 0)


def test_write_with_draft_vocab_writes_a_complete_folder_and_never_overwrites(tmp_path):
    drafter = make_drafter(TARGETS["llama"])
    drafter.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "d3d_metrics.json").write_text(json.dumps({"tau": 1.0}))  # measured on the full head
    (tmp_path / "src" / "training_log.json").write_text(json.dumps({"log": []}))
    records = [{"prompt_ids": [5], "response_ids": [7, 7, 8, EOS]}]
    coverage = write_with_draft_vocab(tmp_path / "src", records, 3, tmp_path / "out")
    assert coverage == 1.0
    loaded = D3DDrafterModel.from_pretrained(tmp_path / "out")
    assert loaded.draft_vocab.tolist() == [EOS, 7, 8]
    assert (tmp_path / "out" / "training_log.json").is_file()
    assert not (tmp_path / "out" / "d3d_metrics.json").exists()  # the copy's tau must be measured anew
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    with pytest.raises(FileExistsError):
        write_with_draft_vocab(tmp_path / "src", records, 3, tmp_path / "out")


def test_processed_q_with_a_draft_vocab_is_what_each_slot_was_drawn_from():
    from transformers.generation import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

    from hf_d3d import D3DCandidateGenerator

    target = tiny_target("llama", vocab=16, seed=3)
    drafter = make_drafter(target, block_size=3)
    drafter.set_draft_vocab([0, 3, 4, 5, 6, 9, 12])
    procs = LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(1.3),
            TemperatureLogitsWarper(0.8),
            TopKLogitsWarper(4),
            TopPLogitsWarper(0.9),
        ]
    )
    x = torch.tensor([[4, 5, 6, 7]])
    ids, layout = pack_blocks(x, 0, [3], 3, 0)
    with torch.no_grad():
        raw = drafter(ids, layout=layout, use_cache=False).logits[:, 4:].float()
    torch.manual_seed(0)
    for _ in range(50):
        seq, scores = D3DCandidateGenerator(drafter, procs, do_sample=True).get_candidates(x)
        for i in range(scores.shape[1]):
            torch.testing.assert_close(scores[:, i], procs(seq[:, : 4 + i], raw[:, i].clone()))
        assert set(seq[0, 4:].tolist()) <= {0, 3, 4, 5, 6, 9, 12}


def test_a_draft_ends_where_processors_rule_out_the_whole_draft_vocab():
    from transformers.generation import NoBadWordsLogitsProcessor

    from hf_d3d import D3DCandidateGenerator

    target = TARGETS["llama"]
    drafter = restricted(target)
    banned = NoBadWordsLogitsProcessor([[t] for t in sorted(set(VOCAB_IDS))], eos_token_id=None)
    x = torch.tensor([[5, 9, 17]])
    for do_sample in (False, True):
        seq, scores = D3DCandidateGenerator(drafter, LogitsProcessorList([banned]), do_sample).get_candidates(x)
        assert seq.shape[1] == 3 and scores.shape[1] == 0  # nothing proposable: an empty draft, no NaN, no crash
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=12, bad_words_ids=[[t] for t in sorted(set(VOCAB_IDS))])
    ref = target.generate(x, do_sample=False, **kw)
    assert torch.equal(ref, target.generate(x, do_sample=False, assistant_model=drafter, **kw))
    # Sampling through transformers needs a draft row every round: the first slot is drawn from a uniform stand-in
    # and reported as it, so speculative sampling still keeps the target's distribution.
    generator = D3DCandidateGenerator(drafter, LogitsProcessorList([banned]), do_sample=True, min_draft=1)
    seq, scores = generator.get_candidates(x)
    # uniform over the draft vocabulary, whose tokens alone the packed pass can place (a token outside it crashed)
    uniform = torch.full((1, 1, VOCAB), float("-inf"))
    uniform[..., sorted(set(VOCAB_IDS))] = 0.0
    assert seq.shape[1] == 4 and seq[0, -1].item() in VOCAB_IDS and torch.equal(scores, uniform)
    for async_drafting in (False, True):
        drafter.config.async_drafting = async_drafting
        torch.manual_seed(0)
        out = target.generate(x, do_sample=True, assistant_model=drafter, **kw)  # raised in torch.stack before
        assert out.shape[1] > 3 and not set(out[0, 3:].tolist()) & set(VOCAB_IDS)


def test_from_target_refuses_a_draft_vocab_size_without_ids():
    with pytest.raises(ValueError, match="set_draft_vocab"):
        make_drafter(TARGETS["llama"], draft_vocab_size=10)


def test_gathered_head_follows_new_draft_vocab_ids_loaded_in_place():
    target = TARGETS["qwen3"]
    a, b = restricted(target), make_drafter(target)
    b.set_draft_vocab(list(range(1, VOCAB, 3)))  # as many ids as a has, other ones
    x = torch.tensor([[5, 9, 17]])
    with torch.no_grad():
        a(x, use_cache=False)  # gathers a's rows
        a.load_state_dict(b.state_dict())  # same shapes, new ids copied into the same buffer
        torch.testing.assert_close(a(x, use_cache=False).logits, b(x, use_cache=False).logits)


def test_training_loss_is_the_softmax_over_the_draft_vocab():
    """draft_logits trains exactly the distribution the drafter proposes from; other tokens carry no loss."""
    from hf_d3d.train.objective import IGNORE, d3d_loss, make_batch

    target = TARGETS["llama"]
    drafter = restricted(target).train()
    outside = next(t for t in range(VOCAB) if t not in VOCAB_IDS)
    records = [{"idx": 0, "prompt_ids": [5, 6, 7], "response_ids": [9, 12, outside, 15, 18, 21, 24, 27]}]
    batch = make_batch(records, 4, 3, 0, 0, torch.Generator().manual_seed(0))
    index = torch.full((VOCAB,), IGNORE)
    index[drafter.draft_vocab] = torch.arange(len(drafter.draft_vocab))
    loss, metrics = d3d_loss(drafter, batch, 0.5, 0.8, vocab_index=index)

    has = batch.labels != IGNORE
    full = drafter(batch.input_ids, layout=batch.layout, use_cache=False, logits_to_keep=has).logits
    sub = full[:, drafter.draft_vocab]
    torch.testing.assert_close(
        drafter(batch.input_ids, layout=batch.layout, use_cache=False, logits_to_keep=has, draft_logits=True).logits,
        sub,
    )
    labels, slot = index[batch.labels[has]], batch.layout.is_slot[has]
    ce = torch.nn.functional.cross_entropy(sub.float(), labels.clamp_min(0), reduction="none")
    w = 0.8 ** batch.slot_index[has][slot].float() * (labels[slot] != IGNORE)
    ar_mask = ~slot & (labels != IGNORE)
    want = (ce[slot] * w).sum() / w.sum() + 0.5 * ce[ar_mask].mean()
    torch.testing.assert_close(loss, want)
    assert (batch.labels[has] == outside).any()  # the outside token was a label, and it was left out above
    with pytest.raises(ValueError, match="needs a draft vocabulary"):
        make_drafter(target)(batch.input_ids, layout=batch.layout, use_cache=False, draft_logits=True)


def test_training_a_drafter_with_a_draft_vocab_keeps_it(tmp_path, monkeypatch):
    from hf_d3d.train import trainer

    target = TARGETS["llama"]
    seen = []
    real_loss = trainer.d3d_loss
    monkeypatch.setattr(trainer, "d3d_loss", lambda *a, **k: seen.append(a[4]) or real_loss(*a, **k))
    records = [{"idx": i, "prompt_ids": [5, 6, 7 + i], "response_ids": [9, 12, 15, 18, 21, EOS]} for i in range(4)]
    cfg = trainer.TrainConfig(max_steps=2, batch_size=2, save_every=1000, eval_every=1000)
    final = D3DDrafterModel.from_pretrained(trainer.train(restricted(target), records, tmp_path / "a", cfg))
    assert final.draft_vocab.tolist() == sorted(set(VOCAB_IDS))
    assert seen[0] is not None and seen[0][VOCAB_IDS[1]] == 1  # token id -> its place in the draft vocabulary
    cfg.draft_vocab_loss = False
    trainer.train(restricted(target), records, tmp_path / "b", cfg)
    assert seen[-1] is None


def test_drafting_over_the_draft_vocab_matches_the_full_vocab_logits():
    """Argmax, returned scores and packed-pass hypotheses are computed over the draft vocabulary: same answers."""
    drafter = restricted(TARGETS["llama"], block_size=4)
    x = torch.tensor([[5, 9, 17, 33, 40]])
    gen = D3DCandidateGenerator(drafter, async_drafting=True, num_hypotheses=6)
    seq, scores = gen.get_candidates(x)
    draft = seq[0, x.shape[1] :].tolist()
    ids, layout = pack_blocks(x, 0, [x.shape[1] - 1], 4, 0)
    with torch.no_grad():  # the same block through the plain forward, over the full vocabulary
        full = drafter(ids, layout=layout, use_cache=False).logits[0, x.shape[1] :].float()
    torch.testing.assert_close(scores[0], full)
    assert draft == full.argmax(-1).tolist() and set(draft) <= set(VOCAB_IDS)
    want = choose_hypotheses(full.softmax(-1), draft, budget=6)
    assert gen._pending.outcomes == want
    assert all(g in VOCAB_IDS for _, g in want if g is not None)
