"""What one SmolLM2-135M-Instruct forward over a few new rows costs with each few-row linear kernel (fp32, CPU).

Usage: python scripts/linear_kernels.py [--rows 1,5,9,13,17] [--repeats 11] [--context 300]

The target's cache holds ``--context`` tokens; each timed forward (after an untimed one of the same shape) appends
``rows`` tokens and is cropped off again. Kernels, alternated in every repeat: ``F.linear`` (as plain ``generate``
runs, one row included), ``(W @ x.T).T`` and oneDNN over packed weights (``skinny_d3d``; here applied to one
row too, to show what the kernel alone does to a decode step). Prints medians in ms.
"""

import argparse
import contextlib
import statistics
import time

import torch
from transformers import DynamicCache

import hf_d3d.modeling.skinny_d3d as skinny_mod
from hf_d3d.modeling.generation_d3d import cache_kwarg
from hf_d3d.targets import load_target

parser = argparse.ArgumentParser()
parser.add_argument("--rows", default="1,5,9,13,17")
parser.add_argument("--repeats", type=int, default=11)
parser.add_argument("--context", type=int, default=300)
args = parser.parse_args()
rows_list = [int(r) for r in args.rows.split(",")]
target, _ = load_target()
kw = cache_kwarg(target)
g = torch.Generator().manual_seed(0)
cache = DynamicCache()
with torch.no_grad():
    target(torch.randint(100, 20000, (1, args.context), generator=g), **{kw: cache}, use_cache=True)


@contextlib.contextmanager
def kernel(onednn: bool):
    before = skinny_mod.ONEDNN
    skinny_mod.ONEDNN = onednn
    try:
        with skinny_mod.skinny_linears(target, min_rows=1):
            yield
    finally:
        skinny_mod.ONEDNN = before


kernels = {"F.linear": contextlib.nullcontext, "(W @ x.T).T": lambda: kernel(False)}
if skinny_mod.ONEDNN:
    kernels["oneDNN packed"] = lambda: kernel(True)
times = {(k, r): [] for k in kernels for r in rows_list}
with torch.no_grad():
    for rep in range(args.repeats + 1):  # the first is a warm-up (and packs the weights)
        for name, ctx in kernels.items():
            with ctx():
                for r in rows_list:
                    x = torch.randint(100, 20000, (1, r), generator=g)
                    target(x, **{kw: cache}, use_cache=True)  # untimed: the same shapes once before, as in a decode
                    cache.crop(-r)
                    start = time.perf_counter()
                    target(x, **{kw: cache}, use_cache=True)
                    seconds = time.perf_counter() - start
                    cache.crop(-r)
                    if rep:
                        times[name, r].append(seconds)
print(
    f"torch {torch.__version__}, CPU kernels {torch.backends.cpu.get_cpu_capability()}, "
    f"{torch.get_num_threads()} threads; ms per forward (median of {args.repeats})"
)
print("| rows | " + " | ".join(kernels) + " |")
print("|---|" + "---|" * len(kernels))
for r in rows_list:
    print(f"| {r} | " + " | ".join(f"{statistics.median(times[k, r]) * 1e3:.1f}" for k in kernels) + " |")
