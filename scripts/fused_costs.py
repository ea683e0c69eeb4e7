"""What one fused pass costs, in decode steps of the target: SmolLM2-135M-Instruct and the committed -D3D-whole.

One forward after CONTEXT cached tokens, medians of REPEAT: a decode step, 24 rows with a causal mask and with the
D3D mask, and fused passes (8 verification rows and 2 or 8 blocks of 8, the adapter hooks on). Prints a markdown
table. Usage: python scripts/fused_costs.py [--dtype float32 bfloat16] [--context 300] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_d3d.fused import FusedPass
from hf_d3d.modeling.attention_d3d import d3d_attention_mask, pack_blocks
from hf_d3d.targets import load_drafter, load_target


def costs(dtype: torch.dtype, drafter, context: int, repeat: int) -> dict[str, float]:
    """Median milliseconds of each forward, for the embedded SmolLM2 target in ``dtype``."""
    target, _ = load_target(None, dtype=dtype)
    vocab = target.config.vocab_size
    past = torch.randint(0, vocab, (1, context))
    ctx = torch.randint(0, vocab, (1, 8))

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeat):
            cache = DynamicCache()
            target(past, cache=cache)
            start = time.perf_counter()
            fn(cache)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    ids, layout = pack_blocks(ctx, context, [context, context + 1], 8, fill_id=0)
    allowed = d3d_attention_mask(layout, context)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    embeds = target.get_input_embeddings()(ids)
    keep = torch.arange(8)
    d3d_mask = dict(inputs_embeds=embeds, attention_mask=mask, position_ids=layout.position_ids, logits_to_keep=keep)
    with torch.no_grad(), FusedPass(target, drafter) as run:
        return {
            "decode step (1 row)": median_ms(lambda c: target(ctx[:, :1], cache=c)),
            "24 rows, causal": median_ms(lambda c: target(ids, cache=c, logits_to_keep=keep)),
            "24 rows, the D3D mask": median_ms(lambda c: target(cache=c, **d3d_mask)),
            "fused: 8 verification rows + 2 blocks of 8": median_ms(lambda c: run(c, context, ctx, 0, [0, 1])),
            "fused: 8 verification rows + 8 blocks of 8": median_ms(lambda c: run(c, context, ctx, 0, list(range(8)))),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--drafter", default="checkpoints/SmolLM2-135M-Instruct-D3D-whole")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    drafter = load_drafter(args.drafter)
    torch.manual_seed(0)
    rows = {name: costs(getattr(torch, name), drafter, args.context, args.repeat) for name in args.dtype}
    names = list(rows)
    print("| forward | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label in rows[names[0]]:
        cells = []
        for name in names:
            ms, step = rows[name][label], rows[name]["decode step (1 row)"]
            cells.append(f"{ms:.1f} ms ({ms / step:.2f} steps)")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
