"""Tiny random targets and drafters shared by the fast suite."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_d3d import D3DDrafterModel, speculative
from hf_d3d.modeling import generation_d3d

torch.set_num_threads(1)

VOCAB = 96
EOS = 3

# Every property test builds or runs models: no per-example deadline, and slow data generation or a function-scoped
# fixture (the oracle patch, reset per test) is expected. Tests choose only how many examples they draw.
settings.register_profile(
    "d3d", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
settings.load_profile("d3d")

FAMILIES = st.sampled_from(["llama", "qwen3"])  # the two tiny target families


def prompts(max_size: int) -> st.SearchStrategy[list[int]]:
    """Prompts of 1..``max_size`` ordinary tokens (ids below 4 are special: pad, bos, eos)."""
    return st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=max_size)


def tiny_target(family: str = "llama", vocab: int = VOCAB, seed: int = 0, layers: int = 3):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=12, tie_word_embeddings=False))
    # Sharper logits than the default init, so greedy continuations vary instead of repeating one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param)


class OracleGenerator(generation_d3d.D3DCandidateGenerator):
    """Drafts the target's own greedy tokens (full acceptance), corrupting each slot with probability ``noise``."""

    target = None
    noise = 0.0
    demote = 0.0
    reference = None  # a known greedy output [1, n]: draft from it instead of recomputing the target's choices

    def _draft_logits(self, input_ids):
        real = super()._draft_logits(input_ids)  # keep the drafter's cache bookkeeping exercised
        if self.reference is not None:
            # Bitwise-sensitive tests (bf16) need drafts that are plain generate's own tokens; a full forward over
            # the sequence can differ from decode steps at a near-tie on some CPUs.
            ahead = self.reference[0, input_ids.shape[1] : input_ids.shape[1] + self.block_size].tolist()
            logits = torch.zeros(1, self.block_size, self.drafter.config.vocab_size)
            for j, tok in enumerate(ahead):
                logits[0, j, tok] = 50.0
            return logits
        if self.target is None:  # no oracle set: behave as the real drafter
            return real
        seq = input_ids
        logits = []
        for _ in range(self.block_size):
            step = self.target(seq).logits[:, -1:].float()
            logits.append(step)
            seq = torch.cat([seq, step.argmax(-1)], dim=1)
        logits = torch.cat(logits, dim=1)
        if self.noise:
            flip = torch.rand(logits.shape[:2]) < self.noise
            logits[flip] = torch.randn_like(logits[flip]) * 50
        if self.demote:  # the right token stays second best: a chain misses it, a draft tree can still find it
            for b, j in (torch.rand(logits.shape[:2]) < self.demote).nonzero().tolist():
                row, vocab = logits[b, j], logits.shape[-1]
                right = int(row.argmax())
                row.fill_(0.0)
                row[right], row[(right + 1 + int(torch.randint(vocab - 1, (1,)))) % vocab] = 9.5, 10.0
        return logits


@pytest.fixture
def oracle(monkeypatch):
    """Patch the candidate generator so drafters become oracles of ``target`` (set ``.target`` / ``.noise``)."""
    monkeypatch.setattr(generation_d3d, "D3DCandidateGenerator", OracleGenerator)
    monkeypatch.setattr(speculative, "D3DCandidateGenerator", OracleGenerator)
    yield OracleGenerator
    OracleGenerator.target, OracleGenerator.noise, OracleGenerator.demote = None, 0.0, 0.0
    OracleGenerator.reference = None


def make_drafter(target, block_size: int = 4, layers: int = 2, **kw) -> D3DDrafterModel:
    torch.manual_seed(1)
    return D3DDrafterModel.from_target(target, num_hidden_layers=layers, block_size=block_size, **kw)
