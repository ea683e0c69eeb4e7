"""A whole-LM drafter saved without its base LM's weights: small on disk, whole again at load, same drafts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import tiny_target
from hf_d3d import D3DDrafterModel, speculative


def _adapter_drafter(family: str, base_dir) -> tuple[torch.nn.Module, D3DDrafterModel]:
    lm = tiny_target(family)
    lm.save_pretrained(base_dir)
    lm = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    drafter = D3DDrafterModel.from_pretrained_lm(lm, block_size=4, block_adapter_rank=4, block_adapter_layers=[1, 2])
    torch.manual_seed(0)
    with torch.no_grad():  # stand-in for training: the adapters and the mask vector change, the base does not
        for name, p in drafter.named_parameters():
            if "block_adapters" in name or name == "model.mask_embedding":
                p.add_(torch.randn_like(p) * 0.5)
    return lm, drafter


def test_a_base_from_the_hub_is_pinned_to_its_commit():
    """A drafter whose adapters were trained over one commit of a Hub LM fetches that commit, not a later one."""
    lm = tiny_target("llama")
    lm.name_or_path, lm.config._commit_hash = "org/base-lm", "0123456789abcdef0123456789abcdef01234567"
    pinned = D3DDrafterModel.from_pretrained_lm(lm, block_size=4)
    assert (pinned.config.base_model, pinned.config.base_model_revision) == ("org/base-lm", lm.config._commit_hash)
    other = D3DDrafterModel.from_pretrained_lm(lm, block_size=4, base_model="org/elsewhere")
    assert other.config.base_model_revision is None  # lm's commit says nothing about another repository
    lm.config._commit_hash = None  # a local folder
    assert D3DDrafterModel.from_pretrained_lm(lm, block_size=4).config.base_model_revision is None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_saved_without_base_loads_whole_and_drafts_the_same(tmp_path, family):
    lm, drafter = _adapter_drafter(family, tmp_path / "base")
    assert drafter.config.base_model == str(tmp_path / "base")
    drafter.save_pretrained(tmp_path / "full")
    drafter.save_pretrained(tmp_path / "small", omit_base_weights=True)
    with safe_open(tmp_path / "small" / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    assert stored and all("block_adapters" in k or k == "model.mask_embedding" for k in stored), stored
    small = (tmp_path / "small" / "model.safetensors").stat().st_size
    assert small < (tmp_path / "full" / "model.safetensors").stat().st_size / 3

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "small", trust_remote_code=True).eval()
    mine, theirs = drafter.state_dict(), loaded.state_dict()
    assert set(mine) == set(theirs)
    for name, tensor in mine.items():
        torch.testing.assert_close(theirs[name], tensor, rtol=0, atol=0, msg=name)

    prompt = torch.tensor([[5, 9, 17, 4, 33, 8]])
    plain = lm.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    out = speculative.speculative_generate(lm, loaded, prompt, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(out, plain)


def test_other_base_weights_warn_and_a_missing_base_is_a_clear_error(tmp_path, monkeypatch):
    _, drafter = _adapter_drafter("llama", tmp_path / "base")
    drafter.save_pretrained(tmp_path / "small", omit_base_weights=True)
    tiny_target("llama", seed=7).save_pretrained(tmp_path / "other")  # same shapes, other weights
    with pytest.warns(UserWarning, match="other weights"):
        D3DDrafterModel.from_pretrained(tmp_path / "small", base_model=str(tmp_path / "other"))
    with pytest.warns(UserWarning, match="other weights"):  # the Auto path hands base_model over inside the config
        AutoModelForCausalLM.from_pretrained(
            tmp_path / "small", trust_remote_code=True, base_model=str(tmp_path / "other")
        )
    with pytest.raises(OSError, match="base LM"):
        D3DDrafterModel.from_pretrained(tmp_path / "small", base_model=str(tmp_path / "nowhere"))
    pickled = tmp_path / "pickled"  # a base with pickled weights only is refused, never unpickled
    tiny_target("llama").config.save_pretrained(pickled)
    torch.save(tiny_target("llama").state_dict(), pickled / "pytorch_model.bin")
    with monkeypatch.context() as m:
        m.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
        with pytest.raises(OSError, match="base LM.*safetensors"):
            D3DDrafterModel.from_pretrained(tmp_path / "small", base_model=str(pickled))
    tiny_target("llama", layers=2).save_pretrained(tmp_path / "shallow")  # fewer layers than the drafter has
    with pytest.raises(ValueError, match="does not match this drafter"):
        D3DDrafterModel.from_pretrained(tmp_path / "small", base_model=str(tmp_path / "shallow"))


def test_a_drafter_in_a_subfolder_fetches_its_base_and_a_base_given_at_load_is_not_saved(tmp_path):
    """A drafter stored without its base inside a folder of a bigger repo (``subfolder=``) loads whole; a
    ``base_model=`` passed at load says where to fetch the base from, and a later save still names the original."""
    lm, drafter = _adapter_drafter("llama", tmp_path / "base")
    drafter.config.base_model = "org/base-lm"  # a Hub id, unreachable here: the base comes from the local copy
    drafter.save_pretrained(tmp_path / "repo" / "drafter", omit_base_weights=True)
    local = str(tmp_path / "base")
    loaded = D3DDrafterModel.from_pretrained(tmp_path / "repo", subfolder="drafter", base_model=local)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    # (transformers looks for remote code at the repo's top, not in the subfolder: the Auto path reads the folder)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "repo" / "drafter", trust_remote_code=True, base_model=local)
    for model in (loaded, auto):
        assert model.config.base_model == "org/base-lm"
        model.save_pretrained(tmp_path / "again", omit_base_weights=True)
        assert json.loads((tmp_path / "again" / "config.json").read_text())["base_model"] == "org/base-lm"


@pytest.mark.parametrize("damage", [b"not a safetensors file", b"\x10\x00\x00\x00\x00\x00\x00\x00{broken json}!!", b""])
def test_a_corrupt_weights_file_of_a_drafter_with_a_base_is_refused_clearly(tmp_path, damage):
    _, drafter = _adapter_drafter("llama", tmp_path / "base")
    drafter.save_pretrained(tmp_path / "small", omit_base_weights=True)
    (tmp_path / "small" / "model.safetensors").write_bytes(damage)
    with pytest.raises(ValueError, match="not a safetensors file"):
        D3DDrafterModel.from_pretrained(tmp_path / "small")


def test_omitting_needs_a_base_and_a_stored_tensor_missing_is_refused(tmp_path):
    _, drafter = _adapter_drafter("llama", tmp_path / "base")
    drafter.config.base_model = None
    with pytest.raises(ValueError, match="base_model"):
        drafter.save_pretrained(tmp_path / "x", omit_base_weights=True)
    drafter.config.base_model = str(tmp_path / "base")
    drafter.save_pretrained(tmp_path / "small", omit_base_weights=True)
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    config["block_adapter_layers"] = [0, 1, 2]  # an adapter the checkpoint does not hold is not a base weight
    (tmp_path / "small" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match its config"):
        D3DDrafterModel.from_pretrained(tmp_path / "small")


def test_a_checkpoint_without_a_checksum_still_refuses_to_save_a_changed_base_away(tmp_path):
    """Checkpoints made before checksums were recorded (the shipped -whole one): the base fetched at load stands in."""
    _, drafter = _adapter_drafter("llama", tmp_path / "base")
    drafter.config.base_model_checksum = None
    drafter.save_pretrained(tmp_path / "small", omit_base_weights=True)
    loaded = D3DDrafterModel.from_pretrained(tmp_path / "small", base_model_revision="other")
    assert loaded.config.base_model_checksum is None and loaded.base_unchanged()
    assert loaded.config.base_model_revision is None  # a one-off override is not what a save records
    with torch.no_grad():
        loaded.model.layers[0].mlp.down_proj.weight.data.mul_(1.5)
    with pytest.raises(ValueError, match="base weights changed"):
        loaded.save_pretrained(tmp_path / "again", omit_base_weights=True)


def test_a_changed_base_is_not_saved_away(tmp_path):
    from hf_d3d.prune import prune
    from hf_d3d.train.trainer import TrainConfig, save_final

    _, drafter = _adapter_drafter("llama", tmp_path / "base")
    assert drafter.base_unchanged()
    drafter.save_pretrained(tmp_path / "bf16", omit_base_weights=True)  # a bf16 copy's rounding is no change
    assert D3DDrafterModel.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16).base_unchanged()
    with torch.no_grad():  # a full fine-tune moved the base: its checkpoint must keep those weights
        drafter.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    assert not drafter.base_unchanged()
    with pytest.raises(ValueError, match="base weights changed"):
        drafter.save_pretrained(tmp_path / "small", omit_base_weights=True)
    assert not (tmp_path / "small" / "model.safetensors").exists()
    moved = drafter.model.layers[0].mlp.down_proj.weight
    # adapters-only training and an unhealed pruning of such a drafter store it whole, as it is
    save_final(drafter, tmp_path / "trained", TrainConfig(adapters_only=True), [])
    loaded = D3DDrafterModel.from_pretrained(tmp_path / "trained")
    assert torch.equal(loaded.model.layers[0].mlp.down_proj.weight, moved)
    prune(None, drafter, [[5, 6]], tmp_path / "pruned", target_depth=2, judge=lambda model, skip: 2.0 - len(skip))
    loaded = D3DDrafterModel.from_pretrained(tmp_path / "pruned" / "model")
    assert loaded.config.target_layer_ids[0] == 0 and torch.equal(loaded.model.layers[0].mlp.down_proj.weight, moved)
    # and stays marked as changed, so that a later adapters-only run on the pruned drafter keeps it whole too
    assert not loaded.base_unchanged()
    with pytest.raises(ValueError, match="base weights changed"):
        loaded.save_pretrained(tmp_path / "small", omit_base_weights=True)


def test_card_says_where_the_base_weights_come_from(tmp_path):
    from hf_d3d.publish import METRICS, PublishError, assemble

    _, drafter = _adapter_drafter("llama", tmp_path / "base")
    rows = {"base_model": "org/target", "rows": [{"dataset": "toy", "tau": 1.5, "command": "hf-d3d eval-tau ..."}]}
    drafter.save_pretrained(tmp_path / "local", omit_base_weights=True)
    (tmp_path / "local" / METRICS).write_text(json.dumps(rows))
    with pytest.raises(PublishError, match="no one else can fetch"):  # its base is a folder on this machine
        assemble(tmp_path / "local", tmp_path / "hub-local", "org/x")
    drafter.config.base_model = "org/base-lm"
    for name, omit in (("small", True), ("full", False)):
        drafter.save_pretrained(tmp_path / name, omit_base_weights=omit)
        (tmp_path / name / METRICS).write_text(json.dumps(rows))
        card = (assemble(tmp_path / name, tmp_path / f"hub-{name}", "org/x") / "README.md").read_text()
        assert ("takes every other weight from [org/base-lm]" in card) == omit
        assert "A **D3D drafter** for [org/target]" in card  # the target measured on, not the LM it came from


def test_a_pruned_whole_lm_drafter_still_fetches_its_remaining_layers(tmp_path):
    import warnings

    from hf_d3d.prune import drop_layers

    _, drafter = _adapter_drafter("llama", tmp_path / "base")
    pruned = drop_layers(drafter, [1])  # base layers 0 and 2 remain, the adapters of layer 2 with them
    assert pruned.config.target_layer_ids == [0, 2]
    pruned.save_pretrained(tmp_path / "pruned", omit_base_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checksum is the kept layers' own: no warning
        loaded = D3DDrafterModel.from_pretrained(tmp_path / "pruned")
    for name, tensor in pruned.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_adapters_only_checkpoints_hold_the_adapters_and_resume_the_same(tmp_path, monkeypatch):
    """A checkpoint of adapters-only training leaves out a base that a resume can fetch again (an 8B base would be
    GBs every --save-every steps); the resume ends where an uninterrupted run does, and refuses a base that has
    changed since. A base in a folder of this machine stays in the checkpoint, which may move to another."""
    import copy

    from test_training import train_until_first_checkpoint

    from hf_d3d.train import trainer
    from hf_d3d.train.trainer import TrainConfig, train

    lm, drafter = _adapter_drafter("llama", tmp_path / "base")
    records = [{"prompt_ids": [5, 6, 7 + i], "response_ids": [8 + i, 9, 10, 11, 12, 13, 3]} for i in range(8)]
    cfg = TrainConfig(max_steps=4, batch_size=4, lr=1e-2, warmup_steps=1, save_every=2, adapters_only=True)

    def stored(run):
        with safe_open(tmp_path / run / "checkpoint" / "model.safetensors", "pt") as f:
            return set(f.keys())

    straight = D3DDrafterModel.from_pretrained(train(copy.deepcopy(drafter), records, tmp_path / "a", cfg))
    assert "model.embed_tokens.weight" in stored("a")  # its base is a folder here
    monkeypatch.setattr(trainer, "base_refetchable", lambda *a: True)  # as for a Hub id in the cache
    train_until_first_checkpoint(monkeypatch, copy.deepcopy(drafter), records, tmp_path / "b", cfg)
    assert stored("b") and all("block_adapters" in k or k == "model.mask_embedding" for k in stored("b"))
    resumed = D3DDrafterModel.from_pretrained(train(copy.deepcopy(drafter), records, tmp_path / "b", cfg))
    for name, value in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    train_until_first_checkpoint(monkeypatch, copy.deepcopy(drafter), records, tmp_path / "c", cfg)
    with torch.no_grad():
        lm.model.layers[0].mlp.up_proj.weight.mul_(1.0001)  # the base moved on (a new revision on the Hub)
    lm.save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="other weights than the run trained over"):
        train(copy.deepcopy(drafter), records, tmp_path / "c", cfg)


def test_which_bases_a_resume_can_fetch_again(tmp_path):
    from types import SimpleNamespace

    from hf_d3d.targets import DEFAULT_TARGET
    from hf_d3d.train.trainer import TrainConfig, base_refetchable

    def drafter(base, unchanged=True):
        return SimpleNamespace(config=SimpleNamespace(base_model=base), base_unchanged=lambda: unchanged)

    adapters = TrainConfig(adapters_only=True)
    assert base_refetchable(drafter(DEFAULT_TARGET), adapters)  # embedded: every machine that installs us has it
    assert not base_refetchable(drafter(DEFAULT_TARGET), TrainConfig())  # the base trains too
    assert not base_refetchable(drafter(DEFAULT_TARGET, unchanged=False), adapters)
    assert not base_refetchable(drafter(str(tmp_path)), adapters)  # a folder of this machine
    assert not base_refetchable(drafter("org/never-downloaded"), adapters)
    assert not base_refetchable(drafter(None), adapters)
