"""The benchmark's autoregressive peer: trained with the same pipeline, exported as a plain causal LM."""

from __future__ import annotations

import pytest
import torch
from test_training import toy, toy_data  # noqa: F401  (module fixtures: a tiny target and its distillation data)
from transformers import AutoModelForCausalLM

from conftest import VOCAB, make_drafter, tiny_target
from hf_d3d.export_ar import export_autoregressive, write_autoregressive
from hf_d3d.train.objective import d3d_loss, make_batch
from hf_d3d.train.trainer import TrainConfig, train


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_export_has_the_drafters_next_token_logits_and_assists_losslessly(family):
    target = tiny_target(family)
    drafter = make_drafter(target, layers=2)
    drafter.set_draft_vocab(list(range(0, VOCAB, 2)))  # D3D-only state stays behind
    ar = export_autoregressive(drafter)
    assert type(ar).__name__ == type(target).__name__
    x = torch.tensor([[5, 9, 17, 33, 40]])
    drafter.set_draft_vocab(None)
    with torch.no_grad():
        torch.testing.assert_close(ar(x).logits, drafter(x, use_cache=False).logits, rtol=1e-4, atol=1e-4)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20)
    assert torch.equal(target.generate(x, **kw), target.generate(x, assistant_model=ar, **kw))


def test_write_autoregressive_makes_a_loadable_folder_and_never_overwrites(tmp_path):
    target = tiny_target("llama")
    drafter = make_drafter(target, layers=2)
    drafter.save_pretrained(tmp_path / "d3d")
    out = write_autoregressive(tmp_path / "d3d", tmp_path / "ar")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.num_hidden_layers == 2 and loaded.config.model_type == "llama"
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    with pytest.raises(FileExistsError):
        write_autoregressive(tmp_path / "d3d", tmp_path / "ar")


def test_skipped_layers_are_refused():
    drafter = make_drafter(tiny_target("llama"), layers=2)
    drafter.model.skip_layers = {1}
    with pytest.raises(ValueError, match="skipped layers"):
        export_autoregressive(drafter)


def test_ar_objective_trains_next_token_loss_only(toy, toy_data, tmp_path):  # noqa: F811
    target, _ = toy
    drafter = make_drafter(target, block_size=4, layers=2)
    batch = make_batch(toy_data, 4, 0, 0, 0, torch.Generator().manual_seed(0))
    assert not batch.layout.is_slot.any()  # no mask blocks: a plain causal batch
    first = d3d_loss(drafter, batch, 1.0)[1]
    assert first["denoise"] == 0.0 and first["ar"] > 0
    cfg = TrainConfig(
        max_steps=80, batch_size=6, lr=3e-3, warmup_steps=5, num_blocks=0, ar_weight=1.0, max_ar_positions=None
    )
    cfg.save_every = cfg.eval_every = 1000
    trained = type(drafter).from_pretrained(train(drafter, toy_data, tmp_path, cfg))
    assert d3d_loss(trained, batch, 1.0)[1]["ar"] < 0.5 * first["ar"]
