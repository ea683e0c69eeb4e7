"""Measure what a D3D round costs on this machine, so that each round proposes only the tokens that pay.

A round that proposes k tokens costs one draft plus one target forward over k + 1 tokens. On a GPU that forward
costs about the same for every small k; on a CPU it grows, and in steps (matrix-multiply kernels change with the
number of rows), so the best draft length depends on the machine: it is measured, not assumed.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_d3d.atomic import write_json_atomic
from hf_d3d.cpu.skinny import skinny_by_default, skinny_linears
from hf_d3d.modeling.compat_d3d import cache_kwarg
from hf_d3d.modeling.generation_d3d import D3DCandidateGenerator


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU runs ahead of the host), so a wall clock times what ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timer(device: torch.device):
    def timed(fn) -> float:
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - start

    return timed


@torch.no_grad()
def measure_round_cost(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    context_length: int = 256,
    repeats: int = 15,
    new_per_round: int = 3,
    seed: int = 0,
    skinny: bool | None = None,
) -> list[float]:
    """Cost of a round proposing k = 1 .. ``block_size`` tokens, in target decode steps (medians of ``repeats``).

    The target's cache holds ``context_length`` tokens; each timed verify forward is cropped off again, and the
    sizes are timed in rotating order so that a drifting machine affects them alike. The draft is timed as a round
    sees it: ``new_per_round`` new committed tokens into the drafter's cache, then one block.
    """
    device = target.device
    timed = _timer(device)
    block = drafter.config.block_size
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, drafter.config.vocab_size, (1, context_length), generator=g).to(device)
    trims = {"logits_to_keep"} & set(inspect.signature(target.forward).parameters)
    cache = DynamicCache()
    cache_kw = cache_kwarg(target)
    target(context, **{cache_kw: cache}, use_cache=True)
    sizes = list(range(1, block + 2))
    verify: dict[int, list[float]] = {m: [] for m in sizes}
    skinny = skinny_by_default(target) if skinny is None else skinny
    with skinny_linears(target, drafter) if skinny else contextlib.nullcontext():
        for rep in range(repeats + 1):  # the first pass is a warm-up
            for m in sizes[rep % len(sizes) :] + sizes[: rep % len(sizes)]:
                keep = {"logits_to_keep": m} if trims else {}
                seconds = timed(lambda m=m, keep=keep: target(context[:, -m:], **{cache_kw: cache}, **keep))
                cache.crop(-m)
                if rep:
                    verify[m].append(seconds)
        gen = D3DCandidateGenerator(drafter, async_drafting=False)
        gen.round_cost = None  # time the full block
        gen.get_candidates(context)
        drafts = []
        for rep in range(repeats + 1):
            gen.cache.crop(-new_per_round)  # as if the last round committed this many tokens
            seconds = timed(lambda: gen.get_candidates(context))
            if rep:
                drafts.append(seconds)
    step = statistics.median(verify[1])
    draft = statistics.median(drafts)
    return [round((draft + statistics.median(verify[k + 1])) / step, 3) for k in range(1, block + 1)]


def write_round_cost(drafter_dir: str | Path, key: str, costs: list[float]) -> Path:
    """Record ``costs`` under ``key`` (:func:`round_cost_key`: device type, plus the target's dtype unless fp32) in
    the drafter folder's config.json (atomically; other keys kept)."""
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: calibrate a drafter folder saved with save_pretrained")
    config = json.loads(path.read_text())
    config["round_cost"] = {**(config.get("round_cost") or {}), key: costs}
    write_json_atomic(path, config)
    return path
