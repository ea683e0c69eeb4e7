#!/usr/bin/env bash
# For device calls (scripts/device_bundle.py): `on` takes the committed drafters' weight files out of the index and
# ignores them, so the checkout travels in 22 MiB instead of 140 (a call takes 64 MiB); `off` puts them back as
# committed. While it is on, `git status` shows them deleted: run on -> the calls -> off in one go, never commit between.
set -euo pipefail
cd "$(dirname "$0")/.."
FILES=(checkpoints/SmolLM2-135M-Instruct-D3D/model.safetensors checkpoints/SmolLM2-135M-Instruct-D3D-whole/model.safetensors)
EXCLUDE="$(git rev-parse --git-path info/exclude)"
case "${1:-}" in
    on)
        mkdir -p "$(dirname "$EXCLUDE")" && touch "$EXCLUDE"
        [ -z "$(tail -c 1 "$EXCLUDE")" ] || echo >> "$EXCLUDE"  # a last line without its newline stays whole
        for f in "${FILES[@]}"; do grep -qxF "/$f" "$EXCLUDE" || echo "/$f" >> "$EXCLUDE"; done
        for f in "${FILES[@]}"; do  # again after an earlier `on`: nothing left to take out
            if git ls-files --error-unmatch -- "$f" > /dev/null 2>&1; then git rm -q --cached -- "$f"; fi
        done
        echo "weights out of the index: run scripts/device_slim.sh off after the calls, before any commit" ;;
    off)
        git reset -q -- "${FILES[@]}"
        if [ -f "$EXCLUDE" ]; then for f in "${FILES[@]}"; do sed -i "\\#^/$f\$#d" "$EXCLUDE"; done; fi
        echo "weights back in the index" ;;
    *) echo "usage: scripts/device_slim.sh on|off" >&2; exit 2 ;;
esac
git status --short -- "${FILES[@]}"
