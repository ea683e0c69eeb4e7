#!/usr/bin/env bash
# Speed on what users send: GSM8K test + HumanEval + held-aside ShareGPT first turns (10 prompts each), greedy,
# 128 new tokens, every method side by side in one run (alternating, warm-up, medians), every output checked
# against plain generate. Usage: scripts/bench_mixed.sh DRAFTER OUT.json
# The autoregressive peer (AR_PEER=folder to choose another) is by default the committed 4-layer drafter's next-token
# path exported as a LlamaForCausalLM (built once into ~/.cache/hf_d3d by `hf-d3d export-ar`). d3d_hub is the path a
# Hub user takes (AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True), generate(assistant_model=)).
set -euo pipefail
cd "$(dirname "$0")/.."
DRAFTER="${1:?usage: scripts/bench_mixed.sh DRAFTER OUT.json}"
OUT="${2:?usage: scripts/bench_mixed.sh DRAFTER OUT.json}"
COMMITTED=checkpoints/SmolLM2-135M-Instruct-D3D
if [ -z "${AR_PEER:-}" ]; then
    AR_PEER="$HOME/.cache/hf_d3d/ar-peer-$(basename "$COMMITTED")-$(cat "$COMMITTED"/*.safetensors | sha256sum | cut -c1-12)"
    [ -d "$AR_PEER" ] || .venv/bin/hf-d3d export-ar --drafter "$COMMITTED" --out "$AR_PEER"
fi
.venv/bin/hf-d3d bench --drafter "$DRAFTER" --ar-drafter "$AR_PEER" --prompts gsm8k:test,humaneval,sharegpt:heldout \
    --num-prompts "${NUM_PROMPTS:-10}" --max-new-tokens 128 \
    --methods plain,assisted_ar,prompt_lookup,d3d_hub,d3d_sync,d3d_fast --out "$OUT"
