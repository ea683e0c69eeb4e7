"""Progressive layer pruning by acceptance length: drop the layer whose removal costs the least tau, repeat.

Each step measures mean tau on calibration prompts with every remaining layer skipped in turn (layers are skipped
at run time, so no copy is made), removes the cheapest one, and optionally heals with a short fine-tune (then the
healed tau decides). It stops before tau would fall below ``retention`` x the unpruned tau; with ``target_depth``,
at that depth whatever tau.
Progress is saved after every step (``prune_state.json``), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_d3d.atomic import atomic_folder, save_figure, write_json_atomic
from hf_d3d.evaluate import measure_tau, teacher_forced_tau
from hf_d3d.modeling.modeling_d3d import D3DDrafterModel, _layer_state
from hf_d3d.publish import METRICS
from hf_d3d.train.trainer import FINAL, RUN_LOGISTICS, TrainConfig, data_fingerprint, train

STATE = "prune_state.json"
REPORT = "prune_report.json"


def _renumber_layers(state: dict[str, torch.Tensor], index: dict[int, int]) -> dict[str, torch.Tensor]:
    """``state`` with decoder layer i renamed to layer ``index[i]``; layers missing from ``index`` are left out."""
    out = {}
    for name, value in state.items():
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers.") :].split(".", 1)
            if int(idx) not in index:
                continue
            name = f"model.layers.{index[int(idx)]}.{rest}"
        out[name] = value
    return out


def drop_layers(drafter: D3DDrafterModel, remove: list[int]) -> D3DDrafterModel:
    """A physically smaller copy of ``drafter`` without the layers at indices ``remove``; provenance kept."""
    keep = [i for i in range(drafter.config.num_hidden_layers) if i not in set(remove)]
    if not keep:
        raise ValueError("cannot remove every layer")
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers = len(keep)
    if remove:
        config.round_cost = None  # measured for the old depth
    source_ids = drafter.config.target_layer_ids or list(range(drafter.config.num_hidden_layers))
    config.target_layer_ids = [source_ids[i] for i in keep]
    if config.block_adapter_layers is not None:
        config.block_adapter_layers = [
            new for new, old in enumerate(keep) if old in drafter.config.block_adapter_layers
        ]
    pruned = D3DDrafterModel(config).to(dtype=drafter.dtype, device=drafter.device)
    renumbered = _renumber_layers(drafter.state_dict(), {old: new for new, old in enumerate(keep)})
    pruned.load_state_dict(renumbered, strict=True)
    pruned.generation_config = copy.deepcopy(drafter.generation_config)
    if config.base_model_checksum is not None:  # the base weights it holds are now a subset of the LM's
        drift = drafter._base_drift()
        # A base that training changed stays marked as changed (by the same offset), so the pruned drafter too is
        # saved whole rather than with the original base fetched in place of its trained one.
        pruned.config.base_model_checksum = pruned.base_checksum() + (drift[1] - drift[0] if drift else 0.0)
    return pruned.eval()


def insert_layers(drafter: D3DDrafterModel, target: PreTrainedModel, layer_ids: list[int]) -> D3DDrafterModel:
    """A deeper copy of ``drafter`` with copies of ``target``'s layers ``layer_ids`` added, each where it sits in
    the target's order among the drafter's own (by ``target_layer_ids``).

    An added layer starts as an identity (its attention and MLP output projections zeroed), so the grown drafter
    drafts exactly like ``drafter`` until training gives the new layers something to add. The round cost measured
    for the old depth is dropped.
    """
    own = list(drafter.config.target_layer_ids or [])
    n_target = target.config.get_text_config().num_hidden_layers
    if len(own) != drafter.config.num_hidden_layers:
        raise ValueError("the drafter does not record which target layers it holds (config.target_layer_ids)")
    if own != sorted(own):
        raise ValueError(f"the drafter's target_layer_ids are not in the target's order: {own}")
    new_ids = sorted(set(layer_ids))
    if not new_ids or any(not 0 <= i < n_target for i in new_ids) or set(new_ids) & set(own):
        raise ValueError(f"layer_ids must be new target layers in [0, {n_target}), not in {own}; got {layer_ids}")
    order = sorted([(i, "own", k) for k, i in enumerate(own)] + [(i, "new", i) for i in new_ids])
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers = len(order)
    config.target_layer_ids = [i for i, _, _ in order]
    config.round_cost = None
    grown = D3DDrafterModel(config).to(dtype=drafter.dtype, device=drafter.device)
    placed = {k: pos for pos, (_, kind, k) in enumerate(order) if kind == "own"}
    missing, unexpected = grown.load_state_dict(_renumber_layers(drafter.state_dict(), placed), strict=False)
    source = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    for pos, (i, kind, _) in enumerate(order):
        if kind == "new":
            layer = grown.model.layers[pos]
            layer.load_state_dict(_layer_state(source.layers[i]))
            with torch.no_grad():
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    new_prefixes = tuple(f"model.layers.{pos}." for pos, (_, kind, _) in enumerate(order) if kind == "new")
    if unexpected or any(not k.startswith(new_prefixes) for k in missing):
        raise ValueError(f"the drafter's weights do not fit the grown layout: {missing} {unexpected}")
    grown.generation_config = copy.deepcopy(drafter.generation_config)
    return grown.eval()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of a model's weights, by name: tells one drafter (or training stage) from another."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(
            name.encode() + tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()


def tau_with_skipped(
    target: PreTrainedModel, drafter: D3DDrafterModel, prompts_ids: list[list[int]], skip: set[int], max_new: int
) -> float:
    drafter.model.skip_layers = set(skip)
    try:
        return measure_tau(target, drafter, prompts_ids, max_new)["tau"]
    finally:
        drafter.model.skip_layers = set()


def judge_answers(records: list[dict], count: int, max_tokens: int = 128) -> list[dict]:
    """``count`` answers spread evenly over ``records``, each cut to its first ``max_tokens`` response tokens: every
    candidate layer is judged on them, so each judgement must be cheap."""
    step = max(1, len(records) // count)
    return [{**r, "response_ids": r["response_ids"][:max_tokens]} for r in records[::step][:count]]


def teacher_forced_judge(records: list[dict], blocks_per_record: int = 8) -> Callable:
    """A pruning judge that estimates tau from the target's own answers (no target forward; see
    :func:`hf_d3d.evaluate.teacher_forced_tau`): what makes judging every layer of a whole-LM drafter affordable."""

    def judge(drafter: D3DDrafterModel, skip: set[int]) -> float:
        drafter.model.skip_layers = set(skip)
        try:
            return teacher_forced_tau(drafter, records, blocks_per_record)
        finally:
            drafter.model.skip_layers = set()

    judge.description = f"teacher-forced tau on {len(records)} answers x {blocks_per_record} blocks"
    judge.fingerprint = f"{data_fingerprint(records)}:{blocks_per_record}"  # a resumed pruning is judged the same
    return judge


def prune(
    target: PreTrainedModel,
    drafter: D3DDrafterModel,
    prompts_ids: list[list[int]],
    out_dir: str | Path,
    retention: float = 0.99,
    target_depth: int | None = None,
    max_new_tokens: int = 64,
    heal: Callable[[D3DDrafterModel, list[int]], None] | None = None,
    judge: Callable[[D3DDrafterModel, set[int]], float] | None = None,
    holdout_ids: list[list[int]] | None = None,
) -> dict:
    """Prune ``drafter`` progressively; writes ``out_dir/model`` (smaller checkpoint), the report and a plot.

    ``judge(drafter, skipped_layers)`` scores a candidate (default: measured tau on ``prompts_ids``).
    ``holdout_ids``: prompts the pruning never saw, on which the report measures the tau of the drafter before
    and after pruning (greedy, ``max_new_tokens``).
    """
    if judge is None:

        def judge(model: D3DDrafterModel, skip: set[int]) -> float:
            return tau_with_skipped(target, model, prompts_ids, skip, max_new_tokens)

    calibration = {tuple(ids) for ids in prompts_ids}
    if holdout_ids and any(tuple(ids) in calibration for ids in holdout_ids):
        raise ValueError("some holdout prompts are calibration prompts: the holdout must be prompts pruning never sees")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_layers = drafter.config.num_hidden_layers
    floor = max(1, target_depth or 1)
    # What a saved state answers: this drafter, pruned this way; resuming it for another is refused.
    run = {
        "drafter": weights_fingerprint(drafter),
        "retention": retention,
        "target_depth": target_depth,
        "judge": getattr(judge, "description", "measured tau on the calibration prompts"),
        "calibration": hashlib.sha256(repr(sorted(calibration)).encode()).hexdigest(),
        "max_new_tokens": max_new_tokens,
        "healed": heal is not None,
    }
    # which answers judge and which settings and data heal: a finished heal is reused on resume, so they must match
    for key, part in (("judge_data", judge), ("heal", heal)):
        if getattr(part, "fingerprint", None):
            run[key] = part.fingerprint
    state_path = out / STATE
    if state_path.is_file():
        state = json.loads(state_path.read_text())
        changed = sorted(k for k, v in state.get("run", run).items() if run.get(k) != v)
        if changed:
            raise ValueError(
                f"{out} holds the pruning of another drafter or with other settings ({', '.join(changed)}); "
                "prune into a new --out"
            )
    else:
        base = judge(drafter, set())
        state = {"base_tau": base, "removed": [], "steps": [{"layers": n_layers, "removed": None, "tau": base}]}
        state["run"] = run
        write_json_atomic(state_path, state)
    base = state["base_tau"]
    # the drafter as given: is its base still the LM's own (so that a pruning of it can fetch it)?
    base_unchanged = drafter.base_unchanged()
    # Healing rewrites the kept layers; keep the unhealed weights to go back to when a healed removal is refused.
    original = {k: v.clone() for k, v in drafter.state_dict().items()} if heal is not None else None
    if heal is not None and state["removed"]:
        heal(drafter, state["removed"])  # resuming: reload (or finish) the last accepted heal
    bar = tqdm(total=n_layers - floor, initial=len(state["removed"]), desc="prune")
    while n_layers - len(state["removed"]) > floor and not state.get("done"):
        removed = set(state["removed"])
        candidates = {}
        for layer in range(n_layers):
            if layer not in removed:
                candidates[layer] = judge(drafter, removed | {layer})
        best = max(candidates, key=lambda k: (candidates[k], k))
        step = {
            "layers": n_layers - len(removed) - 1,
            "removed": best,
            "tau": candidates[best],
            "retention": candidates[best] / base if base else 0.0,
            "candidates": {str(k): v for k, v in candidates.items()},
        }
        if heal is not None:
            # With healing, the removal is judged by what the smaller drafter gives after its fine-tune.
            heal(drafter, state["removed"] + [best])
            step["healed_tau"] = judge(drafter, removed | {best})
            step["healed_retention"] = step["healed_tau"] / base if base else 0.0
        keep_going = target_depth is not None or step.get("healed_tau", step["tau"]) >= retention * base
        step["accepted"] = keep_going
        state["steps"].append(step)
        if not keep_going:
            state["done"] = True  # the cheapest removal would cost more than the threshold allows
            if heal is not None:
                drafter.load_state_dict(original)
                if state["removed"]:
                    heal(drafter, state["removed"])  # back to the last accepted heal
        else:
            state["removed"].append(best)
            bar.update(1)
        write_json_atomic(state_path, state)
    bar.close()

    pruned = drop_layers(drafter, state["removed"])
    accepted = [s for s in state["steps"] if s.get("accepted", True)]
    model_dir = out / "model"
    source_ids = drafter.config.target_layer_ids or list(range(n_layers))
    report = {
        "base_tau": base,
        "retention_threshold": retention,
        "target_depth": target_depth,
        "removed_layers": state["removed"],
        "removed_target_layers": [source_ids[i] for i in state["removed"]],
        "kept_target_layers": pruned.config.target_layer_ids,
        "final_layers": pruned.config.num_hidden_layers,
        "final_tau": _tau_after(accepted[-1]),
        "healed": heal is not None,
        "steps": state["steps"],
        "judge": getattr(judge, "description", "measured tau on the calibration prompts"),
        "calibration_prompts": len(prompts_ids),
        "max_new_tokens": max_new_tokens,
    }
    if holdout_ids:
        before = drafter
        if original is not None:  # healing rewrote the drafter's layers in place: "before" is the drafter as given
            before = copy.deepcopy(drafter)
            before.load_state_dict(original)
        report["holdout"] = {
            "prompts": len(holdout_ids),
            "tau_before": measure_tau(target, before, holdout_ids, max_new_tokens)["tau"],
            "tau_after": measure_tau(target, pruned, holdout_ids, max_new_tokens)["tau"],
        }
        report["holdout"]["retention"] = report["holdout"]["tau_after"] / report["holdout"]["tau_before"]
    # A rerun of a finished pruning writes the same drafter again: what was measured on it since (`eval-tau
    # --write-metrics`, `calibrate --write`) stays with it.
    same = (model_dir / REPORT).is_file() and json.loads((model_dir / REPORT).read_text()).get("removed_layers") == (
        state["removed"]
    )
    if same and (model_dir / "config.json").is_file():
        measured = json.loads((model_dir / "config.json").read_text()).get("round_cost")
        # once layers are gone, the unpruned drafter's own costs (which older versions copied in) are not this one's
        stale = state["removed"] and measured == drafter.config.round_cost
        pruned.config.round_cost = None if stale else measured
    with atomic_folder(model_dir, overwrite=True) as tmp:  # a resumed run rewrites it whole
        # unhealed or healed in its adapters alone, its layers are still the base LM's own: store what training
        # changed, as the drafter was
        base_kept = base_unchanged and (heal is None or bool(pruned.config.block_adapter_rank))
        pruned.save_pretrained(tmp, omit_base_weights=base_kept and bool(pruned.config.base_model))
        write_json_atomic(tmp / REPORT, report)
        if same and (model_dir / METRICS).is_file():
            shutil.copy2(model_dir / METRICS, tmp / METRICS)
    write_json_atomic(out / REPORT, report)
    plot_report(report, out / "prune_tau.png")
    return report


def _tau_after(step: dict) -> float:
    """The tau a pruning step leaves: after its heal when it had one."""
    return step.get("healed_tau", step["tau"])


def make_healer(records: list[dict], out_dir: str | Path, config: TrainConfig) -> Callable:
    """A ``heal`` for :func:`prune`: fine-tune the drafter without the removed layers, in place.

    Each heal trains a physically smaller copy in ``out_dir/heal-<layers removed>`` (a normal, resumable training
    run; a finished one is reused) and writes its weights back into the kept layers, so the skip-one-layer
    measurements that follow see the healed drafter.
    """

    def heal(drafter: D3DDrafterModel, removed: list[int]) -> None:
        run = Path(out_dir) / f"heal-{len(removed)}"
        # a drafter with block adapters heals them alone: its LM (and the first slot, its next token) stays exact
        cfg = dataclasses.replace(config, adapters_only=True) if drafter.config.block_adapter_rank else config
        if not (run / FINAL).is_dir():  # atomic_folder: the final folder exists only once complete
            train(drop_layers(drafter, removed), records, run, cfg)
        # the tensors the heal stored: all of them, or (adapters alone, base LM kept) the adapters; what it did not
        # store, it did not change
        healed = {}
        for file in sorted((run / FINAL).glob("*.safetensors")):
            healed.update(load_file(file))
        keep = [i for i in range(drafter.config.num_hidden_layers) if i not in set(removed)]
        back = _renumber_layers(healed, dict(enumerate(keep)))
        missing, unexpected = drafter.load_state_dict(back, strict=False)
        whole = "model.embed_tokens.weight" in healed
        tied = {"lm_head.weight"} if drafter.config.tie_word_embeddings else set()  # stored once, as the embeddings
        gone = tuple(f"model.layers.{i}." for i in removed)
        stray = [k for k in missing if not k.startswith(gone) and k not in tied] if whole else []
        if stray or unexpected:
            raise ValueError(f"healed weights do not fit the drafter (missing {stray}, unexpected {unexpected})")

    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in RUN_LOGISTICS or k == "max_steps"}
    heal.fingerprint = hashlib.sha256(f"{sorted(settings.items())}:{data_fingerprint(records)}".encode()).hexdigest()
    return heal


def plot_report(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s in report["steps"] if s.get("accepted", True)]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([s["layers"] for s in steps], [_tau_after(s) for s in steps], marker="o", label="kept")
    rejected = [s for s in report["steps"] if not s.get("accepted", True)]
    if rejected:  # at the tau that refused it: after its heal when it had one
        ax.plot([s["layers"] for s in rejected], [_tau_after(s) for s in rejected], "x", color="red", label="rejected")
    healed = [s for s in report["steps"] if "healed_tau" in s]
    if healed:  # before healing, the skip-one-layer measurement
        ax.plot([s["layers"] for s in healed], [s["tau"] for s in healed], ".", color="gray", label="before heal")
    ax.axhline(report["base_tau"] * report["retention_threshold"], color="gray", ls="--", lw=1, label="threshold")
    ax.set_xlabel("drafter layers")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("mean tau")
    ax.invert_xaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
