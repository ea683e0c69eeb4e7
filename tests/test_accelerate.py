"""`accelerate launch` runs the training command unchanged: two CPU processes (DDP over gloo), tiny models.

accelerate's own multi-CPU launcher needs mpirun; its torch.distributed launcher (the multi-GPU config) with
ACCELERATE_USE_CPU set starts the same processes on CPU, which is how this machine can check the path.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from safetensors import SafetensorError
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import VOCAB, tiny_target
from hf_d3d import D3DDrafterModel
from hf_d3d.checks import check_pair, tokenizer_fingerprint
from hf_d3d.targets import load_target
from hf_d3d.train.distill import DistillConfig, distill, load_records

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
num_machines: 1
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: {port}
mixed_precision: 'no'
use_cpu: false
"""


def _target_folder(tmp_path):
    """A target folder as the CLI loads it: weights plus a word-level tokenizer whose tokens are the ids themselves."""
    target = tiny_target("llama", seed=3)
    words = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token="3")
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    return target, tokenizer


def _target_and_data(tmp_path) -> int:
    """:func:`_target_folder` and the target's distilled answers; returns how many records."""
    target, tokenizer = _target_folder(tmp_path)
    prompts = [" ".join(str(4 + (i * 5 + j * 7) % 90) for j in range(6)) for i in range(10)]
    distill(target, tokenizer, prompts, tmp_path / "data", DistillConfig(max_new_tokens=16, batch_size=5))
    return len(load_records(tmp_path / "data"))


def _launch(tmp_path, args: list[str]) -> subprocess.CompletedProcess:
    config = tmp_path / "accelerate.yaml"
    config.write_text(CONFIG.format(port=29500 + os.getpid() % 1000))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m", "hf_d3d.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true"}
    return subprocess.run(command + args, capture_output=True, text=True, timeout=600, env=env)


def _train_args(tmp_path) -> list[str]:
    args = ["train", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data")]
    args += ["--out", str(tmp_path / "run"), "--layers", "1", "--block-size", "4", "--num-blocks", "2"]
    return args + ["--batch-size", "2", "--num-eval-prompts", "0"]


def test_a_target_loaded_without_weights_reads_none_and_serves_the_checks(tmp_path):
    target, tokenizer = _target_folder(tmp_path)
    drafter = D3DDrafterModel.from_target(
        target, num_hidden_layers=1, block_size=4, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer)
    )
    (tmp_path / "target" / "model.safetensors").write_bytes(b"not weights")  # so any read of them fails
    with pytest.raises(SafetensorError):
        load_target(str(tmp_path / "target"))
    shell, shell_tokenizer = load_target(str(tmp_path / "target"), weights=False)
    assert {p.device.type for p in shell.parameters()} == {"meta"}
    for field in ("model_type", "vocab_size", "num_hidden_layers", "hidden_size"):
        assert getattr(shell.config, field) == getattr(target.config, field)
    check_pair(shell, drafter, shell_tokenizer)  # vocabulary and tokenizer checked from the config alone
    drafter.config.vocab_size += 1
    with pytest.raises(ValueError, match="vocab_size"):
        check_pair(shell, drafter, shell_tokenizer)


@pytest.mark.parametrize(
    ("start", "main", "weights"),
    [
        (["--init-from", "D"], False, False),
        (["--whole-lm", "L"], False, False),
        (["--init-from", "D"], True, True),
        ([], False, True),
        (["--whole-lm", "target"], False, True),
    ],
)
def test_only_the_main_process_loads_target_weights_it_does_not_build_from(tmp_path, monkeypatch, start, main, weights):
    """Under `accelerate launch` the other processes compute nothing with the target: they read its weights only
    where the drafter is built from them (a Qwen3-8B target in fp32 is 32 GB per process)."""
    from accelerate import PartialState

    from hf_d3d import cli
    from hf_d3d.train.token_file import write_token_file

    records = [{"idx": 0, "prompt_ids": [5, 6], "response_ids": [7, 8]}]
    data = write_token_file(records, tmp_path / "d.safetensors", VOCAB, {"target": "SmolLM2-135M-Instruct"})
    asked = []

    class Stop(RuntimeError):
        pass

    def load_target(name, weights=True, **kw):
        asked.append(weights)
        raise Stop("stopped after the target was asked for")

    class Rank(PartialState):  # what a process of a 2-process launch reports
        is_main_process, num_processes = main, 2

    monkeypatch.setattr("accelerate.PartialState", Rank)
    monkeypatch.setattr("hf_d3d.targets.load_target", load_target)
    args = ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1", *start]
    assert cli.main(args) == 2
    assert asked == [weights]


@pytest.mark.slow
def test_accelerate_launch_trains_on_two_cpu_processes(tmp_path):
    """Started from a drafter (--init-from), so the second process holds the target's config alone."""
    records = _target_and_data(tmp_path)
    target = load_target(str(tmp_path / "target"))[0]
    D3DDrafterModel.from_target(target, num_hidden_layers=1, block_size=4).save_pretrained(tmp_path / "init")
    args = _train_args(tmp_path) + ["--init-from", str(tmp_path / "init")]
    done = _launch(tmp_path, args + ["--epochs", "1", "--save-every", "2"])
    assert done.returncode == 0, done.stderr[-3000:]

    log = json.loads((tmp_path / "run" / "final" / "training_log.json").read_text())
    # One epoch with two processes taking 2 records each per step: the launch config reached the trainer.
    assert log["config"]["max_steps"] == math.ceil(records / 4)
    assert len(log["log"]) == log["config"]["max_steps"]
    assert all(math.isfinite(entry["loss"]) for entry in log["log"])
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_single_process_run_continues_under_accelerate_launch(tmp_path):
    """A run started on one device goes on with `accelerate launch` and the same command (the move to GPUs)."""
    records = _target_and_data(tmp_path)
    assert 8 <= records < 12  # so that step 3 (4 records at offset 4) still fits epoch 0, and step 4 opens epoch 1
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # two steps in one process; then the same command under `accelerate launch`, asking for four, goes on from there
    first = [sys.executable, "-m", "hf_d3d.cli", *_train_args(tmp_path), "--steps", "2", "--save-every", "1"]
    done = subprocess.run(first, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 2
    before = [entry["loss"] for entry in state["log"]]

    done = _launch(tmp_path, _train_args(tmp_path) + ["--steps", "4", "--save-every", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(resuming)" in done.stdout
    log = json.loads((tmp_path / "run" / "final" / "training_log.json").read_text())["log"]
    assert [entry["step"] for entry in log] == [1, 2, 3, 4]
    assert [entry["loss"] for entry in log[:2]] == before  # the first two steps were not run again
    # two steps of 2 records, then two of 4: step 3 read on in epoch 0 (records 4-7 of its order), none skipped
    state = json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())
    assert state["data_cursor"] == {"epoch": 1, "offset": 4, "order_per_step": 4}


def test_a_target_dispatched_over_cpu_and_disk_decodes_as_plain_generate(tmp_path):
    """A target that accelerate spreads over devices (here CPU and disk, its layers' weights read back per forward
    through its hooks) gives the Hub path and the fast loop plain generate's tokens; the fused path refuses it."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_d3d import fused_generate, speculative_generate

    target, _ = _target_folder(tmp_path)
    drafter = D3DDrafterModel.from_target(target, num_hidden_layers=1, block_size=4).eval()
    layers = {f"model.layers.{i}": "disk" if i % 2 == 0 else "cpu" for i in range(target.config.num_hidden_layers)}
    ends = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    placement = ends | layers
    spread = AutoModelForCausalLM.from_pretrained(
        tmp_path / "target", device_map=placement, offload_folder=str(tmp_path / "offload")
    ).eval()
    assert "disk" in spread.hf_device_map.values()
    x = torch.tensor([[5, 6, 7, 8, 9, 10]])
    plain = target.generate(x, max_new_tokens=24, do_sample=False)
    assert torch.equal(spread.generate(x, max_new_tokens=24, do_sample=False), plain)
    assert torch.equal(spread.generate(x, assistant_model=drafter, max_new_tokens=24, do_sample=False), plain)
    assert torch.equal(speculative_generate(spread, drafter, x, max_new_tokens=24), plain)
    with pytest.raises(ValueError, match="one device"):
        fused_generate(spread, drafter, x, max_new_tokens=4)


def test_device_map_on_the_command_line(tmp_path, capsys):
    """`--device-map auto` reaches from_pretrained (on a CPU-only machine accelerate keeps the target whole on the
    CPU), the bench runs beside it (every output identical) and the flag is recorded in the commands; with `--device`
    as well, or with `calibrate --write`, it is refused before anything loads."""
    from hf_d3d import cli

    target, _ = _target_folder(tmp_path)
    D3DDrafterModel.from_target(target, num_hidden_layers=1, block_size=4).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"{5 + i} 6 7 {8 + i} 9"}) + "\n" for i in range(2)))
    common = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts)]
    common += ["--num-prompts", "2", "--max-new-tokens", "12"]
    out = tmp_path / "bench.json"
    args = ["bench", *common, "--methods", "plain,d3d_sync,d3d_fast", "--out", str(out), "--device-map", "auto"]
    assert cli.main(args) == 0
    result = json.loads(out.read_text())
    assert result["all_identical"] and result["command"].endswith(" --device-map auto")
    assert cli.main(["eval-tau", *common, "--device-map", "auto", "--write-metrics"]) == 0
    rows = json.loads((tmp_path / "drafter" / "d3d_metrics.json").read_text())["rows"]
    assert [row["command"].endswith(" --device-map auto") for row in rows] == [True]
    capsys.readouterr()
    assert cli.main(["eval-tau", *common, "--device-map", "auto", "--device", "cpu"]) == 2
    assert "leave out --device" in capsys.readouterr().err
    calibrate = ["calibrate", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]
    assert cli.main([*calibrate, "--device-map", "auto", "--write"]) == 2
    assert "its own" in capsys.readouterr().err


def test_the_drafter_goes_where_the_target_embeddings_compute(tmp_path, monkeypatch):
    """Under accelerate's offload a module's weights are on "meta" and its hook holds the device it computes on."""
    import types

    import torch

    from hf_d3d import cli

    target, tokenizer = _target_folder(tmp_path)
    monkeypatch.setattr("hf_d3d.targets.load_target", lambda *a, **k: (target, tokenizer))
    args = types.SimpleNamespace(target=None, device="auto", device_map="auto")
    assert cli._load_placed_target(args, torch.float32)[2] == torch.device("cpu")
    target.get_input_embeddings()._hf_hook = types.SimpleNamespace(execution_device="cuda:1")
    assert cli._load_placed_target(args, torch.float32)[2] == torch.device("cuda:1")


def test_train_grows_the_adapters_of_an_init_from_drafter_and_a_resume_must_grow_them_too(tmp_path, capsys):
    from hf_d3d import cli

    _target_and_data(tmp_path)
    target, tokenizer = load_target(str(tmp_path / "target"))
    start = D3DDrafterModel.from_pretrained_lm(
        target, block_size=4, block_adapter_rank=4, tokenizer_fingerprint=tokenizer_fingerprint(tokenizer)
    )
    start.save_pretrained(tmp_path / "init")
    args = ["train", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data"), "--init-from"]
    args += [str(tmp_path / "init"), "--block-adapter-rank", "4", "--num-blocks", "2", "--batch-size", "2"]
    args += ["--num-eval-prompts", "0", "--save-every", "1", "--out", str(tmp_path / "run")]
    assert cli.main([*args, "--steps", "1", "--grow-block-adapter-rank", "8"]) == 0, capsys.readouterr().err
    final = D3DDrafterModel.from_pretrained(tmp_path / "run" / "final")
    assert final.config.block_adapter_rank == 8
    assert final.model.layers[0].mlp.block_adapters["up_proj"].up.shape[1] == 8
    assert cli.main([*args, "--steps", "2"]) == 2  # the same run, resumed without the growth: another drafter
    assert "block_adapter_rank: 8 -> 4" in capsys.readouterr().err
    assert cli.main([*args, "--steps", "2", "--grow-block-adapter-rank", "8"]) == 0, capsys.readouterr().err
    assert len(json.loads((tmp_path / "run" / "final" / "training_log.json").read_text())["log"]) == 2
