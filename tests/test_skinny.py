"""Few-row linears (`hf_d3d.modeling.skinny_d3d`: oneDNN over packed weights, or weight @ input.T): same values,
scoped, and only where it applies."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig

import hf_d3d.modeling.skinny_d3d as skinny_mod
from conftest import make_drafter, tiny_target
from hf_d3d import exact_verification, speculative_generate
from hf_d3d.cpu.skinny import no_skinny_linears, skinny_by_default, skinny_linears


class _Scaled(nn.Linear):  # a Linear subclass (as quantized linears are): its own forward must stay
    def forward(self, x):
        return 2 * super().forward(x)


class Kernel(str):
    onednn_calls: list[int]


@pytest.fixture(params=["onednn", "transpose"])
def kernel(request, monkeypatch):
    """Each test runs with both few-row kernels: oneDNN's (where this torch has it) and (W @ x.T).T; the oneDNN
    calls are counted (rows per call)."""
    have = skinny_mod.ONEDNN
    if request.param == "onednn" and not have:
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(skinny_mod, "ONEDNN", request.param == "onednn")
    out = Kernel(request.param)
    out.onednn_calls = []
    if not have:
        return out
    real = torch.ops.mkldnn._linear_pointwise

    def counting(x, *args):
        out.onednn_calls.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(skinny_mod.torch.ops.mkldnn, "_linear_pointwise", counting)
    return out


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 7), (2, 7), (5, 7), (1, 3, 7), (2, 2, 7), (16, 7), (17, 7), (1, 40, 7)])
def test_values_match_linear_and_are_row_major(kernel, bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(7, 11, bias=bias)
    x = torch.randn(shape)
    with torch.no_grad(), skinny_linears(lin) as n:
        out = lin(x)
    assert n == 1
    assert out.shape == (*shape[:-1], 11) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias))
    rows = x.numel() // 7
    assert kernel.onednn_calls == ([rows] if kernel == "onednn" and 2 <= rows <= 16 else [])


def test_scoped_and_restored_even_on_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="boom"), skinny_linears(model) as n:
        assert n == 2 and all("forward" in m.__dict__ for m in (model[0], model[2]))
        raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())
    for bad in ({"max_rows": 1}, {"min_rows": 0}, {"min_rows": 5, "max_rows": 4}):
        with pytest.raises(ValueError, match="max_rows"), skinny_linears(model, **bad):
            pass


def test_one_row_only_with_min_rows_1(kernel, monkeypatch):
    lin = nn.Linear(6, 5)
    x = torch.randn(1, 6)
    calls, real = [], F.linear
    monkeypatch.setattr(skinny_mod.F, "linear", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        with skinny_linears(lin):
            lin(x)
        assert calls == [1]  # one row: left to F.linear
        with skinny_linears(lin, min_rows=1):
            out = lin(x)
        assert calls == [1]
    torch.testing.assert_close(out, real(x, lin.weight, lin.bias))


def test_marks_the_generation_configs_and_undoes_only_its_own_forwards():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.generation_config = GenerationConfig()
    theirs = functools.partial(F.linear, weight=model[1].weight)  # say accelerate hooks it inside the block
    with skinny_linears(model, model) as n:  # a module listed twice is patched once
        assert n == 2 and model.generation_config.d3d_skinny
        model[1].forward = theirs
        with skinny_linears(model) as inner:  # nested: nothing left to patch, and the mark stays the outer one's
            assert inner == 0
        assert model.generation_config.d3d_skinny
    assert not hasattr(model.generation_config, "d3d_skinny")
    assert "forward" not in model[0].__dict__ and model[1].forward is theirs


@pytest.mark.skipif(not skinny_mod.ONEDNN, reason="this torch build has no oneDNN")
def test_onednn_packs_once_and_again_when_the_weight_changes(monkeypatch):
    packs = []
    real = torch.ops.mkldnn._reorder_linear_weight

    def counting(w, *args):
        packs.append(w.data_ptr())
        return real(w, *args)

    monkeypatch.setattr(skinny_mod.torch.ops.mkldnn, "_reorder_linear_weight", counting)
    lin = nn.Linear(6, 5)
    x = torch.randn(3, 6)
    with torch.no_grad(), skinny_linears(lin):
        lin(torch.randn(1, 6))
        assert packs == []  # one row never packs
        first = lin(x)
        lin(x), lin(torch.randn(4, 6))
        assert len(packs) == 1  # packed once
        lin.weight.mul_(2)  # changed in place: its packed copy is stale
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
        assert len(packs) == 2
        lin.weight = nn.Parameter(lin.weight / 2)  # replaced
        torch.testing.assert_close(lin(x), first)
        assert len(packs) == 3
    for _ in range(10):  # a dtype round trip frees the storage; a new one may get its address: never stale
        lin.bfloat16().float()
        with torch.no_grad(), skinny_linears(lin):
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    with torch.inference_mode():  # weights made there have no version counter
        made = nn.Linear(6, 5)
    with torch.no_grad(), skinny_linears(made):
        torch.testing.assert_close(made(x), F.linear(x, made.weight, made.bias))


@pytest.mark.skipif(not skinny_mod.ONEDNN, reason="this torch build has no oneDNN")
def test_a_weight_written_through_data_between_calls_is_packed_again():
    """``weight.data`` writes (PEFT's merge_adapter) bump no version counter: a pack kept from an earlier call
    would compute the old weights in verify forwards while decode steps use the new ones."""
    lin = nn.Linear(6, 5)
    x = torch.randn(3, 6)
    with torch.no_grad(), skinny_linears(lin):
        lin(x)
    lin.weight.data.mul_(2)
    with torch.no_grad(), skinny_linears(lin):
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_a_nested_block_puts_back_the_mark_it_found():
    from hf_d3d.cpu.skinny import no_skinny_linears

    model = nn.Linear(4, 4)
    model.generation_config = GenerationConfig()
    with no_skinny_linears(model):
        with skinny_linears(model):
            assert model.generation_config.d3d_skinny is True
        assert model.generation_config.d3d_skinny is False
    assert not hasattr(model.generation_config, "d3d_skinny")


def test_onednn_check_ignores_the_default_dtype():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert skinny_mod._onednn_available() == skinny_mod.ONEDNN
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("trains", ["all", "input only (frozen layer)", "bias only"])
def test_gradients_flow_wherever_one_is_needed(kernel, trains):
    torch.manual_seed(0)
    lin, ref = nn.Linear(6, 5), nn.Linear(6, 5)
    ref.load_state_dict(lin.state_dict())
    for m in (lin, ref):
        m.weight.requires_grad_(trains == "all")
        m.bias.requires_grad_(trains != "input only (frozen layer)")
    x = torch.randn(3, 6, requires_grad=trains != "bias only")
    x2 = x.detach().clone().requires_grad_(x.requires_grad)
    with skinny_linears(lin):
        lin(x).square().sum().backward()
    ref(x2).square().sum().backward()
    assert kernel.onednn_calls == []  # oneDNN's op has no autograd
    for a, b in ((lin.weight, ref.weight), (lin.bias, ref.bias), (x, x2)):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


def test_bias_keeps_the_dtype_autocast_chose(kernel):
    lin = nn.Linear(8, 3)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = lin(x)
        with skinny_linears(lin):
            out = lin(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=0.05, rtol=0.02)


def test_leaves_other_linears_alone():
    hooked = nn.Linear(4, 4)
    hook = hooked.forward  # an instance forward, as accelerate's offload hooks install
    hooked.forward = hook
    model = nn.ModuleDict({"bf16": nn.Linear(4, 4).bfloat16(), "sub": _Scaled(4, 4), "hooked": hooked})
    with skinny_linears(model) as n:
        assert n == 0
        assert hooked.forward is hook
        x = torch.randn(3, 4)
        torch.testing.assert_close(model["sub"](x), 2 * F.linear(x, model["sub"].weight, model["sub"].bias))
    assert hooked.forward is hook


def test_default_is_fp32_cpu_without_exact_verification():
    target = tiny_target("llama")
    assert skinny_by_default(target)
    with exact_verification(target):
        assert not skinny_by_default(target)
        with pytest.raises(ValueError, match="exact verification needs skinny=False"):
            speculative_generate(target, make_drafter(target), torch.tensor([[5, 6]]), 4, skinny=True)
    assert not skinny_by_default(tiny_target("llama").bfloat16())


def test_fast_loop_takes_the_skinny_path_and_stays_lossless(kernel, monkeypatch):
    target = tiny_target("qwen3")
    drafter = make_drafter(target, block_size=8)
    rows_seen = []
    real = skinny_mod._skinny_forward

    def counting(module, x, **kwargs):
        rows_seen.append(x.numel() // x.shape[-1])
        return real(module, x, **kwargs)

    monkeypatch.setattr(skinny_mod, "_skinny_forward", counting)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=30, eos_token_id=None)
    for tree in (None, False):
        out = speculative_generate(target, drafter, x, max_new_tokens=30, eos_token_id=None, tree=tree)
        assert torch.equal(out, ref)
    assert any(2 <= r <= skinny_mod.SKINNY_ROWS for r in rows_seen)  # verify forwards went through it
    assert not any("forward" in m.__dict__ for m in target.modules())  # and it was undone
    rows_seen.clear()
    speculative_generate(target, drafter, x, max_new_tokens=30, eos_token_id=None, skinny=False)
    assert rows_seen == []


def test_a_torch_whose_onednn_ops_changed_falls_back(monkeypatch):
    def changed(*args):
        raise TypeError("_linear_pointwise() takes 5 arguments")

    monkeypatch.setattr(skinny_mod.torch.ops.mkldnn, "_linear_pointwise", changed)
    assert not skinny_mod._onednn_available()
    monkeypatch.setattr(skinny_mod.torch.ops.mkldnn, "_linear_pointwise", lambda x, w, b, *a: torch.zeros(2, 3))
    assert not skinny_mod._onednn_available()  # runs but computes something else


def _patched(model: nn.Module) -> bool:
    """Whether any of ``model``'s linears computes as skinny_linears makes it (other patches, e.g. exact's, aside)."""
    return any(getattr(m.__dict__.get("forward"), "func", None) is skinny_mod._skinny_forward for m in model.modules())


def _spy_forwards(target: nn.Module) -> list[tuple[int, bool]]:
    """(rows, whether the target's linears were few-row ones) for every target forward after the first."""
    seen: list[tuple[int, bool]] = []
    target.register_forward_hook(lambda m, args, kwargs, out: seen.append((kwargs["input_ids"].shape[1], _patched(m))),
                                 with_kwargs=True)  # fmt: skip
    return seen


def test_assisted_generate_gives_only_the_verify_forwards_few_row_linears(kernel):
    """The plain path: the drafter's generator computes each verify forward of the target with few-row linears,
    one forward at a time, and leaves nothing behind; output identical to plain greedy."""
    target = tiny_target("llama")
    drafter = make_drafter(target, block_size=4)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24, eos_token_id=None)
    ref = target.generate(x, **kw)
    seen = _spy_forwards(target)
    out = target.generate(x, assistant_model=drafter, **kw)
    assert torch.equal(out, ref)
    verifies = [patched for rows, patched in seen[1:] if 2 <= rows <= skinny_mod.SKINNY_ROWS]
    assert verifies and all(verifies)  # every verify forward after the prefill
    assert not seen[0][1]  # the prefill is not one
    assert not _patched(target) and not _patched(drafter)
    assert not target._forward_pre_hooks and len(target._forward_hooks) == 1  # the spy's alone
    assert not hasattr(target.generation_config, "d3d_skinny")
    target._forward_hooks.clear()
    # generate with the caller's skinny_linears: it is theirs, nothing is added; under exact verification, nothing
    with skinny_linears(target, drafter):
        assert torch.equal(target.generate(x, assistant_model=drafter, **kw), ref)
    seen = _spy_forwards(target)
    with exact_verification(target):
        assert torch.equal(target.generate(x, assistant_model=drafter, **kw), ref)
    assert len(seen) > 2 and not any(patched for _, patched in seen)
    seen.clear()
    with no_skinny_linears(target):  # the reference without them
        assert torch.equal(target.generate(x, assistant_model=drafter, **kw), ref)
    assert len(seen) > 2 and not any(patched for _, patched in seen)
    assert not hasattr(target.generation_config, "d3d_skinny")


@pytest.mark.skipif(not skinny_mod.ONEDNN, reason="this torch build has no oneDNN")
def test_assisted_generate_sees_weights_merged_through_data_since_the_last_call():
    """A LoRA merged into the target between two calls (PEFT writes ``base_layer.weight.data``): the second call's
    verify forwards compute the merged weights, as its decode steps do."""
    target = tiny_target("llama")
    drafter = make_drafter(target, block_size=4)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24, eos_token_id=None)
    target.generate(x, assistant_model=drafter, **kw)  # packs the target's linears
    torch.manual_seed(1)
    for layer in target.model.layers:
        layer.mlp.down_proj.weight.data += 0.5 * torch.randn_like(layer.mlp.down_proj.weight)
    seen = _spy_forwards(target)
    out = target.generate(x, assistant_model=drafter, **kw)
    assert any(patched for _, patched in seen)  # the verify forwards did use the packed few-row kernel
    target._forward_hooks.clear()
    assert torch.equal(out, target.generate(x, **kw))


def test_a_verify_forward_that_raises_leaves_no_few_row_linears_behind():
    target = tiny_target("llama")
    drafter = make_drafter(target, block_size=4)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    calls = []

    def fail_in_a_verify_forward(module, args):
        calls.append(_patched(target))
        if len(calls) == 3:
            raise RuntimeError("boom")

    target.model.layers[1].register_forward_pre_hook(fail_in_a_verify_forward)
    with pytest.raises(RuntimeError, match="boom"):
        target.generate(x, attention_mask=torch.ones_like(x), assistant_model=drafter, max_new_tokens=24)
    assert calls[-1]  # it failed inside few-row linears
    assert not _patched(target) and not target._forward_pre_hooks and not target._forward_hooks
