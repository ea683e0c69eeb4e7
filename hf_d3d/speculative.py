"""The opt-in fast loop: D3D speculative decoding that owns the whole decode (batch size 1).

Same tokens as ``target.generate``; less per-round work than transformers' general assisted loop (no candidate
generator plumbing, no per-round kwargs copies), and greedy rounds verify draft trees (:mod:`hf_d3d.tree`). The host
reads the device after each verify forward, to learn the acceptance length, and once per round after the draft:
the slot candidates a tree is built from, or, for a chain, the draft's confidences where async drafting or a
measured ``round_cost`` (the draft length is then chosen per round) needs them.
Usable directly, or as ``target.generate(**inputs, custom_generate=d3d_generate, drafter=drafter)``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, GenerationConfig, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.generation import EosTokenCriteria, GenerationMode, LogitsProcessorList

from hf_d3d.checks import check_pair
from hf_d3d.cpu.skinny import skinny_by_default, skinny_linears
from hf_d3d.exact import is_exact
from hf_d3d.modeling.compat_d3d import cache_kwarg, caller_locals
from hf_d3d.modeling.generation_d3d import D3DCandidateGenerator, refuse_rescaling_rope
from hf_d3d.tree import (
    attention_implementations,
    build_tree,
    keep_path,
    tree_inputs,
    tree_size,
    tree_unsupported,
    verify_tree_greedy,
)
from hf_d3d.verify import verify_greedy, verify_sampling

# Generation settings that need stopping criteria the fast loop does not build itself, each with the value that leaves
# it off; with one set, pass ``stopping_criteria=`` or go through ``target.generate(custom_generate=d3d_generate,
# ...)``, which builds them all.
_STOPPING_FIELDS = {"stop_strings": None, "max_time": None}


class _CompleteProcessors(LogitsProcessorList):
    """``generate``'s own finished list, as it hands it to a ``custom_generate``: used as it is, not rebuilt."""


def _processors(
    target: PreTrainedModel,
    config: GenerationConfig,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria,
) -> LogitsProcessorList:
    """The logits processors plain ``generate`` builds for ``config``, with the caller's merged in as ``generate``
    merges them (a caller's processor of a kind it also builds takes that one's place)."""
    if isinstance(logits_processor, _CompleteProcessors):
        return logits_processor
    asked = [f for f, off in _STOPPING_FIELDS.items() if getattr(config, f, None) not in (None, off)]
    if asked and stopping_criteria is None:
        raise ValueError(
            f"{asked} need stopping criteria that speculative_generate does not build: pass stopping_criteria=... "
            "or call target.generate(..., custom_generate=d3d_generate, drafter=drafter)"
        )
    config = copy.copy(config)  # transformers writes tensor forms of the special tokens into the config it gets
    target._prepare_special_tokens(config, device=target.device)  # where the loop's ids and logits are
    return target._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids.to(target.device),  # a decoder-only generate's "encoder" ids are its prompt
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=target.device,
    )


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        return set(eos_token_id.reshape(-1).tolist())
    return set(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else {int(eos_token_id)}


def _target_cache(target: PreTrainedModel, kind: str, max_len: int) -> Cache:
    if kind == "dynamic":
        return DynamicCache()
    if kind != "static":
        raise ValueError(f"cache_implementation must be 'dynamic' or 'static', got {kind!r}")
    if any("flash" in impl for impl in attention_implementations(target)):
        # flash kernels take no mask here: they would attend over the whole preallocated buffer
        raise ValueError("cache_implementation='static' needs sdpa or eager attention; use 'dynamic' with flash")
    cache = StaticCache(config=target.config, max_cache_len=max_len)
    # Rollback moves each layer's write position back; only a plain static layer is rolled back by that (sliding
    # and chunked layers are ring buffers, linear-attention layers carry a recurrent state).
    if any(type(layer) is not StaticLayer for layer in cache.layers):
        raise ValueError("cache_implementation='static' supports full-attention targets only; use 'dynamic'")
    return cache


def _truncate(cache: Cache, keep: int, held: int) -> None:
    """Drop cached positions from ``keep`` on; the cache holds ``held``.

    A static cache just moves its write position back: the causal mask hides what lies beyond it until the next
    pass overwrites it.
    """
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(keep)
    elif held > keep:
        cache.crop(keep - held)


@dataclass
class _Plan:
    """What a decode needs, settled before its first round."""

    config: GenerationConfig
    eos: set[int]
    procs: LogitsProcessorList
    cache: Cache
    gen: D3DCandidateGenerator
    exact: bool  # exact verification: the prompt is prefilled alone, as plain generate does
    use_tree: bool
    per_round: int  # at most this many draft tokens per round
    trims_logits: bool  # the target's forward takes logits_to_keep
    skinny: bool


def _plan(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    input_ids: torch.LongTensor,
    config: GenerationConfig,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None,
    procs: LogitsProcessorList,
    async_drafting: bool | None,
    tree: bool | None,
    skinny: bool | None,
) -> _Plan:
    """Check the request and choose how to decode it: cache, draft tree or chain, few-row kernels."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"speculative_generate supports batch size 1, got input of shape {tuple(input_ids.shape)}")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("speculative_generate does not support padded inputs (attention_mask with zeros)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if config.num_beams not in (None, 1):
        raise ValueError("D3D speculative decoding does not support beam search")
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):  # not decoded greedily in its place
        raise ValueError(f"D3D speculative decoding runs greedy decoding or sampling, not {mode.value}")
    if config.return_dict_in_generate or (config.num_return_sequences or 1) > 1:
        raise ValueError(
            "speculative_generate returns one sequence of token ids: return_dict_in_generate=False and "
            "num_return_sequences=1"
        )
    if getattr(config, "assistant_ensemble_weight", None) is not None:
        raise ValueError("assistant_ensemble_weight verifies against a target/draft mixture; D3D is lossless only")
    check_pair(target, drafter)
    refuse_rescaling_rope(target.config, input_ids.shape[1] + max_new_tokens)
    exact = is_exact(target)
    kind = config.cache_implementation or "dynamic"
    if exact and kind != "dynamic":
        raise ValueError("exact verification computes rows as plain generate does, over a dynamic cache")
    cache = _target_cache(target, kind, input_ids.shape[1] + max_new_tokens)
    if tree and async_drafting is None:  # asked for a tree: draft in sync, even where a config asks for async
        async_drafting = False
    if skinny is None:
        skinny = skinny_by_default(target)
    if skinny and exact:
        raise ValueError("skinny=True computes rows unlike a decode step; exact verification needs skinny=False")
    do_sample = bool(config.do_sample)
    gen = D3DCandidateGenerator(
        drafter, procs, do_sample=do_sample, async_drafting=async_drafting, target_dtype=target.dtype, skinny=skinny
    )
    gen.defer_packed = True  # _chain_round launches the packed pass once the verify forward is queued
    why_not = tree_unsupported(target, cache, do_sample)
    if why_not is None and gen.async_drafting:
        why_not = "async drafting prepares the next chain's outcomes; draft trees draft in sync"
    if tree and why_not:
        raise ValueError(f"tree=True: {why_not}")
    # The same knob as in generate(assistant_model=...): draft (and verify) at most this many tokens per round.
    per_round = int(getattr(drafter.generation_config, "num_assistant_tokens", 0) or drafter.config.block_size)
    return _Plan(
        config=config,
        eos=_eos_set(config.eos_token_id),
        procs=procs,
        cache=cache,
        gen=gen,
        exact=exact,
        use_tree=why_not is None and tree is not False,
        per_round=per_round,
        # Only the k + 1 verified positions need the LM head; at prefill that skips the whole prompt's rows.
        trims_logits="logits_to_keep" in inspect.signature(target.forward).parameters,
        skinny=skinny,
    )


@torch.no_grad()
def speculative_generate(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int | None = None,
    generation_config: GenerationConfig | None = None,
    attention_mask: torch.Tensor | None = None,
    streamer=None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria=None,
    generator: torch.Generator | None = None,
    on_round: Callable[[list[int], int, list[int]], None] | None = None,
    async_drafting: bool | None = None,
    tree: bool | None = None,
    skinny: bool | None = None,
    fused: bool = False,
    **kwargs,
) -> torch.LongTensor:
    """Decode with D3D drafts verified by ``target``; returns prompt + new tokens ``[1, n]``, the tokens
    ``target.generate`` returns for the same settings.

    Settings merge as in ``generate``: keyword arguments that name generation-config fields (``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, ``eos_token_id`` (``None`` ignores EOS), ``cache_implementation``) over
    ``generation_config`` over the target's over transformers' defaults (so sampling keeps the top 50 tokens unless
    ``top_k`` says otherwise). ``max_new_tokens`` defaults to the config's, else what a set ``max_length`` leaves,
    else 128. The logits processors are the ones ``generate`` builds for those settings, with ``logits_processor``
    merged in as ``generate`` merges it; settings that need stopping criteria (``stop_strings``, ``max_time``) are
    refused unless ``stopping_criteria`` is passed (:func:`d3d_generate` builds them all); a caller's
    ``EosTokenCriteria`` there replaces the config's EOS as the stop, as in ``generate``. ``return_dict_in_generate``,
    ``num_return_sequences`` > 1 and ``assistant_ensemble_weight`` are refused. Each round
    drafts up to ``drafter.generation_config.num_assistant_tokens`` tokens (fewer where the drafter's measured
    ``round_cost`` says the rest do not pay); the call's statistics (every round counted) are in
    ``drafter.last_stats``. ``on_round(draft, accepted, committed)`` is called after each verification (the Space
    colours accepted and rejected draft tokens with it). ``cache_implementation="static"`` preallocates the
    target's KV cache for the whole decode; rejected positions are then overwritten rather than freed.
    ``tree``: verify draft trees (greedy; the default where the target supports them and drafting is in sync) or
    chains (False). ``skinny``: compute few-row linears (the target's verify forwards, the drafter's blocks) as
    :func:`hf_d3d.skinny_linears` does (default: fp32 targets on CPU, unless verification is exact).
    ``fused``: for a drafter that is the target plus block adapters, one target forward per round verifies the
    draft and drafts the next one (:func:`hf_d3d.fused_generate`; greedy, dynamic cache; ``tree`` as above).
    """
    # As generate: the call's settings over the target's over transformers' defaults (top_k=50 when sampling).
    config, unknown = target._prepare_generation_config(generation_config, **kwargs)
    unknown = {k for k in unknown if k not in ("output_attentions", "output_hidden_states")}
    if unknown:
        raise TypeError(f"speculative_generate got unexpected arguments {sorted(unknown)}")
    if max_new_tokens is None:
        # generate's own default is 20 tokens in all; the fast loop's, 128 new ones, unless a max_length was set
        set_lengths = [kwargs.get("max_length")]
        set_lengths += [getattr(c, "max_length", None) for c in (generation_config, target.generation_config)]
        max_length = next((n for n in set_lengths if n is not None), None)
        if config.max_new_tokens is not None:
            max_new_tokens = config.max_new_tokens
        else:
            max_new_tokens = 128 if max_length is None else max(0, max_length - input_ids.shape[1])
    # the lengths generate settles before it builds its processors (forced EOS reads max_length, min_new_tokens
    # overrides min_length)
    config.max_length = input_ids.shape[1] + max_new_tokens
    if config.min_new_tokens is not None:
        config.min_length = input_ids.shape[1] + config.min_new_tokens
    procs = _processors(target, config, input_ids, logits_processor, stopping_criteria)
    criteria_eos = _criteria_eos(stopping_criteria)
    if criteria_eos:  # as in plain generate, a caller's EOS criterion replaces the config's as the stop (not in procs)
        config.eos_token_id = criteria_eos
    if fused:
        from hf_d3d.fused import fused_generate  # fused reuses this module's stopping rules

        _refuse_for_fused(config, procs, async_drafting, skinny, attention_mask)
        return fused_generate(
            target,
            drafter,
            input_ids,
            max_new_tokens=max_new_tokens,
            eos_token_id=config.eos_token_id if config.eos_token_id is not None else [],  # None: EOS ignored
            stopping_criteria=stopping_criteria,
            streamer=streamer,
            on_round=on_round,
            tree=tree is not False,
            generation_config=config,
        )
    plan = _plan(
        target,
        drafter,
        input_ids,
        config,
        max_new_tokens,
        attention_mask,
        procs,
        async_drafting,
        tree,
        skinny,
    )
    drafter.last_stats = plan.gen.stats
    plan.gen.generator = generator  # one seeded generator makes a sampled run repeatable, drafts included
    seq = input_ids.to(target.device)
    if streamer is not None:
        streamer.put(seq.cpu())
    with skinny_linears(target, drafter) if plan.skinny else contextlib.nullcontext():
        limit = seq.shape[1] + max_new_tokens
        seq = _decode(target, plan, seq, limit, stopping_criteria, generator, on_round, streamer)
    if streamer is not None:
        streamer.end()
    return seq


def _refuse_for_fused(config, procs, async_drafting, skinny, attention_mask) -> None:
    """speculative_generate(fused=True): name every asked setting the fused rounds do not do."""
    refused = {
        "sampling (do_sample=True)": bool(config.do_sample),
        "logits processors": len(procs) > 0,
        "async drafting": bool(async_drafting),
        "few-row kernels (skinny=True)": bool(skinny),
        "a static cache": (config.cache_implementation or "dynamic") != "dynamic",
        "beam search": config.num_beams not in (None, 1),
        "padded inputs": attention_mask is not None and not bool(attention_mask.all()),
    }
    asked = [name for name, on in refused.items() if on]
    if asked:
        raise ValueError(f"fused=True decodes greedily over a dynamic cache; it does not support {', '.join(asked)}")


def _decode(target, plan: _Plan, seq, limit, stopping_criteria, generator, on_round, streamer) -> torch.LongTensor:
    """The rounds: draft, verify in one target forward, commit the accepted tokens and the target's own next one.

    The first verify pass also prefills the prompt. ``cached`` counts the positions the target's cache holds for
    us: every committed token but the last, which the next verify pass re-reads."""
    gen, cache, cached = plan.gen, plan.cache, 0
    while seq.shape[1] < limit:
        # exact verification prefills the prompt alone, as plain generate does: the first round drafts nothing
        budget = 0 if plan.exact and cached == 0 else min(plan.per_round, limit - seq.shape[1] - 1)
        tree_round = plan.use_tree and budget > 0  # nothing to draft (exact's first round): an ordinary forward
        if tree_round:
            draft, n, nxt, path = _tree_round(target, gen, seq, cache, cached, budget, plan.procs, plan.trims_logits)
        else:
            do_sample = bool(plan.config.do_sample)
            draft, n, nxt = _chain_round(
                target, gen, seq, cache, cached, budget, plan.procs, plan.trims_logits, do_sample, generator
            )
        new, stop = _until_stop(seq, (draft[:n] + [nxt])[: limit - seq.shape[1]], plan.eos, stopping_criteria)
        gen.record_outcome(min(n, len(new)), len(new))
        if on_round is not None:
            on_round(draft, min(n, len(new)), new)
        held = seq.shape[1] + len(draft)  # what a chain's verify pass left in the cache
        seq = torch.cat([seq, torch.tensor([new], device=seq.device)], dim=1)
        if tree_round:  # the cache holds every node: keep the committed ones, moved into place
            keep_path(cache, seq.shape[1] - len(new) - 1, path[: len(new) - 1])
        else:
            _truncate(cache, seq.shape[1] - 1, held)
        cached = seq.shape[1] - 1
        if streamer is not None:
            streamer.put(torch.tensor(new))
        if stop:
            break
    return seq


def _until_stop(seq, new: list[int], eos: set[int], stopping_criteria) -> tuple[list[int], bool]:
    """The round's tokens up to and including the first that ends generation (EOS, or a stopping criterion checked
    after every committed token, as generate does), and whether one did."""
    stop = False
    for i, tok in enumerate(new):
        if tok in eos:
            new, stop = new[: i + 1], True
            break
    if stopping_criteria is not None:
        for i in range(len(new)):
            grown = torch.cat([seq, torch.tensor([new[: i + 1]], device=seq.device)], dim=1)
            if bool(stopping_criteria(grown, None).any()):
                return new[: i + 1], True
    return new, stop


def _verified_logits(target, ids, cache, rows, procs, prefixes, trims_logits, **extra) -> torch.Tensor:
    """The target's processed logits ``[rows, vocab]`` for the last ``rows`` positions of ``ids``; ``prefixes[i]`` is
    the sequence that position i was predicted from, as processors must see it."""
    keep = {"logits_to_keep": rows} if trims_logits else {}
    logits = target(ids, **{cache_kwarg(target): cache}, use_cache=True, **keep, **extra).logits[0, -rows:].float()
    for i in range(rows) if len(procs) else ():
        logits[i] = procs(prefixes(i), logits[i : i + 1])[0]
    return logits


def _chain_round(target, gen, seq, cache, cached, budget, procs, trims_logits, do_sample, generator):
    """Draft one chain and verify it: (draft tokens, accepted count, the target's next token)."""
    cand, q_scores = gen.get_candidates(seq, max_new_tokens=budget)
    k = cand.shape[1] - seq.shape[1]
    logits = _verified_logits(
        target, cand[:, cached:], cache, k + 1, procs, lambda i: cand[:, : seq.shape[1] + i], trims_logits
    )
    gen.launch_deferred()  # async drafting: the next blocks, beside the verify (on a GPU) before its result is read
    draft = cand[0, seq.shape[1] :]
    if do_sample:
        n, nxt = verify_sampling(draft, q_scores[0].softmax(-1), logits.softmax(-1), generator)
    else:
        n, nxt = verify_greedy(draft, logits)
    return draft.tolist(), n, nxt


# Uncached tokens (the prompt, in the first round) verified in the same forward as a tree, up to this many; beyond
# it they are prefilled on their own, so the custom mask stays small.
_JOIN_PREFILL = 512


def _tree_round(target, gen, seq, cache, cached, budget, procs, trims_logits):
    """Draft a tree of up to ``budget`` nodes and verify it in one forward (greedy; also prefills what is uncached).

    Returns the round's draft as a chain (the accepted path, then the tree's best guesses below it, which the target
    rejected), the accepted count, the target's next token and the accepted node indices. The cache then holds the
    root and every node; :func:`keep_path` compacts it.
    """
    logprobs, tokens = gen.get_slot_candidates(seq, depth=budget, width=budget)
    tree = build_tree(logprobs, tokens, budget)
    tree = tree.prefix(tree_size(tree, gen.round_cost))
    gen.stats.drafted_tokens += len(tree.tokens)
    if seq.shape[1] - cached > _JOIN_PREFILL:  # a long prompt: its own forward, not a dense (m + n)^2 tree mask
        keep = {"logits_to_keep": 1} if trims_logits else {}
        target(seq[:, cached:-1], **{cache_kwarg(target): cache}, use_cache=True, **keep)
        cached = seq.shape[1] - 1
    eager = "eager" in attention_implementations(target)  # an additive float mask, which sdpa takes too
    ids, positions, mask = tree_inputs(tree, seq[0, cached:].tolist(), cached, seq.device, target.dtype, eager)
    committed = seq[0].tolist() if len(procs) else []
    logits = _verified_logits(
        target,
        ids,
        cache,
        len(tree.tokens) + 1,
        procs,
        lambda i: torch.tensor([committed + tree.path_to(i - 1)], device=seq.device),
        trims_logits,
        position_ids=positions,
        attention_mask=mask,
    )
    path, nxt = verify_tree_greedy(tree, logits.argmax(-1).tolist())
    return [tree.tokens[i] for i in path + tree.best_chain(path[-1] if path else -1)], len(path), nxt, path


def d3d_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria,
    generation_config,
    drafter: PreTrainedModel = None,
    fused: bool = False,
    **model_kwargs,
) -> torch.LongTensor:
    """``custom_generate`` entry: ``target.generate(**inputs, custom_generate=d3d_generate, drafter=drafter)``;
    ``fused=True`` as in :func:`speculative_generate`."""
    if drafter is None:
        raise ValueError("custom_generate=d3d_generate needs drafter=<a D3D drafter>")
    if generation_config.return_dict_in_generate:
        raise ValueError("custom_generate=d3d_generate returns token ids only; use return_dict_in_generate=False")
    # transformers hands a callable custom_generate only the arguments its own loops do not take: not the streamer
    streamer = caller_locals("generate", holding="custom_generate").get("streamer")
    # what generate passes any decoding loop; anything more (images, embeddings, token types) would be dropped
    extra = sorted(
        set(model_kwargs)
        - {"attention_mask", "cache", "past_key_values", "logits_to_keep", "position_ids", "use_cache"}
    )
    if extra:
        raise ValueError(f"custom_generate=d3d_generate decodes from input_ids (and attention_mask) alone, got {extra}")
    generation_config = copy.copy(generation_config)  # generate's own, already complete; the cache kind is ours
    generation_config.cache_implementation = _cache_kind(generation_config.cache_implementation)
    # Plain generate stops on its EOS criteria, which a caller's EosTokenCriteria replaces: the loop stops on those
    # ids, not on the config's. Passed as an argument, since a None in the config would be refilled from the target's.
    return speculative_generate(
        model,
        drafter,
        input_ids,
        max_new_tokens=generation_config.max_length - input_ids.shape[1],
        generation_config=generation_config,
        attention_mask=model_kwargs.get("attention_mask"),
        streamer=_AfterPrompt(streamer) if streamer is not None else None,
        logits_processor=_CompleteProcessors(logits_processor),
        stopping_criteria=stopping_criteria,
        fused=fused,
        eos_token_id=_criteria_eos(stopping_criteria),
    )


def _criteria_eos(stopping_criteria) -> list[int] | None:
    """The ids of the ``EosTokenCriteria`` among ``stopping_criteria`` (``None`` if there is none)."""
    stops = [c for c in stopping_criteria or [] if isinstance(c, EosTokenCriteria)]
    return sorted({i for c in stops for i in c.eos_token_id.reshape(-1).tolist()}) or None


class _AfterPrompt:
    """A streamer that ``generate`` has already given the prompt: passes on the new tokens and the end."""

    def __init__(self, streamer):
        self.streamer, self.prompt_seen = streamer, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.streamer.put(value)
        self.prompt_seen = True

    def end(self) -> None:
        self.streamer.end()


def _cache_kind(requested: str | None) -> str:
    if requested in (None, "dynamic", "static"):
        return requested or "dynamic"
    warnings.warn(
        f"d3d_generate uses a dynamic cache; cache_implementation={requested!r} is not supported", stacklevel=3
    )
    return "dynamic"
