"""bitsandbytes targets: 4-bit (nf4, fp4) and row-wise 8-bit verify exactly; LLM.int8 outliers are refused first."""

from __future__ import annotations

import bitsandbytes  # noqa: F401  (installed by the test set-up, pip install -e .[test]; a missing one is an error)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

from conftest import make_drafter, prompts
from hf_d3d import check_pair, speculative_generate

VOCAB = 128
SCHEMES = {
    "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8-rowwise": BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama with the 64-wide shapes bitsandbytes' CPU kernels pack (multiples of their block)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=3,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)  # sharper logits: varied greedy continuations
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def quantized(saved):
    path, full = saved
    out = {}
    for name, q in {**SCHEMES, "int8-outliers": BitsAndBytesConfig(load_in_8bit=True)}.items():
        out[name] = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.float32).eval()
    return out, make_drafter(full, block_size=4)


@settings(max_examples=12)
@given(
    scheme=st.sampled_from(sorted(SCHEMES)),
    prompt=prompts(12),
    max_new=st.integers(1, 32),
)
def test_quantized_targets_verify_exactly(quantized, scheme, prompt, max_new):
    models, drafter = quantized
    target = models[scheme]
    x = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new)
    plain = target.generate(x, **kw)
    assert torch.equal(target.generate(x, assistant_model=drafter, **kw), plain)
    assert torch.equal(speculative_generate(target, drafter, x, max_new_tokens=max_new), plain)


def test_llm_int8_outliers_are_refused_before_any_work(quantized):
    models, drafter = quantized
    target = models["int8-outliers"]
    calls = []
    handle = target.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match="llm_int8_threshold=0.0"):
            speculative_generate(target, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=8)
        with pytest.raises(ValueError, match="outlier columns"):
            check_pair(target, drafter)
    finally:
        handle.remove()
    assert calls == []
