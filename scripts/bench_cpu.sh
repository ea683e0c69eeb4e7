#!/usr/bin/env bash
# Reproduce the README's CPU numbers: SmolLM2-135M-Instruct + the committed drafter, GSM8K test prompts,
# greedy, 128 new tokens, every method side by side in one run (alternating, warm-up, medians).
# The autoregressive peer is the committed drafter's own next-token path (same size, same data, same training run)
# exported as a plain LlamaForCausalLM; it is built once into ~/.cache/hf_d3d. The d3d_hub speedup
# (target.generate(assistant_model=drafter), the path a user takes) goes into the drafter's d3d_metrics.json (its card).
# DTYPE=bfloat16 runs the target (and plain generate) in bf16 instead, every other method under
# hf_d3d.exact_verification, into results/bench_cpu_gsm8k_bf16_exact.*; the card is left alone.
# OUT=results/NAME.json writes there instead and leaves the card alone (a run on another kind of CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_PROMPTS="${NUM_PROMPTS:-20}"
DRAFTER="${DRAFTER:-checkpoints/SmolLM2-135M-Instruct-D3D}"
DTYPE="${DTYPE:-float32}"
# Keyed by the drafter's weights, so a retrained drafter never meets the peer exported from its predecessor.
WEIGHTS_ID=$( (cat "$DRAFTER"/*.safetensors 2>/dev/null || echo "$DRAFTER") | sha256sum | cut -c1-12)
AR_PEER="${AR_PEER:-$HOME/.cache/hf_d3d/ar-peer-$(basename "$DRAFTER")-$WEIGHTS_ID}"
case "$DTYPE" in
    float32) MODE=(--out "${OUT:-results/bench_cpu_gsm8k.json}") && [ -n "${OUT:-}" ] || MODE+=(--write-metrics) ;;
    bfloat16) MODE=(--dtype bfloat16 --exact --out results/bench_cpu_gsm8k_bf16_exact.json) ;;
    *) echo "DTYPE must be float32 or bfloat16, got $DTYPE" >&2; exit 2 ;;
esac
[ -d "$AR_PEER" ] || .venv/bin/hf-d3d export-ar --drafter "$DRAFTER" --out "$AR_PEER"
.venv/bin/hf-d3d bench --drafter "$DRAFTER" --ar-drafter "$AR_PEER" --prompts gsm8k:test \
    --num-prompts "$NUM_PROMPTS" --max-new-tokens 128 \
    --methods plain,assisted_ar,prompt_lookup,d3d_hub,d3d_sync,d3d_async,d3d_fast "${MODE[@]}"
