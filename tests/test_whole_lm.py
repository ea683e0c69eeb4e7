"""A drafter converted from a whole pretrained LM: what the conversion keeps, and the AR shift's head start."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EOS, VOCAB, tiny_target
from hf_d3d import D3DDrafterModel, speculative
from hf_d3d.evaluate import count_forwards
from hf_d3d.modeling.attention_d3d import pack_blocks

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}
WHOLE = {fam: D3DDrafterModel.from_pretrained_lm(t, block_size=4) for fam, t in TARGETS.items()}


def _cache(out):
    return getattr(out, "cache", None) or out.past_key_values  # its name from transformers 5.24, and before


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_conversion_keeps_every_layer_and_weight(family):
    lm, drafter = TARGETS[family], WHOLE[family]
    assert drafter.config.num_hidden_layers == lm.config.num_hidden_layers
    assert drafter.config.target_layer_ids == list(range(lm.config.num_hidden_layers))
    assert drafter.config.shifted_slots
    theirs = lm.state_dict()
    mine = drafter.state_dict()
    copied = 0
    for name, tensor in theirs.items():
        if "rotary" in name:
            continue
        assert name in mine, name  # the drafter names its tensors as the source LM does
        torch.testing.assert_close(mine[name], tensor, rtol=0, atol=0, msg=name)
        copied += 1
    assert copied == len([k for k in theirs if "rotary" not in k])
    extra = set(mine) - set(theirs)
    assert extra <= {"model.mask_embedding"}, extra  # the learned mask vector is all the drafter adds
    assert (drafter.lm_head.weight is drafter.model.embed_tokens.weight) == lm.config.tie_word_embeddings


@settings(max_examples=25, deadline=None)
@given(
    family=st.sampled_from(["llama", "qwen3"]),
    prompt=st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=20),
    cached=st.integers(0, 19),
)
def test_first_slot_is_the_source_lms_greedy_token(family, prompt, cached):
    """At initialisation, with the shift, slot 0 reads the anchor's causal output: the LM's next-token prediction."""
    lm, drafter = TARGETS[family], WHOLE[family]
    x = torch.tensor([prompt])
    cached = min(cached, len(prompt) - 1)  # the anchor (last token) is always in the forward, as callers arrange
    with torch.no_grad():
        want = lm(x).logits[0, -1]
        cache = None
        if cached:
            cache = _cache(drafter(x[:, :cached], use_cache=True))
        ids, layout = pack_blocks(x[:, cached:], cached, [len(prompt) - 1], 4, 0)
        out = drafter(ids, layout=layout, cache=cache, use_cache=cache is not None).logits[0, layout.num_context :]
    torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-4)


def test_unshifted_slots_do_not_read_the_anchor():
    lm = TARGETS["llama"]
    drafter = D3DDrafterModel.from_pretrained_lm(lm, block_size=4, shifted_slots=False)
    x = torch.tensor([[5, 9, 17, 33, 40]])
    ids, layout = pack_blocks(x, 0, [4], 4, 0)
    with torch.no_grad():
        out = drafter(ids, layout=layout, use_cache=False).logits[0, layout.num_context]
        want = lm(x).logits[0, -1]
    assert not torch.allclose(out, want, atol=1e-3)


def test_an_anchor_outside_the_forward_is_refused():
    drafter = WHOLE["llama"]
    x = torch.tensor([[5, 9, 17, 33, 40]])
    with torch.no_grad():
        cache = _cache(drafter(x[:, :3], use_cache=True))
        ids, layout = pack_blocks(x[:, 3:], 3, [1], 4, 0)  # anchor 1 lies in the cache
        with pytest.raises(ValueError, match="anchor among the forward's context tokens"):
            drafter(ids, layout=layout, cache=cache)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_drafter_from_the_target_itself_never_wastes_a_round(family):
    """Drafted from the target itself, the first token of every draft is right: each round commits >= 2 tokens."""
    target, drafter = TARGETS[family], WHOLE[family]
    x = torch.tensor([[7, 8, 9, 10, 11, 12]])
    plain = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=30, eos_token_id=None)
    with count_forwards(target) as calls:
        out = target.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=30,
            eos_token_id=None,
            assistant_model=drafter,
        )
    assert torch.equal(out, plain)
    assert min(drafter.last_stats.acceptance_lengths) >= 1
    assert calls["n"] <= 16  # 30 tokens at >= 2 per forward, plus prefill
    fast = speculative.speculative_generate(target, drafter, x, max_new_tokens=30, eos_token_id=EOS)
    ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=30, eos_token_id=EOS)
    assert torch.equal(fast, ref)
    assert min(drafter.last_stats.acceptance_lengths[:-1] or [1]) >= 1


def test_a_sibling_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        D3DDrafterModel.from_pretrained_lm(tiny_target("qwen3", vocab=VOCAB + 8), target=TARGETS["qwen3"])


def test_shifted_drafter_trains_and_round_trips(tmp_path):
    from hf_d3d.train.objective import d3d_loss, make_batch

    drafter = D3DDrafterModel.from_pretrained_lm(TARGETS["qwen3"], block_size=4).train()
    records = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11, 12, 13, EOS]}] * 2
    batch = make_batch(records, 4, 3, 0, VOCAB - 1, torch.Generator().manual_seed(0))
    loss, metrics = d3d_loss(drafter, batch)
    loss.backward()
    assert torch.isfinite(loss) and drafter.model.layers[0].mlp.up_proj.weight.grad is not None
    drafter.eval().save_pretrained(tmp_path)
    again = D3DDrafterModel.from_pretrained(tmp_path)
    assert again.config.shifted_slots


@settings(max_examples=15, deadline=None)
@given(
    family=st.sampled_from(["llama", "qwen3"]),
    prompt=st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=16),
    max_new=st.integers(1, 40),
    async_drafting=st.booleans(),
    tree=st.booleans(),
)
def test_whole_lm_drafter_is_lossless_in_every_loop(family, prompt, max_new, async_drafting, tree):
    """Shifted slots in the sync draft, the packed pass (hypothesis and bonus blocks) and draft trees."""
    target, drafter = TARGETS[family], WHOLE[family]
    x = torch.tensor([prompt])
    ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new)
    out = speculative.speculative_generate(
        target, drafter, x, max_new_tokens=max_new, async_drafting=async_drafting, tree=tree and not async_drafting
    )
    assert torch.equal(out, ref)
    if async_drafting and drafter.last_stats.packed_passes:
        assert drafter.last_stats.hits + drafter.last_stats.misses > 0
