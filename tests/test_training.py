"""Training: loss masks, both loss terms learn on a tiny overfit run, exact resume, bad data refused."""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conftest import VOCAB, make_drafter, tiny_target
from hf_d3d import D3DDrafterModel
from hf_d3d.evaluate import measure_tau
from hf_d3d.train import trainer
from hf_d3d.train.distill import DistillConfig, chat_prompt_ids, distill, load_records, transformers_backend
from hf_d3d.train.objective import IGNORE, d3d_loss, make_batch, slots_reached
from hf_d3d.train.trainer import TrainConfig, train, validate_records


class ToyTokenizer:
    """Enough of a tokenizer for distillation on a tiny random target: prompts are space-separated ids."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = 3

    def __call__(self, text):
        return {"input_ids": [int(t) for t in text.split()]}


@pytest.fixture(scope="module")
def toy():
    target = tiny_target("llama", seed=11)
    prompts = [" ".join(str(4 + (i * 7 + j * 3) % 90) for j in range(5 + i % 4)) for i in range(12)]
    return target, prompts


@pytest.fixture(scope="module")
def toy_data(toy, tmp_path_factory):
    target, prompts = toy
    out = tmp_path_factory.mktemp("distill")
    distill(target, ToyTokenizer(), prompts, out, DistillConfig(max_new_tokens=24, batch_size=5))
    return load_records(out)


def test_distill_resumes_and_marks_completion(toy, tmp_path):
    target, prompts = toy
    cfg = DistillConfig(max_new_tokens=8, batch_size=4)
    distill(target, ToyTokenizer(), prompts[:4], tmp_path, cfg)
    first = (tmp_path / "records.jsonl").read_text()
    (tmp_path / "meta.json").unlink()  # pretend the run died after the first prompts were written
    lines = first.splitlines(keepends=True)
    (tmp_path / "records.jsonl").write_text("".join(lines[:-1]) + lines[-1].rstrip("\n"))  # killed before its "\n"
    with pytest.raises(FileNotFoundError, match="not a finished"):
        load_records(tmp_path)
    distill(target, ToyTokenizer(), prompts[:4], tmp_path, cfg)  # the record without its newline is answered again
    assert (tmp_path / "records.jsonl").read_text() == first
    (tmp_path / "meta.json").unlink()
    with open(tmp_path / "records.jsonl", "a") as f:
        f.write('{"idx": 9, "prompt_ids": [1, 2')  # and a torn last line
    with pytest.raises(FileNotFoundError, match="not a finished"):
        load_records(tmp_path)
    distill(target, ToyTokenizer(), prompts[:6], tmp_path, cfg)
    records = load_records(tmp_path)
    assert sorted(r["idx"] for r in records) == list(range(6))
    assert (tmp_path / "records.jsonl").read_text().startswith(first)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["num_records"] == 6 and meta["device"] == "cpu"  # provenance: where the answers were generated


def test_a_resumed_sampled_run_draws_what_an_uninterrupted_one_does(toy, tmp_path, monkeypatch):
    from hf_d3d.train import distill as distill_module

    target, prompts = toy
    cfg = DistillConfig(max_new_tokens=8, batch_size=2, do_sample=True, temperature=1.5, seed=5)
    whole = distill(target, ToyTokenizer(), prompts[:6], tmp_path / "whole", cfg)
    real = distill_module.transformers_backend

    def dies_after_one_batch(*args):
        run, calls = real(*args), []

        def once(batch):
            calls.append(1)
            if len(calls) > 1:
                raise Killed
            return run(batch)

        return once

    monkeypatch.setattr(distill_module, "transformers_backend", dies_after_one_batch)
    with pytest.raises(Killed):
        distill(target, ToyTokenizer(), prompts[:6], tmp_path / "cut", cfg)
    monkeypatch.setattr(distill_module, "transformers_backend", real)
    assert len((tmp_path / "cut" / "records.jsonl").read_text().splitlines()) == 2
    distill(target, ToyTokenizer(), prompts[:6], tmp_path / "cut", cfg)
    assert (tmp_path / "cut" / "records.jsonl").read_text() == (whole / "records.jsonl").read_text()


def test_a_run_cut_short_can_be_finished_as_partial(toy, tmp_path):
    target, prompts = toy
    cfg = DistillConfig(max_new_tokens=8, batch_size=2)
    with pytest.raises(FileNotFoundError, match="nothing to finish"):
        distill(target, ToyTokenizer(), prompts[:6], tmp_path / "never", cfg, finish_partial=True)
    assert not (tmp_path / "never").exists()  # nothing half-made left behind
    distill(target, ToyTokenizer(), prompts[:2], tmp_path, cfg)
    (tmp_path / "meta.json").unlink()  # as if a 6-prompt run had died after its first batch
    kept = (tmp_path / "records.jsonl").read_text()
    distill(target, ToyTokenizer(), prompts[:6], tmp_path, cfg, finish_partial=True)
    assert (tmp_path / "records.jsonl").read_text() == kept  # nothing more generated
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["partial"] is True and meta["num_prompts"] == 6 and meta["num_records"] == 2
    assert sorted(r["idx"] for r in load_records(tmp_path)) == [0, 1]
    with pytest.raises(ValueError, match="other max_new_tokens"):  # a resume with other settings: refused, kept
        distill(target, ToyTokenizer(), prompts[:6], tmp_path, DistillConfig(max_new_tokens=9, batch_size=2))
    assert json.loads((tmp_path / "meta.json").read_text())["partial"] is True
    distill(target, ToyTokenizer(), prompts[:6], tmp_path, cfg)  # called again without finish_partial: it goes on
    assert (tmp_path / "records.jsonl").read_text().startswith(kept)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["partial"] is False and meta["num_records"] == 6
    assert sorted(r["idx"] for r in load_records(tmp_path)) == list(range(6))
    full = tmp_path / "full"
    distill(target, ToyTokenizer(), prompts[:2], full, cfg)
    assert json.loads((full / "meta.json").read_text())["partial"] is False


def test_prompts_over_the_length_cap_are_left_out_and_counted(toy, tmp_path):
    target, prompts = toy
    tok = ToyTokenizer()
    lengths = [len(chat_prompt_ids(tok, p)) for p in prompts[:8]]
    cap = sorted(lengths)[3]
    cfg = DistillConfig(max_new_tokens=6, batch_size=4, max_prompt_tokens=cap)
    distill(target, tok, prompts[:8], tmp_path, cfg)
    kept = sorted(i for i, n in enumerate(lengths) if n <= cap)
    assert 0 < len(kept) < 8
    assert sorted(r["idx"] for r in load_records(tmp_path)) == kept
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["skipped_long"] == 8 - len(kept) and meta["partial"] is False and meta["max_prompt_tokens"] == cap
    assert meta["skipped_empty"] == len(kept) - len(load_records(tmp_path))  # the left-out ones are not "empty"
    (tmp_path / "meta.json").unlink()  # a resume with another cap would mix two datasets
    with pytest.raises(ValueError, match="other max_prompt_tokens"):
        distill(target, tok, prompts[:8], tmp_path, DistillConfig(max_new_tokens=6, max_prompt_tokens=cap + 1))
    with pytest.raises(ValueError, match="all 8 prompts are longer"):
        distill(target, tok, prompts[:8], tmp_path / "none", DistillConfig(max_prompt_tokens=1))
    assert not (tmp_path / "none").exists()
    with pytest.raises(ValueError, match="max_prompt_tokens must be at least 1"):
        DistillConfig(max_prompt_tokens=0)


def test_runs_from_before_the_length_cap_still_resume(toy, tmp_path):
    target, prompts = toy
    cfg = DistillConfig(max_new_tokens=6, batch_size=4)
    distill(target, ToyTokenizer(), prompts[:2], tmp_path, cfg)
    (tmp_path / "meta.json").unlink()  # as if a 4-prompt run had been interrupted
    request = json.loads((tmp_path / "request.json").read_text())
    del request["max_prompt_tokens"]  # written before the field existed: no prompt was left out
    (tmp_path / "request.json").write_text(json.dumps(request))
    distill(target, ToyTokenizer(), prompts[:4], tmp_path, cfg)
    assert sorted(r["idx"] for r in load_records(tmp_path)) == [0, 1, 2, 3]


def test_resuming_with_other_prompts_is_refused(toy, tmp_path):
    target, prompts = toy
    cfg = DistillConfig(max_new_tokens=6, batch_size=4)
    distill(target, ToyTokenizer(), prompts[:4], tmp_path, cfg)
    (tmp_path / "meta.json").unlink()  # as if interrupted
    with pytest.raises(ValueError, match="answers other prompts"):
        distill(target, ToyTokenizer(), prompts[2:6], tmp_path, cfg)  # another slice into the same folder
    with pytest.raises(ValueError, match="other max_new_tokens"):
        distill(target, ToyTokenizer(), prompts[:4], tmp_path, DistillConfig(max_new_tokens=7))
    distill(target, ToyTokenizer(), prompts[:4], tmp_path, DistillConfig(max_new_tokens=6, batch_size=3))
    assert len(load_records(tmp_path)) == 4


def test_a_finished_run_or_another_target_is_not_taken_for_this_request(toy, tmp_path):
    """A finished folder is returned only for the request it answered (a changed script used to get the old data
    back as "ready"); an interrupted run is not resumed by another model of the same tokenizer."""
    target, prompts = toy
    cfg = DistillConfig(max_new_tokens=6, batch_size=4)
    distill(target, ToyTokenizer(), prompts[:4], tmp_path, cfg)
    assert distill(target, ToyTokenizer(), prompts[:4], tmp_path, DistillConfig(max_new_tokens=6, batch_size=2))
    with pytest.raises(ValueError, match="finished run with other max_new_tokens"):
        distill(target, ToyTokenizer(), prompts[:4], tmp_path, DistillConfig(max_new_tokens=9))
    with pytest.raises(ValueError, match="finished run with other num_prompts"):
        distill(target, ToyTokenizer(), prompts[:6], tmp_path, cfg)
    (tmp_path / "meta.json").unlink()  # as if interrupted
    other = tiny_target("llama", seed=12)
    other.config.name_or_path = "org/another-model"
    with pytest.raises(ValueError, match="other target"):
        distill(other, ToyTokenizer(), prompts[:4], tmp_path, cfg)


def test_the_targets_dtype_is_part_of_the_run(toy, tmp_path):
    target, prompts = toy
    cfg = DistillConfig(max_new_tokens=6, batch_size=4)
    distill(target, ToyTokenizer(), prompts[:4], tmp_path, cfg)
    assert json.loads((tmp_path / "meta.json").read_text())["dtype"] == "float32"
    (tmp_path / "meta.json").unlink()  # as if interrupted
    with pytest.raises(ValueError, match="other dtype"):
        distill(copy.deepcopy(target).to(torch.bfloat16), ToyTokenizer(), prompts[:4], tmp_path, cfg)
    request = json.loads((tmp_path / "request.json").read_text())
    del request["dtype"]  # a folder from before the dtype was recorded: those runs were fp32
    (tmp_path / "request.json").write_text(json.dumps(request))
    distill(target, ToyTokenizer(), prompts[:4], tmp_path, cfg)
    assert len(load_records(tmp_path)) == 4


def test_several_folders_merge_without_repeats(toy, tmp_path):
    target, prompts = toy
    cfg = DistillConfig(max_new_tokens=6, batch_size=4)
    a, b = tmp_path / "a", tmp_path / "b"
    distill(target, ToyTokenizer(), prompts[:5], a, cfg)
    distill(target, ToyTokenizer(), prompts[3:8], b, cfg)  # prompts 3 and 4 are in both
    merged = load_records(a, b)
    assert [r["prompt_ids"] for r in merged] == [r["prompt_ids"] for r in load_records(a)] + [
        r["prompt_ids"] for r in load_records(b) if r["idx"] >= 2
    ]
    assert len(merged) == 8
    meta = json.loads((b / "meta.json").read_text())
    (b / "meta.json").write_text(json.dumps({**meta, "target": "/elsewhere/Other-Model"}))
    with pytest.raises(ValueError, match="Other-Model"):
        load_records(a, b)


def test_sampled_answers_join_the_greedy_ones_without_repeats(toy, tmp_path):
    target, prompts = toy
    greedy, sampled = tmp_path / "greedy", tmp_path / "sampled"
    distill(target, ToyTokenizer(), prompts[:6], greedy, DistillConfig(max_new_tokens=6, batch_size=4))
    cfg = DistillConfig(max_new_tokens=6, batch_size=4, do_sample=True, temperature=1.5, seed=3)
    distill(target, ToyTokenizer(), prompts[2:6], sampled, cfg)
    g, s = load_records(greedy), load_records(sampled)
    assert len(g) == 6 and len(s) == 4
    greedy_answer = {tuple(r["prompt_ids"]): r["response_ids"] for r in g}
    assert all(r["response_ids"] != greedy_answer[tuple(r["prompt_ids"])] for r in s)  # really other answers
    for order in ((greedy, sampled), (sampled, greedy)):  # the greedy answer is kept beside a sampled one
        assert len(load_records(*order)) == 10
    assert len(load_records(greedy, sampled, sampled, greedy)) == 10  # no answer counts twice
    assert len(load_records(greedy, greedy)) == 6


def test_vllm_backend_gives_the_transformers_records(toy, tmp_path, monkeypatch):
    """The vLLM adapter (prompt format, sampling params, outputs, EOS cut) on a stand-in engine with vLLM's API."""
    target, prompts = toy
    target.save_pretrained(tmp_path / "target")
    seen = {}

    class SamplingParams:  # vLLM's keywords, so a misspelt one fails
        def __init__(
            self,
            *,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            repetition_penalty,
            stop_token_ids,
            ignore_eos,
            detokenize,
        ):
            self.__dict__.update({k: v for k, v in locals().items() if k != "self"})

    class LLM:  # answers like vLLM's offline engine, computing with the same model through transformers
        def __init__(self, model, max_model_len):
            seen["model"], seen["max_model_len"] = model, max_model_len
            self.run = transformers_backend(type(target).from_pretrained(model), 0, cfg)

        def generate(self, requests, params, use_tqdm=True):
            seen["params"] = params.__dict__
            outs = self.run([r["prompt_token_ids"] for r in requests])
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(o))]) for o in outs]

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams))
    cfg = DistillConfig(max_new_tokens=10, batch_size=4)
    distill(target, ToyTokenizer(), prompts[:6], tmp_path / "hf", cfg)
    distill(str(tmp_path / "target"), ToyTokenizer(), prompts[:6], tmp_path / "vllm", cfg, backend="vllm")
    assert seen["model"] == str(tmp_path / "target")
    assert seen["params"]["temperature"] == 0.0 and seen["params"]["max_tokens"] == 10
    assert seen["params"]["stop_token_ids"] == [target.generation_config.eos_token_id]
    assert seen["max_model_len"] == max(len(r["prompt_ids"]) for r in load_records(tmp_path / "hf")) + 10
    assert load_records(tmp_path / "vllm") == load_records(tmp_path / "hf")
    assert json.loads((tmp_path / "vllm" / "meta.json").read_text())["backend"] == "vllm"
    with pytest.raises(TypeError, match="Hub id or folder"):
        distill(target, ToyTokenizer(), prompts[:2], tmp_path / "x", cfg, backend="vllm")
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed
    with pytest.raises(ModuleNotFoundError, match="pip install vllm"):
        distill(str(tmp_path / "target"), ToyTokenizer(), prompts[:2], tmp_path / "y", cfg, backend="vllm")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()  # nothing half-written


def test_loss_masks():
    records = [{"idx": 0, "prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11]}]
    batch = make_batch(records, block_size=3, num_blocks=2, pad_id=0, fill_id=0, generator=torch.Generator())
    width = 7
    labels, lay = batch.labels[0], batch.layout
    # AR loss on response tokens only: positions 2..5 predict tokens 3..6; the prompt and the last token carry none
    assert labels[:width].tolist() == [IGNORE, IGNORE, 8, 9, 10, 11, IGNORE]
    for b in range(2):
        start = width + 3 * b
        anchor = int(lay.anchors[0, start])
        assert 2 <= anchor <= 5  # anchored at the last prompt token or inside the response
        seq = [5, 6, 7, 8, 9, 10, 11]
        expect = [seq[anchor + 1 + j] if anchor + 1 + j < 7 else IGNORE for j in range(3)]
        assert labels[start : start + 3].tolist() == expect
        assert batch.slot_index[0, start : start + 3].tolist() == [0, 1, 2]
    mask = lay.attention_mask()[0, 0]
    assert not mask[:width, width:].any()  # context never sees block slots
    slot = width
    anchor = int(lay.anchors[0, slot])
    assert mask[slot, : anchor + 1].all() and not mask[slot, anchor + 1 : width].any()


def test_slots_reached_are_those_behind_correct_slots_of_their_own_block():
    # Three blocks: the first breaks at slot 1, the second (cut short by its sequence's end) is right, the third
    # breaks at slot 0; a wrong slot is itself reached, what follows it is not, and the next block starts afresh.
    slot_index = torch.tensor([0, 1, 2, 3, 0, 1, 0, 1, 2])
    correct = torch.tensor([1, 0, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    assert slots_reached(correct, slot_index).tolist() == [1, 1, 0, 0, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("unreached_weight", [0.0, 0.25])
def test_unreached_slots_weigh_less_in_the_denoising_loss(toy, toy_data, unreached_weight):
    target, _ = toy
    drafter = make_drafter(target, block_size=4, layers=2)
    batch = make_batch(toy_data[:3], 4, 3, 0, 0, torch.Generator().manual_seed(1))
    _, metrics = d3d_loss(drafter, batch, ar_weight=0.0, slot_decay=0.8, unreached_weight=unreached_weight)
    every = torch.ones_like(batch.labels, dtype=torch.bool)
    with torch.no_grad():
        logits = drafter(batch.input_ids, layout=batch.layout, use_cache=False, logits_to_keep=every).logits.float()
    labels, slot, index = batch.labels.flatten(), batch.layout.is_slot.flatten(), batch.slot_index.flatten()
    logits = logits.view(len(labels), -1)
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORE)
    weight = torch.zeros_like(ce)
    hit = logits.argmax(-1) == labels
    for row in torch.nonzero(slot & (labels != IGNORE)).flatten().tolist():  # each slot checks its block's slots
        j = int(index[row])
        reached = bool(hit[row - j : row].all())
        weight[row] = 0.8**j * (1.0 if reached else unreached_weight)
    full = 0.8 ** index.clamp_min(0).float() * (slot & (labels != IGNORE))
    assert (weight < full).any()  # the batch holds unreached slots, so the weighting is exercised
    denoise = (ce * weight).sum() / weight.sum()
    torch.testing.assert_close(metrics["denoise"], denoise.item(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_ar_positions", [None, 0])
def test_loss_is_the_slot_weighted_denoising_plus_the_next_token_term(toy, toy_data, max_ar_positions):
    target, _ = toy
    drafter = make_drafter(target, block_size=4, layers=2)
    batch = make_batch(toy_data[:3], 4, 3, 0, 0, torch.Generator().manual_seed(1), max_ar_positions)
    loss, metrics = d3d_loss(drafter, batch, ar_weight=0.5, slot_decay=0.8)
    # Reference from every position's logits, without the loss's selection of rows.
    every = torch.ones_like(batch.labels, dtype=torch.bool)
    with torch.no_grad():
        logits = drafter(batch.input_ids, layout=batch.layout, use_cache=False, logits_to_keep=every).logits.float()
    labels, slot = batch.labels.flatten(), batch.layout.is_slot.flatten()
    ce = torch.nn.functional.cross_entropy(logits.view(len(labels), -1), labels, reduction="none", ignore_index=IGNORE)
    weight = 0.8 ** batch.slot_index.flatten().clamp_min(0).float() * (slot & (labels != IGNORE))
    denoise = (ce * weight).sum() / weight.sum()
    has_ar = ~slot & (labels != IGNORE)
    ar = ce[has_ar].mean() if has_ar.any() else torch.tensor(0.0)
    first = slot & (labels != IGNORE) & (batch.slot_index.flatten() == 0)
    acc0 = (logits.view(len(labels), -1)[first].argmax(-1) == labels[first]).float().mean()
    torch.testing.assert_close(metrics["denoise"], denoise.item(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["loss"], (denoise + 0.5 * ar).item(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.item(), metrics["loss"], rtol=1e-6, atol=1e-6)
    assert metrics["slot0_acc"] == pytest.approx(acc0.item())
    assert ("ar" in metrics) == bool(has_ar.any())  # reported only where a next-token label exists
    if has_ar.any():
        torch.testing.assert_close(metrics["ar"], ar.item(), rtol=1e-5, atol=1e-6)
    loss.backward()  # the loss still reaches the trainable weights in both cases
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


def test_both_losses_decrease_and_tau_rises(toy, toy_data, tmp_path):
    target, _ = toy
    drafter = make_drafter(target, block_size=4, layers=2)
    before = measure_tau(target, drafter, [r["prompt_ids"] for r in toy_data[:6]], 24)["tau"]
    gen = torch.Generator().manual_seed(0)
    first = d3d_loss(drafter, make_batch(toy_data, 4, 4, 0, 0, gen), 0.5)[1]
    cfg = TrainConfig(max_steps=150, batch_size=6, lr=3e-3, warmup_steps=10, save_every=1000, eval_every=1000)
    final = train(drafter, toy_data, tmp_path, cfg)
    trained = type(drafter).from_pretrained(final)
    last = d3d_loss(trained, make_batch(toy_data, 4, 4, 0, 0, torch.Generator().manual_seed(0)), 0.5)[1]
    assert last["denoise"] < 0.5 * first["denoise"]
    assert last["ar"] < 0.5 * first["ar"]
    after = measure_tau(target, trained, [r["prompt_ids"] for r in toy_data[:6]], 24)["tau"]
    assert after > before + 0.5  # the drafter learned the target's own continuations


def test_a_bf16_checkpoint_trains_with_fp32_weights(toy, toy_data, tmp_path):
    """Our checkpoints are stored in bf16; continuing from one must not update bf16 weights in place."""
    target, _ = toy
    start = make_drafter(target, block_size=4).to(torch.bfloat16)
    cfg = TrainConfig(max_steps=3, batch_size=4, lr=1e-5, warmup_steps=0, save_every=1000, eval_every=1000)
    final = type(start).from_pretrained(train(start, toy_data, tmp_path, cfg))
    assert final.dtype == torch.float32
    before = make_drafter(target, block_size=4).to(torch.bfloat16).float().state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    moved = (final.state_dict()[name] - before[name]).abs()
    # lr 1e-5 moves a weight by ~1e-5 a step: less than half the bf16 spacing of any weight of magnitude >= 2**-6
    # (2**-13), so bf16 weights of that size could not move at all; fp32 ones nearly all do
    large = before[name].abs() >= 2**-6
    assert large.sum() > 100
    assert (moved[large] > 0).float().mean() > 0.9 and moved.max() < 1e-3


@pytest.mark.parametrize(
    "device, mixed_precision, native_bf16, warns",
    [
        ("cpu", "bf16", False, True),
        ("cpu", "bf16", True, False),
        ("cpu", "no", False, False),
        ("cuda", "bf16", False, False),
    ],
)
def test_bf16_training_on_a_cpu_that_emulates_bf16_warns(monkeypatch, device, mixed_precision, native_bf16, warns):
    """Emulated bf16 autocast makes each step ~2.5x slower than fp32: say so rather than train slowly in silence."""
    import warnings

    from hf_d3d.train import trainer

    monkeypatch.setattr(trainer, "cpu_computes_bf16", lambda: native_bf16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trainer.warn_emulated_bf16(torch.device(device), mixed_precision) is warns
    assert sum("--mixed-precision no trains faster" in str(w.message) for w in caught) == int(warns)


def test_training_checks_its_compute_type_on_its_device(toy, toy_data, tmp_path, monkeypatch):
    # A bf16 run cannot start here once another test has set accelerate's process-wide state to fp32, so the
    # call itself is what this checks.
    from hf_d3d.train import trainer

    seen = []
    monkeypatch.setattr(trainer, "warn_emulated_bf16", lambda device, mp: seen.append((device.type, mp)))
    cfg = TrainConfig(max_steps=1, batch_size=4, warmup_steps=0, save_every=1000, eval_every=1000)
    train(make_drafter(toy[0], block_size=4), toy_data, tmp_path, cfg)
    assert seen == [("cpu", "no")]


def test_final_weights_in_the_save_dtype_checkpoints_in_fp32(toy, toy_data, tmp_path):
    target, _ = toy
    cfg = TrainConfig(max_steps=2, batch_size=4, warmup_steps=0, save_every=1, eval_every=1000, save_dtype="bfloat16")
    drafter = make_drafter(target, block_size=4)
    final = train(drafter, toy_data, tmp_path, cfg)
    from safetensors import safe_open

    # Read the stored tensors: dtype="auto" loads bf16 weights in fp32 on a CPU without bf16 units.
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert drafter.dtype == torch.float32  # the trained model itself is untouched
    saved = type(drafter).from_pretrained(final, dtype=torch.bfloat16)
    torch.testing.assert_close(saved.float().state_dict(), drafter.to(torch.bfloat16).float().state_dict())
    checkpoint = type(drafter).from_pretrained(tmp_path / "checkpoint", dtype="auto")
    assert checkpoint.dtype == torch.float32


class Killed(Exception):
    pass


def train_until_first_checkpoint(monkeypatch, *args) -> None:
    """``train(*args)`` as a process that dies right after its first checkpoint is on disk."""
    real_save = trainer.save_checkpoint

    def save_then_die(*a, **kw):
        real_save(*a, **kw)
        raise Killed

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        train(*args)
    monkeypatch.setattr(trainer, "save_checkpoint", real_save)


@pytest.mark.parametrize("group_by_length", [False, True])
def test_resume_gives_the_same_state(toy, toy_data, tmp_path, monkeypatch, group_by_length):
    target, _ = toy
    cfg = TrainConfig(
        max_steps=6,
        batch_size=4,
        lr=1e-3,
        warmup_steps=2,
        save_every=3,
        eval_every=1000,
        group_by_length=group_by_length,
    )
    straight = train(make_drafter(target, block_size=4), toy_data, tmp_path / "a", cfg)

    # the process dies right after the step-3 checkpoint is on disk
    train_until_first_checkpoint(monkeypatch, make_drafter(target, block_size=4), toy_data, tmp_path / "b", cfg)
    assert not (tmp_path / "b" / "final").exists()
    resumed = train(make_drafter(target, block_size=4), toy_data, tmp_path / "b", cfg)
    a = type(make_drafter(target)).from_pretrained(straight).state_dict()
    b = type(make_drafter(target)).from_pretrained(resumed).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    # The log's wall time is the run's, summed over the resume: it never goes back at the restart.
    log = json.loads((resumed / "training_log.json").read_text())["log"]
    assert [m["step"] for m in log] == list(range(1, 7))
    elapsed = [m["elapsed_s"] for m in log]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    # a checkpoint written before the data cursor was saved is placed by its step, and resumes the same
    train_until_first_checkpoint(monkeypatch, make_drafter(target, block_size=4), toy_data, tmp_path / "c", cfg)
    state_file = tmp_path / "c" / "checkpoint" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state.pop("data_cursor")["order_per_step"] == 4
    state_file.write_text(json.dumps(state))
    old = type(make_drafter(target)).from_pretrained(
        train(make_drafter(target, block_size=4), toy_data, tmp_path / "c", cfg)
    )
    for name, value in old.state_dict().items():
        torch.testing.assert_close(a[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_resume_under_more_processes_reads_on_where_the_data_stood():
    """Moving a run to more processes changes how many records a step reads, not which records come next."""
    from hf_d3d.train.trainer import take_records

    # one per_step throughout: the positions a step index gave, the remainder of each epoch left out
    cursor, seen = {"epoch": 0, "offset": 0, "order_per_step": 4}, []
    for _ in range(7):
        at, cursor = take_records(cursor, 4, 10)
        seen.append((at["epoch"], at["offset"]))
    assert seen == [(e, k * 4) for e, k in (divmod(i, 10 // 4) for i in range(7))]
    # two steps of 2 records, then 4 a step (twice the processes): the epoch's order read on, nothing skipped
    cursor, read = {"epoch": 0, "offset": 0, "order_per_step": 2}, []
    for per_step in (2, 2, 4, 4):
        at, cursor = take_records(cursor, per_step, 10)
        read.append((at["epoch"], at["offset"], at["order_per_step"]))
    assert read == [(0, 0, 2), (0, 2, 2), (0, 4, 2), (1, 0, 4)]


def test_fp16_loss_scale_continues_across_a_resume(toy, toy_data, tmp_path, monkeypatch):
    """fp16 training's loss scaler is saved with each checkpoint and restored: a resumed run goes on from the scale
    it had reached (it restarted from the initial scale). A CPU accelerator has no scaler, so one is given here: a
    CPU GradScaler that doubles its scale after every step without overflow."""
    from accelerate import Accelerator

    scalers = []

    class WithScaler(Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
            scalers.append(self.scaler)

    monkeypatch.setattr(trainer, "Accelerator", WithScaler)
    target, _ = toy
    cfg = TrainConfig(max_steps=6, batch_size=4, lr=1e-3, warmup_steps=2, save_every=3, eval_every=1000)
    train(make_drafter(target, block_size=4), toy_data, tmp_path / "a", cfg)
    straight = scalers[-1].get_scale()
    assert straight > 2.0**4  # the scale moved: a restart from the initial scale would show

    train_until_first_checkpoint(monkeypatch, make_drafter(target, block_size=4), toy_data, tmp_path / "b", cfg)
    train(make_drafter(target, block_size=4), toy_data, tmp_path / "b", cfg)
    assert scalers[-1].get_scale() == straight


def test_a_checkpoint_is_resumed_only_as_the_run_it_belongs_to(toy, toy_data, tmp_path, monkeypatch):
    """A resume may run longer, save, evaluate and compute otherwise; another drafter, lr or data, or a --steps
    below the checkpoint's step, is refused before anything is trained or written (each was silently resumed)."""
    from hf_d3d import atomic

    real_fsync = atomic._fsync
    target, _ = toy
    cfg = TrainConfig(max_steps=2, batch_size=4, lr=1e-3, warmup_steps=1, save_every=1, eval_every=1000)
    final = train(make_drafter(target, block_size=4), toy_data, tmp_path, cfg)
    written = (final / "model.safetensors").stat().st_mtime_ns
    other_runs = [
        (make_drafter(target, block_size=8), toy_data, dict(max_steps=3), "block_size"),
        (make_drafter(target, block_size=4), toy_data, dict(max_steps=3, lr=1e-2), "lr"),
        (make_drafter(target, block_size=4), toy_data[:-1], dict(max_steps=3), "training data"),
        (make_drafter(target, block_size=4), toy_data, dict(max_steps=1), "past --steps 1"),
    ]
    for drafter, records, change, named in other_runs:
        with pytest.raises(ValueError, match=named):
            train(drafter, records, tmp_path, replace(cfg, **change))
    assert (final / "model.safetensors").stat().st_mtime_ns == written
    # a save cut between its two renames leaves the last checkpoint under its old name: resumed from there
    (tmp_path / "checkpoint").rename(tmp_path / ".checkpoint.old")
    steps, real_loss = [], trainer.d3d_loss
    monkeypatch.setattr(trainer, "d3d_loss", lambda *a, **k: steps.append(1) or real_loss(*a, **k))
    synced = []
    monkeypatch.setattr(atomic, "_fsync", lambda path: synced.append(path) or real_fsync(path))
    longer = replace(cfg, max_steps=3, save_every=2, save_dtype="bfloat16")  # the same run, on for a step
    log = json.loads(
        (train(make_drafter(target, block_size=4), toy_data, tmp_path, longer) / "training_log.json").read_text()
    )
    assert [m["step"] for m in log["log"]] == [1, 2, 3] and len(steps) == 1
    # every file of the new checkpoint was on disk before the swap made it the checkpoint
    assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= {
        p.name for p in synced if p.parent.name.startswith(".checkpoint-")
    }


def test_a_setting_newer_than_its_checkpoint_is_held_to_its_old_behaviour_on_resume(tmp_path):
    """A checkpoint written before a setting existed trained as the code did then (the setting's default, or
    BEFORE_IT_EXISTED), so a resume that changes it is another run; a checkpoint that names no settings at all is not
    checked this way, and the draft-vocabulary loss is compared only for a drafter that has a draft vocabulary."""
    plain = SimpleNamespace(**{k: None for k in trainer.DRAFTER_SHAPE})
    drafted = SimpleNamespace(**{**vars(plain), "draft_vocab_size": 64})
    absent = ("unreached_weight", "kd_weight", "draft_vocab_loss")
    state = {"step": 5, "config": {k: v for k, v in vars(TrainConfig()).items() if k not in absent}}
    # the same run: before draft_vocab_loss existed, a draft vocabulary's drafter trained over the full vocabulary
    trainer.check_resume(state, TrainConfig(draft_vocab_loss=False), "d", drafted, drafted, tmp_path)
    trainer.check_resume(state, TrainConfig(), "d", plain, plain, tmp_path)  # no draft vocabulary: no difference
    for change in (dict(unreached_weight=0.1), dict(kd_weight=0.5, adapters_only=True), dict(draft_vocab_loss=True)):
        config = TrainConfig(**{"draft_vocab_loss": False, **change})
        with pytest.raises(ValueError, match=next(iter(change))):
            trainer.check_resume(state, config, "d", drafted, drafted, tmp_path)
    trainer.check_resume({"step": 5}, TrainConfig(unreached_weight=0.1), "d", plain, plain, tmp_path)


def test_periodic_eval_logs_tau_with_both_models_on_the_training_device(toy, toy_data, tmp_path, monkeypatch):
    target, _ = toy
    drafter = make_drafter(target, block_size=4, layers=2)
    seen = []
    real = trainer.measure_tau

    def spy(tgt, dft, prompts, max_new):
        seen.append((tgt.device, next(dft.parameters()).device))
        return real(tgt, dft, prompts, max_new)

    monkeypatch.setattr(trainer, "measure_tau", spy)
    cfg = TrainConfig(max_steps=4, batch_size=2, eval_every=2, save_every=1000)
    prompts = [r["prompt_ids"] for r in toy_data[:2]]
    final = train(drafter, toy_data, tmp_path, cfg, target=target, eval_prompts=prompts, eval_max_new_tokens=8)
    log = json.loads((final / "training_log.json").read_text())["log"]
    assert [m["step"] for m in log if "eval_tau" in m] == [2, 4]
    assert all(m["eval_tau"] >= 1.0 for m in log if "eval_tau" in m)  # a round commits at least the target's token
    assert len(seen) == 2 and all(t == d for t, d in seen)


@pytest.mark.parametrize("sharding", ["FSDP", "DEEPSPEED"])
def test_sharded_training_is_refused_before_anything_is_written(toy, toy_data, tmp_path, monkeypatch, sharding):
    from accelerate import Accelerator, DistributedType

    class Sharded(Accelerator):  # what accelerate reports under an FSDP or DeepSpeed launch config
        distributed_type = getattr(DistributedType, sharding)

    monkeypatch.setattr(trainer, "Accelerator", Sharded)
    drafter = make_drafter(toy[0], block_size=4, layers=2)
    with pytest.raises(ValueError, match=f"{sharding}.*DDP"):
        train(drafter, toy_data, tmp_path / "run", TrainConfig(max_steps=2, batch_size=2))
    assert not any((tmp_path / "run").iterdir())  # no checkpoint of one shard


def test_a_sharded_launch_is_refused_by_the_cli_before_any_model_loads(toy_data, tmp_path, monkeypatch, capsys):
    from hf_d3d import cli
    from hf_d3d.train.token_file import write_token_file

    data = write_token_file(toy_data, tmp_path / "d.safetensors", VOCAB, {"target": "SmolLM2-135M-Instruct"})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` sets under an FSDP config
    monkeypatch.setattr("hf_d3d.targets.load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert "FSDP shards the weights" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_bad_records_are_refused():
    good = {"idx": 0, "prompt_ids": [5, 6], "response_ids": [7, 8]}
    with pytest.raises(ValueError, match="empty response"):
        validate_records([{**good, "response_ids": []}], 96, 512, 4)
    with pytest.raises(KeyError, match="response_ids"):
        validate_records([{"idx": 0, "prompt_ids": [5]}], 96, 512, 4)
    with pytest.raises(ValueError, match="exceeds"):
        validate_records([{**good, "prompt_ids": list(range(4, 90)) * 6}], 96, 512, 4)
    with pytest.raises(ValueError, match="outside the drafter vocabulary"):
        validate_records([{**good, "response_ids": [500]}], 96, 512, 4)
    with pytest.raises(ValueError, match="empty prompt"):  # its first block would open after position -1
        validate_records([{**good, "prompt_ids": []}], 96, 512, 4)


def test_fewer_records_than_one_step_reads_are_refused(toy, toy_data, tmp_path, monkeypatch):
    """Under a 2-process launch, 3 records at batch 2: the second process would get an empty batch while the
    first waits in the gradient sync (a hang); refused before any step."""
    from accelerate import Accelerator

    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    target, _ = toy
    with pytest.raises(ValueError, match="3 records are fewer than one step reads: 2 per process x 2"):
        train(make_drafter(target), toy_data[:3], tmp_path, TrainConfig(max_steps=1, batch_size=2))
    assert not (tmp_path / "final").exists()


def test_pack_data_refuses_two_runs_of_one_name(tmp_path, capsys):
    from hf_d3d.cli import main

    for parent in ("a", "b"):
        (tmp_path / parent / "gsm8k_train_0").mkdir(parents=True)
    runs = [str(tmp_path / p / "gsm8k_train_0") for p in ("a", "b")]
    assert main(["pack-data", "--data", *runs, "--out-dir", str(tmp_path / "out")]) == 2
    assert "two runs named gsm8k_train_0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_pack_data_keeps_a_token_file_already_there(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_d3d.cli import main

    target = tiny_target("llama")
    target.config.save_pretrained(tmp_path / "target")
    words = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="3")
    distill(target, tokenizer, ["5 6 7", "8 9"], tmp_path / "gsm8k_train_0", DistillConfig(max_new_tokens=4))
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "out").mkdir()
    kept = tmp_path / "out" / "gsm8k_train_0.safetensors"
    kept.write_bytes(b"committed data")
    args = ["pack-data", "--target", str(tmp_path / "target"), "--out-dir", str(tmp_path / "out"), "--data"]
    assert main([*args, str(tmp_path / "gsm8k_train_0")]) == 2
    assert "pass --overwrite" in capsys.readouterr().err and kept.read_bytes() == b"committed data"
    # an unfinished run among the folders: nothing is written, not even the finished one's file
    assert main([*args, str(tmp_path / "gsm8k_train_0"), str(tmp_path / "unfinished"), "--overwrite"]) == 2
    assert "not finished distillation runs" in capsys.readouterr().err and kept.read_bytes() == b"committed data"
    assert main([*args, str(tmp_path / "gsm8k_train_0"), "--overwrite"]) == 0
    assert len(load_records(kept)) == 2


def test_pack_data_refuses_another_targets_run(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_d3d.cli import main

    target = tiny_target("llama")
    target.config.save_pretrained(tmp_path / "target")
    words = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="3")
    run = distill(target, tokenizer, ["5 6 7"], tmp_path / "gsm8k_train_0", DistillConfig(max_new_tokens=4))
    args = ["pack-data", "--target", str(tmp_path / "target"), "--out-dir", str(tmp_path / "out"), "--data", str(run)]
    meta = json.loads((run / "meta.json").read_text())
    for name, rc in (("/models/Other-LM", 2), ("/elsewhere/TARGET", 0)):  # by name, case aside, as training checks
        (run / "meta.json").write_text(json.dumps({**meta, "target": name}))
        assert main(args) == rc
        if rc:
            assert "distilled from 'Other-LM', not from 'target'" in capsys.readouterr().err
            assert not (tmp_path / "out").exists()
    assert len(load_records(tmp_path / "out" / "gsm8k_train_0.safetensors")) == 1


@pytest.mark.parametrize("field", ["max_steps", "batch_size", "grad_accum", "eval_every", "save_every"])
def test_zero_counts_are_refused_before_training(field):
    # --eval-every 0 once ran into a modulo by zero after the first step's work
    with pytest.raises(ValueError, match=f"{field} must be at least 1"):
        TrainConfig(**{field: 0})
    with pytest.raises(ValueError, match="num_blocks must be at least 0"):
        TrainConfig(num_blocks=-1)
    assert TrainConfig(num_blocks=0).num_blocks == 0  # the AR peer's objective
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="unreached_weight must be in"):
            TrainConfig(unreached_weight=bad)
    with pytest.raises(ValueError, match="this objective has none"):
        TrainConfig(num_blocks=0, unreached_weight=0.5)


def test_epochs_count_every_process_batches():
    from hf_d3d.train.trainer import epochs_to_steps

    assert epochs_to_steps(1000, 2.0, 8, 1) == 250
    assert epochs_to_steps(1000, 2.0, 8, 1, num_processes=4) == 63  # 4 processes x 8 records per step
    assert epochs_to_steps(1000, 1.0, 8, 2, num_processes=2) == 32
    with pytest.raises(ValueError, match="at least 1"):
        epochs_to_steps(1000, 1.0, 0, 1)  # not a ZeroDivisionError


def test_length_grouped_order_reads_every_record_once_with_less_padding():
    from hf_d3d.train.trainer import epoch_order

    lengths = torch.randint(20, 600, (800,), generator=torch.Generator().manual_seed(0)).tolist()
    plain, grouped = epoch_order(lengths, 8, seed=3), epoch_order(lengths, 8, seed=3, group_by_length=True)
    # Without grouping the order is the one earlier runs drew, so they resume unchanged.
    assert plain == torch.randperm(800, generator=torch.Generator().manual_seed(3)).tolist()
    assert sorted(grouped) == list(range(800)) and grouped != plain
    assert grouped == epoch_order(lengths, 8, seed=3, group_by_length=True)  # from the seed alone: resume is exact

    def padded(order: list[int]) -> int:
        return sum(8 * max(lengths[i] for i in order[k : k + 8]) for k in range(0, 800, 8))

    assert padded(grouped) < 0.8 * padded(plain)


def test_token_file_round_trip_and_training_resumes_on_it(toy, toy_data, tmp_path, monkeypatch):
    """Committed data format: records come back exactly, and a whole-LM drafter's run on it resumes exactly."""
    from hf_d3d.train.token_file import read_token_file, write_token_file

    target, _ = toy
    path = write_token_file(toy_data, tmp_path / "data.safetensors", VOCAB, {"target": "tiny", "source": "toy"})
    back, provenance = read_token_file(path)
    assert [(r["prompt_ids"], r["response_ids"]) for r in back] == [
        (r["prompt_ids"], r["response_ids"]) for r in toy_data
    ]
    assert provenance["source"] == "toy" and provenance["vocab_size"] == VOCAB
    assert load_records(path) == back
    assert path.stat().st_size < 2 * sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in toy_data) + 2000

    cfg = TrainConfig(
        max_steps=4, batch_size=4, lr=1e-3, warmup_steps=1, save_every=2, eval_every=1000, freeze_layers=1
    )

    def whole():
        return D3DDrafterModel.from_pretrained_lm(target, block_size=4)

    straight = train(whole(), load_records(path), tmp_path / "a", cfg)
    train_until_first_checkpoint(monkeypatch, whole(), load_records(path), tmp_path / "b", cfg)
    resumed = train(whole(), load_records(path), tmp_path / "b", cfg)
    a = D3DDrafterModel.from_pretrained(straight).state_dict()
    b = D3DDrafterModel.from_pretrained(resumed).state_dict()
    start = whole().state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
        if name.startswith(("model.layers.0.", "model.embed_tokens", "model.mask_embedding", "lm_head")):
            assert torch.equal(a[name], start[name]), f"{name} is frozen but changed"
        elif name.endswith("mlp.down_proj.weight"):
            assert not torch.equal(a[name], start[name]), f"{name} is trained but did not change"


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_a_damaged_token_file_is_refused(toy_data, tmp_path, damage):
    from hf_d3d.train.token_file import write_token_file

    path = write_token_file(toy_data, tmp_path / "d.safetensors", VOCAB, {"target": "tiny"})
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) - 7]
    elif damage == "flip":
        raw[-3] ^= 0x01  # one bit of the last token id
    elif damage == "garbage":
        raw = bytearray(b"not a safetensors file at all")
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupt|not a readable|truncated"):
        load_records(path)


def test_token_files_of_two_targets_do_not_mix(toy_data, tmp_path):
    from hf_d3d.train.token_file import write_token_file

    a = write_token_file(toy_data[:3], tmp_path / "a.safetensors", VOCAB, {"target": "one"})
    b = write_token_file(toy_data[3:], tmp_path / "b.safetensors", VOCAB, {"target": "two"})
    with pytest.raises(ValueError, match="one target only"):
        load_records(a, b)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_token_file(toy_data, tmp_path / "c.safetensors", 8, {"target": "one"})


def test_data_of_another_target_is_refused_before_training(toy_data, tmp_path, monkeypatch, capsys):
    from hf_d3d import cli
    from hf_d3d.train.token_file import write_token_file

    path = write_token_file(toy_data, tmp_path / "q.safetensors", VOCAB, {"target": "Qwen3-8B"})
    assert len(load_records(path, target="Qwen/Qwen3-8B")) == len(toy_data)  # the Hub id names the same model
    assert len(load_records(path, target="/models/qwen3-8b")) == len(toy_data)  # a local copy under its name
    with pytest.raises(ValueError, match="distilled from 'Qwen3-8B', but the drafter is for 'ORG/Other'"):
        load_records(path, target="ORG/Other")
    # The CLI's default target is SmolLM2: the data is refused before any model loads.
    monkeypatch.setattr("hf_d3d.targets.load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main(["train", "--data", str(path), "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert "distilled from 'Qwen3-8B', but the drafter is for 'HuggingFaceTB/SmolLM2-135M-Instruct'" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()


def test_a_steps_log_is_the_mean_of_its_micro_batches_and_processes():
    """With gradient accumulation or several processes the log describes the step, not one process's last batch."""
    from types import SimpleNamespace

    from hf_d3d.train.trainer import step_metrics

    one = SimpleNamespace(num_processes=1)
    micro = [
        {"loss": 2.0, "denoise": 2.0, "slot0_acc": 0.5, "ar": 1.0},
        {"loss": 4.0, "denoise": 3.0, "slot0_acc": 1.0},
    ]
    assert step_metrics(micro, one) == {"loss": 3.0, "denoise": 2.5, "slot0_acc": 0.75, "ar": 1.0}
    other = torch.tensor([5.0, 4.5, 0.25])  # the other process's loss, denoise, slot0_acc

    def reduce(tensor, op):
        assert op == "mean"
        return (tensor + other) / 2

    two = SimpleNamespace(num_processes=2, device=torch.device("cpu"), reduce=reduce)
    assert step_metrics(micro, two) == {"loss": 4.0, "denoise": 3.5, "slot0_acc": 0.5, "ar": 1.0}


def test_data_of_another_tokenizer_is_refused_whatever_its_targets_name(toy, toy_data, tmp_path):
    """Two models in folders of the same name pass the name check; the tokenizer's fingerprint, recorded by
    distill and kept by pack-data, tells them apart."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_d3d.checks import tokenizer_fingerprint
    from hf_d3d.train.distill import pack_run
    from hf_d3d.train.token_file import write_token_file

    target, prompts = toy
    words = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="3")
    run = distill(target, tokenizer, prompts[:3], tmp_path / "run", DistillConfig(max_new_tokens=8, batch_size=3))
    mine = tokenizer_fingerprint(tokenizer)
    packed = pack_run(run, tmp_path / "run.safetensors", VOCAB)
    for source in (run, packed):
        assert load_records(source, tokenizer_fingerprint=mine)
        with pytest.raises(ValueError, match="another tokenizer"):
            load_records(source, target="model", tokenizer_fingerprint="0123456789abcdef")
    # data written before the fingerprint was recorded is checked by the model's name alone
    old = write_token_file(toy_data, tmp_path / "old.safetensors", VOCAB, {"target": "tiny", "source": "toy"})
    assert load_records(old, tokenizer_fingerprint="0123456789abcdef") == load_records(old)


def test_a_resume_with_other_steps_says_how_the_learning_rate_moves(toy, toy_data, tmp_path, monkeypatch, capsys):
    """Resuming with another --steps is allowed (a run cut short, or lengthened) and stretches the schedule: said."""
    from transformers import get_cosine_schedule_with_warmup

    from hf_d3d.train.trainer import cosine_lr_factor

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = get_cosine_schedule_with_warmup(optimizer, 2, 10)
    for step in range(11):
        assert cosine_lr_factor(step, 2, 10) == pytest.approx(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    target, _ = toy
    cfg = TrainConfig(max_steps=6, batch_size=4, lr=1e-3, warmup_steps=2, save_every=3, eval_every=1000)
    train_until_first_checkpoint(monkeypatch, make_drafter(target, block_size=4), toy_data, tmp_path, cfg)
    capsys.readouterr()
    train(make_drafter(target, block_size=4), toy_data, tmp_path, replace(cfg, max_steps=12))
    said = capsys.readouterr().out
    lr_then, lr_now = (cosine_lr_factor(3, 2, n) * 1e-3 for n in (6, 12))
    assert "resuming at step 3 with --steps 12 (the run was started with 6)" in said
    assert f"goes from {lr_then:.3g} to {lr_now:.3g}" in said and lr_now > lr_then


def test_an_update_skipped_for_overflow_leaves_the_schedule_where_it_was(toy, toy_data, tmp_path, monkeypatch):
    """fp16's loss scaler skips an update whose gradients overflowed; the warmup and cosine then wait for the next
    applied update (as transformers' Trainer does), across a resume too."""
    from accelerate import Accelerator

    from hf_d3d.train.trainer import cosine_lr_factor

    skipped = iter([True, True] + [False] * 10)  # the first two updates overflow, as a fresh scale's often do
    monkeypatch.setattr(Accelerator, "optimizer_step_was_skipped", property(lambda self: next(skipped)))
    target, _ = toy
    cfg = TrainConfig(max_steps=6, batch_size=4, lr=1e-3, warmup_steps=2, save_every=3, eval_every=1000)
    train_until_first_checkpoint(monkeypatch, make_drafter(target, block_size=4), toy_data, tmp_path, cfg)
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert (state["step"], state["lr_steps"]) == (3, 1)
    train(make_drafter(target, block_size=4), toy_data, tmp_path, cfg)
    log = json.loads((tmp_path / "final" / "training_log.json").read_text())
    lrs = [row["lr"] for row in (log["log"] if isinstance(log, dict) else log)]
    assert lrs == pytest.approx([cosine_lr_factor(n, 2, 6) * 1e-3 for n in (0, 0, 1, 2, 3, 4)])


def test_unanswered_prompts_are_those_no_greedy_answer_covers(tmp_path):
    """scripts/unanswered_prompts.py: a sampled answer does not stand in for a greedy one, and another target's
    data is refused rather than read as answering nothing."""
    import importlib.util
    import pathlib

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_d3d.train.token_file import write_token_file

    path = pathlib.Path(__file__).parents[1] / "scripts" / "unanswered_prompts.py"
    spec = importlib.util.spec_from_file_location("unanswered_prompts", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    words = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="3")
    prompts = ["5 6", "7 8", "9 10", "11 12"]

    def answers(*chosen):
        return [{"prompt_ids": chat_prompt_ids(tokenizer, prompts[i]), "response_ids": [4, 3]} for i in chosen]

    greedy = write_token_file(answers(0), tmp_path / "greedy.safetensors", VOCAB, {"target": "tiny"})
    drawn = {"target": "tiny", "do_sample": True}
    sampled = write_token_file(answers(1, 2), tmp_path / "t07.safetensors", VOCAB, drawn)
    assert script.unanswered(prompts, tokenizer, "org/tiny", str(greedy), str(sampled)) == prompts[1:]
    # a cut-short sampled run goes on with the prompts no sampled answer covers, greedy answers or not
    assert script.unanswered(prompts, tokenizer, "org/tiny", str(greedy), str(sampled), sampled=True) == [
        prompts[0],
        prompts[3],
    ]
    other = write_token_file(answers(3), tmp_path / "other.safetensors", VOCAB, {"target": "Other-LM"})
    with pytest.raises(ValueError, match="distilled from 'Other-LM'"):
        script.unanswered(prompts, tokenizer, "org/tiny", str(other))
