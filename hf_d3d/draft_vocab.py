"""Choose a drafter's draft vocabulary: the tokens its target actually writes, by frequency in distillation data.

On a small target the drafter's LM head over the full vocabulary costs more than its layers; proposing only the
frequent tokens keeps nearly every draft the drafter would have made (the coverage says how many) and stays
lossless, since the target verifies every proposal over its full vocabulary.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

from hf_d3d.atomic import atomic_folder
from hf_d3d.modeling.modeling_d3d import D3DDrafterModel


def frequent_tokens(records: list[dict], size: int, always: tuple[int, ...] = ()) -> tuple[list[int], float]:
    """The ``size`` most frequent response tokens (plus ``always``, e.g. EOS) and the share of tokens they cover.

    When the data has fewer distinct tokens than ``size``, the rest are the lowest unused ids: BPE vocabularies
    number tokens in merge order, so low ids are the ones frequent in the tokenizer's own (broader) corpus.
    """
    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    counts = Counter(t for r in records for t in r["response_ids"])
    total = sum(counts.values())
    if total == 0:
        raise ValueError("no response tokens to count")
    keep = set(always)
    for tok, _ in counts.most_common():
        if len(keep) >= size:
            break
        keep.add(tok)
    fill = 0
    while len(keep) < size:
        if fill not in keep:
            keep.add(fill)
        fill += 1
    return sorted(keep), sum(counts[t] for t in keep) / total


def write_with_draft_vocab(drafter_path: str | Path, records: list[dict], size: int, out: str | Path) -> float:
    """Save a copy of the drafter at ``drafter_path`` that proposes only its ``size`` most frequent tokens.

    The copy is built in a temporary folder and renamed into place; an existing ``out`` is never overwritten.
    Returns the coverage of the response tokens in ``records``.
    """
    if Path(out).exists():
        raise FileExistsError(f"{out} exists; choose a new folder")
    drafter = D3DDrafterModel.from_pretrained(drafter_path, dtype="auto")
    eos = drafter.config.eos_token_id
    always = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    ids, coverage = frequent_tokens(records, size, always)
    drafter.set_draft_vocab(ids)
    with atomic_folder(out) as tmp:
        drafter.save_pretrained(tmp)
        # Provenance travels with the weights; measured tau and the card do not (measure the copy anew).
        if (Path(drafter_path) / "training_log.json").is_file():
            shutil.copy2(Path(drafter_path) / "training_log.json", tmp / "training_log.json")
    return coverage
