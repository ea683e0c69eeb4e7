"""hf-d3d: lossless speculative decoding with a decoupled block-diffusion drafter (D3D)."""

from hf_d3d.checks import check_pair, tokenizer_fingerprint
from hf_d3d.cpu.fp16_weights import fp16_weights
from hf_d3d.cpu.skinny import skinny_linears
from hf_d3d.exact import exact_verification
from hf_d3d.fused import fused_generate
from hf_d3d.modeling.configuration_d3d import D3DConfig
from hf_d3d.modeling.generation_d3d import D3DCandidateGenerator, D3DStats
from hf_d3d.modeling.modeling_d3d import D3DDrafterModel
from hf_d3d.speculative import d3d_generate, speculative_generate

__all__ = [
    "D3DConfig",
    "D3DDrafterModel",
    "D3DCandidateGenerator",
    "D3DStats",
    "check_pair",
    "tokenizer_fingerprint",
    "speculative_generate",
    "d3d_generate",
    "fused_generate",
    "exact_verification",
    "skinny_linears",
    "fp16_weights",
]
__version__ = "0.1.0"
