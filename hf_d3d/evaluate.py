"""Acceptance measurement: tau (tokens committed per target forward) of a drafter on a set of prompts."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel


@contextmanager
def count_forwards(model: torch.nn.Module):
    """Count calls of ``model.forward`` inside the block (one per verification round in assisted decoding)."""
    counter = {"n": 0}

    def hook(*_):
        counter["n"] += 1

    handle = model.register_forward_pre_hook(hook)
    try:
        yield counter
    finally:
        handle.remove()


@torch.no_grad()
def measure_tau(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompts_ids: list[list[int]],
    max_new_tokens: int = 128,
    progress: bool = False,
) -> dict:
    """Greedy assisted generation over ``prompts_ids``: tau, totals, acceptance histogram and (async) hit rate."""
    new_tokens, forwards, hits, misses = 0, 0, 0, 0
    hist: Counter[int] = Counter()
    for ids in tqdm(prompts_ids, disable=not progress, desc="tau"):
        x = torch.tensor([ids], device=target.device)
        with count_forwards(target) as calls:
            out = target.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                assistant_model=drafter,
                pad_token_id=target.generation_config.pad_token_id,
            )
        new_tokens += out.shape[1] - x.shape[1]
        forwards += calls["n"]
        hist.update(drafter.last_stats.acceptance_lengths)
        hits, misses = hits + drafter.last_stats.hits, misses + drafter.last_stats.misses
    return {
        "tau": new_tokens / max(forwards, 1),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "acceptance_histogram": {int(k): v for k, v in sorted(hist.items())},
        "hit_rate": hits / (hits + misses) if hits + misses else None,
    }
