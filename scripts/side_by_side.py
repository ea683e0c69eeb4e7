"""Fast-loop speed of several drafter settings side by side with plain greedy, in one run.

Usage: python scripts/side_by_side.py SPEC [SPEC ...] [--num-prompts N] [--out RESULT.json]. SPEC is a drafter
folder, then optionally ``@K`` to draft up to K tokens per round (default: its shipped ``num_assistant_tokens``),
then any of ``+static`` (a preallocated target cache), ``+fixed`` (K tokens every round, ignoring the measured
round cost), ``+fp32`` (the drafter in fp32 instead of its stored dtype), ``+chain`` (one chain per round instead
of a draft tree), ``+fp16w`` (the drafter's linear weights kept in fp16, ``hf_d3d.fp16_weights``) and
``+noskinny`` (the target's and drafter's few-row linears as ``F.linear`` computes them, and the round costs
calibrated that way; see ``skinny_d3d``), ``+transpose`` (few-row linears as ``(W @ x.T).T``, the kernel for
builds without oneDNN): ``PATH@4+fixed+fp32``. The SPEC ``plain+onednn`` is plain greedy with every fp32 linear of one
to 16 rows (decode steps included) computed by oneDNN over packed weights: what that kernel alone does to plain
decoding, the reference for how much of a speedup is the kernel's rather than speculation's. GSM8K test prompts,
timed by ``hf_d3d.bench.run_methods`` (alternating, warm-up, medians); exits non-zero on any output that differs from
plain greedy.
"""

import argparse
import sys

import torch

import hf_d3d.modeling.skinny_d3d as skinny_mod
from hf_d3d import speculative_generate
from hf_d3d.bench import markdown_table, run_methods, write_outputs
from hf_d3d.cpu.fp16_weights import fp16_weights
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_drafter, load_target
from hf_d3d.train.distill import chat_prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("specs", nargs="+")
parser.add_argument("--num-prompts", type=int, default=6)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--out", default=None, help="also write RESULT.json/.md/.png")
args = parser.parse_args()
target, tok = load_target()
loaded = {}


def fast(drafter, k, cache, round_cost, tree, skinny, onednn=skinny_mod.ONEDNN):
    def run(x):
        skinny_mod.ONEDNN = onednn
        drafter.generation_config.num_assistant_tokens = k
        drafter.config.round_cost = round_cost
        return speculative_generate(
            target,
            drafter,
            x,
            max_new_tokens=args.max_new_tokens,
            cache_implementation=cache,
            tree=tree,
            skinny=skinny,
        )

    return run


runners = {
    "plain": (
        lambda x: target.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=args.max_new_tokens
        ),
        None,
    )
}
FLAGS = {"static", "fixed", "fp32", "chain", "noskinny", "fp16w", "transpose"}


def plain_onednn(x):
    skinny_mod.ONEDNN = True  # a +transpose runner before it may have switched it off
    with skinny_mod.skinny_linears(target, min_rows=1):
        return runners["plain"][0](x)


for spec in args.specs:
    if spec == "plain+onednn":
        if not skinny_mod.ONEDNN:
            sys.exit("plain+onednn: this torch build has no oneDNN")
        runners[spec] = (plain_onednn, None)
        continue
    spec_path, *flags = spec.split("+")
    if unknown := set(flags) - FLAGS:
        sys.exit(f"unknown flags {sorted(unknown)} in {spec!r}: use any of {sorted(FLAGS)}")
    path, _, k = spec_path.partition("@")
    dtype = torch.float32 if "fp32" in flags or "fp16w" in flags else "auto"
    fp16w = "fp16w" in flags
    if (path, dtype, fp16w) not in loaded:
        drafter = load_drafter(path, dtype=dtype)
        if fp16w:
            fp16_weights(drafter)
        # as shipped, before any spec changes them
        shipped = drafter.generation_config.num_assistant_tokens
        loaded[path, dtype, fp16w] = (drafter, shipped, drafter.config.round_cost)
    drafter, shipped, round_cost = loaded[path, dtype, fp16w]
    cache = "static" if "static" in flags else "dynamic"
    costs = None if "fixed" in flags else round_cost
    runners[spec] = (
        fast(
            drafter,
            int(k) if k else shipped,
            cache,
            costs,
            False if "chain" in flags else None,
            False if "noskinny" in flags else None,
            skinny_mod.ONEDNN and "transpose" not in flags,
        ),
        drafter,
    )
questions = load_prompts("gsm8k:test", "question", args.num_prompts)
result = run_methods(target, runners, [chat_prompt_ids(tok, q) for q in questions], args.max_new_tokens)
print(markdown_table(result))
if args.out:
    write_outputs(result, args.out)
sys.exit(0 if result["all_identical"] else "some output differs from plain greedy")
