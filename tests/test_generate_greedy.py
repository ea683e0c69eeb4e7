"""Greedy `target.generate(assistant_model=drafter)` must equal plain greedy `generate`, token for token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextStreamer, pipeline

from conftest import EOS, FAMILIES, VOCAB, make_drafter, prompts, tiny_target
from hf_d3d import d3d_generate
from hf_d3d.evaluate import count_forwards

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}
DRAFTERS = {(fam, b): make_drafter(t, block_size=b) for fam, t in TARGETS.items() for b in (1, 2, 4, 8, 16)}


def plain(target, x, **kw):
    return target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, **kw)


def assisted(target, drafter, x, **kw):
    return target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, assistant_model=drafter, **kw)


@settings(max_examples=40)
@given(
    family=FAMILIES,
    block=st.sampled_from([1, 2, 4, 8, 16]),
    prompt=prompts(24),
    max_new=st.integers(1, 40),
    eos_on=st.booleans(),
)
def test_untrained_drafter_is_lossless(family, block, prompt, max_new, eos_on):
    target, drafter = TARGETS[family], DRAFTERS[(family, block)]
    x = torch.tensor([prompt])
    eos = EOS if eos_on else None
    ref = plain(target, x, max_new_tokens=max_new, eos_token_id=eos)
    out = assisted(target, drafter, x, max_new_tokens=max_new, eos_token_id=eos)
    assert torch.equal(ref, out)


@settings(max_examples=40)
@given(
    family=FAMILIES,
    block=st.sampled_from([1, 2, 4, 8, 16]),
    prompt=prompts(16),
    max_new=st.integers(1, 40),
    noise=st.sampled_from([0.0, 0.2, 0.5]),
    eos_at=st.one_of(st.none(), st.integers(0, 39)),
)
def test_oracle_drafter_is_lossless(oracle, family, block, prompt, max_new, noise, eos_at):
    """Full and partial acceptance; EOS anywhere (inside or at the edge of a block); max_new_tokens inside a block."""
    target, drafter = TARGETS[family], DRAFTERS[(family, block)]
    oracle.target, oracle.noise = target, noise
    x = torch.tensor([prompt])
    eos = None
    if eos_at is not None:  # make the token the target emits at step `eos_at` the EOS token
        free = plain(target, x, max_new_tokens=40, eos_token_id=None)
        eos = int(free[0, x.shape[1] + eos_at])
    ref = plain(target, x, max_new_tokens=max_new, eos_token_id=eos)
    with count_forwards(target) as calls:
        out = assisted(target, drafter, x, max_new_tokens=max_new, eos_token_id=eos)
    # the oracle's own target calls are counted too; only the equality matters here
    assert torch.equal(ref, out)
    assert calls["n"] >= 1


def test_full_acceptance_commits_whole_blocks(oracle):
    """With a perfect drafter every round commits block_size + 1 tokens: tau = B + 1."""
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    oracle.target = target
    x = torch.tensor([[5, 9, 17, 33]])
    out = assisted(target, drafter, x, max_new_tokens=25, eos_token_id=None)
    assert torch.equal(out, plain(target, x, max_new_tokens=25, eos_token_id=None))
    stats = drafter.last_stats
    assert stats.acceptance_lengths and all(a == 4 for a in stats.acceptance_lengths)
    assert stats.tau == pytest.approx(5.0)


def test_text_generation_pipeline_takes_the_drafter(oracle):
    """``pipeline("text-generation", ..., assistant_model=drafter)``: the target's own text, drafted blocks used."""
    words = Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="0", eos_token=str(EOS))
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    oracle.target, oracle.noise = target, 0.3
    kw = dict(max_new_tokens=24, do_sample=False, return_tensors=True)
    (plain_out,) = pipeline("text-generation", model=target, tokenizer=tokenizer)("5 9 17 33", **kw)
    drafter.last_stats = None
    assisted_pipe = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    (out,) = assisted_pipe("5 9 17 33", **kw)
    assert len(plain_out["generated_token_ids"]) > 4
    assert list(out["generated_token_ids"]) == list(plain_out["generated_token_ids"])
    assert drafter.last_stats is not None and drafter.last_stats.accepted_tokens > 0


def test_untrained_drafter_rounds_and_stats():
    target, drafter = TARGETS["qwen3"], DRAFTERS[("qwen3", 8)]
    x = torch.tensor([[7, 8, 9, 10, 11]])
    with count_forwards(target) as calls:
        out = assisted(target, drafter, x, max_new_tokens=12, eos_token_id=None)
    new = out.shape[1] - x.shape[1]
    assert new == 12
    stats = drafter.last_stats
    # one draft per verification forward, except a last round with one token left, where transformers skips drafting
    assert calls["n"] - 1 <= stats.rounds <= calls["n"]
    assert stats.committed_tokens <= new and stats.tau >= 1.0


def test_streamer_receives_the_same_tokens():
    class Collect(TextStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.chunks.append("end")

    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    x = torch.tensor([[4, 5, 6]])
    streamer = Collect()
    out = assisted(target, drafter, x, max_new_tokens=10, eos_token_id=None, streamer=streamer)
    flat = [t for c in streamer.chunks[:-1] for t in c]
    assert streamer.chunks[-1] == "end"
    assert flat == out[0].tolist()  # the prompt first, then every committed token exactly once
    # the fast loop as custom_generate: transformers hands it no streamer (only its own new arguments) and has
    # already streamed the prompt
    streamer = Collect()
    kw = dict(max_new_tokens=10, eos_token_id=None, attention_mask=torch.ones_like(x), streamer=streamer)
    out = target.generate(x, custom_generate=d3d_generate, drafter=drafter, **kw)
    assert streamer.chunks[-1] == "end"
    assert [t for c in streamer.chunks[:-1] for t in c] == out[0].tolist()


@pytest.mark.parametrize("async_drafting", [False, True])
def test_each_committed_token_enters_the_drafters_cache_once(monkeypatch, async_drafting):
    """transformers crops an assistant's cache as if it held the whole last draft; the D3D cache holds committed
    tokens only, so that crop would make every draft after a rejection recompute valid entries."""
    from hf_d3d import D3DCandidateGenerator

    target, drafter = TARGETS["llama"], make_drafter(TARGETS["llama"], block_size=8)  # untrained: most drafts fail
    drafter.config.async_drafting = async_drafting
    context_rows, run = [], D3DCandidateGenerator._run

    def counting(self, ids, layout, keep):
        context_rows.append(layout.num_context)  # the rows that enter the cache
        return run(self, ids, layout, keep)

    monkeypatch.setattr(D3DCandidateGenerator, "_run", counting)
    x = torch.tensor([[4, 5, 6, 7]])
    out = assisted(target, drafter, x, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(out, plain(target, x, max_new_tokens=24, eos_token_id=None))
    assert drafter.last_stats.rounds > 3 and drafter.last_stats.tau < 3
    if not async_drafting:  # (a packed pass caches its whole draft, then keeps what was committed)
        assert sum(context_rows) < out.shape[1]  # every committed token once; the last ones need no draft


def test_the_drafter_alone_generates_as_a_causal_lm_with_its_cache():
    """Outside assisted decoding the drafter is a plain causal LM: ``drafter.generate`` (which hands the KV cache to
    forward as ``cache`` from transformers 5.24) equals greedy decoding by full recomputation; the cache can also
    be passed by its older name, not both."""
    from transformers import DynamicCache

    drafter = DRAFTERS[("llama", 4)]
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        out = drafter.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False)
        seq = x
        for _ in range(8):
            nxt = drafter(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        assert torch.equal(out, seq)
        for name in ("cache", "past_key_values"):
            cache = DynamicCache()
            first = drafter(seq[:, :-3], **{name: cache})
            field = "cache" if "cache" in type(first).__dataclass_fields__ else "past_key_values"  # 5.24 / 5.23
            assert getattr(first, field) is cache  # handed back under the output's field, as generate reads it
            got = drafter(seq[:, -3:], **{name: cache}).logits
            torch.testing.assert_close(got, drafter(seq, use_cache=False).logits[:, -3:])
        with pytest.raises(ValueError, match="not both"):
            drafter(seq, cache=DynamicCache(), past_key_values=DynamicCache())
