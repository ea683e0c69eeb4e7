"""Where a round's time goes on this machine: target forward over k tokens, drafter pass, LM head, one layer.

Usage: python scripts/cost_breakdown.py [DRAFTER]. Medians of 25 calls after a warm-up, 200 cached tokens.
"""

import sys
import time

import torch
from transformers import DynamicCache

from hf_d3d.modeling.attention_d3d import d3d_attention_mask, pack_blocks
from hf_d3d.targets import load_drafter, load_target

torch.manual_seed(0)
target, _ = load_target()
drafter = load_drafter(sys.argv[1] if len(sys.argv) > 1 else None)
ids = torch.randint(100, 1000, (1, 200))


def median_ms(f, n: int = 25) -> float:
    f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1000


with torch.no_grad():
    cache = DynamicCache()
    target(ids, past_key_values=cache)
    for k in (1, 2, 3, 4, 5, 9):

        def verify(k=k):
            target(ids[:, :k], past_key_values=cache)
            cache.crop(-k)

        print(f"target forward over {k} tokens: {median_ms(verify):.1f} ms")
    dcache = DynamicCache()
    drafter(ids[:, :199], past_key_values=dcache)
    for blocks in (1, 4, 16):

        def draft(blocks=blocks, head=True):
            x, layout = pack_blocks(ids[:, -1:], 199, [199] * blocks, drafter.config.block_size, 0)
            mask = d3d_attention_mask(layout, 199)
            h = drafter.model(x, layout.is_slot, layout.position_ids, mask, dcache, layout.num_context)
            if head:
                drafter._logits(h[:, layout.num_context :])
            dcache.crop(-(dcache.get_seq_length() - 199))

        full, body = median_ms(draft), median_ms(lambda: draft(head=False))
        print(f"drafter, {blocks} block(s): {full:.1f} ms ({body:.1f} ms without the LM head)")

    # What pruning one layer would save in the packed pass (16 hypothesis blocks), measured by skipping it; the
    # cache is refilled with the layer skipped, since a skipped layer keeps only placeholder entries.
    full = median_ms(lambda: draft(16))
    drafter.model.skip_layers = {drafter.config.num_hidden_layers - 1}
    dcache = DynamicCache()
    drafter(ids[:, :199], past_key_values=dcache)
    pruned = median_ms(lambda: draft(16))
    drafter.model.skip_layers = set()
    print(
        f"drafter, 16 blocks, one of {drafter.config.num_hidden_layers} layers skipped: {pruned:.1f} ms "
        f"(vs {full:.1f} ms)"
    )
