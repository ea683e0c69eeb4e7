"""Drafting with a D3D drafter: the candidate generator behind ``target.generate(assistant_model=drafter)``.

transformers' assisted loop calls ``drafter.generate`` once per round and hands back whatever came out as
``past_key_values`` (``cache`` from transformers 5.24). We return a :class:`D3DCandidateGenerator` there, so the
drafter state (its KV cache over committed tokens, its statistics) lives exactly as long as one
``target.generate`` call and needs no global patch.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, fields

import torch
from transformers import DynamicCache
from transformers.generation import (
    CandidateGenerator,
    EosTokenCriteria,
    LogitsProcessorList,
    MaxLengthCriteria,
    MaxTimeCriteria,
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .attention_d3d import pack_blocks
from .compat_d3d import (
    GENERATE_OUTPUT_CACHE_FIELD,
    assisted_stopping_criteria,
    assisting_target,
    cache_kwarg,
    passed_cache,
)
from .skinny_d3d import few_row_forwards, patched_forwards, skinny_next_forward


@dataclass
class D3DStats:
    """What one generation did. ``tau`` is committed tokens per target forward, bonus token included.

    Inside ``target.generate`` a round's outcome is read off the next round's input, so the final round stays
    pending until :meth:`observe` is given the output (``measure_tau`` and the benchmark do; the fast loop records
    every round itself). A round transformers runs without asking the drafter (one token left to the length limit)
    is not counted; its token joins the round before. Async fields:
    ``packed_passes`` launched, ``hits`` (next draft served from the packed pass), ``misses`` (sync draft needed).
    ``critical_draft_seconds`` is host time spent drafting before the target could verify (sync drafts and joins).
    """

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    committed_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    packed_passes: int = 0
    hits: int = 0
    misses: int = 0
    critical_draft_seconds: float = 0.0
    # the round not yet observed: its draft [1, k] and the committed length it was proposed at
    _pending: tuple[torch.LongTensor, int] | None = field(default=None, repr=False, compare=False)

    @property
    def tau(self) -> float:
        observed = len(self.acceptance_lengths)
        return self.committed_tokens / observed if observed else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0

    def record(self, accepted: int, committed: int) -> None:
        self._pending = None
        self.acceptance_lengths.append(accepted)
        self.accepted_tokens += accepted
        self.committed_tokens += committed

    def propose(self, draft: torch.LongTensor, committed_length: int) -> None:
        """A round proposed ``draft`` [1, k] at ``committed_length`` tokens; :meth:`observe` records its outcome."""
        self._pending = (draft, committed_length)

    def observe(self, input_ids: torch.LongTensor) -> None:
        """Record the pending round's outcome from ``input_ids``, the committed tokens since it was proposed on:
        the draft's leading tokens equal to them were accepted."""
        if self._pending is None:
            return
        draft, length = self._pending
        new = input_ids[0, length:].to(draft.device)
        draft = draft[0, : max(len(new) - 1, 0)]
        accepted = int((new[: len(draft)] == draft).int().cumprod(0).sum()) if len(draft) else 0
        self.record(accepted, len(new))  # which clears the pending round

    def as_dict(self) -> dict:
        counts = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        return {
            **counts,
            "acceptance_lengths": list(self.acceptance_lengths),
            "tau": self.tau,
            "hit_rate": self.hit_rate,
        }


@dataclass
class _Pending:
    """A packed pass in flight: the draft it assumed, its hypotheses and their slot logits."""

    committed_len: int  # L: committed tokens when the draft d_1..d_k was proposed
    draft: list[int]
    outcomes: list[tuple[int, int | None]]  # (accepted a, correction token g); g None: bonus guessed by slot 0
    logits: torch.Tensor  # [num_hypotheses, block_size, draft vocabulary]
    event: object = None  # CUDA event recorded on the side stream after the pass


# Logits processors whose output depends on the calls before (classifier-free guidance runs the model on an
# unconditional cache it extends at each call; SynthID keeps a context of the tokens it saw): nothing rolls their state
# back when a drafted row is rejected.
STATEFUL_PROCESSORS = (UnbatchedClassifierFreeGuidanceLogitsProcessor, SynthIDTextWatermarkLogitsProcessor)


def choose_hypotheses(
    probs: torch.Tensor, draft: list[int], budget: int, with_bonus: bool = True
) -> list[tuple[int, int | None]]:
    """The ``budget`` most likely verification outcomes (a accepted, correction g) under the draft's own confidence.

    ``probs`` is ``[k, vocab]``: the drafter's distribution at each draft slot. Outcome (a, g) with a < k means
    d_1..d_a accepted and g (not d_{a+1}) committed instead; (k, None) means all accepted and a bonus token whose
    guess is the first slot of a block anchored after d_k.
    """
    k = len(draft)
    rows, tokens = torch.arange(k, device=probs.device), torch.tensor(draft, device=probs.device)
    alt = probs.clone()
    alt[rows, tokens] = 0.0  # the corrections: any token but the draft's
    top = alt.topk(min(budget, alt.shape[-1]), dim=-1)
    # three reads of the device per round, not two per slot (each read waits for the device)
    p_draft = probs[rows, tokens].clamp(0.0, 1.0).tolist()
    values, indices = top.values.tolist(), top.indices.tolist()
    scored: list[tuple[float, tuple[int, int | None]]] = []
    reach = 1.0  # probability that d_1..d_a are all accepted
    for a in range(k):
        for prob, tok in zip(values[a], indices[a]):
            scored.append((reach * prob, (a, tok)))  # P(d_1..d_a accepted) * P(target says g at slot a+1)
        reach *= p_draft[a]
    if with_bonus:
        scored.append((reach * 0.5, (k, None)))
    scored.sort(key=lambda x: -x[0])
    return [outcome for _, outcome in scored[:budget]]


# The longest run of rounds that skip the drafter after rounds whose draft would not pay (see get_candidates).
MAX_IDLE_ROUNDS = 8


def best_length(expected: list[float], round_cost: list[float]) -> int:
    """The one "does it pay" rule of chains and trees: the k with the most expected committed tokens per unit of
    round cost. ``expected[k - 1]``: tokens a round proposing k draft tokens commits in expectation (the target's
    own token included); ``round_cost[k - 1]``: that round's cost, in target decode steps. k = 0, no draft, competes
    too: the target's own token for one decode step. Ties go to the shorter."""
    best_k, best = 0, 1.0
    for k, (value, cost) in enumerate(zip(expected, round_cost), start=1):
        if value / cost > best:
            best_k, best = k, value / cost
    return best_k


def draft_length(confidence: list[float], round_cost: list[float]) -> int:
    """How many leading draft tokens of a chain to propose (:func:`best_length`).

    ``confidence[i]`` is the drafter's probability that draft token i + 1 is right; a round proposing k tokens
    commits 1 + sum over i <= k of prod over j <= i of ``confidence[j]`` tokens in expectation (the correction or
    bonus token always comes). k never exceeds either list; it is 0 where no draft beats a plain decode step (on a
    CPU, verifying even two rows can cost nearly two steps).
    """
    expected, reach, total = [], 1.0, 1.0
    for p in confidence:
        reach *= p
        total += reach
        expected.append(total)
    return best_length(expected, round_cost)


def round_cost_key(
    device_type: str,
    target_dtype: torch.dtype | str | None = None,
    machine: str | None = None,
    skinny: bool = False,
    fp16_weights: bool = False,
) -> str:
    """Where calibrated round costs are kept: the device type ("cpu" means an fp32 target), then ``-machine`` if
    given (a CPU's instruction set, e.g. "cpu-avx2"), then ``+skinny`` for costs measured with few-row linears
    (``hf_d3d.skinny_linears``), ``+fp16w`` for a drafter with fp16-stored weights (``hf_d3d.fp16_weights``),
    then ``:dtype`` for any target dtype but fp32."""
    name = str(target_dtype or "float32").removeprefix("torch.")
    device = f"{device_type}-{machine.lower().replace(' ', '')}" if machine else device_type
    device += ("+skinny" if skinny else "") + ("+fp16w" if fp16_weights else "")
    return device if name == "float32" else f"{device}:{name}"


def cpu_kind() -> str:
    """The instruction set torch's CPU kernels use here ("AVX2", "AVX512", ...): CPUs of different kinds run a
    verify pass over several rows at very different costs relative to one decode step."""
    return torch.backends.cpu.get_cpu_capability()


def find_round_cost(
    costs: dict | None,
    device_type: str,
    target_dtype: torch.dtype | str | None = None,
    skinny: bool = False,
    fp16_weights: bool = False,
):
    """Round costs for this device and target dtype, the closest match first: with ``skinny`` those measured with
    few-row linears, then on a CPU those measured on this kind of CPU before the plain "cpu" ones, then with
    ``fp16_weights`` those of the drafter with fp16-stored weights; ``None`` when none were measured."""
    costs = costs or {}
    machines = (cpu_kind(), None) if device_type == "cpu" else (None,)
    for with_skinny in (True, False) if skinny else (False,):
        for machine in machines:
            for with_fp16 in (True, False) if fp16_weights else (False,):
                found = costs.get(round_cost_key(device_type, target_dtype, machine, with_skinny, with_fp16))
                if found is not None:
                    return found
    return None


class D3DCandidateGenerator(CandidateGenerator):
    """Proposes one block of ``block_size`` tokens per round from the drafter's own cache of committed tokens.

    Where the drafter's config holds a measured ``round_cost`` for this device and ``target_dtype`` (in the assisted
    loop, which never shows the drafter its target: the generation config's ``d3d_target_dtype``; fp32 if unset), a
    round proposes only the leading tokens of the block that pay for themselves (:func:`draft_length`), none when
    no draft beats a plain decode step (``min_draft`` at least); that costs one host read of the draft's
    confidences per round.

    With ``async_drafting`` it also launches, right after proposing a draft, one packed pass that drafts the next
    block for the likeliest verification outcomes; on CUDA it runs on a side stream while the target verifies.
    When the outcome is among them (a hit) the next draft costs nothing on the critical path; otherwise (a miss)
    a sync draft runs. Output is the same either way.

    It also answers the two cache calls that transformers' assisted loop makes on the assistant's
    ``past_key_values`` (``get_seq_length`` and ``crop``), which is how it rides along between rounds.
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        logits_processor: LogitsProcessorList | None = None,
        do_sample: bool = False,
        block_size: int | None = None,
        async_drafting: bool | None = None,
        num_hypotheses: int | None = None,
        target_dtype: torch.dtype | str | None = None,
        skinny: bool = False,
        min_draft: int = 0,
        verify_target: torch.nn.Module | None = None,
    ):
        self.drafter = drafter
        # The target whose verify forward follows each draft (transformers' assisted loop): computed with few-row
        # linears, one forward at a time, so that nothing outlives the round (skinny_next_forward).
        self.verify_target = verify_target
        self._verify_forwards = few_row_forwards(verify_target) if verify_target is not None else []
        skinny = skinny or bool(self._verify_forwards)
        self._drafter_forwards = few_row_forwards(drafter) if skinny else []  # collected once, entered every draft
        self.min_draft = min_draft
        self._idle, self._backoff = 0, 1  # rounds left to skip drafting; how many the next skip lasts
        config = drafter.config
        self.block_size = block_size or config.block_size
        # transformers hands the assistant a plain list of processors; the wrapper makes it callable
        self.logits_processor = LogitsProcessorList(logits_processor or [])
        stateful = sorted({type(p).__name__ for p in self.logits_processor if isinstance(p, STATEFUL_PROCESSORS)})
        if stateful:
            raise ValueError(
                f"{stateful} keep state from call to call; speculative decoding calls them for draft and verify "
                "rows that may be rejected, so the output would no longer be the target's own: decode without a "
                "drafter for guidance_scale or a SynthID watermark"
            )
        self.do_sample = do_sample
        self.cache = DynamicCache()
        self.stats = D3DStats()
        fill = config.mask_token_id
        self._fill_id = fill if fill is not None else 0  # slot embeddings are replaced, the id only fills the tensor
        if async_drafting is None:
            async_drafting = getattr(config, "async_drafting", None)
        device = self._device = next(drafter.parameters()).device
        if async_drafting is None:  # opt-in: on one H200, eager PyTorch hid none of the packed pass behind the
            async_drafting = False  # verify forward (one host thread launches both), so it only added its cost
        self.async_drafting = bool(async_drafting)
        # Round costs measured for this device (kind of CPU) and target dtype (hf-d3d calibrate); without them every
        # round drafts in full. An fp32 target is assumed unless told: the assisted loop never shows us the target.
        # ``skinny``: the target verifies with few-row linears (hf_d3d.skinny_linears), which cost less.
        # Drafts cost less with fp16-stored weights, which hf_d3d.fp16_weights notes in the drafter's generation config.
        fp16w = bool(getattr(drafter.generation_config, "d3d_fp16_weights", False))
        costs = getattr(config, "round_cost", None)
        self.round_cost = find_round_cost(costs, device.type, target_dtype, bool(skinny), fp16w)
        self.num_hypotheses = num_hypotheses or getattr(config, "num_hypotheses", 4)
        self._side_stream = torch.cuda.Stream(device) if self.async_drafting and device.type == "cuda" else None
        self._pending: _Pending | None = None
        # A loop that owns the rounds (hf_d3d.speculative_generate) sets this, queues the target's verify forward, and
        # then calls launch_deferred(): the packed pass's launch no longer delays the verify's (DESIGN: verify first).
        self.defer_packed = False
        self.generator: torch.Generator | None = None  # what sampled drafts draw from (None: torch's global RNG)
        self._deferred: tuple | None = None
        # Drafting works over the draft vocabulary (argmax, confidences, hypotheses: a sixth of the work for 8k of
        # 49k tokens); full-vocabulary logits are built only for what get_candidates hands back.
        self._vocab = drafter.draft_vocab if getattr(config, "draft_vocab_size", None) else None
        self._cache_kw = cache_kwarg(drafter)

    # -- the cache protocol of transformers' AssistedCandidateGenerator -------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length(layer_idx)

    def crop(self, max_length: int) -> None:
        """Ignored. transformers crops an assistant's cache as if it held the last draft, but this one holds only
        committed tokens (a packed pass's draft entries are trimmed by :meth:`_take_hypothesis`), so its crop
        would throw valid entries away for the next draft to recompute; :meth:`_draft_logits` trims what is
        stale."""

    # -- the draft vocabulary -------------------------------------------------------------------------------------
    def _tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of positions in the draft vocabulary."""
        return index if self._vocab is None else self._vocab[index]

    def _positions(self, tokens: list[int]) -> list[int]:
        """Positions in the (sorted) draft vocabulary of tokens the drafter proposed, which always lie inside it."""
        if self._vocab is None:
            return tokens
        return torch.searchsorted(self._vocab, torch.tensor(tokens, device=self._vocab.device)).tolist()

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits as full-vocabulary logits, ``-inf`` for tokens the drafter never proposes."""
        return logits if self._vocab is None else self.drafter.expand_draft_logits(logits)

    # -- drafting -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def get_candidates(
        self, input_ids: torch.LongTensor, max_new_tokens: int | None = None, **kwargs
    ) -> tuple[torch.LongTensor, torch.FloatTensor]:
        """Return ``input_ids`` extended by up to ``block_size`` draft tokens, and the logits they were drawn from."""
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"D3D drafting supports batch size 1 (as transformers' assisted decoding); got {input_ids.shape[0]}"
            )
        start = time.perf_counter()
        caller, input_ids = input_ids.device, input_ids.to(self._device)  # the fast loop passes the target's device
        self.stats.observe(input_ids)
        k = self.block_size if max_new_tokens is None else max(0, min(self.block_size, max_new_tokens))
        logits = self._take_hypothesis(input_ids)
        if k == 0 or (self._idle and logits is None):
            if k:  # resting after a round whose draft would not pay: a round of the target's own token alone
                self._idle -= 1
                self.stats.propose(input_ids[:, :0], input_ids.shape[1])
                self.stats.rounds += 1
            return input_ids.to(caller), input_ids.new_zeros(
                (1, 0, self.drafter.config.vocab_size), dtype=torch.float, device=caller
            )
        if logits is None or logits.shape[1] == 0:
            logits = self._draft_logits(input_ids)
        logits = logits[:, :k]
        draft, scores = self._choose(input_ids, logits)
        if self.round_cost is not None and draft.shape[1] > self.min_draft:
            # Judged on the drafter's own distributions over the whole block, never on the drawn tokens: a cut that
            # looked at a sampled token (or at how far the draws let the draft run) would bias which tokens reach
            # verification, and speculative sampling would no longer be exact.
            confidence = logits[0].softmax(-1).amax(-1).tolist()
            keep = max(min(draft_length(confidence, self.round_cost), draft.shape[1]), self.min_draft)
            draft, scores = draft[:, :keep], scores[:, :keep]
            # Hard stretches of text come in runs: after a round that found nothing worth verifying, the next 1, 2,
            # 4 .. rounds skip the drafter too (its cache catches up when it drafts again); a draft resets the count.
            self._idle, self._backoff = (
                (self._backoff, min(2 * self._backoff, MAX_IDLE_ROUNDS)) if keep == 0 else (0, 1)
            )
        k = draft.shape[1]
        self.stats.propose(draft, input_ids.shape[1])
        self.stats.rounds += 1
        self.stats.drafted_tokens += k
        if self.async_drafting and k:  # without a draft the target's one-row forward leaves nothing to hide behind
            if self.defer_packed:
                self._deferred = self._prepare_packed(input_ids, draft, logits)
            else:
                self._launch_packed(input_ids, draft, logits)
        # host time before the target can verify; on CPU the packed pass runs in line and so is included
        self.stats.critical_draft_seconds += time.perf_counter() - start
        return torch.cat([input_ids, draft], dim=1).to(caller), scores.to(caller)

    @torch.no_grad()
    def get_slot_candidates(
        self, input_ids: torch.LongTensor, depth: int, width: int
    ) -> tuple[list[list[float]], list[list[int]]]:
        """The ``width`` best candidates (log-probabilities, token ids) of each of the first ``depth`` slots of a
        block anchored at the last committed token, best first: what a draft tree is built from (one host read)."""
        start = time.perf_counter()
        input_ids = input_ids.to(self._device)
        self.stats.observe(input_ids)
        logits = self._draft_logits(input_ids)[0, :depth]
        top = logits.log_softmax(-1).topk(min(width, logits.shape[-1]), -1)
        values, tokens = top.values.tolist(), self._tokens(top.indices).tolist()
        self.stats.rounds += 1
        self.stats.critical_draft_seconds += time.perf_counter() - start
        return values, tokens

    def record_outcome(self, accepted: int, committed: int) -> None:
        """Record a round's outcome when the caller knows it (the fast loop) instead of inferring it next round."""
        self.stats.record(accepted, committed)

    def _draft_logits(self, input_ids: torch.LongTensor) -> torch.FloatTensor:
        """One drafter forward: uncached committed tokens as context plus one block anchored at the last of them.

        Returns the slots' logits over the draft vocabulary (the full one when the drafter has none)."""
        past = self.cache.get_seq_length()
        if past >= input_ids.shape[1]:  # the cache must end before the last committed token, which anchors the block
            self.cache.crop(-(past - input_ids.shape[1] + 1))
            past = input_ids.shape[1] - 1
        ids, layout = pack_blocks(input_ids[:, past:], past, [input_ids.shape[1] - 1], self.block_size, self._fill_id)
        slots = torch.arange(layout.num_context, ids.shape[1], device=ids.device)
        return self._run(ids, layout, slots).float()

    def _run(self, ids: torch.LongTensor, layout, keep: torch.Tensor) -> torch.Tensor:
        """Drafter forward over ``ids`` (context enters the cache); logits over the draft vocabulary at ``keep``."""
        draft_only = {"draft_logits": True} if self._vocab is not None else {}
        cache = {self._cache_kw: self.cache}
        with patched_forwards(self._drafter_forwards, (self.drafter,)) if self._drafter_forwards else nullcontext():
            return self.drafter(ids, layout=layout, logits_to_keep=keep, **cache, **draft_only).logits

    # -- asynchronous packed drafting ------------------------------------------------------------------------------
    def launch_deferred(self) -> None:
        """Launch the packed pass that :meth:`get_candidates` prepared and held back under ``defer_packed``."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            start = time.perf_counter()
            self._start_packed(deferred)
            if self._side_stream is None:  # it ran in line: the loop waited for it, as for a sync draft
                self.stats.critical_draft_seconds += time.perf_counter() - start

    def _launch_packed(self, input_ids: torch.LongTensor, draft: torch.LongTensor, logits: torch.Tensor) -> None:
        """Draft the next block for the likeliest outcomes of verifying ``draft``, in one packed forward.

        Context = uncached committed tokens + the draft itself (valid for every accepted prefix, since context
        attention is causal); it enters the cache and is cropped to the accepted prefix once the outcome is known.
        """
        self._start_packed(self._prepare_packed(input_ids, draft, logits))

    def _prepare_packed(self, input_ids: torch.LongTensor, draft: torch.LongTensor, logits: torch.Tensor) -> tuple:
        """The packed pass's inputs. Every host read it needs is made here, before a deferring loop queues its verify
        forward: after that, each read would wait for the verify to finish."""
        committed = input_ids.shape[1]
        tokens = draft[0].tolist()
        # the bonus block spends its first slot on guessing the bonus, so a block of one has no draft left after it
        found = choose_hypotheses(
            logits[0].softmax(-1), self._positions(tokens), self.num_hypotheses, self.block_size > 1
        )
        guesses = self._tokens(torch.tensor([g or 0 for _, g in found], device=draft.device)).tolist()  # one read
        outcomes = [(a, None if g is None else tok) for (a, g), tok in zip(found, guesses)]
        anchors = [committed - 1 + a for a, _ in outcomes]
        prefixes = [[g] if g is not None else [] for _, g in outcomes]
        past = self.cache.get_seq_length()
        context = torch.cat([input_ids[:, past:], draft], dim=1)
        ids, layout = pack_blocks(context, past, anchors, self.block_size, self._fill_id, prefixes)
        slot_index = layout.is_slot[0].nonzero().squeeze(1)
        ready = None
        if self._side_stream is not None:  # the side stream waits for these inputs, not for a verify queued later
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(ids.device))
        return committed, tokens, outcomes, ids, layout, slot_index, ready

    def _start_packed(self, prepared: tuple) -> None:
        """Run the packed forward that :meth:`_prepare_packed` set up: on the side stream on CUDA, else in line."""
        committed, tokens, outcomes, ids, layout, slot_index, ready = prepared
        if self._side_stream is not None:
            self._side_stream.wait_event(ready)
            # Tensors made on the main stream and read (or freed, like the cache tensors that update() replaces)
            # by the side stream must not be handed back to the main stream's allocator before the pass is done.
            inputs = [ids, slot_index, layout.position_ids, layout.block_ids, layout.is_slot, layout.anchors]
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None:
                    inputs += [layer.keys, layer.values]
            for t in inputs:
                t.record_stream(self._side_stream)
            with torch.cuda.stream(self._side_stream):
                out = self._run(ids, layout, slot_index)
                event = torch.cuda.Event()
                event.record(self._side_stream)
        else:
            out = self._run(ids, layout, slot_index)
            event = None
        self._pending = _Pending(committed, tokens, outcomes, out.view(len(outcomes), self.block_size, -1), event)
        self.stats.packed_passes += 1

    def _take_hypothesis(self, input_ids: torch.LongTensor) -> torch.Tensor | None:
        """Join the packed pass; on a hit return the next draft's slot logits ``[1, n, vocab]``, else ``None``."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.event is not None:
            main = torch.cuda.current_stream(input_ids.device)
            main.wait_event(pending.event)
            # The pass allocated its logits and the grown cache tensors on the side stream; the main stream reads
            # them from here on, so their memory must not be reused by the side stream before the main one is done.
            pending.logits.record_stream(main)
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None:
                    layer.keys.record_stream(main)
                    layer.values.record_stream(main)
        new = input_ids[0, pending.committed_len :].tolist()
        accepted = len(new) - 1
        common = 0  # committed tokens that extend the draft the packed pass assumed
        while common < min(len(new), len(pending.draft)) and new[common] == pending.draft[common]:
            common += 1
        # The packed pass cached the whole draft; keep only what was committed (transformers may have cropped more).
        keep = min(self.cache.get_seq_length(), pending.committed_len + common)
        self.cache.crop(-(self.cache.get_seq_length() - keep))
        if accepted < 0 or common < accepted:
            self.stats.misses += 1
            return None
        correction = new[-1]
        for i, (a, g) in enumerate(pending.outcomes):
            if a != accepted:
                continue
            block = pending.logits[i : i + 1].float()
            if g == correction:
                self.stats.hits += 1
                return block
            if g is None and int(self._tokens(block[0, 0].argmax())) == correction:
                # bonus block: its first slot guessed the bonus token right; the rest is the next draft
                self.stats.hits += 1
                return block[:, 1:]
        self.stats.misses += 1
        return None

    def _choose(
        self, input_ids: torch.LongTensor, logits: torch.FloatTensor
    ) -> tuple[torch.LongTensor, torch.FloatTensor]:
        """Pick draft tokens from draft-vocabulary ``logits``; return them with each slot's processed logits over the
        full vocabulary: exactly the distribution it was drawn from."""
        if not self.do_sample and len(self.logits_processor) == 0:
            return self._tokens(logits.argmax(-1)), self._full(logits)
        logits = self._full(logits)  # processors and sampling index by token id
        # uniform over the tokens the drafter can propose (its draft vocabulary), which the packed pass indexes by
        in_vocab = torch.isfinite(logits[:, 0])
        stand_in = torch.where(in_vocab, 0.0, float("-inf"))
        seq = input_ids
        scores = torch.empty_like(logits)
        proposable = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
        for i in range(logits.shape[1]):
            # Processors such as repetition penalty read the tokens drafted so far, as they will at verification.
            scores[:, i] = self.logits_processor(seq, logits[:, i])
            if self._vocab is not None:  # a processor may lift -inf (remove_invalid_values): never off-vocabulary
                scores[:, i] = scores[:, i].masked_fill(~in_vocab, float("-inf"))
            # A row with no finite score (processors ruled out every token the drafter can propose, e.g. bad words
            # within a draft vocabulary) ends the draft. The cut is made after the loop, so the host reads the
            # device once per round; meanwhile such a row draws from a harmless uniform stand-in.
            proposable[i] = torch.isfinite(scores[:, i]).any()
            row = torch.where(proposable[i], scores[:, i], stand_in)
            if self.do_sample:  # drawn where the generator lives (a CPU one cannot draw on a GPU), then moved
                at = self.generator.device if self.generator is not None else row.device
                nxt = torch.multinomial(row.softmax(-1).to(at), 1, generator=self.generator).to(row.device)
            else:
                nxt = row.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        # Sampling through transformers needs a draft row in every round (min_draft): then a first slot with nothing
        # proposable stays, drawn from the uniform stand-in and reported as it. Speculative sampling is exact for
        # whatever distribution a draft token was drawn from, so the target's distribution is kept.
        keep = max(int(proposable.long().cumprod(0).sum()), self.min_draft)
        scores = torch.where(proposable[:keep, None], scores[:, :keep], stand_in[:, None])
        return seq[:, input_ids.shape[1] : input_ids.shape[1] + keep], scores


def assistant_generate(drafter, input_ids: torch.LongTensor, **kwargs) -> GenerateDecoderOnlyOutput:
    """What ``drafter.generate`` answers when transformers' assisted loop asks it for candidates."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"D3D assisted generation supports batch size 1, got {input_ids.shape[0]}")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("D3D assisted generation does not support padded inputs (attention_mask with zeros)")
    # the target's generation config, as transformers' assisted loop passes it to every assistant; D3D reads three
    # optional fields from it: ``d3d_target_dtype`` and ``d3d_skinny`` (which calibrated round costs apply; False:
    # leave the target's linears alone) and ``d3d_prefill_alone`` (exact verification: no draft in the first round).
    # hf_d3d.exact_verification, hf_d3d.skinny_linears and hf_d3d.cpu.skinny.no_skinny_linears set them for their
    # block.
    config = kwargs["generation_config"]
    generator = passed_cache(kwargs.get("cache"), kwargs.get("past_key_values"))
    first = not isinstance(generator, D3DCandidateGenerator)
    if first:
        target = assisting_target()
        criteria, loop_config = assisted_stopping_criteria()
        refuse_round_end_stops(criteria, loop_config)
        if target is not None and loop_config is not None and loop_config.max_length is not None:
            refuse_rescaling_rope(target.config, loop_config.max_length)
        if getattr(config, "assistant_ensemble_weight", None) is not None:
            # transformers then accepts against a mixture of target and draft: no longer the target's own output
            raise ValueError("assistant_ensemble_weight verifies against a target/draft mixture; D3D is lossless only")
        exact = getattr(config, "d3d_prefill_alone", False)
        skinny = getattr(config, "d3d_skinny", None)  # True: the caller's skinny_linears block; False: not wanted
        # Verifying a few rows costs nearly a decode step per row with fp32 CPU GEMMs; the drafter gives the target's
        # verify forwards few-row linears itself, unless the caller already did, or said not to, or verification
        # must be exact.
        few_rows = target is not None and skinny is None and not exact
        generator = D3DCandidateGenerator(
            drafter,
            kwargs.get("logits_processor"),
            do_sample=bool(config.do_sample),
            target_dtype=getattr(config, "d3d_target_dtype", None) or getattr(target, "dtype", None),
            skinny=bool(skinny),
            min_draft=int(config.do_sample),  # transformers' speculative sampling needs a draft row in every round
            verify_target=target if few_rows else None,
        )
        drafter.last_stats = generator.stats
        if exact and not config.do_sample:
            # Exact verification (hf_d3d.exact): no draft in the first round, so the target prefills the prompt
            # alone.
            generator.stats.propose(input_ids[:, :0], input_ids.shape[1])
            return _assistant_output(input_ids, input_ids.new_zeros((1, 0, drafter.config.vocab_size)), generator)
    sequences, scores = generator.get_candidates(input_ids, max_new_tokens=kwargs.get("max_new_tokens"))
    if generator._verify_forwards and not first and sequences.shape[1] > input_ids.shape[1]:
        # the target's next forward verifies this draft (the first round's is its prefill; without a draft, one row)
        skinny_next_forward(generator.verify_target, generator._verify_forwards)
    return _assistant_output(sequences, scores, generator)


def refuse_round_end_stops(criteria: list, loop_config=None) -> None:
    """Refuse stopping criteria that transformers' assisted loop checks only once per round (stop strings, custom
    ones): a round commits several tokens, so the output could run past where plain ``generate`` stops. It cuts a
    round at its config's EOS and length limit itself, so an EOS or length criterion of other values (a caller's,
    which replaces generate's own) is refused too; a time limit stops at no fixed token anyway."""
    others = {
        type(c).__name__ for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria))
    }
    if loop_config is not None:
        eos = getattr(loop_config, "_eos_token_tensor", None)
        eos = set() if eos is None else set(eos.reshape(-1).tolist())
        for c in criteria:
            if isinstance(c, MaxLengthCriteria) and c.max_length != loop_config.max_length:
                others.add(f"MaxLengthCriteria(max_length={c.max_length}), not generate's max_length")
            if isinstance(c, EosTokenCriteria) and set(c.eos_token_id.reshape(-1).tolist()) != eos:
                others.add(f"EosTokenCriteria({sorted(c.eos_token_id.reshape(-1).tolist())}), not generate's EOS")
    if others:
        raise ValueError(
            f"assisted generation checks {sorted(others)} only after each round of several tokens, so the output could "
            "run past where plain generate stops; hf_d3d's fast loop checks them after every token: "
            "target.generate(..., custom_generate=hf_d3d.d3d_generate, drafter=drafter)"
        )


def refuse_rescaling_rope(config, max_length: int, lookahead: int = 0) -> None:
    """Refuse a generation that may run past the length where the target's RoPE rescales (``dynamic`` NTK beyond
    ``max_position_embeddings``, ``longrope`` beyond ``original_max_position_embeddings``): transformers rescales by
    the longest position of a forward, so a verify forward over several tokens rescales them all where decode steps
    rescale from the crossing token on, and the output would part from plain ``generate``. ``lookahead``: how many
    positions past the last verified one a target forward also holds (the fused pass's draft blocks)."""
    config = config.get_text_config()
    params = getattr(config, "rope_parameters", None) or {}
    per_layer_type = bool(params) and all(isinstance(p, dict) or p is None for p in params.values())
    for rope in [p for p in params.values() if p] if per_layer_type else [params]:
        kind = rope.get("rope_type", rope.get("type", "default"))  # "type": a config that was never standardised
        if "dynamic" in kind:
            limit = config.max_position_embeddings
        elif kind == "longrope":
            limit = rope.get("original_max_position_embeddings") or config.max_position_embeddings
        else:
            continue
        if max_length + lookahead > limit:
            further = f" (its forwards reach up to {lookahead} positions further)" if lookahead else ""
            raise ValueError(
                f"this target's RoPE ({kind}) rescales once a sequence passes {limit} tokens, and a forward over "
                "several draft tokens rescales them together where decoding one at a time does not, so a generation "
                f"of up to {max_length} tokens could differ from plain generate; keep prompt + max_new_tokens <= "
                f"{limit - lookahead}{further}"
            )


def _assistant_output(sequences, scores, generator) -> GenerateDecoderOnlyOutput:
    if scores.shape[1] == 0 and not generator.do_sample:
        # A round without a draft. transformers stacks the scores, so one unused row stands in for them; greedy
        # verification never reads it (sampling would, which is why a sampling generator always drafts).
        scores = scores.new_zeros((1, 1, scores.shape[-1]), dtype=torch.float)
    return GenerateDecoderOnlyOutput(
        sequences=sequences, scores=tuple(scores.unbind(1)), **{GENERATE_OUTPUT_CACHE_FIELD: generator}
    )
