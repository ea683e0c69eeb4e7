"""One target forward that verifies the current draft and drafts the next: D3D for a drafter that *is* its target.

A whole-LM drafter converted from the target itself (``hf-d3d train --whole-lm target --block-adapter-rank R``) runs
the target's exact computation on context tokens and sends only block tokens through its low-rank adapters, and a
block's first draft token is read from its anchor's causal output (the shift). So the target's own forward can carry
the drafter's blocks: the verification rows stay the target's own, and a block anchored after each likely accepted
prefix drafts the next draft in the same pass (a tree of its best candidates per slot, verified with a tree mask as
the two-pass loop's trees are, or a chain). A round costs one target forward instead of a verify forward plus a
drafter pass, and no second copy of the weights is read. The block anchored after the prefix the target accepts
holds the next draft: its slot 0 sits where the target's own next token goes (committed from the verification row),
its slots 0..S-2 predict the S-1 tokens after that. Where the accepted prefix had no block, the next pass verifies
nothing and drafts afresh, so every pass commits at least the target's own token.

Greedy decoding, batch size 1, a dynamic cache. :func:`fusable` says whether a drafter qualifies.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GenerationConfig, PreTrainedModel

from hf_d3d.checks import check_pair
from hf_d3d.exact import is_exact
from hf_d3d.modeling.attention_d3d import D3DLayout, d3d_attention_mask, pack_blocks, pack_tree_blocks
from hf_d3d.modeling.compat_d3d import cache_kwarg
from hf_d3d.modeling.generation_d3d import D3DStats, refuse_rescaling_rope
from hf_d3d.modeling.modeling_d3d import _lm_state
from hf_d3d.speculative import _eos_set, _processors, _until_stop
from hf_d3d.tree import (
    DraftTree,
    build_tree,
    keep_path,
    tree_rows,
    tree_unsupported,
    tree_visibility,
    verify_tree_greedy,
)

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def fusable(target: PreTrainedModel, drafter: PreTrainedModel) -> str | None:
    """``None`` where ``drafter`` is ``target`` plus block adapters (so one target forward can run both); else why
    not. Compares every base weight of the drafter with the target's, cast to the drafter's dtype, once per pair of
    weight versions (the answer is kept on the drafter)."""
    devices = set((getattr(target, "hf_device_map", None) or {}).values())
    if len(devices) > 1 or devices & {"disk", "meta"}:  # its rounds are one forward of one module on one device
        return f"the target must run on one device; this one is dispatched over {sorted(map(str, devices))}"
    pairs = _base_pairs(target, drafter)
    if isinstance(pairs, str):
        return pairs
    key = (id(target), tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for pair in pairs for t in pair))
    kept = getattr(drafter, "_fusable", None)
    if kept is None or kept[0] != key:
        same = all(m.shape == t.shape and torch.equal(m, t.to(m.device, m.dtype)) for m, t in pairs)
        drafter._fusable = (key, None if same else "the drafter's base weights differ from the target's")
    return drafter._fusable[1]


def _base_pairs(target: PreTrainedModel, drafter: PreTrainedModel) -> list[tuple[torch.Tensor, torch.Tensor]] | str:
    """(drafter, target) pairs of every weight the drafter takes from its base LM (embeddings, norms, head unless
    tied, every layer's projections, biases and norms), or why the drafter has no such pairing."""
    cfg = drafter.config
    if not getattr(cfg, "shifted_slots", False) or not getattr(cfg, "block_adapter_rank", 0):
        return "the drafter is not a whole LM with block adapters and shifted slots (hf-d3d train --whole-lm target)"
    kind = target.config.get_text_config().model_type
    if kind != cfg.target_model_type:  # another family may compute its mask or projections differently
        return f"the drafter was converted from a {cfg.target_model_type} model; this target is {kind}"
    layers = target.get_decoder().layers
    if list(cfg.target_layer_ids or []) != list(range(len(layers))) or cfg.num_hidden_layers != len(layers):
        return f"the drafter keeps target layers {cfg.target_layer_ids}, not all {len(layers)} of them"
    if drafter.model.skip_layers:
        return "the drafter skips layers at run time"
    mine = drafter.state_dict()
    theirs = _lm_state(target, list(range(len(layers))), bool(cfg.tie_word_embeddings), cfg.vocab_size)
    missing = sorted(set(theirs) - set(mine))
    if missing:
        return f"the drafter has no {missing[0]} (another architecture than the target's)"
    pairs = [(mine[k].detach(), t.detach()) for k, t in theirs.items()]
    # the target's head drafts the blocks: it must be the drafter's, tied or not
    return pairs + [(drafter.lm_head.weight.detach(), target.get_output_embeddings().weight.detach())]


def draft_from(
    hidden: torch.Tensor, head: torch.Tensor, draft_vocab: torch.Tensor | None, width: int
) -> tuple[list[list[float]], list[list[int]]]:
    """The ``width`` best candidates of each slot row of ``hidden`` through ``head`` (rows of the draft vocabulary,
    if any): log-probabilities and token ids, best first, as :func:`hf_d3d.tree.build_tree` takes them."""
    top = F.linear(hidden, head).float().log_softmax(-1).topk(width, -1)
    tokens = top.indices if draft_vocab is None else draft_vocab[top.indices]
    return top.values.tolist(), tokens.tolist()


def likely_ends(parents: list[int], q: list[float], budget: int) -> list[int]:
    """The ``budget`` nodes of a draft tree most likely to end the path the target accepts (-1: the root, nothing
    accepted), under the drafter's own probabilities: node i is reached with the product of ``q`` along its path
    (``q[i]``: its probability given its parent) and ends the path unless one of its children is accepted."""
    reach = [1.0] * len(parents)
    leave = {-1: 1.0}
    for i, parent in enumerate(parents):
        reach[i] = (reach[parent] if parent >= 0 else 1.0) * q[i]
        leave[parent] = leave.get(parent, 1.0) - q[i]
    score = {-1: leave[-1], **{i: reach[i] * leave.get(i, 1.0) for i in range(len(parents))}}
    return sorted(sorted(score, key=lambda i: -score[i])[: max(budget, 1)])


class FusedPass:
    """One target forward over context tokens and draft blocks: the target's own rows for the context, the drafter's
    adapters added to the block rows. A context manager: the adapter hooks live on the target inside ``with``."""

    def __init__(self, target: PreTrainedModel, drafter: PreTrainedModel):
        self.target, self.drafter = target, drafter
        self.size = drafter.config.block_size
        self.mask_vector = drafter.model.mask_vector().detach().to(target.device, target.dtype)
        self.block_from: int | None = None  # rows from here on are block rows (None: a plain forward)
        self.fired = 0  # adapter hooks run by the last pass
        self.hidden: torch.Tensor | None = None
        self._handles: list = []

    def _adapter_hook(self, adapter, module: torch.nn.Module):
        device, dtype = module.weight.device, module.weight.dtype
        down = adapter.down.weight.detach().to(device, dtype)
        up_t = adapter.up.detach().to(device, dtype).t()

        def hook(module, args, out):
            n = self.block_from
            if n is None:
                return out
            if out.dim() != 3 or args[0].shape[:2] != out.shape[:2]:
                raise ValueError(f"fused rounds need projections applied to [batch, rows, features]; got {out.shape}")
            self.fired += 1
            if out.shape[1] > n:  # batch size 1: 2-D rows keep these matmuls plain mm calls
                out[0, n:].addmm_(F.linear(args[0][0, n:], down), up_t)
            return out

        return hook

    def _keep_hidden(self, module, args, out) -> None:  # normed last hidden states: the blocks' drafts read them
        self.hidden = out.last_hidden_state

    def __enter__(self) -> FusedPass:
        decoder = self.target.get_decoder()
        for mine, theirs in zip(self.drafter.model.layers, decoder.layers):
            for part, names in (("self_attn", _ATTN), ("mlp", _MLP)):
                adapters = getattr(mine, part).block_adapters
                for name in names if adapters is not None else ():
                    module = getattr(getattr(theirs, part), name)
                    self._handles.append(module.register_forward_hook(self._adapter_hook(adapters[name], module)))
        self._handles.append(decoder.register_forward_hook(self._keep_hidden))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __call__(
        self, cache: DynamicCache, cached: int, context: torch.LongTensor, verify_from: int, anchors: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``context`` (``[1, n]``, after ``cached`` cached positions) and one block anchored after each of its
        rows ``anchors`` (offsets into ``context``): :meth:`run` of the :func:`pack_blocks` layout."""
        ids, layout = pack_blocks(context, cached, [cached + a for a in anchors], self.size, fill_id=0)
        return self.run(cache, ids, layout, verify_from)

    def run(
        self, cache: DynamicCache, ids: torch.LongTensor, layout: D3DLayout, verify_from: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over a D3D layout of context rows then blocks. Returns the target's logits for context
        rows ``verify_from`` on and the blocks' last hidden states ``[blocks, block_size, hidden]``. The cache then
        holds every row of the pass; crop it to what is committed."""
        target, device, cached = self.target, ids.device, layout.past_length
        x = torch.where(layout.is_slot[..., None], self.mask_vector, target.get_input_embeddings()(ids))
        allowed = d3d_attention_mask(layout, cached)
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=device).masked_fill(~allowed, torch.finfo(x.dtype).min)
        n = layout.num_context
        self.block_from, self.fired = n, 0
        try:
            logits = target(
                inputs_embeds=x,
                attention_mask=mask,
                position_ids=layout.position_ids,
                use_cache=True,
                logits_to_keep=torch.arange(verify_from, n, device=device),
                **{cache_kwarg(target): cache},
            ).logits[0]
        finally:
            self.block_from = None
        if self.fired != len(self._handles) - 1:  # a kernel that bypasses a projection module skips its adapter
            raise ValueError(
                f"{self.fired} of {len(self._handles) - 1} adapted projections ran in the target's forward"
            )
        return logits, self.hidden[0, n:].view(-1, self.size, self.hidden.shape[-1])


@torch.no_grad()
def fused_generate(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 128,
    eos_token_id: int | list[int] | None = None,
    num_hypotheses: int | None = None,
    stopping_criteria=None,
    streamer=None,
    on_round: Callable[[list[int], int, list[int]], None] | None = None,
    tree: bool = True,
    generation_config: GenerationConfig | None = None,
) -> torch.LongTensor:
    """Greedy decode of ``target`` whose rounds each cost one target forward (see the module); returns prompt + new
    tokens ``[1, n]``, the tokens ``target.generate(do_sample=False)`` returns. ``eos_token_id`` defaults to the
    target's generation config. ``generation_config`` (default: the target's): the settings plain ``generate`` would
    decode with; one that builds a logits processor (a repetition penalty, ``min_new_tokens``, ...) is refused.
    ``tree``: verify a draft tree of the accepted block's best candidates (the default)
    or its greedy chain. ``num_hypotheses``: blocks per pass, anchored at the draft's nodes most likely to end the
    accepted path (default: every node and the root on an accelerator, 2 on a CPU, where each block's rows cost
    compute). ``stopping_criteria``, ``streamer`` and ``on_round(draft, accepted, committed)`` as in
    :func:`hf_d3d.speculative_generate`. Statistics in ``drafter.last_stats`` (``hits``: passes whose accepted path
    ended at a node with a block)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"fused_generate supports batch size 1, got input of shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_pair(target, drafter)
    refuse_rescaling_rope(target.config, input_ids.shape[1] + max_new_tokens, lookahead=drafter.config.block_size)
    why_not = fusable(target, drafter)
    if why_not:
        raise ValueError(f"fused_generate cannot run this pair: {why_not}")
    if "logits_to_keep" not in inspect.signature(target.forward).parameters:
        raise ValueError("fused_generate needs a target whose forward takes logits_to_keep (its verification rows)")
    if is_exact(target):
        raise ValueError("fused_generate runs blocks beside the verification rows: exact verification cannot run")
    config = copy.copy(generation_config or target.generation_config or GenerationConfig())
    config.do_sample, config.max_length = False, input_ids.shape[1] + max_new_tokens
    procs = _processors(target, config, input_ids, None, stopping_criteria)
    if len(procs):  # plain greedy generate applies them; the fused rounds take the argmax of raw logits
        names = sorted({type(p).__name__ for p in procs})
        raise ValueError(f"fused_generate decodes without logits processors; the generation config asks for {names}")
    cache = DynamicCache()
    why_not = tree_unsupported(target, cache, do_sample=False)
    if why_not:  # the same needs as a tree's verify forward: a custom 4D mask, positions from position_ids
        raise ValueError(f"fused_generate passes the target a custom mask, as draft trees do, and {why_not}")
    if eos_token_id is None and target.generation_config is not None:
        eos_token_id = target.generation_config.eos_token_id
    eos = _eos_set(eos_token_id)
    size = drafter.config.block_size
    per_round = min(size - 1, int(getattr(drafter.generation_config, "num_assistant_tokens", 0) or size))
    device = target.device
    if num_hypotheses is None:
        num_hypotheses = per_round + 1 if device.type != "cpu" else 2
    draft_vocab = drafter.draft_vocab.to(device) if drafter.config.draft_vocab_size is not None else None
    head = target.get_output_embeddings().weight
    draft_head = head if draft_vocab is None else head.index_select(0, draft_vocab)
    stats = drafter.last_stats = D3DStats()

    seq = input_ids.to(device)
    if streamer is not None:
        streamer.put(seq.cpu())
    limit = seq.shape[1] + max_new_tokens
    cached = seq.shape[1] - 1
    if cached and max_new_tokens:  # the prompt but its last token, plainly: no dense custom mask over a long prompt
        target(seq[:, :cached], use_cache=True, logits_to_keep=1, **{cache_kwarg(target): cache})
    width = per_round if tree else 1  # candidates per slot: a draft tree, or a chain (a tree of one path)
    draft_tree, node_q = DraftTree([], [], [], []), []  # the draft, and each node's probability given its parent
    with FusedPass(target, drafter) as fused_pass:
        while seq.shape[1] < limit:
            # Context: the tokens the cache lacks (the prompt, then the last committed token: the root) and the draft.
            pending = seq[0, cached:].tolist()
            m = len(pending)
            ends = likely_ends(draft_tree.parents, node_q, num_hypotheses)  # -1: the root
            context_ids, positions = tree_rows(draft_tree, pending, cached, device)
            sees = tree_visibility(draft_tree.parents, m)
            anchor_rows = [m + e for e in ends]  # the root's row is m - 1
            ids, layout = pack_tree_blocks(context_ids, positions, sees, cached, anchor_rows, size, fill_id=0)
            logits, blocks = fused_pass.run(cache, ids, layout, verify_from=m - 1)
            path, token = verify_tree_greedy(draft_tree, logits.argmax(-1).tolist())
            draft = [draft_tree.tokens[i] for i in path + draft_tree.best_chain(path[-1] if path else -1)]
            accepted = len(path)
            new, stop = _until_stop(seq, (draft[:accepted] + [token])[: limit - seq.shape[1]], eos, stopping_criteria)
            stats.rounds += 1
            stats.drafted_tokens += len(draft_tree.tokens)
            stats.record(min(accepted, len(new)), len(new))
            if on_round is not None:
                on_round(draft, min(accepted, len(new)), new)
            keep_path(cache, cached + m - 1, path)  # the root and the accepted nodes stay; other nodes, blocks go
            cached += m + accepted
            seq = torch.cat([seq, torch.tensor([new], device=device, dtype=seq.dtype)], dim=1)
            if streamer is not None:
                streamer.put(torch.tensor(new))
            if stop:
                break
            end = path[-1] if path else -1
            room = max(limit - seq.shape[1] - 1, 0)  # a round commits its accepted drafts and one more token
            if end in ends:  # the block anchored after the accepted path holds the next draft
                stats.hits += bool(draft_tree.tokens)
                logprobs, tokens = draft_from(blocks[ends.index(end), :per_round], draft_head, draft_vocab, width)
                draft_tree = build_tree(logprobs[:room], tokens[:room], min(per_round, room))
                nodes = zip(draft_tree.tokens, draft_tree.depths)
                node_q = [math.exp(logprobs[d - 1][tokens[d - 1].index(t)]) for t, d in nodes]
            else:
                stats.misses += 1
                draft_tree, node_q = DraftTree([], [], [], []), []
    if streamer is not None:
        streamer.end()
    return seq
