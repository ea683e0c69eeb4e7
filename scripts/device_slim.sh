#!/usr/bin/env bash
# For device calls (scripts/device_bundle.py): `on` takes the committed drafters' weight files out of the index and
# ignores them, so the checkout travels in 22 MiB instead of 140 (a call takes 64 MiB); `off` puts them back.
# While it is on, `git status` shows them deleted: never commit then.
set -euo pipefail
cd "$(dirname "$0")/.."
FILES=(checkpoints/SmolLM2-135M-Instruct-D3D/model.safetensors checkpoints/SmolLM2-135M-Instruct-D3D-whole/model.safetensors)
EXCLUDE="$(git rev-parse --git-path info/exclude)"
case "${1:-}" in
    on)
        git rm -q --cached -- "${FILES[@]}"
        for f in "${FILES[@]}"; do grep -qxF "/$f" "$EXCLUDE" 2>/dev/null || echo "/$f" >> "$EXCLUDE"; done
        echo "weights out of the index: run scripts/device_slim.sh off after the calls, before any commit" ;;
    off)
        for f in "${FILES[@]}"; do sed -i "\\#^/$f\$#d" "$EXCLUDE"; done
        git reset -q -- "${FILES[@]}"
        echo "weights back in the index" ;;
    *) echo "usage: scripts/device_slim.sh on|off" >&2; exit 2 ;;
esac
git status --short -- "${FILES[@]}"
