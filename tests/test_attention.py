"""The D3D attention pattern: explicit rules, and block predictions independent of how the pass is packed."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from conftest import make_drafter, tiny_target
from hf_d3d.modeling.attention_d3d import pack_blocks


def test_mask_rules_on_a_small_layout():
    # 2 cached + 2 new context tokens (positions 0..3), block A anchored at 1 (2 slots), block B anchored at 3
    # with one private clean token (position 4) then 2 slots (positions 5, 6).
    ids, layout = pack_blocks(torch.tensor([[10, 11]]), 2, [1, 3], 2, 0, prefixes=[[], [42]])
    assert layout.position_ids[0].tolist() == [2, 3, 2, 3, 4, 5, 6]
    m = layout.attention_mask()[0, 0].int().tolist()
    # keys: past 0, past 1 | ctx 2, ctx 3 | A0, A1 | B-clean, B0, B1
    assert m == [
        [1, 1, 1, 0, 0, 0, 0, 0, 0],  # ctx pos 2: causal over context
        [1, 1, 1, 1, 0, 0, 0, 0, 0],  # ctx pos 3
        [1, 1, 0, 0, 1, 1, 0, 0, 0],  # A slot: context <= 1, own block both ways
        [1, 1, 0, 0, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0, 0],  # B clean token: context <= 3, itself, not its slots
        [1, 1, 1, 1, 0, 0, 1, 1, 1],  # B slots: context <= 3, clean token, both slots
        [1, 1, 1, 1, 0, 0, 1, 1, 1],
    ]
    assert ids[0].tolist() == [10, 11, 0, 0, 42, 0, 0]


def _block_logits(drafter, context, anchor, block, prefix=()):
    """Block anchored at ``anchor`` run alone: context[:anchor+1] then the block, in one pass without cache."""
    ids, layout = pack_blocks(context[:, : anchor + 1], 0, [anchor], block, 0, prefixes=[list(prefix)])
    out = drafter(ids, layout=layout, use_cache=False).logits
    return out[:, anchor + 1 + len(prefix) :]


def test_block_predictions_alone_incremental_and_packed():
    target = tiny_target("qwen3")
    drafter = make_drafter(target, block_size=4, mask_token_id=None)
    torch.manual_seed(0)
    context = torch.randint(4, 96, (1, 20))
    block = drafter.config.block_size
    anchors, prefixes = [5, 12, 19, 12], [[], [], [], [77]]
    alone = [_block_logits(drafter, context, a, block, p) for a, p in zip(anchors, prefixes)]

    # incremental: context enters the cache in three chunks, then the block anchored at the last token
    cache = DynamicCache()
    for lo, hi in [(0, 7), (7, 15)]:
        ids, layout = pack_blocks(context[:, lo:hi], lo, [], block, 0)
        drafter(ids, layout=layout, past_key_values=cache)
    ids, layout = pack_blocks(context[:, 15:], 15, [19], block, 0)
    inc = drafter(ids, layout=layout, past_key_values=cache).logits[:, -block:]
    assert cache.get_seq_length() == 20  # block slots never enter the cache
    torch.testing.assert_close(inc, alone[2], rtol=1e-4, atol=1e-4)

    # packed: the whole context plus all four blocks (one with a private clean token) in one forward
    ids, layout = pack_blocks(context, 0, anchors, block, 0, prefixes=prefixes)
    packed = drafter(ids, layout=layout, use_cache=False).logits[:, 20:]
    offset = 0
    for p, ref in zip(prefixes, alone):
        width = len(p) + block
        torch.testing.assert_close(packed[:, offset + len(p) : offset + width], ref, rtol=1e-4, atol=1e-4)
        offset += width

    # the private token hypothesis equals a sync draft after committing that token
    committed = torch.cat([context[:, :13], torch.tensor([[77]])], dim=1)
    ref = _block_logits(drafter, committed, 13, block)
    torch.testing.assert_close(alone[3], ref, rtol=1e-4, atol=1e-4)


def test_context_logits_match_plain_causal_forward():
    """With no blocks the drafter is an ordinary causal LM, and a full copy of the target reproduces it."""
    target = tiny_target("llama")
    full = make_drafter(target, layers=target.config.num_hidden_layers)
    x = torch.randint(4, 96, (1, 15))
    torch.testing.assert_close(full(x).logits, target(x).logits, rtol=1e-4, atol=1e-4)


def test_repeated_kv_heads_attend_as_grouped_ones():
    """On CUDA the drafter repeats grouped KV heads under a mask (so SDPA keeps a fused kernel); the result must be
    grouped attention's: query head h reads KV head h // groups (a ``repeat`` instead of ``repeat_interleave`` would
    pair heads wrongly and fail here)."""
    from hf_d3d.modeling.modeling_d3d import _attend

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 4, generator=gen)  # 6 query heads over 2 KV heads: groups of 3
    k, v = torch.randn(2, 2, 7, 4, generator=gen), torch.randn(2, 2, 7, 4, generator=gen)
    mask = torch.rand(2, 1, 5, 7, generator=gen) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    grouped = _attend(q, k, v, mask, repeat_kv=False)
    torch.testing.assert_close(_attend(q, k, v, mask, repeat_kv=True), grouped)
    by_hand = torch.stack(
        [
            torch.nn.functional.scaled_dot_product_attention(q[:, h], k[:, h // 3], v[:, h // 3], mask[:, 0])
            for h in range(6)
        ],
        dim=1,
    )
    torch.testing.assert_close(grouped, by_hand)


def test_a_hypothesis_block_equals_a_sync_draft_with_block_adapters():
    """A whole-LM drafter (shifted slots, block adapters) reads its first slot from the row before it: in a packed
    hypothesis that is the guessed clean token's row, which must be computed as that token in the context is, with
    no adapter, or the packed pass drafts other tokens than sync drafting after committing the same token."""
    from hf_d3d import D3DDrafterModel

    target = tiny_target("llama")
    drafter = D3DDrafterModel.from_pretrained_lm(target, block_size=4, block_adapter_rank=4).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "block_adapters" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    assert drafter.config.shifted_slots
    context = torch.randint(4, 96, (1, 14), generator=gen)
    ids, layout = pack_blocks(context, 0, [12, 9], 4, 0, prefixes=[[77], []])
    packed = drafter(ids, layout=layout, use_cache=False).logits[:, 14:]
    committed = torch.cat([context[:, :13], torch.tensor([[77]])], dim=1)
    torch.testing.assert_close(packed[:, 1:5], _block_logits(drafter, committed, 13, 4), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[:, 5:], _block_logits(drafter, context, 9, 4), rtol=1e-4, atol=1e-4)
    with torch.enable_grad():  # the training forward (autograd's path through the adapters) agrees
        again = drafter(ids, layout=layout, use_cache=False).logits[:, 14:]
    torch.testing.assert_close(again, packed, rtol=1e-5, atol=1e-5)
