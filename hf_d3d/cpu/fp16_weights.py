"""A drafter's linear weights kept in fp16 on CPU: half the bytes read per draft, the arithmetic still fp32.

A draft forward on CPU runs a few rows through every weight of the drafter, so reading the weights is most of
its cost. fbgemm's fp16 linear (torch's dynamic quantization with ``dtype=torch.float16``) stores the weights in
fp16 and multiplies in fp32. Measured on 2 AVX2 cores over the committed drafter's shapes (4 layers and its
8192-row draft head): 6 ms against 18-20 ms for fp32 ``F.linear`` at 11 rows (context + one block), 4.7 against
8 ms at one row. Drafts change only by rounding: bf16-trained weights fit fp16 exactly unless below its normal
range, but fbgemm sums in another order than ``F.linear``, so a near-tie between two draft tokens can flip.

For drafters only: the target's forwards must stay its own, or the output would no longer be the target's.
torch marks this API deprecated in favour of torchao, whose eager CPU path was 5-10x slower here (torchao 0.18).
"""

from __future__ import annotations

import threading
import warnings

import torch
from torch import nn
from transformers import GenerationConfig

_ENGINE_LOCK = threading.Lock()  # the quantized engine is process-wide state


def fp16_weights_supported(model: nn.Module) -> bool:
    """Whether :func:`fp16_weights` applies: fp32 weights on CPU, an fbgemm (x86) quantized engine, inference."""
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and "fbgemm" in torch.backends.quantized.supported_engines
        and not model.training
    )


def _pack(module: nn.Module) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    with _ENGINE_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.ao.quantization is deprecated", DeprecationWarning)
        engine = torch.backends.quantized.engine
        if engine not in ("fbgemm", "x86"):  # e.g. qnnpack chosen by the user: fp16 weights need fbgemm's kernels
            torch.backends.quantized.engine = "fbgemm"
        try:
            return quantize_dynamic(module, {nn.Linear}, dtype=torch.float16, inplace=True)
        finally:
            torch.backends.quantized.engine = engine


def _is_packed(head) -> bool:
    return isinstance(head, nn.Module) and not isinstance(head, nn.Linear)


def _refuse_save(*args, **kwargs):
    raise ValueError(
        "this drafter's weights are packed for CPU inference (hf_d3d.fp16_weights) and cannot be saved as a "
        "checkpoint: save the drafter before packing it, or load it again"
    )


@torch.no_grad()
def fp16_weights(drafter: nn.Module) -> nn.Module:
    """Keep ``drafter``'s linear weights in fp16 (fbgemm), in place, for drafting on CPU; returns ``drafter``.

    A D3D drafter keeps its embeddings and tied ``lm_head`` as they are; its decoder layers' linears and its draft
    vocabulary head are packed (the head is packed again by a second call after ``set_draft_vocab``, a change of
    ``lm_head`` or a move, which fall back to the plain head). Any other model (an autoregressive assistant) has
    every ``nn.Linear`` packed, its LM head included. Its generation config (where transformers keeps an assistant's
    settings) says ``d3d_fp16_weights``: round costs measured this way are found by it. For inference only:
    ``save_pretrained`` refuses it."""
    if not fp16_weights_supported(drafter):
        raise ValueError(
            "fp16_weights needs an fp32 model on CPU in eval mode and torch's fbgemm (x86) engine; "
            f"got {next(drafter.parameters()).dtype} on {next(drafter.parameters()).device}, "
            f"training={drafter.training}, engines {torch.backends.quantized.supported_engines}"
        )
    layers = getattr(getattr(drafter, "model", None), "layers", None)
    d3d = hasattr(drafter, "set_draft_head") and layers is not None
    if not packed_fp16(drafter):
        _pack(layers if d3d else drafter)
    if d3d and getattr(drafter.config, "draft_vocab_size", None) and not _is_packed(drafter.draft_head()):
        rows = drafter.lm_head.weight.index_select(0, drafter.draft_vocab)
        head = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
        head.weight.copy_(rows)
        drafter.set_draft_head(_pack(nn.Sequential(head))[0])
    if drafter.generation_config is not None:
        drafter.generation_config.d3d_fp16_weights = True
    else:  # a model that cannot generate still must not be packed twice
        drafter.generation_config = GenerationConfig(d3d_fp16_weights=True)
    drafter.save_pretrained = _refuse_save
    return drafter


def packed_fp16(model: nn.Module) -> bool:
    """Whether :func:`fp16_weights` packed ``model``."""
    return bool(getattr(getattr(model, "generation_config", None), "d3d_fp16_weights", False))
