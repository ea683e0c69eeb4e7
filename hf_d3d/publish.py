"""Assemble a drafter checkpoint into a Hub repo folder (weights, remote code, rendered card) and upload it."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData
from safetensors import safe_open

from hf_d3d.atomic import atomic_folder

TEMPLATE = Path(__file__).resolve().parents[1] / "hub_cards" / "d3d_drafter.md"
MODELING = Path(__file__).resolve().parent / "modeling"
METRICS = "d3d_metrics.json"
REMOTE_CODE = (
    "configuration_d3d.py",
    "modeling_d3d.py",
    "attention_d3d.py",
    "generation_d3d.py",
    "compat_d3d.py",
    "skinny_d3d.py",
)
REQUIRED = ("config.json", "model.safetensors", "generation_config.json", *REMOTE_CODE)
OPTIONAL = ("prune_report.json", "training_log.json", METRICS)


class PublishError(RuntimeError):
    pass


def weights_sha256(checkpoint: str | Path) -> str | None:
    """SHA-256 of the checkpoint's ``model.safetensors`` (None without one): what ties a measured row to the weights
    it measured."""
    path = Path(checkpoint) / "model.safetensors"
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_metrics(checkpoint: Path) -> dict:
    """The measured numbers a card must carry; a card without them, or with a row measured on other weights, is
    refused."""
    path = checkpoint / METRICS
    if not path.is_file():
        raise PublishError(f"{path} is missing: measure the drafter first (`hf-d3d eval-tau`); no card without numbers")
    metrics = json.loads(path.read_text())
    rows = metrics.get("rows") or []
    if not rows or any("tau" not in r or "command" not in r for r in rows):
        raise PublishError(f"{path} has no measured rows with tau and the command that produced them")
    sha = weights_sha256(checkpoint)
    stale = [r["dataset"] for r in rows if r.get("weights_sha256", sha) != sha]
    if stale:
        raise PublishError(
            f"{path}: the rows for {', '.join(stale)} were measured on other weights than {checkpoint}'s "
            "model.safetensors; run each row's command again with --write-metrics, or drop the rows"
        )
    unbound = [r["dataset"] for r in rows if "weights_sha256" not in r]
    if unbound:  # rows written before measurements recorded the weights' checksum
        warnings.warn(
            f"{path}: the rows for {', '.join(unbound)} do not record which weights they measured",
            stacklevel=2,
        )
    return metrics


def render_card(checkpoint: Path, repo_id: str, metrics: dict) -> str:
    config = json.loads((checkpoint / "config.json").read_text())
    base = metrics.get("base_model") or config.get("base_model") or config.get("_name_or_path") or ""
    if not _is_hub_id(base):
        # the card's metadata and usage code load the target by this name, so a local folder would not serve
        raise PublishError(
            f'the card names the target by its Hub id, and {base or "nothing"!r} is not one: set "base_model" '
            f"in {METRICS} (eval-tau and bench --write-metrics record the --target they measured on)"
        )
    data = ModelCardData(
        base_model=base,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=metrics.get("license", "apache-2.0"),
        datasets=metrics.get("datasets", []),
        tags=["speculative-decoding", "d3d", "drafter", "block-diffusion"],
    )
    table = ["| prompts | tau | speedup | command |", "|---|---|---|---|"]
    for r in metrics["rows"]:
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "not measured"
        if r.get("speedup") is not None and r.get("speedup_setting"):
            speed += f" ({r['speedup_setting']})"
        if r.get("speedup_command"):
            speed += f" (`{r['speedup_command']}`)"
        hit = f", hit rate {r['hit_rate']:.0%}" if r.get("hit_rate") is not None else ""
        table.append(f"| {r['dataset']} | {r['tau']:.2f}{hit} | {speed} | `{r['command']}` |")
    prune = checkpoint / "prune_report.json"
    if prune.is_file():
        rep = json.loads(prune.read_text())
        judged = rep.get("judge") or f"measured tau on {rep['calibration_prompts']} calibration prompts"
        cheapest = next((s for s in rep["steps"][1:] if not s.get("accepted", True)), None)
        if not rep["removed_layers"] and cheapest is not None:
            healed = "healed_tau" in cheapest  # a healed removal is judged after its heal
            tau = cheapest["healed_tau"] if healed else cheapest["tau"]
            kept = cheapest["healed_retention"] if healed else cheapest["retention"]
            pruning = (
                f"Pruning by tau (`hf-d3d prune`, {judged}) removed no layer: without its cheapest layer "
                f"({cheapest['removed']}){' and healed' if healed else ''} the drafter kept {kept:.1%} of its tau "
                f"({rep['base_tau']:.2f} -> {tau:.2f}), under the {rep['retention_threshold']:.0%} asked."
            )
        elif not rep["removed_layers"]:
            pruning = "Not pruned."
        else:
            held = rep.get("holdout")
            pruning = (
                f"Pruned from {rep['final_layers'] + len(rep['removed_layers'])} to {rep['final_layers']} layers "
                f"(removed target layers {rep['removed_target_layers']}); tau {rep['base_tau']:.2f} -> "
                f"{rep['final_tau']:.2f} ({judged}, the data that chose the layers)"
                + (", each removal healed by a short fine-tune" if rep.get("healed") else "")
                + (
                    f"; on {held['prompts']} held-out prompts tau {held['tau_before']:.2f} -> {held['tau_after']:.2f} "
                    f"({held['retention']:.1%} kept)."
                    if held
                    else "; not measured on held-out prompts."
                )
            )
    else:
        pruning = "Not pruned."
    card = ModelCard.from_template(
        data,
        template_path=str(TEMPLATE),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=base,
        num_layers=config["num_hidden_layers"],
        block_size=config["block_size"],
        draft_tokens=_draft_tokens(checkpoint, config),
        draft_policy=(
            f"; fewer where the round costs measured by `hf-d3d calibrate` "
            f"({'; '.join(_cost_where(k) for k in sorted(config['round_cost']))}) say the rest do not pay"
            if config.get("round_cost")
            else ""
        ),
        metrics_table="\n".join(table),
        draft_vocab=(
            f" It proposes only its {config['draft_vocab_size']} most frequent tokens (a draft vocabulary), so its LM "
            f"head costs {config['draft_vocab_size'] / config['vocab_size']:.0%} of a full one; the target still "
            "verifies over its full vocabulary."
            if config.get("draft_vocab_size")
            else ""
        ),
        training=metrics.get("training", "See the hf-d3d repository."),
        pruning=pruning,
        base_weights=_base_weights_note(checkpoint, config),
    )
    return str(card)


def _is_hub_id(name: str) -> bool:
    """``org/name`` as the Hub spells a repo, not a local folder."""
    return bool(name) and name.count("/") == 1 and not name.startswith(("/", ".", "~")) and not Path(name).exists()


def _base_weights_note(checkpoint: Path, config: dict) -> str:
    """For a checkpoint stored without its base LM's weights: where loading takes them from."""
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    if "model.embed_tokens.weight" in stored or not config.get("base_model"):
        return ""
    if not _is_hub_id(config["base_model"]):
        raise PublishError(
            f"this drafter stores only its trained tensors and takes the rest from {config['base_model']!r}, which "
            "no one else can fetch: set its config's base_model to the LM's Hub id (load_drafter keeps the id a "
            "drafter was saved with) and save it again"
        )
    size = (checkpoint / "model.safetensors").stat().st_size / 1e6
    return (
        f" This repo holds only what training changed ({size:.0f} MB: block adapters and the mask vector); "
        f"`from_pretrained` takes every other weight from [{config['base_model']}]"
        f"(https://huggingface.co/{config['base_model']}) itself, fetched as any model is (Hub cache, offline mode)."
    )


def _draft_tokens(checkpoint: Path, config: dict) -> int:
    """Tokens proposed per round: ``num_assistant_tokens`` of the generation config, capped by the block size."""
    gen = checkpoint / "generation_config.json"
    asked = json.loads(gen.read_text()).get("num_assistant_tokens") if gen.is_file() else None
    return min(int(asked or config["block_size"]), config["block_size"])


def _cost_where(key: str) -> str:
    """``cpu`` -> ``cpu, fp32 target``; ``cpu-avx2+skinny+fp16w:bfloat16`` -> ``cpu (AVX2), bfloat16 target,
    few-row linears, fp16 drafter weights`` (keys of ``round_cost_key``)."""
    device, _, dtype = key.partition(":")
    device, *flags = device.split("+")
    device, _, machine = device.partition("-")
    where = f"{device}{f' ({machine.upper()})' if machine else ''}, {dtype or 'fp32'} target"
    named = {"skinny": "few-row linears", "fp16w": "fp16 drafter weights"}
    return ", ".join([where] + [named.get(f, f) for f in flags])


def assemble(checkpoint: str | Path, out_dir: str | Path, repo_id: str) -> Path:
    """Write the Hub folder for ``checkpoint`` into ``out_dir`` (atomically): exactly the files a repo needs."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    missing = [f for f in REQUIRED if not (checkpoint / f).is_file()]
    if missing:
        raise PublishError(f"{checkpoint} is not a saved D3D drafter: missing {missing}")
    stale = [f for f in REMOTE_CODE if (checkpoint / f).read_bytes() != (MODELING / f).read_bytes()]
    if stale:
        # Users load a repo's own copy of the code: one that differs from what was tested is refused, not uploaded.
        raise PublishError(
            f"{checkpoint}: {', '.join(stale)} differs from the installed hf_d3d's remote code; copy "
            f"{MODELING}/{{{','.join(stale)}}} into it before publishing (the weights and their measured rows stay)"
        )
    metrics = load_metrics(checkpoint)
    card = render_card(checkpoint, repo_id, metrics)
    # The folder is replaced whole: only one that holds nothing but a Hub folder's files may be (an earlier dry run).
    if out.exists() and out.resolve() == checkpoint.resolve():
        raise PublishError(f"{out} is the checkpoint itself; write the Hub folder elsewhere")
    if out.exists() and not out.is_dir():
        raise PublishError(f"{out} is a file, not a folder")
    hub_files = {*REQUIRED, *OPTIONAL, "README.md"}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in hub_files) if out.is_dir() else []
    if foreign:
        raise PublishError(f"{out} holds other files ({', '.join(foreign[:5])}); it would be replaced whole")
    with atomic_folder(out, overwrite=True) as tmp:
        for name in REQUIRED + OPTIONAL:
            if (checkpoint / name).is_file():
                shutil.copy2(checkpoint / name, tmp / name)
        (tmp / "README.md").write_text(card)
    return out


def publish(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    force: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
) -> str:
    """Create ``repo_id`` and upload ``folder`` in one commit; refuses to overwrite an existing repo without force.

    With ``force``, the commit makes the repo hold exactly ``folder``: files a former upload left there (an old
    ``prune_report.json``, say) are deleted, so nothing in the repo contradicts the new card."""
    api = HfApi(endpoint=endpoint, token=token)
    try:
        user = api.whoami()
    except Exception as err:  # no token, a bad token, or an unreachable endpoint all end here, before any upload
        raise PublishError(
            f"cannot reach the Hub as an authenticated user ({type(err).__name__}: {err}). "
            "Log in with `hf auth login` or set HF_TOKEN, and check the network / HF_ENDPOINT."
        ) from err
    try:
        exists = api.repo_exists(repo_id)
    except Exception as err:
        raise PublishError(f"cannot check whether {repo_id} exists: {err}") from err
    if exists and not force:
        raise PublishError(f"{repo_id} already exists on the Hub; pass --force to upload a new commit over it")
    try:
        api.create_repo(repo_id, private=private, exist_ok=force)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=f"Upload D3D drafter ({user.get('name', '?')})",
            delete_patterns="*" if exists else None,  # .gitattributes is kept by huggingface_hub
        )
    except Exception as err:
        raise PublishError(
            f"upload to {repo_id} failed; no commit with the drafter was made (the repo may exist now: retry with "
            f"--force): {err}"
        ) from err
    return str(getattr(info, "commit_url", info))
