#!/usr/bin/env bash
# Self-distil the mixed training set of the general SmolLM2 drafter: ShareGPT first turns (train split; the held-aside
# split is never used), ShareGPT code requests, GSM8K train (greedy, then sampled). Each run resumes where it stopped;
# `hf-d3d pack-data` then stores the finished runs compactly under data/distill/. Usage: scripts/distill_mix.sh [OUT]
set -euo pipefail
OUT=${1:-${HF_D3D_CACHE:-$HOME/.cache/hf_d3d}/distill}
D3D=${D3D:-.venv/bin/hf-d3d}
COMMON=(--dtype bfloat16 --max-new-tokens 256 --max-prompt-tokens 384 --batch-size 16)
$D3D distill --prompts sharegpt:train --num-prompts 1200 "${COMMON[@]}" --out "$OUT/sharegpt_train_0"
$D3D distill --prompts gsm8k:train --num-prompts 1000 "${COMMON[@]}" --out "$OUT/gsm8k_train_0"
$D3D distill --prompts sharegpt:code --skip-prompts 400 --num-prompts 600 "${COMMON[@]}" --out "$OUT/sharegpt_code_400"
$D3D distill --prompts gsm8k:train --skip-prompts 1000 --num-prompts 2000 "${COMMON[@]}" --out "$OUT/gsm8k_train_1000"
$D3D distill --prompts sharegpt:train --skip-prompts 1200 --num-prompts 2000 "${COMMON[@]}" --out "$OUT/sharegpt_train_1200"
$D3D distill --prompts sharegpt:code --skip-prompts 1000 --num-prompts 1500 "${COMMON[@]}" --out "$OUT/sharegpt_code_1000"
# fp32: on a CPU without bf16 units (AVX2 only) bf16 generation is emulated and several times slower
FP32=(--dtype float32 --max-new-tokens 256 --max-prompt-tokens 384 --batch-size 16)
$D3D distill --prompts sharegpt:train --skip-prompts 3200 --num-prompts 2000 "${FP32[@]}" --out "$OUT/sharegpt_train_3200"
# sharegpt:train 11200-13199 holds none of the prompts of the code slices above (sharegpt:code 400-2499)
$D3D distill --prompts sharegpt:train --skip-prompts 11200 --num-prompts 2000 "${FP32[@]}" --out "$OUT/sharegpt_train_11200"
# GSM8K train: more questions (greedy), and a sampled second answer to the first ones
$D3D distill --prompts gsm8k:train --skip-prompts 3000 --num-prompts 2000 "${FP32[@]}" --out "$OUT/gsm8k_train_3000"
$D3D distill --prompts gsm8k:train --num-prompts 2000 --do-sample --temperature 0.7 --seed 1 "${FP32[@]}" \
    --out "$OUT/gsm8k_train_0_t07"
# GSM8K train: the rest of its questions (greedy; batch 64 answers more tokens a second on 2 cores than 16)
$D3D distill --prompts gsm8k:train --skip-prompts 5000 --num-prompts 2473 "${FP32[@]}" --batch-size 64 \
    --out "$OUT/gsm8k_train_5000"
# GSM8K train 1000-2999: the 1,296 longest questions, which the cut-short gsm8k_train_1000 run left unanswered
# (bf16 on a CPU with bf16 units, such as an AVX512-BF16 EPYC)
${PYTHON:-.venv/bin/python} scripts/unanswered_prompts.py --prompts gsm8k:train --skip-prompts 1000 --num-prompts 2000 \
    --data data/distill/SmolLM2-135M-Instruct/gsm8k_train_1000.safetensors --out "$OUT/gsm8k_train_1000_rest.jsonl"
$D3D distill --prompts "$OUT/gsm8k_train_1000_rest.jsonl" \
    --source-name "gsm8k:train[1000:3000], the 1,296 questions gsm8k_train_1000 does not answer" \
    "${COMMON[@]}" --batch-size 64 --out "$OUT/gsm8k_train_1000_rest"
# GSM8K train 2000-7472: a sampled second answer (bf16, batches of 64); finished early with --finish-partial at
# 3,456 answers and packed as gsm8k_train_2000_t07. Where its run folder is kept, the same command without that flag
# goes on with the rest; where it is gone (a new machine), the questions no committed sampled answer covers are
# answered with another seed.
if [ -d "$OUT/gsm8k_train_2000_t07" ] || [ ! -f data/distill/SmolLM2-135M-Instruct/gsm8k_train_2000_t07.safetensors ]; then
  $D3D distill --prompts gsm8k:train --skip-prompts 2000 --num-prompts 5473 --do-sample --temperature 0.7 --seed 2 \
      "${COMMON[@]}" --batch-size 64 --out "$OUT/gsm8k_train_2000_t07"
else
  ${PYTHON:-.venv/bin/python} scripts/unanswered_prompts.py --prompts gsm8k:train --skip-prompts 2000 \
      --num-prompts 5473 --sampled --data data/distill/SmolLM2-135M-Instruct/gsm8k_train_2000_t07.safetensors \
      --out "$OUT/gsm8k_train_2000_t07_rest.jsonl"
  $D3D distill --prompts "$OUT/gsm8k_train_2000_t07_rest.jsonl" --do-sample --temperature 0.7 --seed 3 \
      --source-name "gsm8k:train[2000:7473], the questions gsm8k_train_2000_t07 does not answer" \
      "${COMMON[@]}" --batch-size 64 --out "$OUT/gsm8k_train_2000_t07_rest"
fi
