"""Verify forwards over a few rows for about the cost of one decode step, on CPUs where fp32 GEMMs lose that.

A verify forward over k + 1 rows reads the same weights as a decode step, and on a CPU reading them is most of its
cost. But fp32 ``F.linear`` (``x @ W.T``) over 2-16 rows leaves the matrix-vector kernel of one row for a GEMM
that repacks the whole weight on every call: a SmolLM2-135M forward over 2-13 rows took 1.3-2.1 decode steps on the
two CPUs this was measured on. Within the fast loop, plain fp32 ``nn.Linear`` modules of the target and drafter on
CPU therefore compute inputs of 2..``max_rows`` rows in all (verify forwards; also short prefills and small-batch
decode steps inside the block) with a kernel that does not: oneDNN's linear over a weight packed once into its own
layout (kept for one ``generate`` call or one :func:`skinny_linears` block: as much memory again as the fp32 weights
meanwhile, freed after), or,
in a build without oneDNN, ``(W @ x.T).T`` (the few rows as the GEMM's columns). One row (a decode step) and longer
inputs are untouched, so plain decoding is not sped up. The values are the same product, rounded differently: as
with any batched verify forward, not bit-identical to a decode step (:mod:`hf_d3d.exact` is the bitwise mode and
refuses this).

Shipped with every drafter as remote code: a D3D drafter inside ``target.generate(assistant_model=drafter)`` gives the
target's verify forwards these kernels itself (:func:`skinny_next_forward`), one forward at a time.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_ROWS = 16
_ABSENT = object()


def _onednn_available() -> bool:
    """Whether oneDNN's packed linear (the private ops inductor's CPU freezing uses) is here and still computes
    ``F.linear``: checked once on a small product, so a torch that changed them falls back instead of failing."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        # fixed values, dtype and device: no use of torch's RNG or of the user's defaults
        w = torch.arange(12, dtype=torch.float32, device="cpu").view(3, 4) / 8
        x = torch.arange(8, dtype=torch.float32, device="cpu").view(2, 4) / 8
        out = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return bool(torch.allclose(out, F.linear(x, w), atol=1e-5))
    except (AttributeError, RuntimeError, TypeError):
        return False


ONEDNN = _onednn_available()


def packed_weight(module: nn.Linear, packs: dict) -> torch.Tensor:
    """``module.weight`` in oneDNN's linear layout, packed on first use and again whenever the weight changes.

    ``packs`` (module -> its weight's storage (weakly), layout and version when packed, the packed weight) lives as
    long as one :func:`few_row_forwards` collection: one ``generate`` call, or one :func:`skinny_linears` block. A
    write through ``weight.data`` between two calls (PEFT's ``merge_adapter``) bumps no version counter, so a pack
    kept for the module's lifetime could go stale unseen; one per call cannot."""
    w = module.weight
    storage = w.untyped_storage()
    # The storage itself, not its address: a moved or re-cast weight frees its old storage, and a new one may get the
    # same address. The version counter catches in-place writes (inference tensors have none, nor in-place use).
    layout = (w.storage_offset(), w.stride(), w.shape, w.dtype, -1 if w.is_inference() else w._version)
    held = packs.get(module)
    if held is None or held[0]() is not storage or held[1] != layout:
        held = (weakref.ref(storage), layout, torch.ops.mkldnn._reorder_linear_weight(w.detach()))
        packs[module] = held
    return held[2]


def _onednn_applies(module: nn.Linear, x: torch.Tensor) -> bool:
    if not ONEDNN or not torch.backends.mkldnn.enabled or torch.is_autocast_enabled("cpu"):
        return False
    bias = module.bias
    if x.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        return False  # F.linear's own dtype handling and errors
    # oneDNN's op has no autograd: anything that would need a gradient goes through F.linear's path
    return not torch.is_grad_enabled() or not (
        x.requires_grad or module.weight.requires_grad or (bias is not None and bias.requires_grad)
    )


def _skinny_forward(module: nn.Linear, x: torch.Tensor, max_rows: int, min_rows: int, packs: dict) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not min_rows <= rows <= max_rows:
        return F.linear(x, module.weight, module.bias)
    if _onednn_applies(module, x):
        weight = packed_weight(module, packs)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, module.bias, "none", [], "")
    out = (module.weight @ x.reshape(rows, -1).T).T.contiguous()  # row-major again: sdpa's fast kernels need it
    if module.bias is not None:
        out = out + module.bias.to(out.dtype)  # autocast may have computed the product in a lower precision
    return out.reshape(*x.shape[:-1], module.weight.shape[0])


@contextmanager
def skinny_linears(*models: nn.Module, max_rows: int = SKINNY_ROWS, min_rows: int = 2) -> Iterator[int]:
    """Within the block, the plain fp32 CPU ``nn.Linear`` modules of ``models`` (a target and its drafter, say) compute
    2..``max_rows`` rows with a kernel made for few rows (see the module's docstring); yields how many modules that
    is. Subclasses (quantized linears), other dtypes and devices, and modules whose ``forward`` is already replaced
    on the instance (accelerate's offload hooks) are left alone. Each model's generation config carries ``d3d_skinny``
    meanwhile: transformers' assisted loop hands the target's to the assistant, so a D3D drafter picks the
    round costs calibrated this way. A D3D drafter in ``target.generate(..., assistant_model=drafter)`` needs no
    wrapping (it gives each verify forward these linears itself); other assistants, or small-batch decode steps
    of 2-16 sequences, take them inside ``skinny_linears(target, ...)``.
    ``min_rows=1`` computes one-row decode steps that way too: a reference for what the kernel alone does to plain
    decoding (``scripts/side_by_side.py plain+onednn``), not something D3D needs."""
    if not 1 <= min_rows <= max_rows or max_rows < 2:
        raise ValueError(f"need 1 <= min_rows <= max_rows, max_rows >= 2; got min_rows={min_rows}, max_rows={max_rows}")
    with patched_forwards(few_row_forwards(*models, max_rows=max_rows, min_rows=min_rows), models) as n:
        yield n


def few_row_forwards(
    *models: nn.Module, max_rows: int = SKINNY_ROWS, min_rows: int = 2
) -> list[tuple[nn.Linear, functools.partial]]:
    """The plain fp32 CPU ``nn.Linear`` modules of ``models``, each with the forward :func:`skinny_linears` gives it;
    their packed weights live as long as the list does."""
    packs: dict = {}
    return [
        (m, functools.partial(_skinny_forward, m, max_rows=max_rows, min_rows=min_rows, packs=packs))
        for model in models
        for m in model.modules()
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
    ]


@contextmanager
def patched_forwards(
    forwards: list[tuple[nn.Linear, functools.partial]], models: tuple[nn.Module, ...]
) -> Iterator[int]:
    """:func:`skinny_linears` over ``forwards`` collected once (:func:`few_row_forwards`), for callers that enter it
    every round; ``models``' generation configs carry ``d3d_skinny`` meanwhile."""
    patched: list[tuple[nn.Linear, functools.partial]] = []
    configs = [getattr(m, "generation_config", None) for m in dict.fromkeys(models)]
    # what each mark was before (absent, or False under no_skinny_linears), to put back as it was
    marked = [(c, getattr(c, "d3d_skinny", _ABSENT)) for c in configs if c is not None]
    marked = [(c, before) for c, before in marked if before is not True]
    try:
        for config, _ in marked:
            config.d3d_skinny = True
        # a plain instance attribute, set in __dict__: nn.Module.__setattr__'s checks would cost more, every round
        for module, forward in forwards:
            if "forward" not in module.__dict__:  # a module listed twice, or hooked by accelerate: left as it is
                module.__dict__["forward"] = forward
                patched.append((module, forward))
        yield len(patched)
    finally:
        for module, ours in patched:
            if module.__dict__.get("forward") is ours:  # never drop a forward someone else installed meanwhile
                del module.__dict__["forward"]
        for config, before in marked:
            if before is _ABSENT:
                del config.d3d_skinny
            else:
                config.d3d_skinny = before


def skinny_next_forward(model: nn.Module, forwards: list[tuple[nn.Linear, functools.partial]] | None = None) -> None:
    """Compute ``model``'s next forward in :func:`skinny_linears`, and only that one: hooks enter the block when the
    forward starts and leave it, removing themselves, when it ends, even by an exception. This is how a drafter
    gives the target's verify forward (the next forward after a draft, in transformers' assisted loop) few-row
    linears with no patch outliving it. ``forwards``: :func:`few_row_forwards` of ``model``, when the caller keeps
    them from round to round (collecting them costs about as much as the patching itself)."""
    forwards = few_row_forwards(model) if forwards is None else forwards
    block = contextlib.ExitStack()

    def enter(module: nn.Module, args: tuple) -> None:
        block.enter_context(patched_forwards(forwards, (module,)))

    def leave(module: nn.Module, args: tuple, output: object) -> None:
        block.close()
        before.remove()
        after.remove()

    before = model.register_forward_pre_hook(enter)
    after = model.register_forward_hook(leave, always_call=True)
