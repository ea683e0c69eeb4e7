"""Bit-exact verification: every verified row gets exactly the bits that a plain decode step would give it.

A verify forward over k + 1 new tokens is mathematically k + 1 decode steps, but not bitwise. In bf16 the kernels
for several rows sum in another order than those for one row (attention, and the linears: on CPU a one-row bf16
linear is a gemv of its own, several rows go to oneDNN), the results differ by an ulp, at a near-tie the target's
argmax flips and the output drifts from plain ``generate`` (7 of 8 GSM8K answers of SmolLM2-135M-Instruct,
``hf-d3d bench --dtype bfloat16 --num-prompts 8 --methods d3d_fast``). Three things make verification exact:

- attention computed one query row at a time, as a decode step computes it (one sdpa call per row and layer);
- every linear of a verify forward computed one row at a time, with the one-row kernel a decode step uses
  (``batched_linears=True`` keeps them whole: faster, and exact only where the machine's kernels give a row the
  same bits whatever the row count, which :func:`rows_match_decode` samples but cannot prove);
- the prompt prefilled alone, as plain ``generate`` prefills it, so the first round drafts nothing.

So exactness costs speed: a bf16 round proposing 8 drafts costs 5.14 decode steps of SmolLM2-135M-Instruct on a
2-core AVX512-BF16 CPU (``hf-d3d calibrate --dtype bfloat16 --exact``), against 1.48 on an Intel AMX CPU with
batched linears. It is the mode that proves a bf16 path lossless; fp32 targets verify with the ordinary kernels.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from hf_d3d.modeling.compat_d3d import cache_kwarg, passed_cache
from hf_d3d.modeling.generation_d3d import refuse_rescaling_rope

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
def exact_verification(target: PreTrainedModel, batched_linears: bool = False) -> Iterator[PreTrainedModel]:
    """Within the block, greedy D3D decoding with ``target`` reproduces plain greedy ``generate`` bit for bit.

    Covers ``target.generate`` with ``assistant_model=`` (a D3D drafter, or any assistant transformers drafts with
    through a candidate generator) or ``prompt_lookup_num_tokens=``, and :func:`hf_d3d.speculative_generate`, for
    batch size 1 without padding and a dynamic cache, and targets whose weight matrices are all ``nn.Linear`` (others
    are refused unless ``batched_linears=True``). Single rows and prefills are computed exactly as before, so
    plain decoding is unchanged; but any other multi-row forward after a cache (a chunked prefill, a reused chat
    cache) is computed row by row too, which is slower and, in bf16, not bitwise what it was.
    ``batched_linears=True`` computes the linears of a verify forward over all its rows at once: faster, and exact
    only where :func:`rows_match_decode` holds for every input, which a check can sample but not prove.
    """
    impl = getattr(target.config, "_attn_implementation", None)
    if impl == EXACT_ATTENTION:
        yield target
        return
    if impl != "sdpa":
        raise ValueError(f"exact verification wraps sdpa attention; this target uses {impl!r}")
    if not batched_linears:
        _refuse_other_matmuls(target)
    generate = target.generate

    def generate_exact(*args, **kwargs):
        assistant = kwargs.get("assistant_model")
        if getattr(getattr(assistant, "config", None), "model_type", None) == "d3d_drafter":
            return generate(*args, **kwargs)  # told through the generation config (below)
        # other assistants, prompt lookup; plain decoding builds no candidate generator at all
        factory = _first_round_empty_factory(target._get_candidate_generator, target.config)
        with _attribute(target, "_get_candidate_generator", factory):
            return generate(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        # A D3D drafter never sees the target in the assisted loop; the target's generation config reaches it (as
        # the config every assistant is called with): propose nothing in the first round, so that the target
        # prefills the prompt alone, and use the round costs calibrated for the target's dtype.
        stack.enter_context(_attribute(target.generation_config, "d3d_prefill_alone", True))
        stack.enter_context(_attribute(target.generation_config, "d3d_target_dtype", str(target.dtype)))
        stack.enter_context(_attribute(target, "generate", generate_exact))
        if not batched_linears:
            stack.enter_context(_one_row_linears(target))
        target.set_attn_implementation(EXACT_ATTENTION)
        try:
            if not is_exact(target):  # transformers only warns when a model refuses the switch
                raise ValueError(f"{type(target).__name__} did not accept the attention {EXACT_ATTENTION!r}")
            yield target
        finally:
            target.set_attn_implementation(impl)


def _refuse_other_matmuls(target: PreTrainedModel) -> None:
    """Only ``nn.Linear`` modules are split into rows: a weight matrix held by anything else (GPT-2's ``Conv1D``,
    the stacked experts of a mixture-of-experts layer) would multiply a verify forward's rows together."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target  # a VLM's vision tower only prefills
    others = sorted(
        {
            type(module).__name__
            for module in decoder.modules()
            if not isinstance(module, (nn.Linear, nn.Embedding))
            and any(p.dim() >= 2 for p in module.parameters(recurse=False))
        }
    )
    if others:
        raise ValueError(
            f"exact verification computes nn.Linear layers row by row; {others} would multiply several rows at "
            "once, so a verified row could differ from a decode step's bits"
        )


class _Verifying:
    """Whether the target's forward now running is a verify forward: several rows after a cached prefix."""

    rows = False

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        cache = passed_cache(kwargs.get("cache"), kwargs.get("past_key_values"))
        self.rows = bool(
            tokens is not None and tokens.shape[1] > 1 and cache is not None and cache.get_seq_length() > 0
        )

    def after(self, *_) -> None:
        self.rows = False


def _row_by_row(forward, verifying: _Verifying, x: torch.Tensor) -> torch.Tensor:
    if not verifying.rows or x.dim() < 2 or x.shape[-2] == 1:
        return forward(x)
    return torch.cat([forward(x[..., i : i + 1, :]) for i in range(x.shape[-2])], dim=-2)


@contextmanager
def _one_row_linears(target: PreTrainedModel) -> Iterator[None]:
    """Within the block, every linear of ``target`` (quantized subclasses and hooked forwards included) computes a
    verify forward one row at a time: the kernel a decode step runs, whose bits for a row depend on nothing else."""
    verifying = _Verifying()
    hooks = [
        target.register_forward_pre_hook(verifying.before, with_kwargs=True),
        target.register_forward_hook(verifying.after, always_call=True),
    ]
    patched = []
    try:
        for module in target.modules():
            if isinstance(module, nn.Linear):
                own = module.__dict__.get("forward")
                ours = functools.partial(_row_by_row, module.forward, verifying)
                module.forward = ours
                patched.append((module, own, ours))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for module, own, ours in patched:
            if module.__dict__.get("forward") is ours:  # never drop a forward someone else installed meanwhile
                if own is None:
                    del module.forward
                else:
                    module.forward = own


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


def _first_round_empty_factory(factory, target_config):
    """transformers' candidate-generator factory, whose generators propose nothing in their first round, so that
    the target prefills the prompt alone (any generator may return no candidates, as prompt lookup does when it
    finds no match). A generation that could pass where the target's RoPE rescales is refused first."""

    def make(*args, **kwargs):
        config = kwargs.get("generation_config", args[0] if args else None)
        if config is not None and config.max_length is not None:
            refuse_rescaling_rope(target_config, config.max_length)
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
    target: PreTrainedModel,
    rows: tuple[int, ...] = (2, 5, 9, 11),
    context_length: int = 64,
    seed: int = 0,
    batched_linears: bool = False,
) -> bool:
    """Whether, on this machine and dtype, a verify forward over each of ``rows`` tokens gives every row's logits
    exactly the bits of single decode steps under :func:`exact_verification` (random tokens after a random context;
    9 rows is a block of 8 plus the bonus, 11 prompt lookup's 10 plus one). A sample: ``True`` with
    ``batched_linears=True`` does not mean that every input keeps its bits (some rows of some inputs may not)."""
    g = torch.Generator().manual_seed(seed)
    most = max(rows)
    ids = torch.randint(0, target.config.vocab_size, (1, context_length + most), generator=g).to(target.device)
    with exact_verification(target, batched_linears=batched_linears):
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
