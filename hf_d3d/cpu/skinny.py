"""Few-row linears for the fast loop, the benchmark and calibration: the kernels live in
:mod:`hf_d3d.modeling.skinny_d3d`, which every drafter also ships as remote code."""

from __future__ import annotations

import torch
from torch import nn

from hf_d3d.exact import is_exact
from hf_d3d.modeling.skinny_d3d import SKINNY_ROWS, has_skinny_linears, skinny_linears, skinny_next_forward

__all__ = ["SKINNY_ROWS", "has_skinny_linears", "skinny_by_default", "skinny_linears", "skinny_next_forward"]


def skinny_by_default(model: nn.Module) -> bool:
    """Whether the fast loop uses :func:`skinny_linears` for ``model`` unless told: fp32 weights on CPU, and not
    under exact verification (whose row-for-row bits rely on the linears' own kernels)."""
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and not (hasattr(model, "config") and is_exact(model))
    )
