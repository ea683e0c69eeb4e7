"""Where the time of a D3D decode goes, through ``target.generate(assistant_model=...)`` and the fast loop.

Usage: python scripts/profile_paths.py [DRAFTER] [--num-prompts N] [--fp16-weights] [--trace OUT.txt]

Forward hooks time every target and drafter forward (wall clock, so on CPU it is the compute); the rest of each
call is the loop's own work (Python, cache bookkeeping, logits processing, verification). After a warm-up, each
path decodes the same GSM8K test prompts (greedy, 128 new tokens) in turn. ``--fp16-weights`` keeps the drafter's
linear weights in fp16 (``hf_d3d.fp16_weights``). ``--trace`` adds torch.profiler's
table of the most expensive operators of one fast-loop call.
"""

import argparse
import time
from collections import defaultdict

import torch

from hf_d3d import speculative_generate
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_drafter, load_target
from hf_d3d.train.distill import chat_prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("drafter", nargs="?", default=None)
parser.add_argument("--num-prompts", type=int, default=3)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--trace", default=None)
parser.add_argument("--fp16-weights", action="store_true")
args = parser.parse_args()

target, tok = load_target()
drafter = load_drafter(args.drafter, fp16_weights=args.fp16_weights)
spent: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def timed(name: str, module: torch.nn.Module) -> None:
    started = []
    module.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))

    def done(*_):
        spent[name] += time.perf_counter() - started.pop()
        calls[name] += 1

    module.register_forward_hook(done)


timed("target", target)
timed("drafter", drafter)
paths = {
    "generate(assistant_model)": lambda x: target.generate(
        x,
        attention_mask=torch.ones_like(x),
        assistant_model=drafter,
        do_sample=False,
        max_new_tokens=args.max_new_tokens,
    ),
    "speculative_generate": lambda x: speculative_generate(target, drafter, x, max_new_tokens=args.max_new_tokens),
}
prompts = [torch.tensor([chat_prompt_ids(tok, q)]) for q in load_prompts("gsm8k:test", "question", args.num_prompts)]
with torch.no_grad():
    for run in paths.values():  # warm-up
        run(prompts[0])
    for name, run in paths.items():
        spent.clear()
        calls.clear()
        start = time.perf_counter()
        new_tokens = sum(run(x).shape[1] - x.shape[1] for x in prompts)
        total = time.perf_counter() - start
        rest = total - spent["target"] - spent["drafter"]
        print(
            f"{name}: {total / new_tokens * 1000:.1f} ms per new token; "
            f"target {spent['target'] / total:.0%} ({calls['target']} forwards, "
            f"{spent['target'] / calls['target'] * 1000:.1f} ms each), "
            f"drafter {spent['drafter'] / total:.0%} ({calls['drafter']} forwards, "
            f"{spent['drafter'] / max(calls['drafter'], 1) * 1000:.1f} ms each), "
            f"loop {rest / total:.0%} ({rest / calls['target'] * 1000:.1f} ms per round)"
        )
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            speculative_generate(target, drafter, prompts[0], max_new_tokens=args.max_new_tokens)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        with open(args.trace, "w", encoding="utf-8") as f:
            f.write(table)
        print(f"operator table written to {args.trace}")
