"""Bit-exact verification: every verified row gets exactly the bits that a plain decode step would give it.

A verify forward over k + 1 new tokens is mathematically k + 1 decode steps, but not bitwise. In bf16 on CPU,
attention over several query rows runs other kernels than attention for one and differs by an ulp; at a near-tie
the target's argmax then flips and the output drifts from plain ``generate`` (4 of 8 GSM8K answers of
SmolLM2-135M-Instruct). The linears, norms, rotary and LM head give a row the same bits for any row count up to 32
on this project's CPU (oneDNN), but not at prefill sizes. Two things therefore make verification exact there:

- attention computed one query row at a time, as a decode step computes it (one sdpa call per row and layer);
- the prompt prefilled alone, as plain ``generate`` prefills it, so the first round drafts nothing.

Whether the small-row kernels are row-invariant is a property of the machine: :func:`rows_match_decode` checks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache, PreTrainedModel
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

EXACT_ATTENTION = "d3d_exact_sdpa"


def exact_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except that rows after a cached prefix are computed one at a time.

    Each row goes to ``sdpa_attention_forward`` itself with the mask a decode step gets (none: batch 1 without
    padding, which every D3D path checks), so its bits follow whatever transformers does for one row. A forward
    without cache (a prefill) is left whole.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    past = kv_len - q_len
    if q_len == 1 or past == 0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"exact verification supports batch size 1, got {query.shape[0]}")
    rows = []
    for i in range(q_len):
        end = past + i + 1
        row = sdpa_attention_forward(module, query[:, :, i : i + 1], key[:, :, :end], value[:, :, :end], None, **kwargs)
        rows.append(row[0])
    return torch.cat(rows, dim=1), None


AttentionInterface.register(EXACT_ATTENTION, exact_sdpa_attention)
AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)


def is_exact(model: PreTrainedModel) -> bool:
    """Whether ``model`` currently verifies with :func:`exact_sdpa_attention`."""
    return getattr(model.config, "_attn_implementation", None) == EXACT_ATTENTION


@contextmanager
def exact_verification(target: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Within the block, greedy D3D decoding with ``target`` reproduces plain greedy ``generate`` bit for bit.

    Covers ``target.generate`` with ``assistant_model=`` (a D3D drafter or any other assistant model) or
    ``prompt_lookup_num_tokens=``, and :func:`hf_d3d.speculative_generate`, with a dynamic cache. Plain decoding is
    unchanged (single rows and prefills are computed exactly as before).
    """
    impl = getattr(target.config, "_attn_implementation", None)
    if impl == EXACT_ATTENTION:
        yield target
        return
    if impl != "sdpa":
        raise ValueError(f"exact verification wraps sdpa attention; this target uses {impl!r}")
    generate = target.generate

    def generate_exact(*args, **kwargs):
        assistant = kwargs.get("assistant_model")
        with contextlib.ExitStack() as stack:
            if assistant is None:  # plain decoding is unchanged; prompt lookup gets an empty first round
                factory = _first_round_empty_factory(target._get_candidate_generator)
                stack.enter_context(_attribute(target, "_get_candidate_generator", factory))
            elif getattr(assistant.config, "model_type", None) == "d3d_drafter":
                # read by the D3D drafter (modeling/generation_d3d.py), which never sees the target in the assisted
                # loop: propose nothing in the first round, and use the round costs calibrated for this dtype
                stack.enter_context(_attribute(assistant, "prefill_alone", True))
                stack.enter_context(_attribute(assistant, "target_dtype", target.dtype))
            else:
                stack.enter_context(_attribute(assistant, "generate", _first_round_empty(assistant)))
            return generate(*args, **kwargs)

    with _attribute(target, "generate", generate_exact):
        target.set_attn_implementation(EXACT_ATTENTION)
        try:
            yield target
        finally:
            target.set_attn_implementation(impl)


@contextmanager
def _attribute(obj: object, name: str, value) -> Iterator[None]:
    """Set ``obj.name`` for the block; then restore the instance's own attribute, or its absence."""
    missing = object()
    own = obj.__dict__.get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


def _first_round_empty_factory(factory):
    """transformers' candidate-generator factory, whose generators propose nothing in their first round (as prompt
    lookup does when it finds no match), so that the target prefills the prompt alone."""

    def make(*args, **kwargs):
        candidates = factory(*args, **kwargs)
        later = candidates.get_candidates

        def first_round(input_ids, *a, **kw):
            candidates.get_candidates = later
            return input_ids, None

        candidates.get_candidates = first_round
        return candidates

    return make


def _first_round_empty(assistant: PreTrainedModel):
    """``assistant.generate`` that proposes nothing the first time it is asked in a greedy decode (one call of
    ``target.generate``), so that the target prefills the prompt alone."""
    generate, asked = assistant.generate, []

    def first_round_empty(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        config = kwargs.get("generation_config")
        if asked or ids is None or getattr(config, "do_sample", False):
            return generate(*args, **kwargs)
        asked.append(True)
        # transformers stacks the scores, so one unused row stands in for them; greedy verification never reads it
        scores = (ids.new_zeros((ids.shape[0], assistant.config.vocab_size), dtype=torch.float),)
        state = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
        # an empty cache, not None: transformers only grows the assistant's attention mask when it has a cache
        return GenerateDecoderOnlyOutput(sequences=ids, scores=scores, **{state: DynamicCache()})

    return first_round_empty


@torch.no_grad()
def rows_match_decode(target: PreTrainedModel, rows: int = 9, context_length: int = 64, seed: int = 0) -> bool:
    """Whether, on this machine and dtype, a verify forward over ``rows`` tokens gives each row's logits exactly the
    bits of ``rows`` single decode steps under :func:`exact_verification`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, context_length + rows), generator=g).to(target.device)
    with exact_verification(target):
        cache = DynamicCache()
        target(ids[:, :context_length], past_key_values=cache)
        steps = [target(ids[:, [i]], past_key_values=cache).logits[0, -1] for i in range(context_length, len(ids[0]))]
        cache.crop(-rows)
        verify = target(ids[:, context_length:], past_key_values=cache).logits[0]
    return all(torch.equal(verify[i], step) for i, step in enumerate(steps))
