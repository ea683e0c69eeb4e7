"""Publishing: the card renders with valid Hub metadata, dry-run writes exactly the Hub files, failures are clear."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from packaging.requirements import Requirement

from conftest import make_drafter, tiny_target
from hf_d3d.cli import main
from hf_d3d.publish import METRICS, PublishError, assemble, publish, weights_sha256

ROOT = Path(__file__).resolve().parents[1]

EXPECTED = {
    "README.md",
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "configuration_d3d.py",
    "modeling_d3d.py",
    "attention_d3d.py",
    "generation_d3d.py",
    "compat_d3d.py",
    "skinny_d3d.py",
    METRICS,
}


@pytest.fixture
def checkpoint(tmp_path):
    drafter = make_drafter(tiny_target("qwen3"), block_size=4)
    drafter.save_pretrained(tmp_path / "ckpt")
    metrics = {
        "base_model": "Qwen/Qwen3-0.6B",
        "datasets": ["openai/gsm8k"],
        "rows": [{"dataset": "gsm8k:test", "tau": 1.23, "command": "hf-d3d eval-tau --drafter ckpt"}],
    }
    metrics["rows"][0]["weights_sha256"] = weights_sha256(tmp_path / "ckpt")
    (tmp_path / "ckpt" / METRICS).write_text(json.dumps(metrics))
    return tmp_path / "ckpt"


def test_card_metadata_is_valid(checkpoint, tmp_path):
    folder = assemble(checkpoint, tmp_path / "hub", "someone/tiny-d3d")
    card = ModelCard.load(folder / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "Qwen/Qwen3-0.6B"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert "speculative-decoding" in data["tags"] and data["license"] == "apache-2.0"
    assert data["datasets"] == ["openai/gsm8k"]
    assert "| gsm8k:test | 1.23 |" in card.text and "hf-d3d eval-tau --drafter ckpt" in card.text
    assert "someone/tiny-d3d" in card.text
    assert "draft vocabulary" not in card.text and "round costs" not in card.text


def test_card_states_a_pruning_that_removed_no_layer_and_why(checkpoint):
    from hf_d3d.publish import load_metrics, render_card

    rejected = {"layers": 2, "removed": 1, "tau": 2.0, "retention": 2.0 / 2.4, "accepted": False}
    report = {
        "base_tau": 2.4, "retention_threshold": 0.99, "removed_layers": [], "removed_target_layers": [],
        "final_layers": 3, "final_tau": 2.4, "judge": "teacher-forced tau on 16 answers x 8 blocks",
        "steps": [{"layers": 3, "removed": None, "tau": 2.4}, rejected],
    }  # fmt: skip
    (checkpoint / "prune_report.json").write_text(json.dumps(report))
    card = render_card(checkpoint, "someone/x", load_metrics(checkpoint))
    assert "removed no layer" in card and "(1) the drafter kept 83.3% of its tau (2.40 -> 2.00)" in card
    assert "Pruned from" not in card
    rejected.update(healed_tau=2.3, healed_retention=2.3 / 2.4)  # a healed removal was refused on its healed tau
    (checkpoint / "prune_report.json").write_text(json.dumps(report))
    card = render_card(checkpoint, "someone/x", load_metrics(checkpoint))
    assert "(1) and healed the drafter kept 95.8% of its tau (2.40 -> 2.30), under the 99% asked" in card


def test_card_of_a_pruned_drafter_gives_its_held_out_tau(checkpoint):
    """The tau of the data that chose the layers flatters the pruning: the card says which number is which."""
    from hf_d3d.publish import load_metrics, render_card

    report = {
        "base_tau": 2.4, "retention_threshold": 0.99, "removed_layers": [1], "removed_target_layers": [5],
        "final_layers": 2, "final_tau": 2.39, "judge": "teacher-forced tau on 16 answers x 8 blocks",
        "steps": [{"layers": 3, "removed": None, "tau": 2.4}, {"layers": 2, "removed": 1, "tau": 2.39}],
    }  # fmt: skip
    (checkpoint / "prune_report.json").write_text(json.dumps(report))
    card = render_card(checkpoint, "someone/x", load_metrics(checkpoint))
    assert "tau 2.40 -> 2.39 (teacher-forced tau on 16 answers x 8 blocks, the data that chose the layers)" in card
    assert "not measured on held-out prompts" in card
    report["holdout"] = {"prompts": 20, "tau_before": 2.32, "tau_after": 2.2, "retention": 2.2 / 2.32}
    (checkpoint / "prune_report.json").write_text(json.dumps(report))
    card = render_card(checkpoint, "someone/x", load_metrics(checkpoint))
    assert "on 20 held-out prompts tau 2.32 -> 2.20 (94.8% kept)" in card


def test_card_states_the_draft_vocabulary(tmp_path):
    drafter = make_drafter(tiny_target("qwen3"), block_size=4)
    drafter.set_draft_vocab(list(range(24)))
    drafter.generation_config.num_assistant_tokens = 2
    drafter.config.round_cost = {"cpu": [1.1, 1.2, 1.6, 1.7], "cpu:bfloat16": [1.1, 1.1, 1.2, 1.2]}
    drafter.save_pretrained(tmp_path / "ckpt")
    rows = [{"dataset": "gsm8k:test", "tau": 1.5, "hit_rate": 0.42, "command": "c"}]
    (tmp_path / "ckpt" / METRICS).write_text(json.dumps({"rows": rows}))
    with pytest.raises(PublishError, match="names the target by its Hub id"):  # neither metrics nor config name it
        assemble(tmp_path / "ckpt", tmp_path / "hub", "someone/x")
    (tmp_path / "ckpt" / METRICS).write_text(json.dumps({"base_model": "Qwen/Qwen3-0.6B", "rows": rows}))
    card = ModelCard.load(assemble(tmp_path / "ckpt", tmp_path / "hub", "someone/x") / "README.md")
    assert "only its 24 most frequent tokens" in card.text and "25% of a full one" in card.text
    assert (
        "blocks of 4 tokens (up to 2 proposed per round as shipped; fewer where the round costs measured by "
        "`hf-d3d calibrate` (cpu, fp32 target; cpu, bfloat16 target) say the rest do not pay)"
    ) in card.text
    assert "| gsm8k:test | 1.50, hit rate 42% |" in card.text


def test_dry_run_writes_exactly_the_hub_files(checkpoint, tmp_path):
    assert (
        main(["publish", str(checkpoint), "--repo-id", "someone/x", "--folder", str(tmp_path / "hub"), "--dry-run"])
        == 0
    )
    assert {p.name for p in (tmp_path / "hub").iterdir()} == EXPECTED


def test_the_hub_folder_never_replaces_a_folder_of_other_files(checkpoint, tmp_path):
    """The Hub folder is written whole over an earlier one; a folder with anything else in it (`--folder runs`)
    or the checkpoint itself is refused, untouched."""
    assemble(checkpoint, tmp_path / "hub", "someone/x")
    assemble(checkpoint, tmp_path / "hub", "someone/x")  # an earlier dry run's folder is replaced
    (tmp_path / "runs" / "other").mkdir(parents=True)
    (tmp_path / "runs" / "keep.bin").write_bytes(b"precious")
    with pytest.raises(PublishError, match="other files"):
        assemble(checkpoint, tmp_path / "runs", "someone/x")
    assert (tmp_path / "runs" / "keep.bin").read_bytes() == b"precious" and (tmp_path / "runs" / "other").is_dir()
    with pytest.raises(PublishError, match="checkpoint itself"):
        assemble(checkpoint, checkpoint, "someone/x")
    assert (checkpoint / "model.safetensors").is_file()


def test_card_without_metrics_is_refused(checkpoint, tmp_path):
    (checkpoint / METRICS).unlink()
    with pytest.raises(PublishError, match="no card without numbers"):
        assemble(checkpoint, tmp_path / "hub", "someone/x")
    assert not (tmp_path / "hub").exists()
    (checkpoint / METRICS).write_text(json.dumps({"rows": [{"dataset": "x"}]}))
    with pytest.raises(PublishError, match="tau"):
        assemble(checkpoint, tmp_path / "hub", "someone/x")


def test_publish_without_token_or_network_fails_clearly(checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored login
    folder = assemble(checkpoint, tmp_path / "hub", "someone/x")
    with pytest.raises(PublishError, match="hf auth login"):
        publish(folder, "someone/x", endpoint="http://127.0.0.1:9")
    with pytest.raises(PublishError, match="cannot reach the Hub"):
        publish(folder, "someone/x", token="hf_not_a_real_token", endpoint="http://127.0.0.1:9")
    assert main(["publish", str(checkpoint), "--repo-id", "someone/x", "--folder", str(tmp_path / "hub2")]) == 2


def test_metrics_rows_merge_by_dataset_and_weights(tmp_path):
    from hf_d3d.cli import _update_metrics

    (tmp_path / "model.safetensors").write_bytes(b"weights one")
    first = weights_sha256(tmp_path)
    tau_row = {"dataset": "gsm8k:test", "tau": 1.8, "command": "hf-d3d eval-tau ..."}
    _update_metrics(str(tmp_path), tau_row)
    _update_metrics(str(tmp_path), {"dataset": "humaneval", "tau": 1.1, "command": "c"})
    bench_row = {"dataset": "gsm8k:test", "tau": 1.7, "command": "hf-d3d bench ..."}
    speed = {"speedup": 1.2, "speedup_command": "hf-d3d bench ..."}
    _update_metrics(str(tmp_path), bench_row, speed)
    rows = json.loads((tmp_path / "d3d_metrics.json").read_text())["rows"]
    # the bench adds its speedup to the row measured on the same weights; eval-tau's tau and command stay
    assert rows[0] == {**tau_row, "weights_sha256": first, **speed}
    _update_metrics(str(tmp_path), {"dataset": "gsm8k:test", "tau": 1.9, "command": "again"})
    rows = json.loads((tmp_path / "d3d_metrics.json").read_text())["rows"]
    assert rows[1] == {"dataset": "gsm8k:test", "tau": 1.9, "command": "again", "weights_sha256": first, **speed}

    (tmp_path / "model.safetensors").write_bytes(b"weights two")  # new weights copied over the measured ones
    with pytest.raises(ValueError, match="changed while it was measured"):  # a measurement that began on the old
        _update_metrics(str(tmp_path), {"dataset": "gsm8k:test", "tau": 1.95, "command": "c"}, measured=first)
    _update_metrics(str(tmp_path), {"dataset": "gsm8k:test", "tau": 2.0, "command": "new"})
    rows = json.loads((tmp_path / "d3d_metrics.json").read_text())["rows"]
    assert [r["dataset"] for r in rows] == ["humaneval", "gsm8k:test"]
    assert "speedup" not in rows[1]  # measured for the older weights
    _update_metrics(str(tmp_path), {"dataset": "humaneval", "tau": 1.4, "command": "hf-d3d bench"}, {"speedup": 1.05})
    rows = json.loads((tmp_path / "d3d_metrics.json").read_text())["rows"]
    # the old weights' tau is not kept beside a speedup of the new ones: the bench's row replaces it whole
    assert rows[-1] == {"dataset": "humaneval", "tau": 1.4, "command": "hf-d3d bench", "speedup": 1.05,
                        "weights_sha256": weights_sha256(tmp_path)}  # fmt: skip


def test_publishing_refuses_rows_measured_on_other_weights(checkpoint):
    from hf_d3d.cli import _update_metrics
    from hf_d3d.publish import load_metrics

    metrics = json.loads((checkpoint / "d3d_metrics.json").read_text())
    del metrics["rows"][0]["weights_sha256"]  # a row written before rows recorded it
    (checkpoint / "d3d_metrics.json").write_text(json.dumps(metrics))
    with pytest.warns(UserWarning, match="do not record which weights"):
        load_metrics(checkpoint)
    _update_metrics(str(checkpoint), {"dataset": "humaneval", "tau": 1.5, "command": "hf-d3d eval-tau ..."})
    rows = json.loads((checkpoint / "d3d_metrics.json").read_text())["rows"]
    assert rows[-1]["weights_sha256"] == weights_sha256(checkpoint) is not None
    with open(checkpoint / "model.safetensors", "ab") as f:  # weights changed after they were measured
        f.write(b" ")
    with pytest.raises(PublishError, match="the rows for humaneval were measured on other weights"):
        load_metrics(checkpoint)


def test_concurrent_metric_writes_keep_every_row(tmp_path):
    """Two measurements of one drafter at once (the docs run two eval-tau processes side by side)."""
    import threading

    from hf_d3d.cli import _update_metrics

    def write(name):
        for i in range(15):
            _update_metrics(str(tmp_path), {"dataset": f"{name}{i}", "tau": 1.0, "command": "c"})

    threads = [threading.Thread(target=write, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = json.loads((tmp_path / "d3d_metrics.json").read_text())["rows"]
    assert sorted(r["dataset"] for r in rows) == sorted(f"{n}{i}" for n in "ab" for i in range(15))


def test_space_asks_for_the_transformers_versions_the_package_supports():
    """The Space installs its own requirements (hf_d3d/ copied beside app.py until hf-d3d is on PyPI): a range
    wider than the package's would build a Space on a transformers the suite never ran."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (package,) = [Requirement(d) for d in deps if Requirement(d).name == "transformers"]
    lines = (ROOT / "examples/space/requirements.txt").read_text().splitlines()
    (space,) = [Requirement(line) for line in lines if line.startswith("transformers")]
    assert space.specifier == package.specifier


def test_space_pins_the_torch_the_suite_runs_on():
    """An unpinned torch on a CPU Space pulls the multi-GB CUDA build and a version the suite never ran."""
    lines = (ROOT / "examples/space/requirements.txt").read_text().splitlines()
    (space,) = [Requirement(line) for line in lines if line.startswith("torch")]
    (pinned,) = re.findall(r"pip install -q (torch==[\d.]+)", (ROOT / "Makefile").read_text())
    assert str(space.specifier) == pinned.removeprefix("torch")
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
