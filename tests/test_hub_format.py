"""Hub layout: save_pretrained -> AutoModel(trust_remote_code) offline gives the same drafter and the same tokens."""

from __future__ import annotations

import ast
import json

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

from conftest import make_drafter, tiny_target
from hf_d3d import D3DDrafterModel

REMOTE_FILES = {
    "configuration_d3d.py",
    "modeling_d3d.py",
    "attention_d3d.py",
    "generation_d3d.py",
    "compat_d3d.py",
    "skinny_d3d.py",
}


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = tiny_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    drafter.save_pretrained(tmp_path / "d3d")
    return target, drafter, tmp_path / "d3d"


def test_folder_layout_and_auto_map(saved):
    _, _, folder = saved
    files = {p.name for p in folder.iterdir()}
    assert REMOTE_FILES | {"config.json", "model.safetensors", "generation_config.json"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == auto_map["AutoModelForCausalLM"] == "modeling_d3d.D3DDrafterModel"


def test_remote_code_imports_only_torch_and_transformers(saved):
    _, _, folder = saved
    for name in REMOTE_FILES:
        tree = ast.parse((folder / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            # torch, transformers and a few standard-library modules: nothing a Hub user has to install or audit
            allowed = {
                "torch",
                "transformers",
                "__future__",
                "collections",
                "contextlib",
                "dataclasses",
                "functools",
                "inspect",
                "sys",
                "time",
                "warnings",
                "json",
                "weakref",
            }
            assert roots <= allowed, (name, roots)


@pytest.mark.parametrize("auto_cls", [AutoModel, AutoModelForCausalLM])
def test_round_trip_through_trust_remote_code(saved, auto_cls):
    target, drafter, folder = saved
    loaded = auto_cls.from_pretrained(folder, trust_remote_code=True)
    assert type(loaded).__name__ == "D3DDrafterModel"
    assert type(loaded).__module__.startswith("transformers_modules")  # the copied files, not hf_d3d
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    x = torch.tensor([[5, 6, 7, 8, 9]])
    # same function, not only the same weights: buffers such as rotary frequencies are rebuilt on load
    torch.testing.assert_close(loaded(x).logits, drafter(x).logits)
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False, eos_token_id=None)
    ref = target.generate(x, **kw)
    assert torch.equal(target.generate(x, assistant_model=loaded, **kw), ref)
    assert torch.equal(target.generate(x, assistant_model=drafter, **kw), ref)


def test_missing_tensor_is_refused(saved):
    _, _, folder = saved
    weights = load_file(folder / "model.safetensors")
    dropped = next(k for k in weights if "layers.1.mlp" in k)
    del weights[dropped]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match its config"):
        D3DDrafterModel.from_pretrained(folder)


def test_mismatched_tensor_is_refused(saved):
    _, _, folder = saved
    weights = load_file(folder / "model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[key] = torch.zeros(weights[key].shape[0] + 1, weights[key].shape[1])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="(?i)size|shape|mismatch"):
        D3DDrafterModel.from_pretrained(folder)


def test_corrupt_weights_file_is_refused(saved):
    _, _, folder = saved
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SafetensorError, match="header"):
        D3DDrafterModel.from_pretrained(folder)


def test_pickle_weights_are_never_loaded(saved):
    _, drafter, folder = saved
    (folder / "model.safetensors").unlink()
    torch.save(drafter.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        D3DDrafterModel.from_pretrained(folder)
    with pytest.raises(ValueError, match="safetensors"):
        D3DDrafterModel.from_pretrained(folder, use_safetensors=False)


def test_committed_checkpoints_ship_the_current_remote_code():
    """Every committed drafter's trust_remote_code files must be today's hf_d3d/modeling/ files, not a stale copy."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    folders = sorted(p.parent for p in (root / "checkpoints").glob("*/config.json"))
    assert root / "checkpoints" / "SmolLM2-135M-Instruct-D3D" in folders
    for folder in folders:
        for name in REMOTE_FILES:
            assert (folder / name).read_text() == (root / "hf_d3d" / "modeling" / name).read_text(), (
                f"{folder.name}/{name}"
            )


@pytest.mark.parametrize(
    ("x86", "avx512_bf16", "amx", "onednn", "native"),
    [
        (True, False, False, True, False),  # AVX512 alone: oneDNN says bf16, but emulates it
        (True, False, False, False, False),  # AVX2 only
        (True, True, False, True, True),  # AVX512-BF16 (Zen 4, Cooper Lake)
        (True, False, True, True, True),  # AMX (Sapphire Rapids)
        (False, False, False, True, True),  # Arm with bf16: oneDNN's answer
        (False, False, False, False, False),
    ],
)
def test_bf16_counts_as_native_only_with_bf16_units(monkeypatch, x86, avx512_bf16, amx, onednn, native):
    from hf_d3d.modeling.modeling_d3d import cpu_computes_bf16

    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: x86)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    assert cpu_computes_bf16() is native


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_computes_in_fp32_where_the_cpu_emulates_bf16(saved, monkeypatch, native_bf16):
    """A bf16 checkpoint keeps bf16 on a CPU with bf16 units and computes in fp32 on one without: through
    ``load_drafter``, and through ``from_pretrained`` alone (the Hub path) on a machine without a GPU."""
    from hf_d3d import targets
    from hf_d3d.modeling import modeling_d3d

    _, drafter, folder = saved
    bf16 = folder.parent / "bf16"
    drafter.to(torch.bfloat16).save_pretrained(bf16)
    drafter.to(torch.float32)
    want = torch.bfloat16 if native_bf16 else torch.float32
    monkeypatch.setattr(targets, "cpu_computes_bf16", lambda: native_bf16)
    assert targets.load_drafter(str(bf16)).dtype == want
    assert targets.load_drafter(str(bf16), dtype=torch.bfloat16).dtype == torch.bfloat16
    monkeypatch.setattr(modeling_d3d, "cpu_computes_bf16", lambda: native_bf16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D3DDrafterModel.from_pretrained(bf16).dtype == want
    for asked in (torch.bfloat16, "bfloat16"):  # an explicit dtype is the user's choice
        assert D3DDrafterModel.from_pretrained(bf16, dtype=asked).dtype == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: the stored dtype, as transformers
    assert D3DDrafterModel.from_pretrained(bf16).dtype == torch.bfloat16


@pytest.mark.parametrize("native_bf16", [True, False])
def test_a_cards_cpu_setting_says_whether_bf16_runs_in_hardware(monkeypatch, native_bf16):
    """ "AVX512" names both x86 kinds, with and without bf16 units; a card's speedup must say which it ran on."""
    from hf_d3d import cli
    from hf_d3d.modeling import modeling_d3d

    monkeypatch.setattr(modeling_d3d, "cpu_computes_bf16", lambda: native_bf16)
    setting = cli.cpu_setting()
    assert ("(bf16 in hardware)" in setting) is native_bf16 and ("(bf16 emulated)" in setting) is not native_bf16
    assert setting.startswith(f"CPU with {torch.backends.cpu.get_cpu_capability()} kernels")
    assert setting.endswith(f", {torch.get_num_threads()} threads")
