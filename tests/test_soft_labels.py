"""Soft labels for a drafter built on the target itself: the target's next-token distribution, read off the frozen
context rows of the training forward, as a KL term beside each slot's cross-entropy."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EOS, FAMILIES, tiny_target
from hf_d3d import D3DDrafterModel
from hf_d3d.train.objective import IGNORE, d3d_loss, make_batch, teacher_rows
from hf_d3d.train.trainer import TrainConfig, check_teacher, train

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}


def _adapted(family: str, seed: int = 0) -> D3DDrafterModel:
    """The target converted to a drafter, its block adapters moved off zero (a partly trained drafter)."""
    torch.manual_seed(3)
    drafter = D3DDrafterModel.from_pretrained_lm(TARGETS[family], block_size=4, block_adapter_rank=4).float()
    for name, p in drafter.named_parameters():
        p.requires_grad_("block_adapters" in name)
        if "block_adapters" in name:
            p.data.normal_(std=0.3, generator=torch.Generator().manual_seed(seed))
    return drafter


def _records(n: int = 3) -> list[dict]:
    return [
        {"prompt_ids": [5, 6, 7 + i], "response_ids": [8 + i, 9 + i % 3, 10, 11, 12, 13, EOS][: 4 + i]}
        for i in range(n)
    ]  # lengths differ, so the context is padded


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 9)), min_size=1, max_size=4),
    num_blocks=st.integers(1, 5),
    block=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_teacher_row_predicts_exactly_the_token_of_its_slot(lengths, num_blocks, block, seed):
    records = [
        {"prompt_ids": list(range(3, 3 + p)), "response_ids": list(range(20 + i, 20 + i + r))}
        for i, (p, r) in enumerate(lengths)
    ]
    batch = make_batch(records, block, num_blocks, 0, 1, torch.Generator().manual_seed(seed), max_ar_positions=0)
    n = batch.layout.num_context
    is_labelled_slot = batch.layout.is_slot & (batch.labels != IGNORE)
    teacher_row = teacher_rows(batch)
    assert torch.equal(teacher_row >= 0, is_labelled_slot)
    b, t = is_labelled_slot.nonzero(as_tuple=True)
    rows = teacher_row[b, t]
    assert (rows < n).all() and (rows >= 0).all()
    # Context row r predicts the token at r + 1: the slot's own label.
    assert torch.equal(batch.input_ids[b, rows + 1], batch.labels[b, t])


@settings(max_examples=10, deadline=None)
@given(family=FAMILIES, temperature=st.sampled_from([1.0, 2.0]), seed=st.integers(0, 2**16))
def test_soft_labels_are_the_targets_own_distribution(family, temperature, seed):
    """The KD term equals KL(target's next-token distribution || slot's), computed here from the target itself."""
    drafter, target = _adapted(family, seed), TARGETS[family]
    batch = make_batch(_records(), 4, 3, 0, 0, torch.Generator().manual_seed(seed), max_ar_positions=0)
    loss, metrics = d3d_loss(drafter, batch, frozen_context=True, kd_weight=0.5, kd_temperature=temperature)
    plain_loss, plain = d3d_loss(drafter, batch, frozen_context=True)
    (loss - plain_loss).backward()  # the KD term alone
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    torch.testing.assert_close(metrics["denoise"], plain["denoise"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.item(), plain_loss.item() + 0.5 * metrics["kd"], rtol=1e-5, atol=1e-6)

    with torch.no_grad():
        n = batch.layout.num_context
        teacher = target(batch.input_ids[:, :n]).logits.float()
        student = drafter(batch.input_ids, layout=batch.layout, use_cache=False).logits.float()
    b, t = (batch.layout.is_slot & (batch.labels != IGNORE)).nonzero(as_tuple=True)
    rows = batch.layout.anchors[b, t] + batch.slot_index[b, t]  # slot j predicts the token after anchor + j
    p_log = F.log_softmax(teacher[b, rows] / temperature, -1)
    q_log = F.log_softmax(student[b, t] / temperature, -1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    weights = 0.8 ** batch.slot_index[b, t].float()
    expected = (kl * weights).sum() / weights.sum() * temperature**2
    torch.testing.assert_close(metrics["kd"], expected.item(), rtol=1e-4, atol=1e-5)
    assert metrics["kd"] > 1e-3  # the adapters moved the slots off the target's distribution


def test_soft_labels_are_refused_where_they_would_not_be_the_targets():
    drafter = _adapted("llama")
    batch = make_batch(_records(), 4, 2, 0, 0, torch.Generator().manual_seed(0), max_ar_positions=0)
    with pytest.raises(ValueError, match="frozen_context"):  # the context rows would be the trained drafter's
        d3d_loss(drafter, batch, kd_weight=1.0)
    with pytest.raises(ValueError, match="adapters_only"):
        TrainConfig(kd_weight=1.0)
    with pytest.raises(ValueError, match="kd_temperature"):
        TrainConfig(kd_weight=1.0, kd_temperature=0.0, adapters_only=True)
    with pytest.raises(ValueError, match="num_blocks"):
        TrainConfig(kd_weight=1.0, adapters_only=True, num_blocks=0)
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    check_teacher(drafter, TARGETS["llama"], ids)
    check_teacher(drafter, copy.deepcopy(TARGETS["llama"]).to(torch.bfloat16), ids)  # bf16 rounding is no reason
    with pytest.raises(ValueError, match="built on the target itself"):  # the target's own layers, not all of them
        check_teacher(
            D3DDrafterModel.from_target(TARGETS["llama"], num_hidden_layers=2, block_size=4), TARGETS["llama"], ids
        )
    with pytest.raises(ValueError, match="built on the target itself"):  # another LM's distribution
        check_teacher(drafter, TARGETS["qwen3"], ids)


def test_training_with_soft_labels_logs_them_and_stays_lossless(tmp_path):
    target = TARGETS["qwen3"]
    records = [{"prompt_ids": [5, 6, 7 + i], "response_ids": [8 + i, 9, 10, 11, 12, 13, EOS]} for i in range(8)]
    cfg = TrainConfig(
        max_steps=2, batch_size=4, lr=1e-2, warmup_steps=1, eval_every=100, adapters_only=True, kd_weight=1.0
    )
    with pytest.raises(ValueError, match="needs the target"):
        train(_adapted("qwen3"), records, tmp_path / "no_target", cfg)
    with pytest.raises(ValueError, match="built on the target itself"):
        train(_adapted("qwen3"), records, tmp_path / "other", cfg, target=TARGETS["llama"])
    assert not (tmp_path / "other" / "checkpoint").exists()  # refused before any step
    trained = D3DDrafterModel.from_pretrained(train(_adapted("qwen3"), records, tmp_path / "run", cfg, target=target))
    log = json.loads((tmp_path / "run" / "final" / "training_log.json").read_text())["log"]
    assert all(row["kd"] > 0 for row in log) and log[0]["loss"] > log[0]["denoise"]
    x = torch.tensor([[7, 8, 9, 10, 11, 12]])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(target.generate(x, assistant_model=trained, **kw), target.generate(x, **kw))
