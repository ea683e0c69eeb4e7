"""Drafter weights kept in fp16 on CPU (`hf_d3d.fp16_weights`): what is packed, drafts barely move, output unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import make_drafter, tiny_target
from hf_d3d import D3DCandidateGenerator, fp16_weights, speculative_generate
from hf_d3d.cpu.fp16_weights import fp16_weights_supported, packed_fp16
from hf_d3d.modeling.generation_d3d import round_cost_key
from hf_d3d.publish import _cost_where

pytestmark = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="fbgemm (x86) quantized engine not built in"
)


def _packed(module: nn.Module) -> bool:
    return type(module).__name__ == "Linear" and type(module).__module__.startswith("torch.ao.nn.quantized.dynamic")


def _drafter(target, vocab: list[int] | None = None):
    drafter = make_drafter(target, block_size=4).eval()
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    return drafter


def test_packs_the_layers_and_the_draft_head_and_keeps_the_drafts():
    target = tiny_target("llama")
    vocab = list(range(0, 96, 2)) + [3, 5, 7]
    plain, packed = _drafter(target, vocab), fp16_weights(_drafter(target, vocab))
    assert packed_fp16(packed) and not packed_fp16(plain)
    layer_linears = [m for m in packed.model.layers.modules() if isinstance(m, nn.Linear) or _packed(m)]
    assert layer_linears and all(_packed(m) for m in layer_linears)
    assert isinstance(packed.lm_head, nn.Linear) and packed.lm_head.weight is packed.model.embed_tokens.weight
    assert _packed(packed.draft_head())  # the draft-vocabulary head, packed too
    x = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = plain(x).logits, packed(x).logits
    assert torch.equal(a.isinf(), b.isinf())  # the same draft vocabulary
    finite = a.isfinite()
    torch.testing.assert_close(b[finite], a[finite], atol=2e-2 * a[finite].abs().max().item(), rtol=0)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    assert fp16_weights(packed) is packed  # packing twice is a no-op


def test_the_packed_draft_head_is_dropped_when_the_head_or_vocabulary_changes_and_packed_again_on_request():
    drafter = fp16_weights(_drafter(tiny_target("llama"), list(range(40))))
    assert _packed(drafter.draft_head())
    with torch.no_grad():
        drafter.lm_head.weight.mul_(2.0)  # an in-place update: the plain rows of the new weights are gathered
    assert not _packed(drafter.draft_head())
    x = torch.tensor([[5, 6, 7]])
    rows = drafter.lm_head.weight[:40]
    with torch.no_grad():
        hidden = torch.randn(1, 3, rows.shape[1])
        torch.testing.assert_close(drafter.draft_head()(hidden), hidden @ rows.T)
        drafter(x)
    assert _packed(fp16_weights(drafter).draft_head())  # a second call packs the new head
    drafter.set_draft_vocab(list(range(10, 50)))
    assert not _packed(drafter.draft_head())
    assert _packed(fp16_weights(drafter).draft_head())
    drafter.float()  # any move or cast, even to the same dtype
    assert not _packed(drafter.draft_head())


def test_a_packed_drafter_is_refused_as_a_checkpoint_and_loads_packed_on_request(tmp_path):
    import pickle

    from hf_d3d.targets import load_drafter

    drafter = _drafter(tiny_target("llama"), list(range(60)))
    with torch.no_grad():
        drafter(torch.tensor([[5, 6, 7]]))  # gathers the plain head, which must not stop pickling
    pickle.dumps(drafter)
    drafter.save_pretrained(tmp_path / "plain")
    loaded = load_drafter(str(tmp_path / "plain"), fp16_weights=True)
    assert packed_fp16(loaded) and _packed(loaded.draft_head())
    assert not packed_fp16(load_drafter(str(tmp_path / "plain")))
    with pytest.raises(ValueError, match="cannot be saved"):
        loaded.save_pretrained(tmp_path / "packed")
    assert not (tmp_path / "packed").exists()  # refused before anything was written


def test_packing_keeps_the_quantized_engine_the_user_chose():
    engine = torch.backends.quantized.engine
    try:
        if "qnnpack" in torch.backends.quantized.supported_engines:
            torch.backends.quantized.engine = "qnnpack"
        chosen = torch.backends.quantized.engine
        drafter = fp16_weights(_drafter(tiny_target("llama"), list(range(60))))
        assert torch.backends.quantized.engine == chosen
        with torch.no_grad():
            assert drafter(torch.tensor([[5, 6, 7]])).logits.isfinite().any()
    finally:
        torch.backends.quantized.engine = engine


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_output_stays_the_targets_own(family):
    target = tiny_target(family)
    drafter = fp16_weights(_drafter(target, list(range(60))))
    ar = fp16_weights(tiny_target(family, seed=1))  # an autoregressive assistant: every linear, its head too
    assert _packed(ar.lm_head) and not any(isinstance(m, nn.Linear) for m in ar.modules())
    x = torch.tensor([[5, 6, 7, 8]])
    kw = dict(do_sample=False, max_new_tokens=24, eos_token_id=None)
    with torch.no_grad():
        plain = target.generate(x, attention_mask=torch.ones_like(x), **kw)
        for assistant in (drafter, ar):
            assisted = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=assistant, **kw)
            assert torch.equal(assisted, plain)
    fast = speculative_generate(target, drafter, x, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(fast, plain)


def test_refused_where_it_does_not_apply():
    target = tiny_target("llama")
    for drafter, why in (
        (_drafter(target).to(torch.bfloat16), "fp32"),
        (_drafter(target).train(), "training=True"),
    ):
        assert not fp16_weights_supported(drafter)
        with pytest.raises(ValueError, match=why):
            fp16_weights(drafter)
        assert not packed_fp16(drafter)
        assert all(isinstance(m, nn.Linear) for m in drafter.model.layers[0].mlp.children() if m._parameters)


def test_round_costs_measured_with_fp16_weights_go_with_them():
    target = tiny_target("llama")
    drafter = _drafter(target)
    packed = fp16_weights(_drafter(target))
    costs = {
        "cpu": [1.0, 2.0, 3.0, 4.0],
        round_cost_key("cpu", fp16_weights=True): [1.5, 1.5, 1.5, 1.5],
        round_cost_key("cpu", skinny=True): [2.5, 2.5, 2.5, 2.5],
    }
    for d in (drafter, packed):
        d.config.round_cost = costs
    assert D3DCandidateGenerator(drafter).round_cost == costs["cpu"]
    assert D3DCandidateGenerator(packed).round_cost == [1.5] * 4
    # few-row linears change the verify forward, which weighs more than the draft: their costs come first
    assert D3DCandidateGenerator(packed, skinny=True).round_cost == [2.5] * 4
    costs[round_cost_key("cpu", skinny=True, fp16_weights=True)] = [3.5] * 4
    assert D3DCandidateGenerator(packed, skinny=True).round_cost == [3.5] * 4
    assert D3DCandidateGenerator(drafter, skinny=True).round_cost == [2.5] * 4
    assert round_cost_key("cpu", None, "avx2", True, True) == "cpu-avx2+skinny+fp16w"
    assert _cost_where("cpu-avx2+skinny+fp16w") == "cpu (AVX2), fp32 target, few-row linears, fp16 drafter weights"
    assert _cost_where("cpu:bfloat16") == "cpu, bfloat16 target"
