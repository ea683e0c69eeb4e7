"""Fast-loop speed of two drafters side by side (e.g. full LM head vs a draft vocabulary), with plain greedy.

Usage: python scripts/head_timing.py DRAFTER_A DRAFTER_B [NUM_PROMPTS]. GSM8K test prompts, 128 new tokens,
methods alternate per prompt after a warm-up; prints median speedup over plain and tau per drafter.
"""

import statistics
import sys
import time

import torch

from hf_d3d import speculative_generate
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_drafter, load_target
from hf_d3d.train.distill import chat_prompt_ids

paths, n = sys.argv[1:3], int(sys.argv[3]) if len(sys.argv) > 3 else 6
target, tok = load_target()
drafters = {p: load_drafter(p) for p in paths}
prompts = [torch.tensor([chat_prompt_ids(tok, q)]) for q in load_prompts("gsm8k:test", "question", n + 1)]
run = {"plain": lambda x: target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=128)}
for p, d in drafters.items():
    run[p] = lambda x, d=d: speculative_generate(target, d, x, max_new_tokens=128)
for f in run.values():  # warm-up
    f(prompts[0])
times = {k: [] for k in run}
taus = {p: [] for p in drafters}
for i, x in enumerate(prompts[1:]):
    keys = list(run)[i % len(run) :] + list(run)[: i % len(run)]
    outs = {}
    for k in keys:
        start = time.perf_counter()
        outs[k] = run[k](x)
        times[k].append(time.perf_counter() - start)
        if k in drafters:
            taus[k].append(drafters[k].last_stats.tau)
    assert all(torch.equal(o, outs["plain"]) for o in outs.values()), "output differs from plain greedy"
for p in drafters:
    ratio = statistics.median(a / b for a, b in zip(times["plain"], times[p]))
    print(f"{p}: speedup {ratio:.2f}x over plain (median of {n}), tau {statistics.mean(taus[p]):.2f}")
