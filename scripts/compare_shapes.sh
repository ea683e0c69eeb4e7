#!/usr/bin/env bash
# Depth / block-size comparison for the SmolLM2 drafter: the same short schedule for every shape, then tau on
# held-aside GSM8K test prompts. Resumable (each run is); results in results/shape_comparison.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-200}"
DATA="${DATA:-$HOME/.cache/hf_d3d/distill/smollm2-gsm8k-train}"
RUNS="${RUNS:-$HOME/.cache/hf_d3d/runs/shapes}"
SHAPES="${SHAPES:-4x8 6x8 4x16}"
for shape in $SHAPES; do
    layers="${shape%x*}"; block="${shape#*x}"
    [ -f "$RUNS/$shape/final/config.json" ] && continue
    .venv/bin/hf-d3d train --data "$DATA" --out "$RUNS/$shape" --layers "$layers" --block-size "$block" \
        --num-blocks 8 --batch-size 8 --steps "$STEPS" --lr 5e-4 --warmup-steps 20 --mixed-precision bf16 \
        --eval-every "$STEPS" --num-eval-prompts 10 --eval-max-new-tokens 128 --save-every 50
done
.venv/bin/python - "$RUNS" "$STEPS" $SHAPES <<'PY'
import json, sys
from pathlib import Path
runs, steps, shapes = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
rows = []
for shape in shapes:
    log = json.loads((runs / shape / "final" / "training_log.json").read_text())["log"]
    layers, block = shape.split("x")
    rows.append({"layers": int(layers), "block_size": int(block), "steps": steps,
                 "eval_tau": log[-1]["eval_tau"], "final_loss": log[-1]["loss"]})
out = {"command": f"STEPS={steps} scripts/compare_shapes.sh", "eval": "gsm8k:test, 10 prompts, 128 new tokens, greedy",
       "rows": rows}
Path("results/shape_comparison.json").write_text(json.dumps(out, indent=2) + "\n")
md = ["| layers | block | steps | tau (GSM8K test) | final loss |", "|---|---|---|---|---|"]
md += [f"| {r['layers']} | {r['block_size']} | {r['steps']} | {r['eval_tau']:.2f} | {r['final_loss']:.2f} |" for r in rows]
Path("results/shape_comparison.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PY
