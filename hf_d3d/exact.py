"""Bit-exact verification: every verified row gets exactly the bits that a plain decode step would give it.

A verify forward over k + 1 new tokens is mathematically k + 1 decode steps, but not bitwise. In bf16 on CPU,
attention over several query rows runs other kernels than attention for one and differs by an ulp; at a near-tie
the target's argmax then flips and the output drifts from plain ``generate`` (7 of 8 GSM8K answers of
SmolLM2-135M-Instruct, ``hf-d3d bench --dtype bfloat16 --num-prompts 8 --methods d3d_fast``). The linears,
norms, rotary and LM head give a row the same bits for any row count up to 32 on this project's CPU (oneDNN), but
not at prefill sizes. Two things therefore make verification exact there:

- attention computed one query row at a time, as a decode step computes it (one sdpa call per row and layer);
- the prompt prefilled alone, as plain ``generate`` prefills it, so the first round drafts nothing.

Whether the small-row kernels are row-invariant is a property of the machine: :func:`rows_match_decode` checks it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from hf_d3d.modeling.compat_d3d import cache_kwarg

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

    Where every row sees the whole cache (batch 1, no padding, no sliding window), each row goes to
    ``sdpa_attention_forward`` itself over exactly the keys it may see, in order, and no mask, as a decode step
    does, so its bits follow whatever transformers does for one row. For a chain those keys are a prefix; for a
    draft tree they are the cache, the root and the row's ancestors, which are the keys its decode step will see
    once the path is committed. Any other row keeps its mask: right, though not bitwise a decode step. A forward
    whose first row sees only itself (a prefill) is left whole.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    # transformers drops the mask of a multi-row forward only where sdpa's own causal flag is right: a prefill
    if q_len == 1 or attention_mask is None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"exact verification supports batch size 1, got {query.shape[0]}")
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    shared = allowed.shape[1] == 1  # one mask for every head, as transformers' sdpa masks are
    allowed = allowed[0, 0]  # [q, kv]
    ends = allowed.sum(-1).tolist()
    if ends[0] == 1:  # the first row sees only itself: a prefill (into a static cache, say)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    prefixes = torch.arange(kv_len, device=allowed.device) < torch.tensor(ends, device=allowed.device)[:, None]
    chain = bool((allowed == prefixes).all())
    # keys by position: decode steps see the whole cache; a row that does not (padding, a window) keeps its mask
    by_keys = shared and (chain or bool(allowed[:, : kv_len - q_len].all()))
    if not by_keys:
        warnings.warn(
            "exact verification: rows with padding or a sliding window keep their mask; their bits may differ "
            "from a decode step's",
            stacklevel=2,
        )
    rows = []
    for i in range(q_len):
        q = query[:, :, i : i + 1]
        if by_keys and chain:
            row = sdpa_attention_forward(module, q, key[:, :, : ends[i]], value[:, :, : ends[i]], None, **kwargs)
        elif by_keys:  # a tree row: the cache, then its own ancestors and itself, in order
            seen = allowed[i].nonzero().squeeze(1)
            row = sdpa_attention_forward(module, q, key[:, :, seen], value[:, :, seen], None, **kwargs)
        else:
            row = sdpa_attention_forward(module, q, key, value, attention_mask[:, :, i : i + 1], **kwargs)
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

    Covers ``target.generate`` with ``assistant_model=`` (a D3D drafter, or any assistant transformers drafts with
    through a candidate generator) or ``prompt_lookup_num_tokens=``, and :func:`hf_d3d.speculative_generate`, for
    batch size 1 without padding and a dynamic cache. Single rows and prefills are computed exactly as before, so
    plain decoding is unchanged; but any other multi-row forward after a cache (a chunked prefill, a reused chat
    cache) is computed row by row too, which is slower and, in bf16, not bitwise what it was.
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
        if getattr(getattr(assistant, "config", None), "model_type", None) == "d3d_drafter":
            return generate(*args, **kwargs)  # told through the generation config (below)
        # other assistants, prompt lookup; plain decoding builds no candidate generator at all
        factory = _first_round_empty_factory(target._get_candidate_generator)
        with _attribute(target, "_get_candidate_generator", factory):
            return generate(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        # A D3D drafter never sees the target in the assisted loop; the target's generation config reaches it (as
        # the config every assistant is called with): propose nothing in the first round, so that the target
        # prefills the prompt alone, and use the round costs calibrated for the target's dtype.
        stack.enter_context(_attribute(target.generation_config, "d3d_prefill_alone", True))
        stack.enter_context(_attribute(target.generation_config, "d3d_target_dtype", str(target.dtype)))
        stack.enter_context(_attribute(target, "generate", generate_exact))
        target.set_attn_implementation(EXACT_ATTENTION)
        try:
            if not is_exact(target):  # transformers only warns when a model refuses the switch
                raise ValueError(f"{type(target).__name__} did not accept the attention {EXACT_ATTENTION!r}")
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
    """transformers' candidate-generator factory, whose generators propose nothing in their first round, so that
    the target prefills the prompt alone (any generator may return no candidates, as prompt lookup does when it
    finds no match)."""

    def make(*args, **kwargs):
        candidates = factory(*args, **kwargs)
        get, update = candidates.get_candidates, candidates.update_candidate_strategy
        probs = getattr(candidates, "probs", None)

        def first_get(input_ids, *a, **kw):
            candidates.get_candidates = get
            kept = len(probs) if isinstance(probs, list) else None
            get(input_ids, *a, **kw)  # drafted and dropped: an assistant's cache and masks stay in step
            if kept is not None:  # nor does the dropped draft feed the confidence-threshold statistics
                del probs[kept:]
            return input_ids, None

        def first_update(*a, **kw):  # the empty round says nothing about how good the drafts are
            candidates.update_candidate_strategy = update

        candidates.get_candidates, candidates.update_candidate_strategy = first_get, first_update
        return candidates

    return make


@torch.no_grad()
def rows_match_decode(
    target: PreTrainedModel, rows: tuple[int, ...] = (2, 5, 9, 11), context_length: int = 64, seed: int = 0
) -> bool:
    """Whether, on this machine and dtype, a verify forward over each of ``rows`` tokens gives every row's logits
    exactly the bits of single decode steps under :func:`exact_verification` (random tokens after a random context;
    9 rows is a block of 8 plus the bonus, 11 prompt lookup's 10 plus one)."""
    g = torch.Generator().manual_seed(seed)
    most = max(rows)
    ids = torch.randint(0, target.config.vocab_size, (1, context_length + most), generator=g).to(target.device)
    with exact_verification(target):
        cache = DynamicCache(config=target.config)
        kw = {cache_kwarg(target): cache}
        target(ids[:, :context_length], **kw)
        steps = [target(ids[:, [i]], **kw).logits[0, -1] for i in range(context_length, len(ids[0]))]
        for n in rows:
            cache.crop(context_length - cache.get_seq_length())
            verify = target(ids[:, context_length : context_length + n], **kw).logits[0]
            if not all(torch.equal(verify[i], steps[i]) for i in range(n)):
                return False
    return True
