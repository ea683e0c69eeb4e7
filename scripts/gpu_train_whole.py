"""Continue training the whole-LM drafter on one GPU for a fixed wall-clock budget, several settings side by side.

Each setting runs as its own `accelerate launch -m hf_d3d.cli train` process on the same GPU (a 135M drafter leaves
most of an accelerator idle). A short probe run of each measures seconds per step first, so the real run gets the
number of steps (and so the full cosine schedule) that fits the budget. Each result is packed into tar files of
at most 15 MiB (the block adapters, config and training log) for copying off the machine.

Usage: python scripts/gpu_train_whole.py --budget-s 300 --out OUT [--batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

INIT = "checkpoints/SmolLM2-135M-Instruct-D3D-whole"
# name: the train arguments that differ. Run from the stage-3 drafter (adapters in its top 10 layers), "all30"
# became the committed stage 4; from the committed drafter, which has adapters everywhere, the two differ in lr only.
SETTINGS = {
    "top10": ["--block-adapter-rank", "64", "--lr", "2e-4"],  # the init's adapters as they are
    "all30": ["--block-adapter-rank", "64", "--widen-block-adapters", "0", "--lr", "4e-4"],  # every layer adapted
    # top10's run plus the target's soft labels: run "top10,kd" side by side for an A/B of --kd-weight
    "kd": ["--block-adapter-rank", "64", "--lr", "2e-4", "--kd-weight", "1.0"],
    # top10's run with every adapter grown to rank 256 (zero effect at the start): run "top10,rank256" side by side.
    # On CPU rank 128 paid where rank 64 had flattened (docs/drafters.md, stages 20-22); the committed drafter has
    # rank 128 since. Rank 256 stores 156 MB in bf16, over the ~100 MB a committed checkpoint may take.
    "rank256": ["--block-adapter-rank", "64", "--grow-block-adapter-rank", "256", "--lr", "2e-4"],
}
# top10's very run on the GSM8K-weighted part of the data (DATA below): run "top10,gsm" side by side
SETTINGS["gsm"] = SETTINGS["top10"]
# The token files a setting trains on when not all of them (nor --extra-data). On CPU, from the same start, a mix of two
# GSM8K and two ShareGPT files (49% GSM8K tokens, against 17% in the eight files of then) gained twice the GSM8K tau of
# an all-files stage (+0.06 against +0.03) at no measurable cost to chat and code (docs/drafters.md). With the GSM8K
# files distilled since (more questions, and a sampled second answer), this mix keeps GSM8K near that share: 56% of
# 1.79M response tokens.
DATA = {
    "gsm": [
        "gsm8k_train_0",
        "gsm8k_train_0_t07",
        "gsm8k_train_1000",
        "gsm8k_train_3000",
        "sharegpt_code_400",
        "sharegpt_code_1000",
        "sharegpt_train_0",
        "sharegpt_train_1200",
    ]
}
DATA_DIR = Path("data/distill/SmolLM2-135M-Instruct")


def train_files(name: str, extra_data: list[str]) -> list[str]:
    """The token files setting ``name`` trains on; a missing file of a named subset is an error, not a smaller mix."""
    if name not in DATA:
        return sorted(str(p) for p in DATA_DIR.glob("*.safetensors")) + extra_data
    files = [DATA_DIR / f"{stem}.safetensors" for stem in DATA[name]]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"setting {name!r} trains on files that are not here: {missing}")
    return [str(f) for f in files]


def launch(name: str, extra: list[str], steps: int, out: Path, args: argparse.Namespace) -> subprocess.Popen:
    data = train_files(name, args.extra_data)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    cmd += ["--mixed_precision", "bf16", "--dynamo_backend", "no", "-m", "hf_d3d.cli", "train"]
    cmd += ["--init-from", INIT, "--data", *data, "--num-blocks", "32", "--batch-size", str(args.batch_size)]
    cmd += ["--warmup-steps", str(min(30, steps // 10)), "--steps", str(steps), "--mixed-precision", "bf16"]
    cmd += ["--save-dtype", "bfloat16", "--save-every", "100", "--num-eval-prompts", "0", "--out", str(out), *extra]
    # Stage 17's objective, in every setting: on CPU it gave GSM8K 20-79 +0.07 over the same steps without it
    cmd += ["--unreached-weight", "0.1"]
    print(" ".join(cmd), flush=True)
    log = open(out.parent / f"{out.name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def seconds_per_step(run: Path) -> float:
    """From the probe's log: the cost of a step once warm (the first steps compile kernels and fill caches)."""
    log = json.loads((run / "final" / "training_log.json").read_text())["log"]
    warm = log[len(log) // 3 :]
    return (warm[-1]["elapsed_s"] - warm[0]["elapsed_s"]) / max(1, len(warm) - 1)


def export(run: Path, dest: Path) -> Path | None:
    """Pack the run's final folder, or its latest checkpoint reduced to the adapters, into <=15 MiB tar parts."""
    folder = run / "final"
    if not (folder / "config.json").is_file():
        ckpt = run / "checkpoint"
        if not (ckpt / "config.json").is_file():
            return None
        from hf_d3d.modeling.modeling_d3d import D3DDrafterModel
        from hf_d3d.train.trainer import TrainConfig, save_final

        state = json.loads((ckpt / "trainer_state.json").read_text())
        folder = run / "partial"  # what the run would have saved as final, had it ended at its last checkpoint
        save_final(D3DDrafterModel.from_pretrained(ckpt), folder, TrainConfig(**state["config"]), state["log"])
    tar = dest / f"{run.name}.tar"
    with tarfile.open(tar, "w") as t:
        for f in sorted(folder.iterdir()):
            if f.suffix in (".safetensors", ".json"):
                t.add(f, arcname=f.name)
    data, part = tar.read_bytes(), 15 * 2**20
    tar.unlink()
    for i in range(0, len(data), part):
        (dest / f"{run.name}.tar.{i // part:02d}").write_bytes(data[i : i + part])
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget-s", type=float, required=True, help="wall seconds for the real runs")
    parser.add_argument("--out", required=True, help="where the tar parts go")
    parser.add_argument("--work", default="/tmp/gpu_train_whole")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--probe-steps", type=int, default=24)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument(
        "--extra-data", nargs="*", default=[], help="token files or distill folders for the settings that use all data"
    )
    args = parser.parse_args()
    work, dest = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    for n in names:  # a missing token file fails here, before any GPU time is spent
        train_files(n, args.extra_data)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    probes = {n: launch(n, SETTINGS[n], args.probe_steps, work / f"probe_{n}", args) for n in names}
    for p in probes.values():
        p.wait()
    cost = {n: seconds_per_step(work / f"probe_{n}") for n in names}
    print("seconds per step (side by side):", json.dumps(cost), flush=True)

    start = time.time()
    runs = {n: launch(n, SETTINGS[n], max(20, int(args.budget_s / cost[n])), work / n, args) for n in names}
    for n, p in runs.items():
        try:
            p.wait(timeout=max(1.0, args.budget_s * 1.25 + 60 - (time.time() - start)))
        except subprocess.TimeoutExpired:  # over budget: keep the last checkpoint
            p.kill()
            p.wait()
        print(f"{n}: exit {p.returncode} after {time.time() - start:.0f} s", flush=True)
    summary = {"seconds_per_step_probe": cost, "batch_size": args.batch_size, "settings": SETTINGS, "data": DATA}
    for n in names:
        folder = export(work / n, dest)
        log = json.loads((folder / "training_log.json").read_text())["log"] if folder else []
        summary[n] = {"exported": str(folder), "steps": len(log), "last": log[-1] if log else None}
        print(n, json.dumps(summary[n]), flush=True)
    (dest / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
