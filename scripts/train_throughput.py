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
    # rank-64 block adapters in all 30 layers, trained alone (as `hf-d3d train --block-adapter-rank 64` does), with
    # the whole batch under autograd, or with the context first without it (`frozen_context`, the trainer's choice)
    "adapters-30": ("adapters", 0),
    "adapters-30-no-ar": ("adapters", 0),
    "adapters-30-frozen-context": ("adapters", 0),
    # the same, plus the target's soft labels from the frozen context rows (`--kd-weight`)
    "adapters-30-frozen-context-kd": ("adapters", 0),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data", nargs="+")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=8)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--max-ar-positions", type=int, default=64, help="next-token labels per sequence (0: none)")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--out", default="results/train_throughput.json")
    args = parser.parse_args()
    target, _ = load_target(None)
    records = load_records(*args.data)

    def batches_with(max_ar_positions: int) -> list:
        gen = torch.Generator().manual_seed(0)  # the same records; the anchors may differ
        return [
            make_batch(
                records[i * args.batch_size : (i + 1) * args.batch_size],
                8,
                args.num_blocks,
                0,
                0,
                gen,
                max_ar_positions,
            )
            for i in range(args.steps + 1)
        ]

    batches, block_only = batches_with(args.max_ar_positions), batches_with(0)
    rows = []
    for name in args.shapes.split(","):
        kind, frozen = SHAPES[name]
        for precision in args.precisions.split(","):
            if kind == "adapters":
                drafter = D3DDrafterModel.from_pretrained_lm(target, block_size=8, block_adapter_rank=64)
            elif kind == "whole":
                drafter = D3DDrafterModel.from_pretrained_lm(target, block_size=8)
            else:
                drafter = D3DDrafterModel.from_target(target, num_hidden_layers=4, block_size=8)
            drafter.float().train()
            drafter.get_input_embeddings().weight.requires_grad_(False)
            drafter.get_output_embeddings().weight.requires_grad_(False)
            if kind == "adapters":
                for pname, p in drafter.named_parameters():
                    p.requires_grad_("block_adapters" in pname)
            frozen_context = "frozen-context" in name
            kd_weight = 1.0 if name.endswith("-kd") else 0.0
            # next-token labels have no gradient when the context is frozen, so the trainer builds none
            chosen = block_only if frozen_context or name.endswith("no-ar") else batches
            if frozen:
                drafter.model.mask_embedding.requires_grad_(False)
                for layer in drafter.model.layers[:frozen]:
                    layer.requires_grad_(False)
            params = [p for p in drafter.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-5)
            times = []
            for i, batch in enumerate(chosen):
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss, _ = d3d_loss(drafter, batch, frozen_context=frozen_context, kd_weight=kd_weight)
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
                "trained_tokens_per_sec": sum(int((b.labels != -100).sum()) for b in chosen[1:]) / args.steps / sec,
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
