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
        if hasattr(drafter.last_stats, "observe"):  # the final round, whose outcome no later round showed the drafter
            drafter.last_stats.observe(out)
        hist.update(drafter.last_stats.acceptance_lengths)
        hits, misses = hits + drafter.last_stats.hits, misses + drafter.last_stats.misses
    return {
        "tau": new_tokens / max(forwards, 1),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "acceptance_histogram": {int(k): v for k, v in sorted(hist.items())},
        "hit_rate": hits / (hits + misses) if hits + misses else None,
    }


@torch.no_grad()
def teacher_forced_tau(
    drafter: PreTrainedModel,
    records: list[dict],
    blocks_per_record: int = 8,
    batch_size: int = 8,
    seed: int = 0,
) -> float:
    """Estimated greedy tau from the target's own answers, with no target forward: blocks anchored in each
    response are drafted in one packed forward, and a block's accepted length is its count of leading slots that
    equal the answer's tokens (what greedy verification accepts when the answer is the target's greedy text).

    Chains of ``block_size`` tokens, plus the correction/bonus token; blocks are cut where a response ends. Cheap
    enough to rank pruning candidates on a CPU; confirm the result with :func:`measure_tau` on unseen prompts.
    """
    from hf_d3d.train.objective import IGNORE, make_batch

    block = drafter.config.block_size
    fill = drafter.config.mask_token_id if drafter.config.mask_token_id is not None else 0
    pad = drafter.config.pad_token_id if drafter.config.pad_token_id is not None else 0
    gen = torch.Generator().manual_seed(seed)
    committed, blocks = 0.0, 0
    for start in range(0, len(records), batch_size):
        batch = make_batch(records[start : start + batch_size], block, blocks_per_record, pad, fill, gen, 0)
        device = drafter.device
        for name in ("position_ids", "block_ids", "is_slot", "anchors"):
            setattr(batch.layout, name, getattr(batch.layout, name).to(device))
        logits = drafter(
            batch.input_ids.to(device), layout=batch.layout, use_cache=False, logits_to_keep=batch.layout.is_slot
        ).logits
        labels = batch.labels.to(device)[batch.layout.is_slot].view(-1, block)
        right = (logits.argmax(-1).view(-1, block) == labels) & (labels != IGNORE)
        committed += float((right.int().cumprod(-1).sum(-1) + 1).sum())
        blocks += labels.shape[0]
    return committed / max(blocks, 1)
