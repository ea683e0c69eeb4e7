"""Pruning: the provably useless layer goes first, and the smaller checkpoint equals the skip-layer model."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from test_training import ToyTokenizer
from transformers import AutoModelForCausalLM

from conftest import make_drafter, tiny_target
from hf_d3d.evaluate import measure_tau
from hf_d3d.modeling.modeling_d3d import D3DDrafterModel
from hf_d3d.prune import drop_layers, insert_layers, make_healer, prune, teacher_forced_judge
from hf_d3d.train.distill import DistillConfig, distill, load_records
from hf_d3d.train.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-layer drafter trained on a tiny target, whose middle layer is frozen at zero output (an identity)."""
    target = tiny_target("llama", seed=11)
    prompts = [" ".join(str(4 + (i * 5 + j * 11) % 90) for j in range(4 + i % 5)) for i in range(16)]
    data_dir = tmp_path_factory.mktemp("data")
    distill(target, ToyTokenizer(), prompts, data_dir, DistillConfig(max_new_tokens=24, batch_size=8))
    records = load_records(data_dir)
    drafter = make_drafter(target, block_size=4, layers=3)
    useless = drafter.model.layers[1]
    with torch.no_grad():
        useless.self_attn.o_proj.weight.zero_()
        useless.mlp.down_proj.weight.zero_()
    for p in useless.parameters():
        p.requires_grad_(False)  # stays an identity: its residual contributions are exactly zero
    cfg = TrainConfig(max_steps=200, batch_size=8, lr=3e-3, warmup_steps=10, save_every=1000, eval_every=1000)
    final = train(drafter, records, tmp_path_factory.mktemp("run"), cfg)
    drafter = type(drafter).from_pretrained(final)
    assert not drafter.model.layers[1].mlp.down_proj.weight.any()
    return target, drafter, [r["prompt_ids"] for r in records[:8]]


def test_prune_removes_the_useless_layer_first(trained, tmp_path):
    target, drafter, prompts = trained
    report = prune(target, drafter, prompts, tmp_path, retention=0.99, max_new_tokens=24)
    first = report["steps"][1]
    assert first["removed"] == 1 and report["healed"] is False
    assert first["tau"] == report["base_tau"]  # removing an identity layer changes nothing
    assert report["base_tau"] > 1.5  # the drafter is good enough for the comparison to mean something
    others = {k: v for k, v in first["candidates"].items() if k != "1"}
    assert all(v <= first["tau"] for v in others.values())
    saved = json.loads((tmp_path / "prune_report.json").read_text())
    assert saved["removed_layers"][0] == 1 and (tmp_path / "prune_tau.png").stat().st_size > 1000
    assert saved["kept_target_layers"] == [
        drafter.config.target_layer_ids[i] for i in range(3) if i not in saved["removed_layers"]
    ]


def test_prune_resumes_from_its_state(trained, tmp_path):
    target, drafter, prompts = trained
    report = prune(target, drafter, prompts, tmp_path, target_depth=2, max_new_tokens=24)
    state = json.loads((tmp_path / "prune_state.json").read_text())
    # measured on the pruned drafter since (eval-tau --write-metrics, calibrate --write): a rerun keeps it
    (tmp_path / "model" / "d3d_metrics.json").write_text('{"rows": []}')
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "round_cost": {"cpu": [1.1, 1.2]}}))

    def judged_again(model, skip):
        pytest.fail("a finished step was judged again")

    again = prune(target, drafter, prompts, tmp_path, target_depth=2, max_new_tokens=24, judge=judged_again)
    assert again["steps"] == report["steps"] == state["steps"]
    assert (tmp_path / "model" / "d3d_metrics.json").read_text() == '{"rows": []}'
    assert D3DDrafterModel.from_pretrained(tmp_path / "model").config.round_cost == {"cpu": [1.1, 1.2]}
    # but not the unpruned drafter's own costs, which older versions copied in
    drafter.config.round_cost = {"cpu": [1.1, 1.2]}
    try:
        prune(target, drafter, prompts, tmp_path, target_depth=2, max_new_tokens=24)
    finally:
        drafter.config.round_cost = None
    assert D3DDrafterModel.from_pretrained(tmp_path / "model").config.round_cost is None


def test_a_saved_pruning_is_resumed_only_for_its_drafter_and_settings(trained, heal_records, tmp_path):
    """Rerunning the recipe after retraining the drafter, or with another depth, used to replay the old run's
    removals and report; and a holdout made of calibration prompts is no holdout."""
    target, drafter, prompts = trained
    prune(target, drafter, prompts, tmp_path, retention=0.99, max_new_tokens=24)
    retrained = copy.deepcopy(drafter)
    with torch.no_grad():
        retrained.model.layers[0].mlp.up_proj.weight.mul_(1.1)
    with pytest.raises(ValueError, match="another drafter or with other settings \\(drafter\\)"):
        prune(target, retrained, prompts, tmp_path, retention=0.99, max_new_tokens=24)
    with pytest.raises(ValueError, match="target_depth"):
        prune(target, drafter, prompts, tmp_path, retention=0.99, target_depth=2, max_new_tokens=24)
    with pytest.raises(ValueError, match="holdout prompts are calibration prompts"):
        prune(target, drafter, prompts, tmp_path / "b", max_new_tokens=24, holdout_ids=prompts[:2])
    assert not (tmp_path / "b").exists()
    # the judge's answers are part of the run: steps judged on other answers are not mixed in
    prune(target, drafter, [], tmp_path / "c", target_depth=2, judge=teacher_forced_judge(heal_records[:4]))
    with pytest.raises(ValueError, match=r"other settings \(judge_data\)"):
        prune(target, drafter, [], tmp_path / "c", target_depth=2, judge=teacher_forced_judge(heal_records[4:8]))


def test_pruned_checkpoint_equals_skip_layer_model(trained, tmp_path, monkeypatch):
    target, drafter, prompts = trained
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    drop_layers(drafter, [2]).save_pretrained(tmp_path / "pruned")
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True)
    assert pruned.config.num_hidden_layers == 2
    assert pruned.config.target_layer_ids == drafter.config.target_layer_ids[:2]
    drafter.model.skip_layers = {2}
    try:
        x = torch.tensor([prompts[0]])
        torch.testing.assert_close(pruned(x).logits, drafter(x).logits)
        tau_skip = measure_tau(target, drafter, prompts, 24)
        runs_skip = [drafter.last_stats.acceptance_lengths]
    finally:
        drafter.model.skip_layers = set()
    tau_pruned = measure_tau(target, pruned, prompts, 24)
    assert tau_pruned == tau_skip and [pruned.last_stats.acceptance_lengths] == runs_skip


@pytest.fixture(scope="module")
def heal_records(tmp_path_factory):
    target = tiny_target("llama", seed=11)
    prompts = [" ".join(str(4 + (i * 7 + j * 3) % 90) for j in range(4 + i % 4)) for i in range(16)]
    data_dir = tmp_path_factory.mktemp("heal-data")
    distill(target, ToyTokenizer(), prompts, data_dir, DistillConfig(max_new_tokens=24, batch_size=8))
    return load_records(data_dir)


def test_a_drafter_with_block_adapters_heals_its_adapters_alone(heal_records, tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = tiny_target("llama", seed=11)
    drafter = D3DDrafterModel.from_pretrained_lm(lm, block_size=4, block_adapter_rank=4, block_adapter_layers=[1, 2])
    # a base LM on the Hub that this machine cannot reach: the heal must not need it
    drafter.config.base_model = "org/unreachable-base"
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    cfg = TrainConfig(max_steps=6, batch_size=8, lr=3e-3, warmup_steps=1, save_every=1000)
    make_healer(heal_records, tmp_path, cfg)(drafter, [0])  # layer 0 gone; layers 1, 2 healed in place
    with safe_open(tmp_path / "heal-1" / "final" / "model.safetensors", "pt") as f:
        assert all("block_adapters" in k or k == "model.mask_embedding" for k in f.keys())  # stored: adapters only
    changed = {k for k, v in drafter.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all("block_adapters" in k for k in changed), sorted(changed)


def _layer(model, i):
    return {k: v.clone() for k, v in model.model.layers[i].state_dict().items()}


def test_healing_trains_the_smaller_drafter_and_resumes_without_retraining(
    trained, heal_records, tmp_path, monkeypatch
):
    target, drafter, prompts = trained
    cfg = TrainConfig(max_steps=20, batch_size=8, lr=3e-3, warmup_steps=2, save_every=1000)
    original = {k: v.clone() for k, v in drafter.state_dict().items()}
    healed = copy.deepcopy(drafter)
    holdout = [ids[::-1] for ids in prompts[:4]]  # prompts the pruning never sees
    report = prune(
        target,
        healed,
        prompts,
        tmp_path,
        target_depth=2,
        max_new_tokens=24,
        heal=make_healer(heal_records, tmp_path, cfg),
        holdout_ids=holdout,
    )
    step = report["steps"][1]
    assert step["accepted"] and "healed_tau" in step and report["final_tau"] == step["healed_tau"]
    assert report["healed"] is True
    # "before" is the drafter as it was given, not the one the heals rewrote in place
    assert report["holdout"]["tau_before"] == measure_tau(target, drafter, holdout, 24)["tau"]
    removed = step["removed"]
    keep = [i for i in range(3) if i != removed]
    # The heal trained a 2-layer copy; its layers are written back into the kept layers, which have moved.
    run = D3DDrafterModel.from_pretrained(tmp_path / "heal-1" / "final")
    assert run.config.num_hidden_layers == 2
    for small, big in zip(range(2), keep):
        for name, value in _layer(run, small).items():
            torch.testing.assert_close(healed.model.layers[big].state_dict()[name], value)
    moved = any(not torch.equal(v, original[k]) for k, v in healed.state_dict().items() if k.startswith("model.layers"))
    assert moved
    # The written checkpoint is the healed smaller drafter, and its tau is the one reported.
    pruned = D3DDrafterModel.from_pretrained(tmp_path / "model")
    torch.testing.assert_close(pruned.state_dict(), run.state_dict())
    assert measure_tau(target, pruned, prompts, 24)["tau"] == step["healed_tau"]

    # Resuming reloads the finished heal instead of training again.
    import hf_d3d.prune as prune_module

    monkeypatch.setattr(prune_module, "train", lambda *a, **k: pytest.fail("a finished heal was retrained"))
    again = prune(
        target,
        copy.deepcopy(drafter),
        prompts,
        tmp_path,
        target_depth=2,
        max_new_tokens=24,
        heal=make_healer(heal_records, tmp_path, cfg),
    )
    assert again["steps"] == report["steps"]
    torch.testing.assert_close(D3DDrafterModel.from_pretrained(tmp_path / "model").state_dict(), run.state_dict())
    # a heal of other length or data would reuse heal-1 as if it were its own: refused
    for other in (
        make_healer(heal_records, tmp_path, replace(cfg, max_steps=40)),
        make_healer(heal_records[1:], tmp_path, cfg),
    ):
        with pytest.raises(ValueError, match=r"other settings \(heal\)"):
            prune(target, copy.deepcopy(drafter), prompts, tmp_path, target_depth=2, max_new_tokens=24, heal=other)


def test_refused_healed_removal_leaves_the_unhealed_drafter(trained, heal_records, tmp_path):
    target, drafter, prompts = trained
    cfg = TrainConfig(max_steps=5, batch_size=8, lr=3e-3, warmup_steps=1, save_every=1000)
    work = copy.deepcopy(drafter)
    report = prune(
        target, work, prompts, tmp_path, retention=1.5, max_new_tokens=24, heal=make_healer(heal_records, tmp_path, cfg)
    )  # no drafter can keep 150% of its tau
    assert report["removed_layers"] == [] and not report["steps"][1]["accepted"]
    assert "healed_tau" in report["steps"][1]
    torch.testing.assert_close(work.state_dict(), drafter.state_dict())
    torch.testing.assert_close(D3DDrafterModel.from_pretrained(tmp_path / "model").state_dict(), drafter.state_dict())


def test_prune_cli_refuses_heal_steps_without_data(tmp_path):
    from hf_d3d.cli import main

    with pytest.raises(SystemExit, match="--heal-steps and --heal-data go together"):
        main(["prune", "--drafter", str(tmp_path), "--heal-steps", "10", "--out", str(tmp_path / "out")])


def test_grown_drafter_drafts_like_the_original_and_prunes_back_to_it(trained):
    target, _, prompts = trained
    small = make_drafter(target, layers=2)  # target layers 0 and 2
    small.config.round_cost = {"cpu": [1.2, 1.4]}
    grown = insert_layers(small, target, [1])
    assert grown.config.num_hidden_layers == 3 and grown.config.target_layer_ids == [0, 1, 2]
    assert grown.config.round_cost is None  # measured for the old depth
    added = grown.model.layers[1]
    torch.testing.assert_close(added.self_attn.q_proj.weight, target.model.layers[1].self_attn.q_proj.weight)
    assert not added.self_attn.o_proj.weight.any() and not added.mlp.down_proj.weight.any()
    x = torch.tensor([prompts[0]])
    torch.testing.assert_close(grown(x).logits, small(x).logits)
    small.config.round_cost = None
    assert measure_tau(target, grown, prompts, 24) == measure_tau(target, small, prompts, 24)
    torch.testing.assert_close(drop_layers(grown, [1]).state_dict(), small.state_dict())
    grown.config.round_cost = {"cpu": [1.2, 1.4]}
    assert drop_layers(grown, [1]).config.round_cost is None  # measured for the old depth
    assert drop_layers(grown, []).config.round_cost == {"cpu": [1.2, 1.4]}  # nothing removed: still its own
    grown.train()
    grown(x).logits.float().logsumexp(-1).sum().backward()
    assert added.self_attn.o_proj.weight.grad.abs().sum() > 0  # training can move the identity
    assert added.mlp.down_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("ids", [[0], [3], []])
def test_grow_refuses_layers_it_cannot_add(trained, ids):
    target, _, _ = trained
    with pytest.raises(ValueError, match="layer_ids"):
        insert_layers(make_drafter(target, layers=2), target, ids)


def test_teacher_forced_tau_is_exact_where_it_can_be(trained, heal_records, tmp_path):
    """On the target's own greedy answers, the target converted whole with one-slot blocks is always right (tau 2
    exactly); with longer blocks the estimate ranks drafters as measured tau does, and the judge prunes."""
    from hf_d3d.evaluate import teacher_forced_tau
    from hf_d3d.prune import teacher_forced_judge

    target, drafter, prompts = trained
    one = D3DDrafterModel.from_pretrained_lm(target, block_size=1)
    assert teacher_forced_tau(one, heal_records) == 2.0
    whole = D3DDrafterModel.from_pretrained_lm(target, block_size=4)
    random = D3DDrafterModel.from_target(target, num_hidden_layers=1, block_size=4)
    estimated = [teacher_forced_tau(m, heal_records) for m in (random, drafter, whole)]
    measured = [measure_tau(target, m, prompts, 24)["tau"] for m in (random, drafter, whole)]
    assert estimated[0] < estimated[2] and measured[0] < measured[2]
    assert 1.0 <= min(estimated) and max(estimated) <= 5.0

    judge = teacher_forced_judge(heal_records)
    assert judge(drafter, {1}) == judge(drafter, set())  # the identity layer changes nothing
    report = prune(target, drafter, [], tmp_path, target_depth=2, judge=judge, holdout_ids=prompts[:4])
    assert report["judge"].startswith("teacher-forced")
    assert report["steps"][1]["tau"] >= report["base_tau"]  # at least as good as removing the identity layer
    assert report["holdout"]["tau_before"] == measure_tau(target, drafter, prompts[:4], 64)["tau"]
    pruned = D3DDrafterModel.from_pretrained(tmp_path / "model")
    assert report["holdout"]["tau_after"] == measure_tau(target, pruned, prompts[:4], 64)["tau"]
