"""Is a bf16 target with exact verification faster than fp32, in absolute terms? All four in one run.

Usage: python scripts/dtype_side_by_side.py [--num-prompts N] [--out RESULT.json]. SmolLM2-135M-Instruct in fp32 and
in bf16 (two copies in memory), the committed drafter, GSM8K test prompts, 128 new tokens: plain greedy and the
fast loop in fp32, plain greedy and the fast loop under ``hf_d3d.exact_verification`` in bf16, timed by
``hf_d3d.bench.run_methods`` (alternating, warm-up, medians; speedups against fp32 plain). Exits non-zero unless
each fast loop reproduces plain greedy of its own dtype.
"""

import argparse
import sys

import torch

from hf_d3d import exact_verification, speculative_generate
from hf_d3d.bench import markdown_table, run_methods, summarize, write_outputs
from hf_d3d.evaluate import count_forwards
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_drafter, load_target
from hf_d3d.train.distill import chat_prompt_ids

parser = argparse.ArgumentParser()
parser.add_argument("--num-prompts", type=int, default=10)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--out", default=None, help="also write RESULT.json/.md/.png")
args = parser.parse_args()
fp32, tok = load_target()
bf16, _ = load_target(dtype=torch.bfloat16)
drafter = load_drafter(None)
new = args.max_new_tokens
outputs: dict[str, list[torch.Tensor]] = {}


forwards: dict[str, list[int]] = {}


def kept(name, run, target=None):
    """Keep each output; for a bf16 method also count the bf16 target's forwards (run_methods counts fp32's)."""

    def wrapped(x):
        with count_forwards(target or fp32) as calls:
            out = run(x)
        outputs.setdefault(name, []).append(out)
        forwards.setdefault(name, []).append(calls["n"])
        return out

    return wrapped


def plain(target):
    return lambda x: target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new)


def fast_fp32(x):
    return speculative_generate(fp32, drafter, x, max_new_tokens=new)


def fast_exact(x):
    with exact_verification(bf16):
        return speculative_generate(bf16, drafter, x, max_new_tokens=new)


runners = {
    "plain": (kept("plain", plain(fp32)), None),
    "d3d_fast_fp32": (kept("d3d_fast_fp32", fast_fp32), drafter),
    "plain_bf16": (kept("plain_bf16", plain(bf16), bf16), None),
    "d3d_fast_bf16_exact": (kept("d3d_fast_bf16_exact", fast_exact, bf16), drafter),
}
ids = [chat_prompt_ids(tok, p) for p in load_prompts("gsm8k:test", "question", args.num_prompts)]
result = run_methods(fp32, runners, ids, new, warmup=1)
for m in ("plain_bf16", "d3d_fast_bf16_exact"):  # their forwards, counted on the bf16 target (after the warm-up)
    for record, n in zip(result["records"][m], forwards[m][1:]):
        record["target_forwards"] = n
result = summarize(result["records"], new, len(ids))
# the table's "identical" compares with fp32 plain; each fast loop must match plain greedy of its own dtype
pairs = {"d3d_fast_fp32": "plain", "d3d_fast_bf16_exact": "plain_bf16"}
same = {m: all(torch.equal(a, b) for a, b in zip(outputs[m], outputs[ref])) for m, ref in pairs.items()}
for name, ok in same.items():
    result["methods"][name]["identical_to_own_dtype_plain"] = ok
result["command"] = "python scripts/dtype_side_by_side.py " + " ".join(sys.argv[1:])
print(markdown_table(result))
print("identical to plain greedy of the same dtype:", same)
if args.out:
    print("wrote", ", ".join(str(p) for p in write_outputs(result, args.out)))
if not all(same.values()):
    sys.exit("FAILED: a fast loop differs from plain greedy of its own dtype")
