"""Side-by-side benchmark: every decoding method on the same target, prompts and settings, in one run.

Methods run alternately per prompt (rotating order) after a warm-up; speed is the median over prompts of the
per-prompt ratio to plain ``generate`` measured in the same run. tau counts committed tokens per target forward.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_d3d.atomic import save_figure, write_json_atomic, write_text_atomic
from hf_d3d.calibrate import synchronize
from hf_d3d.cpu.skinny import no_skinny_linears, skinny_by_default, skinny_linears
from hf_d3d.evaluate import count_forwards
from hf_d3d.exact import exact_verification
from hf_d3d.fused import fusable, fused_generate
from hf_d3d.modeling.generation_d3d import refuse_rescaling_rope
from hf_d3d.speculative import speculative_generate

Runner = Callable[[torch.Tensor], torch.Tensor]
ALL_METHODS = (
    "plain",
    "assisted_ar",
    "prompt_lookup",
    "d3d_hub",
    "d3d_sync",
    "d3d_async",
    "d3d_fast",
    "d3d_fast_chain",
    "d3d_fused",
)
# d3d_hub: the path a Hub user takes, the drafter as `from_pretrained(..., trust_remote_code=True)` loads it and
# `target.generate(assistant_model=drafter)` with no library call; the other d3d methods get the library's settings
AS_USERS_RUN_IT = ("plain", "d3d_hub")


def _runner(
    method: str, target, drafter, ar_drafter, max_new: int, skinny: bool = False, hub_drafter=None
) -> Callable[[torch.Tensor], torch.Tensor]:
    common = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=target.generation_config.pad_token_id)

    def gen(x, **kw):
        # every speculative peer gets the fast loop's few-row linears; plain generate runs as users run it
        models = [target] + ([kw["assistant_model"]] if "assistant_model" in kw else [])
        if method in AS_USERS_RUN_IT:
            block = contextlib.nullcontext()
        else:  # without: also no D3D drafter may give the target's verify forwards few-row linears itself
            block = skinny_linears(*models) if skinny else no_skinny_linears(target)
        with block:
            return target.generate(x, attention_mask=torch.ones_like(x), **common, **kw)

    if method == "plain":
        return gen
    if method == "prompt_lookup":
        return lambda x: gen(x, prompt_lookup_num_tokens=10)
    if method == "assisted_ar":
        return lambda x: gen(x, assistant_model=ar_drafter)
    if method == "d3d_hub":
        return lambda x: gen(x, assistant_model=hub_drafter)
    if method in ("d3d_sync", "d3d_async"):

        def run(x):
            configured, drafter.config.async_drafting = drafter.config.async_drafting, method == "d3d_async"
            try:
                return gen(x, assistant_model=drafter)
            finally:
                drafter.config.async_drafting = configured  # the later methods run the drafter as configured

        return run
    if method in ("d3d_fast", "d3d_fast_chain"):  # the chain: what the fast loop's trees add, and what its loop does
        tree = None if method == "d3d_fast" else False
        # greedy as every peer, whatever the target's generation_config says (Qwen3's and Llama 3's sample)
        return lambda x: speculative_generate(target, drafter, x, **common, skinny=skinny, tree=tree)
    if method == "d3d_fused":  # a drafter that is its target plus adapters: one target forward per round
        return lambda x: fused_generate(target, drafter, x, max_new_tokens=max_new)
    raise ValueError(f"unknown method {method!r}; choose from {ALL_METHODS}")


def _exact(run: Runner, target: PreTrainedModel) -> Runner:
    def run_exact(x):
        with exact_verification(target):
            return run(x)

    return run_exact


@torch.no_grad()
def run_bench(
    target: PreTrainedModel,
    drafter: PreTrainedModel | None,
    prompts_ids: list[list[int]],
    methods: list[str],
    max_new_tokens: int = 128,
    ar_drafter: PreTrainedModel | None = None,
    warmup: int = 1,
    exact: bool = False,
    skinny: bool | None = None,
    hub_drafter: PreTrainedModel | None = None,
) -> dict:
    """Run ``methods`` on every prompt; returns the result dict (per-method metrics and per-prompt records).

    With ``exact``, every method but ``plain`` and ``d3d_hub`` runs under :func:`hf_d3d.exact_verification`.
    ``skinny`` (default: as the fast loop decides for ``target``): every method but those two and ``d3d_fused`` (whose
    one pass a round computes the verify rows and the next blocks together, many rows) computes its few-row linears
    as :func:`hf_d3d.skinny_linears` does, the peers in transformers' loops included, so that only drafting differs.
    ``d3d_hub`` runs ``hub_drafter`` (loaded as a Hub user loads it) exactly as a user's code would.
    """
    if skinny is None:
        skinny = skinny_by_default(target) and not exact
    if skinny and exact:
        raise ValueError("skinny linears compute rows unlike a decode step; exact verification needs skinny=False")
    if "plain" not in methods:
        methods = ["plain", *methods]
    if "assisted_ar" in methods and ar_drafter is None:
        raise ValueError("method assisted_ar needs an autoregressive drafter (--ar-drafter)")
    if any(m.startswith("d3d") for m in methods) and drafter is None:
        raise ValueError("d3d methods need a D3D drafter")
    if "d3d_fused" in methods and exact:  # refused here, before any model runs, not in its warm-up
        raise ValueError("method d3d_fused runs blocks beside the verification rows: exact verification cannot run")
    if "d3d_fused" in methods and (why_not := fusable(target, drafter)):
        raise ValueError(f"method d3d_fused cannot run this pair: {why_not}")
    if "d3d_hub" in methods and hub_drafter is None:
        raise ValueError("method d3d_hub needs the drafter as from_pretrained(..., trust_remote_code=True) loads it")
    if any(m.startswith("d3d") for m in methods) or exact:  # for the longest prompt now, not partway through the run
        lookahead = drafter.config.block_size if "d3d_fused" in methods else 0
        refuse_rescaling_rope(target.config, max(map(len, prompts_ids)) + max_new_tokens, lookahead)
    runners = {}
    for m in methods:
        run = _runner(m, target, drafter, ar_drafter, max_new_tokens, skinny, hub_drafter)
        stats = hub_drafter if m == "d3d_hub" else drafter if m.startswith("d3d") else None
        runners[m] = (_exact(run, target) if exact and m not in AS_USERS_RUN_IT else run, stats)
    result = run_methods(target, runners, prompts_ids, max_new_tokens, warmup)
    result["skinny"] = skinny
    return result


@torch.no_grad()
def balanced_orders(n: int) -> list[list[int]]:
    """Run orders of ``n`` methods (a Williams design): over the rows each method takes every position equally often
    and follows every other method equally often, so neither a position nor a predecessor (a warm cache, a CPU clock
    the last method raised) favours one. ``n`` rows, or ``2n`` (each row and its mirror) for odd ``n``."""
    first, low, high = [0], 1, n - 1
    for i in range(1, n):
        if i % 2:
            first, low = first + [low], low + 1
        else:
            first, high = first + [high], high - 1
    rows = [[(m + shift) % n for m in first] for shift in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def run_methods(
    target: PreTrainedModel,
    runners: dict[str, tuple[Runner, PreTrainedModel | None]],
    prompts_ids: list[list[int]],
    max_new_tokens: int,
    warmup: int = 1,
) -> dict:
    """Time named ``runners`` (one must be ``plain``) alternately on every prompt, in :func:`balanced_orders`,
    after a warm-up.

    Each runner comes with the D3D drafter whose ``last_stats`` describe its last call, or None.
    """
    if "plain" not in runners:
        raise ValueError("the runners need a 'plain' entry: every speedup is measured against it in the same run")
    methods = list(runners)
    for ids in prompts_ids[:warmup]:  # warm-up: first-call overheads (allocations, lazy init) stay out of timings
        for run, _ in runners.values():
            run(torch.tensor([ids], device=target.device))
    records = {m: [] for m in methods}
    orders = balanced_orders(len(methods))
    for p, ids in enumerate(tqdm(prompts_ids, desc="bench")):
        x = torch.tensor([ids], device=target.device)
        order = [methods[i] for i in orders[p % len(orders)]]
        outs = {}
        for m in order:
            run, stats_from = runners[m]
            synchronize(target.device)
            start = time.perf_counter()
            with count_forwards(target) as calls:
                out = run(x)
            synchronize(target.device)  # a GPU's queued work belongs to the method that queued it
            seconds = time.perf_counter() - start
            outs[m] = out
            stats = stats_from.last_stats if stats_from is not None else None
            if hasattr(stats, "observe"):  # a drafter whose remote code predates it leaves the final round out
                stats.observe(out)  # inside target.generate, the final round's outcome is read off the output
            records[m].append(
                {
                    "prompt": p,
                    "seconds": seconds,
                    "new_tokens": out.shape[1] - x.shape[1],
                    "target_forwards": calls["n"],
                    "hits": stats.hits if stats else 0,
                    "misses": stats.misses if stats else 0,
                    "acceptance_lengths": list(stats.acceptance_lengths) if stats else [],
                }
            )
        for m in methods:
            records[m][-1]["identical_to_plain"] = bool(torch.equal(outs[m], outs["plain"]))
    return summarize(records, max_new_tokens, len(prompts_ids))


def summarize(records: dict[str, list[dict]], max_new_tokens: int, num_prompts: int) -> dict:
    plain = records["plain"]
    result = {"max_new_tokens": max_new_tokens, "num_prompts": num_prompts, "methods": {}, "records": records}
    for m, recs in records.items():
        tokens = sum(r["new_tokens"] for r in recs)
        forwards = sum(r["target_forwards"] for r in recs)
        hits, misses = sum(r["hits"] for r in recs), sum(r["misses"] for r in recs)
        hist = Counter(a for r in recs for a in r["acceptance_lengths"])
        identical = all(r["identical_to_plain"] for r in recs)
        result["methods"][m] = {
            "tau": tokens / max(forwards, 1),
            "tokens_per_second": statistics.median(r["new_tokens"] / r["seconds"] for r in recs),
            # a method whose output differs has no speedup: it did other (maybe less) work than plain
            "speedup": statistics.median(p["seconds"] / r["seconds"] for p, r in zip(plain, recs))
            if identical
            else None,
            "speedup_total_time": (
                sum(p["seconds"] for p in plain) / sum(r["seconds"] for r in recs) if identical else None
            ),
            "identical_to_plain": identical,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "acceptance_histogram": {int(k): v for k, v in sorted(hist.items())},
        }
    result["all_identical"] = all(v["identical_to_plain"] for v in result["methods"].values())
    return result


def markdown_table(result: dict) -> str:
    rows = [
        "| method | tau | tokens/s (median) | speedup (median) | speedup (total time) | identical | hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, v in result["methods"].items():
        hit = f"{v['hit_rate']:.0%}" if v["hit_rate"] is not None else "-"
        speed = [f"{v[k]:.2f}x" if v[k] is not None else "invalid" for k in ("speedup", "speedup_total_time")]
        rows.append(
            f"| {m} | {v['tau']:.2f} | {v['tokens_per_second']:.1f} | {speed[0]} | {speed[1]} | "
            f"{'yes' if v['identical_to_plain'] else 'NO'} | {hit} |"
        )
    return "\n".join(rows)


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(result["methods"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    speedups = [result["methods"][m]["speedup"] for m in methods]
    bars = ax1.bar(methods, [x or 0.0 for x in speedups], color="tab:blue")
    for bar, x in zip(bars, speedups):
        if x is None:  # output differed from plain generate: no bar, a label instead
            ax1.annotate("not identical", (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom", color="red")
    ax1.axhline(1.0, color="gray", lw=1, ls="--")
    ax1.set_ylabel("speedup vs plain generate (median)")
    ax1.tick_params(axis="x", rotation=30)
    for m in methods:
        hist = result["methods"][m]["acceptance_histogram"]
        if hist:
            ks = sorted(hist)
            total = sum(hist.values())
            ax2.plot(ks, [hist[k] / total for k in ks], marker="o", label=m)
    ax2.set_xlabel("draft tokens accepted per round")
    ax2.set_ylabel("share of rounds")
    if ax2.get_legend_handles_labels()[0]:  # methods without rounds (plain) draw no line
        ax2.legend()
    fig.suptitle(f"{result['num_prompts']} prompts, {result['max_new_tokens']} new tokens, greedy")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def output_paths(out: str | Path) -> tuple[Path, Path, Path]:
    """The JSON, table and figure paths of ``out``; refuses an ``out`` that would be one of the other two."""
    out = Path(out)
    if out.suffix.lower() in (".md", ".png"):
        raise ValueError(f"--out names the JSON file, beside which the .md table and .png figure go; got {out}")
    return out, out.with_suffix(".md"), out.with_suffix(".png")


def write_outputs(result: dict, out: str | Path) -> tuple[Path, Path, Path]:
    """Write RESULT.json, RESULT.md and RESULT.png side by side, as a set: all three are made under scratch names
    first, so a failure (the plot, a full disk) leaves the previous three as they were, never a new table beside an
    old figure."""
    out, md, png = output_paths(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = (png, md, out)  # the JSON, the record the others are drawn from, replaced last
    scratch = [p.with_name(f".{p.name}.{os.getpid()}.set") for p in paths]
    try:
        plot(result, scratch[0])
        write_text_atomic(scratch[1], markdown_table(result) + "\n")
        write_json_atomic(scratch[2], result)
        for tmp, path in zip(scratch, paths):
            os.replace(tmp, path)
    finally:
        for tmp in scratch:
            tmp.unlink(missing_ok=True)
    return out, md, png
