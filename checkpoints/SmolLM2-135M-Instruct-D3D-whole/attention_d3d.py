"""The D3D attention pattern and the packed-input layout it is built from.

One forward pass holds clean context tokens followed by any number of draft blocks. A block is anchored after
context position ``p``: it may start with a few private clean tokens (for example a guessed correction token) and
then holds ``block_size`` mask slots. Rules, for query q and key k:

* a context query sees context keys at positions <= its own (causal);
* every token of a block sees context keys at positions <= the block's anchor;
* inside a block, clean tokens see earlier block tokens (causal) and slots see the whole block (bidirectional);
* nothing outside a block sees its tokens.

The context may also be a draft tree (``context_sees``): a context query then sees the context keys its row sees
(the committed tokens and its ancestors), and a block anchored at a tree node sees what that node sees, itself
included.

Training, synchronous drafting and the packed asynchronous pass all build their masks with
:func:`d3d_attention_mask`, so the three can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CONTEXT = -1  # block id of clean context tokens


@dataclass
class D3DLayout:
    """Per-token description of a packed input of shape ``[batch, T]`` that follows ``past_length`` cached tokens.

    Context tokens come first (``num_context`` of them; they are the only ones written to the KV cache), then the
    block tokens. ``anchors`` holds the anchor position of each block token and the own position of context tokens.
    """

    position_ids: torch.LongTensor
    block_ids: torch.LongTensor
    is_slot: torch.BoolTensor
    anchors: torch.LongTensor
    past_length: int
    num_context: int
    # A tree context: which of the forward's context rows each context row sees ([n, n], True on the diagonal), and
    # for every token the context row it takes its view from (its own row, or its block's anchor row).
    context_sees: torch.BoolTensor | None = None
    anchor_rows: torch.LongTensor | None = None
    # some block holds clean tokens before its slots (pack_blocks' prefixes): the rows that are not slots
    clean_block_rows: bool = False

    def attention_mask(self) -> torch.BoolTensor:
        """Boolean mask ``[batch, 1, T, past_length + T]``, True where attention is allowed."""
        return d3d_attention_mask(self, self.past_length)


def d3d_attention_mask(layout: D3DLayout, past_length: int) -> torch.BoolTensor:
    """Build the D3D mask for the queries in ``layout`` over ``past_length`` cached context keys plus themselves."""
    batch, _ = layout.position_ids.shape
    device = layout.position_ids.device
    past_pos = torch.arange(past_length, device=device).expand(batch, past_length)
    k_pos = torch.cat([past_pos, layout.position_ids], dim=1)[:, None, :]
    k_block = torch.cat([torch.full_like(past_pos, CONTEXT), layout.block_ids], dim=1)[:, None, :]
    k_slot = torch.cat([torch.zeros_like(past_pos, dtype=torch.bool), layout.is_slot], dim=1)[:, None, :]
    q_pos = layout.position_ids[:, :, None]
    q_block = layout.block_ids[:, :, None]
    q_slot = layout.is_slot[:, :, None]
    q_anchor = layout.anchors[:, :, None]

    sees_context = (k_block == CONTEXT) & (k_pos <= q_anchor)
    if layout.context_sees is not None:  # a tree: the forward's own context keys by ancestry, not by position
        n = layout.num_context
        tree = layout.context_sees.to(device)[layout.anchor_rows]  # [batch, T, n]
        sees_context[:, :, past_length : past_length + n] = tree
    same_block = (q_block == k_block) & (q_block != CONTEXT)
    sees_block = same_block & ((k_pos <= q_pos) | (q_slot & k_slot))
    return (sees_context | sees_block)[:, None]


def pack_blocks(
    context_ids: torch.LongTensor,
    past_length: int,
    anchors: list[int],
    block_size: int,
    fill_id: int,
    prefixes: list[list[int]] | None = None,
) -> tuple[torch.LongTensor, D3DLayout]:
    """Lay out ``context_ids`` (shape ``[batch, n]``, positions from ``past_length``) followed by one block per anchor.

    Block ``i`` is anchored after absolute context position ``anchors[i]``, starts with the clean tokens
    ``prefixes[i]`` (may be empty; lengths may differ between blocks) and ends with ``block_size`` slots filled with
    ``fill_id``. Every row of the batch shares the layout.
    """
    batch, n_ctx = context_ids.shape
    device = context_ids.device
    prefixes = prefixes if prefixes is not None else [[] for _ in anchors]
    if len(prefixes) != len(anchors):
        raise ValueError("one prefix per anchor is required")
    last = past_length + n_ctx - 1
    if any(a < 0 or a > last for a in anchors):
        raise ValueError(f"block anchors must lie in the context [0, {last}], got {anchors}")

    ids = [context_ids]
    pos = [torch.arange(past_length, past_length + n_ctx, device=device)]
    blk = [torch.full((n_ctx,), CONTEXT, device=device)]
    slot = [torch.zeros(n_ctx, dtype=torch.bool, device=device)]
    anc = [pos[0]]
    for b, (anchor, prefix) in enumerate(zip(anchors, prefixes)):
        width = len(prefix) + block_size
        tokens = torch.tensor(list(prefix) + [fill_id] * block_size, device=device)
        ids.append(tokens.expand(batch, width))
        pos.append(torch.arange(anchor + 1, anchor + 1 + width, device=device))
        blk.append(torch.full((width,), b, device=device))
        slot.append(torch.arange(width, device=device) >= len(prefix))
        anc.append(torch.full((width,), anchor, device=device))

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts).expand(batch, -1)

    layout = D3DLayout(
        position_ids=cat(pos),
        block_ids=cat(blk),
        is_slot=cat(slot),
        anchors=cat(anc),
        past_length=past_length,
        num_context=n_ctx,
        clean_block_rows=any(len(p) for p in prefixes),
    )
    return torch.cat(ids, dim=1), layout


def pack_tree_blocks(
    context_ids: torch.LongTensor,
    position_ids: torch.LongTensor,
    context_sees: torch.BoolTensor,
    past_length: int,
    anchor_rows: list[int],
    block_size: int,
    fill_id: int,
) -> tuple[torch.LongTensor, D3DLayout]:
    """Lay out a tree context (``context_ids`` ``[1, n]`` at ``position_ids`` ``[n]``; row i sees the rows
    ``context_sees[i]`` marks) followed by one block of ``block_size`` slots after each context row in
    ``anchor_rows``, at the positions after its anchor's."""
    n = context_ids.shape[1]
    device = context_ids.device
    ids, pos, blk, slot, rows = [context_ids], [position_ids], [torch.full((n,), CONTEXT, device=device)], [], []
    slot.append(torch.zeros(n, dtype=torch.bool, device=device))
    rows.append(torch.arange(n, device=device))
    for b, row in enumerate(anchor_rows):
        ids.append(torch.full((1, block_size), fill_id, device=device, dtype=context_ids.dtype))
        pos.append(position_ids[row] + 1 + torch.arange(block_size, device=device))
        blk.append(torch.full((block_size,), b, device=device))
        slot.append(torch.ones(block_size, dtype=torch.bool, device=device))
        rows.append(torch.full((block_size,), row, device=device))
    positions = torch.cat(pos)[None]
    anchors = torch.cat([position_ids] + [p[:1].expand(block_size) - 1 for p in pos[1:]])[None]
    layout = D3DLayout(
        position_ids=positions,
        block_ids=torch.cat(blk)[None],
        is_slot=torch.cat(slot)[None],
        anchors=anchors,
        past_length=past_length,
        num_context=n,
        context_sees=context_sees.to(device),
        anchor_rows=torch.cat(rows)[None],
    )
    return torch.cat(ids, dim=1), layout
