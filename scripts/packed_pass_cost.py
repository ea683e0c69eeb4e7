"""The async packed pass (16 hypothesis blocks, draft-vocabulary head) of several drafters, timed alternately.

Usage: python scripts/packed_pass_cost.py DRAFTER [DRAFTER ...]. Medians of 40 calls each after a warm-up, with
199 tokens in each drafter's cache; the drafters take turns, so a drifting machine affects them alike.
"""

import statistics
import sys
import time

import torch
from transformers import DynamicCache

from hf_d3d.modeling.attention_d3d import d3d_attention_mask, pack_blocks
from hf_d3d.targets import load_drafter

torch.manual_seed(0)
ids = torch.randint(100, 1000, (1, 200))
models = {name: load_drafter(name) for name in sys.argv[1:]}
caches = {name: DynamicCache() for name in models}
times = {name: [] for name in models}
with torch.no_grad():
    for name, drafter in models.items():
        drafter(ids[:, :199], cache=caches[name])

    def packed(name: str) -> None:
        drafter, cache = models[name], caches[name]
        x, layout = pack_blocks(ids[:, -1:], 199, [199] * 16, drafter.config.block_size, 0)
        mask = d3d_attention_mask(layout, 199)
        h = drafter.model(x, layout.is_slot, layout.position_ids, mask, cache, layout.num_context)
        drafter._logits(h[:, layout.num_context :], draft_only=drafter.config.draft_vocab_size is not None)
        cache.crop(-(cache.get_seq_length() - 199))

    for rep in range(41):  # the first round is a warm-up
        for name in models:
            start = time.perf_counter()
            packed(name)
            if rep:
                times[name].append((time.perf_counter() - start) * 1000)
for name, ms in times.items():
    layers = models[name].config.num_hidden_layers
    print(f"{name} ({layers} layers): packed pass median {statistics.median(ms):.1f} ms")
