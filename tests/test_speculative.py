"""The fast loop (`speculative_generate`, `custom_generate=d3d_generate`) and the pure verification functions."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sampling import _target_joint, chi_square_pvalue
from transformers import GenerationConfig
from transformers.generation import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper

from conftest import FAMILIES, make_drafter, prompts, tiny_target
from hf_d3d import d3d_generate, speculative_generate
from hf_d3d.evaluate import count_forwards
from hf_d3d.verify import verify_greedy, verify_sampling

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}
DRAFTERS = {(fam, b): make_drafter(t, block_size=b) for fam, t in TARGETS.items() for b in (1, 2, 4, 8, 16)}


def plain(target, x, max_new, eos):
    return target.generate(
        x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, eos_token_id=eos
    )


@settings(max_examples=50)
@given(
    family=FAMILIES,
    block=st.sampled_from([1, 2, 4, 8, 16]),
    prompt=prompts(20),
    max_new=st.integers(1, 40),
    noise=st.sampled_from([None, 0.0, 0.3]),
    demote=st.sampled_from([0.0, 0.5]),
    async_drafting=st.booleans(),
    eos_at=st.one_of(st.none(), st.integers(0, 39)),
    cache=st.sampled_from(["dynamic", "static"]),
    tree=st.sampled_from([None, False, True]),
    skinny=st.sampled_from([None, False]),  # None: on, as for every fp32 CPU target
)
def test_fast_loop_equals_plain_greedy(
    oracle, family, block, prompt, max_new, noise, demote, async_drafting, eos_at, cache, tree, skinny
):
    target, drafter = TARGETS[family], DRAFTERS[(family, block)]
    if noise is not None:  # None: the untrained drafter itself; else an oracle that is right with prob 1 - noise
        oracle.target, oracle.noise, oracle.demote = target, noise, demote  # demote: right token ranked second
    else:
        oracle.target = None
    x = torch.tensor([prompt])
    eos = None
    if eos_at is not None:
        eos = int(plain(target, x, 40, None)[0, x.shape[1] + eos_at])
    ref = plain(target, x, max_new, eos)
    out = speculative_generate(
        target,
        drafter,
        x,
        max_new_tokens=max_new,
        eos_token_id=eos,
        async_drafting=async_drafting,
        cache_implementation=cache,
        # None: a draft tree wherever it can run (dynamic cache, sync drafting), else a chain; True where it can
        tree=None if tree and (cache == "static" or async_drafting) else tree,
        skinny=skinny,
    )
    assert torch.equal(out, ref)
    stats = drafter.last_stats
    assert stats.committed_tokens == out.shape[1] - x.shape[1]  # every round is counted in the fast loop


@pytest.mark.parametrize("cache", [None, "static"])
def test_custom_generate_entry_point(cache):
    target, drafter = TARGETS["qwen3"], DRAFTERS[("qwen3", 4)]
    x = torch.tensor([[9, 10, 11, 12]])
    ref = plain(target, x, 20, 3)
    out = target.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=20,
        eos_token_id=3,
        do_sample=False,
        custom_generate=d3d_generate,
        drafter=drafter,
        cache_implementation=cache,
    )
    assert torch.equal(out, ref)


def test_async_fast_loop_queues_the_verify_before_the_packed_pass(monkeypatch):
    """Verify first (DESIGN section 3): in every async round of the fast loop the packed pass's inputs are prepared
    (its host reads made) before the target's verify forward for that draft is called, and the pass is launched just
    after it, so on a GPU the launch no longer holds the verify back and no read waits for it; the output stays
    plain greedy's."""
    from hf_d3d.modeling.generation_d3d import D3DCandidateGenerator

    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    calls = []  # (kind, tokens): the verify's input ids, or the draft a packed pass was prepared or started for
    real_prepare, real_start = D3DCandidateGenerator._prepare_packed, D3DCandidateGenerator._start_packed

    def prepare(self, input_ids, draft, logits):
        calls.append(("prepare", draft[0].tolist()))
        return real_prepare(self, input_ids, draft, logits)

    def start(self, prepared):
        calls.append(("start", prepared[1]))
        return real_start(self, prepared)

    def verify(_, args, kw):
        calls.append(("verify", (args[0] if args else kw["input_ids"])[0].tolist()))

    monkeypatch.setattr(D3DCandidateGenerator, "_prepare_packed", prepare)
    monkeypatch.setattr(D3DCandidateGenerator, "_start_packed", start)
    handle = target.register_forward_pre_hook(verify, with_kwargs=True)
    try:
        x = torch.tensor([[5, 6, 7, 8, 9]])
        out = speculative_generate(target, drafter, x, max_new_tokens=24, async_drafting=True)
    finally:
        handle.remove()
    assert torch.equal(out, plain(target, x, 24, None))
    started = [i for i, (kind, _) in enumerate(calls) if kind == "start"]
    assert len(started) >= 2
    for i in started:  # just before: the verify forward whose input ends with this draft, and before it, the prepare
        draft = calls[i][1]
        assert i >= 2 and calls[i - 2] == ("prepare", draft), calls
        assert calls[i - 1][0] == "verify" and calls[i - 1][1][-len(draft) :] == draft, calls


def test_a_seeded_generator_repeats_a_sampled_run_drafts_included():
    """speculative_generate(generator=...) draws every random number from it, the drafter's sampled drafts too: two
    runs with one seed agree whatever torch's global RNG holds (the drafts were drawn from the global RNG)."""
    target, drafter = TARGETS["qwen3"], DRAFTERS[("qwen3", 4)]
    x = torch.tensor([[9, 10, 11, 12]])
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        gen = torch.Generator().manual_seed(0)
        kw = dict(max_new_tokens=40, do_sample=True, top_k=0, temperature=1.5, generator=gen)
        runs.append(speculative_generate(target, drafter, x, **kw))
    assert torch.equal(runs[0], runs[1])


def test_static_cache_refuses_sliding_window_targets():
    target = tiny_target("llama")
    target.config.sliding_window = 8  # a ring-buffer cache layer cannot be rolled back by moving its position
    with pytest.raises(ValueError, match="full-attention targets only"):
        speculative_generate(target, make_drafter(target), torch.tensor([[5, 6]]), 4, cache_implementation="static")
    with pytest.raises(ValueError, match="'dynamic' or 'static'"):
        speculative_generate(target, make_drafter(target), torch.tensor([[5, 6]]), 4, cache_implementation="paged")
    flash = tiny_target("llama")
    flash.config._attn_implementation = "flash_attention_2"  # its kernels would see the whole buffer unmasked
    with pytest.raises(ValueError, match="sdpa or eager"):
        speculative_generate(flash, make_drafter(flash), torch.tensor([[5, 6]]), 4, cache_implementation="static")
    # a composite model whose language model alone runs flash: its text config says so, the top one does not
    inner = copy.deepcopy(flash.config)
    flash.config._attn_implementation = "sdpa"
    flash.config.get_text_config = lambda *a, **k: inner
    with pytest.raises(ValueError, match="sdpa or eager"):
        speculative_generate(flash, make_drafter(flash), torch.tensor([[5, 6]]), 4, cache_implementation="static")
    with pytest.raises(ValueError, match="tree=True: draft trees need sdpa or eager"):
        speculative_generate(flash, make_drafter(flash), torch.tensor([[5, 6]]), 4, tree=True)


def test_fast_loop_tau_counts_target_forwards(oracle):
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 8)]
    oracle.target = target
    x = torch.tensor([[5, 6, 7]])
    with count_forwards(target) as calls:
        out = speculative_generate(target, drafter, x, max_new_tokens=27, eos_token_id=None, tree=False)
    oracle.target = None
    verify_calls = len(drafter.last_stats.acceptance_lengths)
    assert drafter.last_stats.tau == (out.shape[1] - 3) / verify_calls
    assert verify_calls == 3  # 27 tokens with a perfect drafter: 9 per verification
    assert calls["n"] > verify_calls  # the oracle's own target calls come on top


def test_verify_greedy_cases():
    logits = torch.full((4, 10), -1.0)
    for i, tok in enumerate([2, 5, 7, 9]):
        logits[i, tok] = 1.0
    assert verify_greedy(torch.tensor([2, 5, 7]), logits) == (3, 9)  # all accepted, bonus 9
    assert verify_greedy(torch.tensor([2, 4, 7]), logits) == (1, 5)  # correction at the first mismatch
    assert verify_greedy(torch.tensor([0, 5, 7]), logits) == (0, 2)
    assert verify_greedy(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 2)


def test_verify_sampling_is_exact_for_the_first_token():
    torch.manual_seed(0)
    vocab = 6
    q = torch.softmax(torch.randn(2, vocab) * 2, -1)
    p = torch.softmax(torch.randn(3, vocab) * 2, -1)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(vocab)
    for _ in range(6000):
        draft = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(2)])
        n, nxt = verify_sampling(draft, q, p, gen)
        first = int(draft[0]) if n >= 1 else nxt
        counts[first] += 1
    assert chi_square_pvalue(counts, p[0]) > 1e-3
    # identical p and q: every draft token is accepted
    n, _ = verify_sampling(torch.tensor([1, 2]), p[:2], torch.cat([p[:2], p[2:]]), gen)
    assert n == 2


def test_verify_sampling_never_keeps_a_token_the_target_rules_out(monkeypatch):
    """Even when the uniform draw is exactly 0 (probability 2^-24 per token), a token with p == 0 (outside the
    target's top-k, suppressed) is rejected, as in transformers' own speculative sampling."""
    q = torch.tensor([[0.5, 0.5, 0.0]])
    p = torch.tensor([[0.0, 0.4, 0.6], [0.2, 0.3, 0.5]])
    monkeypatch.setattr(torch, "rand", lambda k, **kw: torch.zeros(k))
    n, nxt = verify_sampling(torch.tensor([0]), q, p)
    assert (n, nxt) == (0, 2)  # the replacement comes from norm(max(0, p - q)) = [0, 0, 1]


def test_fast_loop_sampling_matches_target_distribution():
    target = tiny_target("qwen3", vocab=12, seed=5)
    drafter = make_drafter(target, block_size=2)
    x = torch.tensor([[4, 7, 9]])
    with torch.no_grad():
        joint = _target_joint(target, x, LogitsProcessorList([TemperatureLogitsWarper(0.5)]))
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(144)
    for trial in range(2500):
        out = speculative_generate(
            target,
            drafter,
            x,
            max_new_tokens=3,
            do_sample=True,
            temperature=0.5,
            eos_token_id=None,
            async_drafting=trial % 2 == 0,
            generator=gen,
        )
        a, b = out[0, 3:5].tolist()
        counts[a * 12 + b] += 1
    assert chi_square_pvalue(counts, joint) > 1e-3


def test_fast_loop_settings_merge_as_generate_merges_them():
    """The call's settings over the target's generation config over transformers' defaults, as in generate:
    sampling keeps the default top 50 tokens, the target's EOS stops a call that passes its own config, and
    max_length bounds the whole sequence."""
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    x = torch.tensor([[9, 10, 11, 12]])
    torch.manual_seed(0)
    # a flat distribution (temperature 50) samples outside the top 50 of 96 tokens about half the time without top-k
    out = speculative_generate(
        target, drafter, x, max_new_tokens=40, do_sample=True, temperature=50.0, eos_token_id=None
    )
    with torch.no_grad():
        top50 = target(out).logits[0, x.shape[1] - 1 : -1].topk(50, -1).indices
    assert all(tok in row for tok, row in zip(out[0, x.shape[1] :].tolist(), top50.tolist()))

    ref = plain(target, x, 20, None)[0, x.shape[1] :].tolist()
    stop = next(t for i, t in enumerate(ref) if i >= 3 and t not in ref[:i])  # a token first made at step >= 3
    stopping = copy.deepcopy(target)
    stopping.generation_config.eos_token_id = stop
    config = GenerationConfig(max_new_tokens=20, do_sample=False)
    ref = stopping.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
    assert ref[0, -1] == stop and ref.shape[1] < x.shape[1] + 20
    assert torch.equal(speculative_generate(stopping, drafter, x, generation_config=config), ref)

    ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_length=12, eos_token_id=None)
    assert ref.shape[1] == 12
    assert torch.equal(speculative_generate(target, drafter, x, max_length=12, eos_token_id=None), ref)


def test_fast_loop_builds_the_processors_generate_builds(oracle):
    """Settings that need logits processors get generate's own; a caller's processors merge in as in generate.
    The oracle drafts the target's unprocessed greedy tokens (and noise): rounds accept some and reject others."""
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    oracle.target, oracle.noise = target, 0.2
    x = torch.tensor([[9, 10, 11, 12, 9, 10]])
    free = plain(target, x, 16, None)[0, x.shape[1] :].tolist()
    first = free[0]
    for setting, prompt in (
        (dict(repetition_penalty=1.5), x),
        (dict(no_repeat_ngram_size=2), x),
        (dict(encoder_no_repeat_ngram_size=2), torch.tensor([[9, 9, 9, 9]])),  # its continuation repeats "9 9"
        (dict(min_new_tokens=12, eos_token_id=first), x),
        (dict(min_length=x.shape[1] + 12, eos_token_id=first), x),
        (dict(forced_eos_token_id=free[3]), x),  # forced as the 16th new token: max_length as generate sets it
        (dict(suppress_tokens=[first]), x),
        (dict(begin_suppress_tokens=[first]), x),
        (dict(bad_words_ids=[[free[1], free[2]]]), x),
        (dict(sequence_bias={(free[2],): -100.0}), x),
        (dict(exponential_decay_length_penalty=(4, 3.0), eos_token_id=free[5]), x),
    ):
        kw = {"eos_token_id": None, **setting}
        ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False, **kw)
        assert not torch.equal(ref, plain(target, prompt, 16, None)), setting  # the setting changes the output
        for tree in (True, False):  # draft trees (greedy's default) and chains
            torch.manual_seed(0)  # the oracle's noise
            out = speculative_generate(target, drafter, prompt, max_new_tokens=16, tree=tree, **kw)
            assert torch.equal(out, ref), (setting, tree)
            stats = drafter.last_stats
            assert 0 < stats.accepted_tokens < stats.drafted_tokens, (setting, tree)  # accepted and rejected drafts
    # a caller's processor and settings at once, as generate merges them: another kind is added, the same kind
    # (a repetition penalty) takes the place of the one the setting builds
    extra = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)])
    kw = dict(max_new_tokens=16, eos_token_id=None, no_repeat_ngram_size=2, repetition_penalty=1.2)
    ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, logits_processor=extra, **kw)
    assert not torch.equal(ref, target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, **kw))
    assert torch.equal(speculative_generate(target, drafter, x, logits_processor=extra, **kw), ref)


def test_fast_loop_refuses_what_it_cannot_keep_lossless():
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    x = torch.tensor([[9, 10, 11, 12]])
    for setting in (dict(stop_strings=["ab"]), dict(max_time=5.0)):
        with pytest.raises(ValueError, match=f"{next(iter(setting))}.*custom_generate=d3d_generate"):
            speculative_generate(target, drafter, x, max_new_tokens=4, **setting)
    # another decoding mode is refused, not decoded greedily in its place
    with pytest.raises(ValueError, match="greedy decoding or sampling, not contrastive_search"):
        speculative_generate(target, drafter, x, max_new_tokens=4, penalty_alpha=0.6, top_k=4)
    # one sequence of ids is what the fast loop returns: other output shapes are refused, not ignored
    for setting in (dict(return_dict_in_generate=True), dict(num_return_sequences=2, do_sample=True)):
        with pytest.raises(ValueError, match="one sequence of token ids"):
            speculative_generate(target, drafter, x, max_new_tokens=4, **setting)
    # transformers' ensemble verification accepts against a target/draft mixture: on every path, refused
    mask = torch.ones_like(x)
    for run in (
        lambda: speculative_generate(target, drafter, x, max_new_tokens=4, assistant_ensemble_weight=0.5),
        lambda: target.generate(x, attention_mask=mask, assistant_model=drafter, assistant_ensemble_weight=0.5),
        lambda: target.generate(x, attention_mask=mask, custom_generate=d3d_generate, drafter=drafter,
                                assistant_ensemble_weight=0.5),
    ):  # fmt: skip
        with pytest.raises(ValueError, match="assistant_ensemble_weight"):
            run()
    # model inputs beyond the ids would be dropped: embeddings (here with no ids at all), images, token types
    with pytest.raises(ValueError, match=r"input_ids \(and attention_mask\) alone, got \['inputs_embeds'\]"):
        target.generate(
            inputs_embeds=target.get_input_embeddings()(x),
            custom_generate=d3d_generate,
            drafter=drafter,
            max_new_tokens=4,
        )
    # classifier-free guidance runs the target on an unconditional cache it extends at each call, drafts included
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor.*keep state"):
        speculative_generate(target, drafter, x, max_new_tokens=4, guidance_scale=1.5)
    with pytest.raises(ValueError, match="keep state"):
        target.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=4, assistant_model=drafter, guidance_scale=1.5
        )


def test_custom_generate_honours_stopping_criteria():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 9, dtype=torch.bool)

    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 8)]
    x = torch.tensor([[9, 10, 11, 12]])
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=20, eos_token_id=None, do_sample=False)
    crit = StoppingCriteriaList([StopAtLength()])
    ref = target.generate(x, stopping_criteria=crit, **kw)
    out = target.generate(x, stopping_criteria=crit, custom_generate=d3d_generate, drafter=drafter, **kw)
    assert ref.shape[1] == 9 and torch.equal(out, ref)
    # transformers' assisted loop would check it after a round of several tokens and run past length 9: refused
    with pytest.raises(ValueError, match=r"StopAtLength.*custom_generate=hf_d3d.d3d_generate"):
        target.generate(x, stopping_criteria=crit, assistant_model=drafter, **kw)


def test_a_callers_eos_or_length_criterion_is_kept_as_generate_keeps_it():
    """A caller's EosTokenCriteria or MaxLengthCriteria takes the place of the one generate builds: plain generate
    then stops on its ids or length alone. The fast loop does the same; the assisted loop, which cuts rounds at the
    config's EOS and length, refuses it."""
    from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 8)]
    x = torch.tensor([[9, 10, 11, 12]])
    free = plain(target, x, 20, None)[0, x.shape[1] :].tolist()
    early = next(t for t in free if free.index(t) >= 2)  # first generated at step 2 or later
    late = next(t for t in free if free.index(t) > free.index(early) + 2)
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False)
    for crit, eos in ((EosTokenCriteria(eos_token_id=late), early), (MaxLengthCriteria(x.shape[1] + 9), None)):
        crit = StoppingCriteriaList([crit])
        ref = target.generate(x, stopping_criteria=crit, eos_token_id=eos, **kw)
        assert not torch.equal(ref, target.generate(x, eos_token_id=eos, **kw))  # it did take the default's place
        out = target.generate(
            x, stopping_criteria=crit, eos_token_id=eos, custom_generate=d3d_generate, drafter=drafter, **kw
        )
        assert torch.equal(out, ref)
        direct = speculative_generate(target, drafter, x, stopping_criteria=crit, eos_token_id=eos, max_new_tokens=20)
        assert torch.equal(direct, ref)  # called directly, too
        with pytest.raises(ValueError, match=r"(EosToken|MaxLength)Criteria\(.*custom_generate=hf_d3d.d3d_generate"):
            target.generate(x, stopping_criteria=crit, eos_token_id=eos, assistant_model=drafter, **kw)
    # eos_token_id=None stops on no EOS, though the target's generation config names one
    configured, target.generation_config.eos_token_id = target.generation_config.eos_token_id, early
    try:
        ref = target.generate(x, eos_token_id=None, **kw)
        assert ref.shape[1] == x.shape[1] + 20
        out = target.generate(x, eos_token_id=None, custom_generate=d3d_generate, drafter=drafter, **kw)
        assert torch.equal(out, ref)
    finally:
        target.generation_config.eos_token_id = configured
    # generate's own criterion, passed again with the same value, is no reason to refuse
    same = StoppingCriteriaList([EosTokenCriteria(eos_token_id=early)])
    out = target.generate(x, stopping_criteria=same, eos_token_id=early, assistant_model=drafter, **kw)
    assert torch.equal(out, target.generate(x, eos_token_id=early, **kw))


def test_num_assistant_tokens_caps_the_draft_in_both_paths(oracle):
    target = TARGETS["llama"]
    drafter = make_drafter(target, block_size=8)
    drafter.generation_config.num_assistant_tokens = 3
    oracle.target = target  # a perfect drafter: every round commits the capped draft plus the bonus token
    x = torch.tensor([[5, 6, 7]])
    drafts: list[int] = []
    out = speculative_generate(
        target,
        drafter,
        x,
        max_new_tokens=20,
        eos_token_id=None,
        on_round=lambda d, a, n: drafts.append(len(d)),
        tree=False,
    )
    assert max(drafts) == 3 and drafter.last_stats.tau == 4.0
    assert torch.equal(out, plain(target, x, 20, None))
    out = speculative_generate(target, drafter, x, max_new_tokens=20, eos_token_id=None, tree=True)
    stats = drafter.last_stats
    assert stats.drafted_tokens <= 3 * stats.rounds and max(stats.acceptance_lengths) <= 3  # trees of 3 nodes
    assert torch.equal(out, plain(target, x, 20, None))
    out = target.generate(
        x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20, assistant_model=drafter
    )
    assert torch.equal(out, plain(target, x, 20, None))
    assert max(drafter.last_stats.acceptance_lengths) == 3  # transformers asks for num_assistant_tokens too


def test_fast_loop_computes_logits_only_for_verified_positions():
    """The prompt's prefill needs the LM head at the verified positions only, not at every prompt token."""
    target = tiny_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    rows = []
    forward = target.forward

    @functools.wraps(forward)  # keeps the signature the loop inspects
    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        rows.append(out.logits.shape[1])
        return out

    target.forward = recording
    prompt = torch.arange(5, 45).unsqueeze(0)  # 40 prompt tokens
    out = speculative_generate(target, drafter, prompt, max_new_tokens=10)
    del target.forward
    assert torch.equal(out, target.generate(prompt, max_new_tokens=10, do_sample=False))
    assert rows and max(rows) <= 5  # at most the 4 drafts + 1, never the 40 prompt rows


def test_fast_loop_takes_a_generation_config_as_generate_does():
    from transformers import GenerationConfig

    target = TARGETS["llama"]
    drafter = DRAFTERS[("llama", 4)]
    x = torch.tensor([[5, 9, 17, 4, 33]])
    config = GenerationConfig(max_new_tokens=21, do_sample=False, eos_token_id=None)
    out = speculative_generate(target, drafter, x, generation_config=config)
    assert torch.equal(out, target.generate(x, attention_mask=torch.ones_like(x), generation_config=config))
    assert out.shape[1] == x.shape[1] + 21 and config.max_new_tokens == 21  # the caller's config is not changed
    # keywords override the config's fields, as in generate
    assert speculative_generate(target, drafter, x, generation_config=config, max_new_tokens=5).shape[1] == 10
    with pytest.raises(TypeError, match="unexpected arguments"):
        speculative_generate(target, drafter, x, 4, temprature=0.7)
    ref = target.generate(x, attention_mask=torch.ones_like(x), generation_config=config, repetition_penalty=1.3)
    assert torch.equal(speculative_generate(target, drafter, x, generation_config=config, repetition_penalty=1.3), ref)
    with pytest.raises(ValueError, match="beam search"):
        speculative_generate(target, drafter, x, 4, num_beams=2)
