"""Few-row linears for the fast loop, the benchmark and calibration: the kernels live in
:mod:`hf_d3d.modeling.skinny_d3d`, which every drafter also ships as remote code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hf_d3d.exact import is_exact
from hf_d3d.modeling.skinny_d3d import SKINNY_ROWS, few_row_forwards, skinny_linears, skinny_next_forward

__all__ = [
    "SKINNY_ROWS",
    "few_row_forwards",
    "no_skinny_linears",
    "skinny_by_default",
    "skinny_linears",
    "skinny_next_forward",
]


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


@contextmanager
def no_skinny_linears(target: nn.Module) -> Iterator[None]:
    """Within the block, a D3D drafter in ``target.generate(assistant_model=drafter)`` leaves the target's linears as
    they are (it gives verify forwards few-row linears by default): the reference that measures what they give.
    Sets ``d3d_skinny = False`` on the target's generation config, which the assisted loop hands the drafter."""
    config = target.generation_config
    had, before = hasattr(config, "d3d_skinny"), getattr(config, "d3d_skinny", None)
    config.d3d_skinny = False
    try:
        yield
    finally:
        if had:
            config.d3d_skinny = before
        else:
            del config.d3d_skinny
