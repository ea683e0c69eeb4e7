"""A drafter converted from a whole pretrained LM: what the conversion keeps, and the AR shift's head start."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EOS, FAMILIES, VOCAB, prompts, tiny_target
from hf_d3d import D3DDrafterModel, speculative
from hf_d3d.evaluate import count_forwards
from hf_d3d.modeling.attention_d3d import pack_blocks
from hf_d3d.modeling.compat_d3d import MODEL_OUTPUT_CACHE_FIELD

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}
WHOLE = {fam: D3DDrafterModel.from_pretrained_lm(t, block_size=4) for fam, t in TARGETS.items()}


def _cache(out):
    return getattr(out, MODEL_OUTPUT_CACHE_FIELD)


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


@settings(max_examples=25)
@given(
    family=FAMILIES,
    prompt=prompts(20),
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


@settings(max_examples=15)
@given(
    family=FAMILIES,
    prompt=prompts(16),
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
    stats = drafter.last_stats
    if async_drafting and stats.rounds > 1:  # every round after the first joins the previous packed pass
        assert stats.packed_passes > 0 and stats.hits + stats.misses > 0


def _with_adapters(family: str, rank: int = 4, layers: list[int] | None = None) -> D3DDrafterModel:
    torch.manual_seed(3)
    return D3DDrafterModel.from_pretrained_lm(
        TARGETS[family], block_size=4, block_adapter_rank=rank, block_adapter_layers=layers
    )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_block_adapters_start_as_no_change_and_never_touch_the_context(family):
    plain, adapted = WHOLE[family], _with_adapters(family, layers=[1, 2])
    assert adapted.model.layers[0].self_attn.block_adapters is None
    assert set(adapted.model.layers[1].mlp.block_adapters) == {"gate_proj", "up_proj", "down_proj"}
    x = torch.tensor([[5, 9, 17, 33, 40, 41, 50]])
    ids, layout = pack_blocks(x, 0, [3, 6], 4, 0)
    with torch.no_grad():
        before = plain(ids, layout=layout, use_cache=False).logits
        torch.testing.assert_close(adapted(ids, layout=layout, use_cache=False).logits, before, rtol=0, atol=0)
        for p in (p for n, p in adapted.named_parameters() if "block_adapters" in n):
            p.normal_(std=0.5)
        after = adapted(ids, layout=layout, use_cache=False).logits
    ctx = layout.num_context
    torch.testing.assert_close(after[:, :ctx], before[:, :ctx], rtol=0, atol=0)  # context: the LM, exactly
    first = layout.is_slot[0] & (torch.arange(ids.shape[1]) == ctx) | (torch.arange(ids.shape[1]) == ctx + 4)
    torch.testing.assert_close(after[0, first], before[0, first], rtol=0, atol=0)  # first slots read the anchors
    assert not torch.allclose(after[0, ctx + 1], before[0, ctx + 1])  # the others learn to look ahead


def test_training_block_adapters_keeps_the_lms_predictions(tmp_path):
    from hf_d3d.train.trainer import TrainConfig, train

    target = TARGETS["qwen3"]
    records = [{"prompt_ids": [5, 6, 7 + i], "response_ids": [8 + i, 9, 10, 11, 12, 13, EOS]} for i in range(8)]
    drafter = _with_adapters("qwen3", rank=4, layers=[2])
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    cfg = TrainConfig(max_steps=3, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=100, adapters_only=True)
    passes = []
    drafter.model.register_forward_hook(lambda module, args, out: passes.append(out.requires_grad))
    trained = D3DDrafterModel.from_pretrained(train(drafter, records, tmp_path / "run", cfg))
    assert passes == [False, True] * 3  # every step: the context without autograd, then the blocks
    assert trained.config.block_adapter_rank == 4 and trained.config.block_adapter_layers == [2]
    changed = {k for k, v in trained.state_dict().items() if not torch.equal(v, start[k])}
    assert changed and all("block_adapters" in k for k in changed)
    x = torch.tensor([[7, 8, 9, 10, 11, 12]])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20, eos_token_id=None)
    plain = target.generate(x, **kw)
    assert torch.equal(target.generate(x, assistant_model=trained, **kw), plain)
    assert min(trained.last_stats.acceptance_lengths) >= 1  # the first slot is still the target's own token
    with pytest.raises(ValueError, match="block adapters"):
        train(WHOLE["qwen3"], records, tmp_path / "bad", cfg)


def test_pruning_keeps_the_adapters_of_the_kept_layers():
    from hf_d3d.prune import drop_layers

    drafter = _with_adapters("llama", layers=[0, 2])
    pruned = drop_layers(drafter, [1])
    assert pruned.config.block_adapter_layers == [0, 1]
    assert pruned.model.layers[1].self_attn.block_adapters is not None


def test_widening_block_adapters_changes_nothing_until_trained(tmp_path):
    from hf_d3d.train.trainer import TrainConfig, train, widen_block_adapters

    drafter = _with_adapters("llama", layers=[2])
    for p in (p for n, p in drafter.named_parameters() if "block_adapters" in n):
        p.data.normal_(std=0.5)  # a trained top layer
    x = torch.tensor([[5, 9, 17, 33, 40, 41, 50]])
    ids, layout = pack_blocks(x, 0, [3, 6], 4, 0)
    with torch.no_grad():
        before = drafter(ids, layout=layout, use_cache=False).logits
        assert widen_block_adapters(drafter, top=2) == [1]
        assert drafter.config.block_adapter_layers == [1, 2] and drafter.model.layers[0].mlp.block_adapters is None
        torch.testing.assert_close(drafter(ids, layout=layout, use_cache=False).logits, before, rtol=0, atol=0)
        assert widen_block_adapters(drafter) == [0] and drafter.config.block_adapter_layers is None
        assert widen_block_adapters(drafter) == []
        torch.testing.assert_close(drafter(ids, layout=layout, use_cache=False).logits, before, rtol=0, atol=0)
    records = [{"prompt_ids": [5, 6, 7 + i], "response_ids": [8 + i, 9, 10, 11, 12, 13, EOS]} for i in range(8)]
    cfg = TrainConfig(max_steps=2, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=100, adapters_only=True)
    trained = D3DDrafterModel.from_pretrained(train(drafter, records, tmp_path / "run", cfg))
    assert trained.config.block_adapter_layers is None
    assert trained.model.layers[0].self_attn.block_adapters["q_proj"].up.abs().sum() > 0  # trained, not zero
    with pytest.raises(ValueError, match="no block adapters"):
        widen_block_adapters(WHOLE["llama"])


def test_growing_the_adapter_rank_changes_nothing_until_trained(tmp_path):
    from hf_d3d.train.trainer import TrainConfig, grow_block_adapter_rank, train

    drafter = _with_adapters("llama", rank=4, layers=[1, 2])
    for p in (p for n, p in drafter.named_parameters() if "block_adapters" in n):
        p.data.normal_(std=0.5)  # trained adapters
    learned = drafter.model.layers[2].mlp.block_adapters["up_proj"].up.detach().clone()
    x = torch.tensor([[5, 9, 17, 33, 40, 41, 50]])
    ids, layout = pack_blocks(x, 0, [3, 6], 4, 0)
    with torch.no_grad():
        before = drafter(ids, layout=layout, use_cache=False).logits
        assert grow_block_adapter_rank(drafter, 8) == 4
        torch.testing.assert_close(drafter(ids, layout=layout, use_cache=False).logits, before, rtol=0, atol=1e-6)
    grown = drafter.model.layers[2].mlp.block_adapters["up_proj"]
    assert grown.down.weight.shape[0] == grown.up.shape[1] == 8 and drafter.config.block_adapter_rank == 8
    assert torch.equal(grown.up[:, :4], learned) and not grown.up[:, 4:].any()
    assert grown.down.weight[4:].abs().sum() > 0  # new directions to learn along, not dead rows
    drafter.save_pretrained(tmp_path / "grown")
    reloaded = D3DDrafterModel.from_pretrained(tmp_path / "grown")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, layout=layout, use_cache=False).logits, before, rtol=0, atol=1e-6)
    records = [{"prompt_ids": [5, 6, 7 + i], "response_ids": [8 + i, 9, 10, 11, 12, 13, EOS]} for i in range(8)]
    cfg = TrainConfig(max_steps=2, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=100, adapters_only=True)
    trained = D3DDrafterModel.from_pretrained(train(drafter, records, tmp_path / "run", cfg))
    assert trained.config.block_adapter_rank == 8
    assert trained.model.layers[2].mlp.block_adapters["up_proj"].up[:, 4:].abs().sum() > 0  # the new part trains
    longer = TrainConfig(**{**cfg.__dict__, "max_steps": 3})
    with pytest.raises(ValueError, match="block_adapter_rank: 8 -> 4"):  # a resume that forgot to grow
        train(_with_adapters("llama", rank=4, layers=[1, 2]), records, tmp_path / "run", longer)
    with pytest.raises(ValueError, match="would drop"):
        grow_block_adapter_rank(drafter, 2)
    with pytest.raises(ValueError, match="no block adapters"):
        grow_block_adapter_rank(WHOLE["llama"], 8)


@pytest.mark.parametrize("flag", [["--grow-block-adapter-rank", "8"], ["--widen-block-adapters", "0"]])
def test_the_adapter_growing_flags_are_refused_without_a_drafter_to_grow(tmp_path, capsys, flag):
    from hf_d3d import cli

    assert cli.main(["train", "--data", str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "run"), *flag]) == 2
    assert "an --init-from drafter" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@settings(max_examples=10, deadline=None)
@given(family=FAMILIES, layers=st.sampled_from([None, [1, 2]]), seed=st.integers(0, 2**16))
def test_frozen_context_gives_the_same_loss_and_gradients(family, layers, seed):
    """Training with ``frozen_context`` (the context without autograd, the blocks over its keys) is the same math."""
    from hf_d3d.train.objective import d3d_loss, make_batch

    drafter = _with_adapters(family, rank=4, layers=layers).float()
    for name, p in drafter.named_parameters():
        p.requires_grad_("block_adapters" in name)
        if "block_adapters" in name:
            p.data.normal_(std=0.3, generator=torch.Generator().manual_seed(seed))
    records = [
        {"prompt_ids": [5, 6, 7 + i], "response_ids": [8 + i, 9 + i % 3, 10, 11, 12, 13, EOS][: 4 + i]}
        for i in range(3)
    ]  # lengths differ, so the context is padded
    batch = make_batch(records, 4, 3, 0, 0, torch.Generator().manual_seed(seed), max_ar_positions=0)
    grads, passes = {}, []
    drafter.model.register_forward_hook(lambda module, args, out: passes.append(out.requires_grad))
    for frozen in (False, True):
        drafter.zero_grad()
        passes.clear()
        loss, metrics = d3d_loss(drafter, batch, frozen_context=frozen)
        loss.backward()
        assert passes == ([False, True] if frozen else [True])  # frozen: a context pass without autograd first
        assert "ar" not in metrics  # no next-token labels were built
        grads[frozen] = (loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad})
    torch.testing.assert_close(grads[True][0], grads[False][0], rtol=1e-5, atol=1e-6)
    assert grads[True][1].keys() == grads[False][1].keys() and grads[True][1]
    for name, grad in grads[False][1].items():
        torch.testing.assert_close(grads[True][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in grads[True][1].values())


def test_frozen_context_is_refused_where_it_would_lose_gradients():
    from hf_d3d.train.objective import d3d_loss, make_batch

    drafter = _with_adapters("llama", rank=4)
    records = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11, EOS]}]
    batch = make_batch(records, 4, 2, 0, 0, torch.Generator().manual_seed(0), max_ar_positions=0)
    with pytest.raises(ValueError, match="block adapters alone"):  # the embeddings are trainable here
        d3d_loss(drafter, batch, frozen_context=True)
    with pytest.raises(ValueError, match="use_cache=False"):
        drafter(batch.input_ids, layout=batch.layout, use_cache=True, frozen_context=True)


def test_convert_refuses_an_lm_with_another_tokenizer_of_the_same_size(tmp_path, capsys):
    """Equal vocab sizes are not one tokenizer (Llama-2 and Mistral both have 32000 tokens): convert compares them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_d3d.cli import main

    def save(folder, words):
        tiny_target("llama").save_pretrained(folder)
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=words[0], eos_token=words[EOS]).save_pretrained(folder)

    save(tmp_path / "target", [str(i) for i in range(VOCAB)])
    save(tmp_path / "same", [str(i) for i in range(VOCAB)])
    save(tmp_path / "other", [f"w{i}" for i in range(VOCAB)])
    args = ["convert", "--target", str(tmp_path / "target"), "--block-size", "4", "--lm"]
    assert main([*args, str(tmp_path / "other"), "--out", str(tmp_path / "bad")]) == 2
    assert "another tokenizer than the target" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert main([*args, str(tmp_path / "same"), "--out", str(tmp_path / "good")]) == 0
    assert D3DDrafterModel.from_pretrained(tmp_path / "good").config.num_hidden_layers == 3  # every layer
