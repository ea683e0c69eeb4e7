"""Fast-loop speed of several drafter settings side by side with plain greedy, in one run.

Usage: python scripts/side_by_side.py SPEC [SPEC ...] [--num-prompts N]; SPEC is a drafter folder, optionally
``@K`` to draft K tokens per round (``num_assistant_tokens``). GSM8K test prompts, 128 new tokens; methods alternate
per prompt after a warm-up; prints the median speedup over plain and tau per spec, and fails on any output that
differs from plain greedy.
"""

import argparse
import statistics
import time

import torch

from hf_d3d import speculative_generate
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_drafter, load_target
from hf_d3d.train.distill import chat_prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("specs", nargs="+")
parser.add_argument("--num-prompts", type=int, default=6)
args = parser.parse_args()
target, tok = load_target()
loaded, drafters = {}, {}
for spec in args.specs:
    path, _, k = spec.partition("@")
    loaded.setdefault(path, load_drafter(path))
    drafters[spec] = (loaded[path], int(k) if k else loaded[path].config.block_size)
questions = load_prompts("gsm8k:test", "question", args.num_prompts + 1)
prompts = [torch.tensor([chat_prompt_ids(tok, q)]) for q in questions]


def fast(x, drafter, k):
    drafter.generation_config.num_assistant_tokens = k
    return speculative_generate(target, drafter, x, max_new_tokens=128)


run = {"plain": lambda x: target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=128)}
for spec, (d, k) in drafters.items():
    run[spec] = lambda x, d=d, k=k: fast(x, d, k)
for f in run.values():  # warm-up
    f(prompts[0])
times = {key: [] for key in run}
taus = {spec: [] for spec in drafters}
for i, x in enumerate(prompts[1:]):
    keys = list(run)[i % len(run) :] + list(run)[: i % len(run)]
    outs = {}
    for key in keys:
        start = time.perf_counter()
        outs[key] = run[key](x)
        times[key].append(time.perf_counter() - start)
        if key in drafters:
            taus[key].append(drafters[key][0].last_stats.tau)
    assert all(torch.equal(o, outs["plain"]) for o in outs.values()), "output differs from plain greedy"
print(f"plain: {statistics.median(times['plain']):.2f} s per prompt (median of {args.num_prompts})")
for spec in drafters:
    ratio = statistics.median(a / b for a, b in zip(times["plain"], times[spec]))
    print(f"{spec}: speedup {ratio:.2f}x over plain, tau {statistics.mean(taus[spec]):.2f}")
