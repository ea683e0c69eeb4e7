"""Training throughput of drafter shapes on this machine: seconds per optimizer step and trained tokens per second.

Every shape takes the same batches (real distillation records), one warm-up step, then the median of the timed ones.
Usage: python scripts/train_throughput.py DATA [DATA ...] [--steps 3] [--out results/train_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_d3d import D3DDrafterModel
from hf_d3d.targets import load_target
from hf_d3d.train.distill import load_records
from hf_d3d.train.objective import d3d_loss, make_batch

SHAPES = {  # name: (how to build, layers frozen from the bottom)
    "whole-30": ("whole", 0),
    "whole-30-freeze20": ("whole", 20),
    "whole-30-freeze24": ("whole", 24),
    "copied-4": ("copied", 0),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data", nargs="+")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=8)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--out", default="results/train_throughput.json")
    args = parser.parse_args()
    target, _ = load_target(None)
    records = load_records(*args.data)
    gen = torch.Generator().manual_seed(0)
    batches = [
        make_batch(records[i * args.batch_size : (i + 1) * args.batch_size], 8, args.num_blocks, 0, 0, gen, 64)
        for i in range(args.steps + 1)
    ]
    tokens = sum(int((b.labels != -100).sum()) for b in batches[1:]) / args.steps
    rows = []
    for name in args.shapes.split(","):
        kind, frozen = SHAPES[name]
        for precision in args.precisions.split(","):
            if kind == "whole":
                drafter = D3DDrafterModel.from_pretrained_lm(target, block_size=8)
            else:
                drafter = D3DDrafterModel.from_target(target, num_hidden_layers=4, block_size=8)
            drafter.float().train()
            drafter.get_input_embeddings().weight.requires_grad_(False)
            drafter.get_output_embeddings().weight.requires_grad_(False)
            if frozen:
                drafter.model.mask_embedding.requires_grad_(False)
                for layer in drafter.model.layers[:frozen]:
                    layer.requires_grad_(False)
            params = [p for p in drafter.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-5)
            times = []
            for i, batch in enumerate(batches):
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss, _ = d3d_loss(drafter, batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if i:
                    times.append(time.perf_counter() - start)
            sec = statistics.median(times)
            row = {
                "shape": name,
                "precision": precision,
                "threads": torch.get_num_threads(),
                "sec_per_step": sec,
                "trained_tokens_per_sec": tokens / sec,
                "trainable_params": sum(p.numel() for p in params),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = {
        "command": "python scripts/train_throughput.py " + " ".join(args.data),
        "batch_size": args.batch_size,
        "num_blocks": args.num_blocks,
        "block_size": 8,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
