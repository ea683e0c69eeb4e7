#!/usr/bin/env bash
# Reproduce the README's CPU numbers: SmolLM2-135M-Instruct + the committed drafter, GSM8K test prompts,
# greedy, 128 new tokens, every method side by side in one run (alternating, warm-up, medians).
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_PROMPTS="${NUM_PROMPTS:-20}"
.venv/bin/hf-d3d bench --prompts gsm8k:test --num-prompts "$NUM_PROMPTS" --max-new-tokens 128 \
    --methods plain,prompt_lookup,d3d_sync,d3d_async,d3d_fast --out results/bench_cpu_gsm8k.json
