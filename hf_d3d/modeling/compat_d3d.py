"""Every transformers-version difference the D3D files meet, in one place; and :func:`assisting_target` and
:func:`assisted_stopping_criteria`, since the assisted loop hands its candidate generator the assistant only, never
the target or its stopping criteria.

transformers 5.24 renamed the KV cache from ``past_key_values`` to ``cache``: the keyword of a model's ``forward``
(which still accepts the old name, with a deprecation warning), the field of model and generate outputs, and the
keyword by which the assisted loop hands an assistant its state back. Drafters saved by older revisions of these
files take ``past_key_values`` only.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast


def _cache_field(output_type: type) -> str:
    return "cache" if "cache" in output_type.__dataclass_fields__ else "past_key_values"


MODEL_OUTPUT_CACHE_FIELD = _cache_field(CausalLMOutputWithPast)
GENERATE_OUTPUT_CACHE_FIELD = _cache_field(GenerateDecoderOnlyOutput)


@functools.lru_cache
def _forward_takes_cache(model_type: type) -> bool:
    return "cache" in inspect.signature(model_type.forward).parameters


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by. Read from the model's class, so an instance-level
    wrapper (accelerate's hooks) does not hide it."""
    return "cache" if _forward_takes_cache(type(model)) else "past_key_values"


def passed_cache(cache, past_key_values):
    """The one KV cache a caller passed, under either name."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the KV cache as `cache` or as `past_key_values`, not both")
    return cache if cache is not None else past_key_values


def caller_locals(function: str, holding: str | None = None) -> dict:
    """The locals of the innermost frame up the stack that runs ``function`` (and, if given, has a local named
    ``holding``); {} where there is none. How D3D reads what transformers' loops hold but do not pass on."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function and (holding is None or holding in frame.f_locals):
            return frame.f_locals
        frame = frame.f_back
    return {}


def assisting_target() -> torch.nn.Module | None:
    """The model whose assisted loop (``generate(assistant_model=...)``) this call runs inside, or ``None``: the
    ``self`` of transformers' ``_assisted_decoding`` frame, the one place the loop keeps its target."""
    model = caller_locals("_assisted_decoding").get("self")
    return model if isinstance(model, torch.nn.Module) else None


def assisted_stopping_criteria() -> tuple[list, object]:
    """The stopping criteria and the generation config of the assisted loop this call runs inside (empty and
    ``None`` outside one): the loop cuts a round at the config's EOS and length, and checks the criteria after it."""
    loop = caller_locals("_assisted_decoding")
    return list(loop.get("stopping_criteria") or []), loop.get("generation_config")
