"""Fused rounds with chains or trees and 1-8 blocks per pass, against plain greedy generate, on a few prompts.

For each setting (N blocks per pass, "t" for a draft tree: "2,2t,8,8t"), prints tokens committed per target forward,
the share of passes whose accepted path ended at a node with a block, the median speedup over plain `generate`
(timed alternately, after a warm-up) and how many outputs were identical. Usage:
python scripts/fused_sweep.py [--dtype bfloat16] [--settings 2,2t,8,8t] [--num-prompts 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_d3d.fused import fused_generate
from hf_d3d.prompts import load_prompts
from hf_d3d.targets import load_drafter, load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--drafter", default="checkpoints/SmolLM2-135M-Instruct-D3D-whole")
    parser.add_argument("--settings", default="2,2t,8,8t")
    parser.add_argument(
        "--num-prompts", type=int, default=2, help="per set: GSM8K test, HumanEval, ShareGPT held-aside"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    settings = [(int(s.rstrip("t")), s.endswith("t")) for s in args.settings.split(",")]
    target, tokenizer = load_target(None, dtype=getattr(torch, args.dtype))
    drafter = load_drafter(args.drafter)
    texts = [
        p for s in ("gsm8k:test", "humaneval", "sharegpt:heldout") for p in load_prompts(s, limit=args.num_prompts)
    ]
    chats = [[{"role": "user", "content": t}] for t in texts]
    inputs = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        for c in chats
    ]
    prompts = [i["input_ids"] for i in inputs]

    def plain(x):
        return target.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens, do_sample=False
        )

    def fused(x, h, tree):
        return fused_generate(target, drafter, x, max_new_tokens=args.max_new_tokens, num_hypotheses=h, tree=tree)

    plain(prompts[0])
    fused(prompts[0], *settings[0])
    rows: dict = {s: [] for s in settings}
    with torch.no_grad():
        for x in prompts:
            start = time.perf_counter()
            want = plain(x)
            t_plain = time.perf_counter() - start
            for h, tree in settings:
                start = time.perf_counter()
                got = fused(x, h, tree)
                seconds = time.perf_counter() - start
                s = drafter.last_stats
                hit = s.hits / max(s.hits + s.misses, 1)
                rows[h, tree].append((t_plain / seconds, s.committed_tokens / s.rounds, hit, torch.equal(got, want)))
    print(
        f"| blocks per pass | draft | tokens per fused pass | hit rate | speedup (median) | identical |  ({args.dtype})"
    )
    print("|---|---|---|---|---|---|")
    for (h, tree), r in rows.items():
        print(
            f"| {h} | {'tree' if tree else 'chain'} | {statistics.mean(x[1] for x in r):.2f} | "
            f"{statistics.mean(x[2] for x in r):.2f} | {statistics.median(x[0] for x in r):.2f}x | "
            f"{sum(x[3] for x in r)} / {len(r)} |"
        )


if __name__ == "__main__":
    main()
