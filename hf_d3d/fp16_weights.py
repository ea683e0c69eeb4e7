"""A drafter's linear weights kept in fp16 on CPU: half the bytes read per draft, the arithmetic still fp32.

A draft forward on CPU runs a few rows through every weight of the drafter, so reading the weights is most of
its cost. fbgemm's fp16 linear (torch's dynamic quantization with ``dtype=torch.float16``) stores the weights in
fp16 and multiplies in fp32. Measured on 2 AVX2 cores over the committed drafter's shapes (4 layers and its
8192-row draft head): 6 ms against 18-20 ms for fp32 ``F.linear`` at 11 rows (context + one block), 4.7 against
8 ms at one row. Drafts only change by the rounding of the weights to fp16, which the bf16-trained checkpoints
survive unchanged (bf16 values within fp16's range are exact in fp16).

For drafters only: the target's forwards must stay its own, or the output would no longer be the target's.
torch marks this API deprecated in favour of torchao, whose eager CPU path was 5-10x slower here (torchao 0.18).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


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

    engine = torch.backends.quantized.engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning, UserWarning))
        try:
            torch.backends.quantized.engine = "fbgemm"
            return quantize_dynamic(module, {nn.Linear}, dtype=torch.float16, inplace=True)
        finally:
            torch.backends.quantized.engine = engine


@torch.no_grad()
def fp16_weights(drafter: nn.Module) -> nn.Module:
    """Keep ``drafter``'s linear weights in fp16 (fbgemm), in place, for drafting on CPU; returns ``drafter``.

    A D3D drafter keeps its embeddings and tied ``lm_head`` as they are; its decoder layers' linears and its
    draft-vocabulary head are packed. Any other model (an autoregressive assistant) has every ``nn.Linear``
    packed, its LM head included. The model is marked ``d3d_fp16_weights`` (round costs measured this way are
    found by it). For inference only: a packed model neither trains nor saves as a checkpoint.
    """
    if getattr(drafter, "d3d_fp16_weights", False):
        return drafter
    if not fp16_weights_supported(drafter):
        raise ValueError(
            "fp16_weights needs an fp32 model on CPU in eval mode and torch's fbgemm (x86) engine; "
            f"got {next(drafter.parameters()).dtype} on {next(drafter.parameters()).device}, "
            f"training={drafter.training}, engines {torch.backends.quantized.supported_engines}"
        )
    layers = getattr(getattr(drafter, "model", None), "layers", None)
    if hasattr(drafter, "set_draft_head") and layers is not None:
        _pack(layers)
        if getattr(drafter.config, "draft_vocab_size", None):
            rows = drafter.lm_head.weight.index_select(0, drafter.draft_vocab)
            head = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
            head.weight.copy_(rows)
            drafter.set_draft_head(_pack(nn.Sequential(head))[0])
    else:
        _pack(drafter)
    drafter.d3d_fp16_weights = True
    return drafter
