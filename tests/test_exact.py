"""Exact verification: in bf16, speculative decoding must reproduce plain greedy generate bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaForCausalLM

from conftest import VOCAB, make_drafter, prompts, tiny_target
from hf_d3d import exact
from hf_d3d.exact import EXACT_ATTENTION, exact_verification, is_exact, rows_match_decode
from hf_d3d.modeling.compat_d3d import cache_kwarg
from hf_d3d.speculative import speculative_generate

TARGET = tiny_target("llama", layers=3).to(torch.bfloat16)
DRAFTER = make_drafter(TARGET, block_size=8)


def plain(x, max_new):
    return TARGET.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new)


def test_rows_match_decode_on_this_machine():
    """The premise of exact verification: small-row linears and per-row attention give decode-step bits."""
    assert rows_match_decode(TARGET)


def test_verify_rows_run_one_attention_call_each(monkeypatch):
    calls = []
    real = exact.sdpa_attention_forward
    monkeypatch.setattr(
        exact, "sdpa_attention_forward", lambda m, q, *a, **k: calls.append(q.shape[2]) or real(m, q, *a, **k)
    )
    ids = torch.randint(4, VOCAB, (1, 20))
    with exact_verification(TARGET), torch.no_grad():
        out = TARGET(ids[:, :12], use_cache=True)
        assert calls == [12] * 3  # a prefill stays whole
        calls.clear()
        cache = out.past_key_values
        TARGET(ids[:, 12:], **{cache_kwarg(TARGET): cache})
    assert calls == [1] * (8 * 3)  # 8 rows, 3 layers


@settings(max_examples=25)
@given(
    prompt=prompts(24),
    max_new=st.integers(1, 40),
    fast=st.booleans(),
)
# a verify forward's v_proj, over several rows, rounded one output of two rows unlike the one-row decode kernel
@example(prompt=[42, 70, 70, 42, 70, 43], max_new=18, fast=False)
def test_exact_greedy_equals_plain_bf16(prompt, max_new, fast):
    x = torch.tensor([prompt])
    ref = plain(x, max_new)
    with exact_verification(TARGET):
        if fast:  # a draft tree, by default
            out = speculative_generate(TARGET, DRAFTER, x, max_new_tokens=max_new)
        else:
            out = TARGET.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, assistant_model=DRAFTER
            )
    assert torch.equal(ref, out)


def test_verify_linears_take_one_row_at_a_time_unless_batched():
    """Batched bf16 linears are not row-invariant for every input (on this project's AVX512-BF16 CPU these tokens
    make layer 1's v_proj round two of nine rows unlike the one-row kernel a decode step runs), so exact
    verification computes a verify forward's linears one row at a time; ``batched_linears=True`` keeps them whole."""
    ids = torch.tensor([[42, 70, 70, 42, 70, 43, 9, 9, 9, 9, 9, 9, 9, 9, 73]])
    v_proj, seen = TARGET.model.layers[1].self_attn.v_proj, []
    v_proj.forward = lambda x: seen.append(x.shape[1]) or torch.nn.Linear.forward(v_proj, x)  # a hooked forward

    def verify_equals_steps(**kw) -> bool:
        with exact_verification(TARGET, **kw), torch.no_grad():
            cache = DynamicCache(config=TARGET.config)
            TARGET(ids[:, :6], **{cache_kwarg(TARGET): cache})
            steps = [TARGET(ids[:, [i]], **{cache_kwarg(TARGET): cache}).logits[0, 0] for i in range(6, 15)]
            cache.crop(6 - cache.get_seq_length())
            seen.clear()
            verify = TARGET(ids[:, 6:], **{cache_kwarg(TARGET): cache}).logits[0]
        return all(torch.equal(verify[i], steps[i]) for i in range(9))

    try:
        assert verify_equals_steps()
        assert seen == [1] * 9
        verify_equals_steps(batched_linears=True)  # its bits depend on the machine's kernels
        assert seen == [9]
        assert "forward" in v_proj.__dict__  # the block restored the forward it found
    finally:
        del v_proj.forward
    assert all("forward" not in m.__dict__ for m in TARGET.modules())


def test_first_round_prefills_the_prompt_alone(oracle):
    """The first round proposes nothing (plain generate prefills the prompt alone); it still counts in tau."""
    x = torch.tensor([[5, 9, 17, 33]])
    ref = TARGET.generate(x, do_sample=False, max_new_tokens=19, eos_token_id=None)
    oracle.reference = ref  # drafts plain generate's own tokens
    with exact_verification(TARGET):
        out = TARGET.generate(x, do_sample=False, max_new_tokens=19, assistant_model=DRAFTER, eos_token_id=None)
    assert torch.equal(out, ref)
    lengths = DRAFTER.last_stats.acceptance_lengths
    assert lengths[0] == 0 and all(a == 8 for a in lengths[1:])  # the oracle is always right after that
    with exact_verification(TARGET):
        speculative_generate(TARGET, DRAFTER, x, max_new_tokens=19, eos_token_id=None)
    assert DRAFTER.last_stats.acceptance_lengths == [0, 8, 8]  # 1 + 9 + 9 tokens


def test_exact_verification_reaches_the_drafter_through_the_generation_config_only():
    """Nothing is set on the drafter; the target's generation config carries the two fields for the block alone."""
    before = dict(vars(DRAFTER))
    with exact_verification(TARGET):
        assert TARGET.generation_config.d3d_prefill_alone is True
        assert TARGET.generation_config.d3d_target_dtype == "torch.bfloat16"
        TARGET.generate(torch.tensor([[5, 9]]), do_sample=False, max_new_tokens=4, assistant_model=DRAFTER)
        assert vars(DRAFTER).keys() == before.keys()
    assert not hasattr(TARGET.generation_config, "d3d_prefill_alone")
    assert not hasattr(TARGET.generation_config, "d3d_target_dtype")


def generate_exact_widths(x, **kw):
    """Greedy ``generate`` under exact verification, and how many tokens each target forward read."""
    widths = []
    hook = TARGET.register_forward_pre_hook(lambda m, a, k: widths.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        with exact_verification(TARGET):
            out = TARGET.generate(x, do_sample=False, max_new_tokens=20, **kw)
    finally:
        hook.remove()
    return out, widths


def test_other_assistants_are_covered_too():
    assistant = LlamaForCausalLM(tiny_target("llama", layers=1, seed=3).config).to(torch.bfloat16).eval()
    x = torch.tensor([[5, 9, 17, 33, 8]])
    out, widths = generate_exact_widths(x, assistant_model=assistant)
    assert torch.equal(out, plain(x, 20))
    assert widths[0] == x.shape[1] and max(widths[1:]) > 1  # the prompt alone, then verified drafts
    assert "_get_candidate_generator" not in TARGET.__dict__


def test_prompt_lookup_is_covered_too():
    x = torch.tensor([[5, 9, 17, 33, 5, 9, 17, 33, 5, 9]])  # repeats, so that lookup proposes from the first round
    out, widths = generate_exact_widths(x, prompt_lookup_num_tokens=4)
    assert torch.equal(out, plain(x, 20))
    assert widths[0] == x.shape[1] and max(widths[1:]) > 1  # the prompt alone, then verified drafts
    assert "_get_candidate_generator" not in TARGET.__dict__


def test_static_caches_and_padding_stay_right():
    """Rows whose mask is not a decode step's (padding here) keep their mask; a static cache's prefill stays whole."""
    x = torch.tensor([[5, 9, 17, 33, 8, 4]])
    kw = dict(do_sample=False, max_new_tokens=12, cache_implementation="static")
    ref = TARGET.generate(x, **kw)
    with exact_verification(TARGET):
        assert torch.equal(TARGET.generate(x, **kw), ref)
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[0, 1] = 0  # a padded position inside the cached prefix
    ids = torch.randint(4, VOCAB, (1, 10))
    with torch.no_grad():
        cache = TARGET(ids[:, :6], attention_mask=mask[:, :6]).past_key_values
        want = TARGET(ids[:, 6:], attention_mask=mask, **{cache_kwarg(TARGET): cache}).logits
        cache.crop(-4)
        with exact_verification(TARGET), pytest.warns(UserWarning, match="keep their mask"):
            got = TARGET(ids[:, 6:], attention_mask=mask, **{cache_kwarg(TARGET): cache}).logits
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.02)


def test_context_restores_the_target_and_refuses_what_it_cannot_make_exact():
    assert not is_exact(TARGET)
    with exact_verification(TARGET) as t:
        assert is_exact(t) and "generate" in TARGET.__dict__
        with pytest.raises(ValueError, match="dynamic cache"):
            speculative_generate(
                TARGET, DRAFTER, torch.tensor([[5, 6]]), max_new_tokens=4, cache_implementation="static"
            )
    assert TARGET.config._attn_implementation == "sdpa" and "generate" not in TARGET.__dict__
    eager = tiny_target("llama", layers=1)
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="sdpa"):
        with exact_verification(eager):
            pass
    assert EXACT_ATTENTION not in ("sdpa", "eager")


def test_targets_with_matmuls_outside_linears_are_refused():
    """Stacked expert weights are multiplied outside nn.Linear, so their verify rows would not be split."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           attn_implementation="sdpa")  # fmt: skip
    moe = MixtralForCausalLM(config)
    with pytest.raises(ValueError, match="row by row.*Experts"):
        with exact_verification(moe):
            pass
    assert moe.config._attn_implementation == "sdpa" and "generate" not in moe.__dict__
    with exact_verification(moe, batched_linears=True):  # batched linears claim nothing per row
        pass


@settings(max_examples=25)
@given(prompt=prompts(24), max_new=st.integers(1, 40))
def test_exact_draft_trees_equal_plain_bf16(oracle, prompt, max_new):
    """Tree rows see the cache and their ancestors: computed over exactly those keys, each is a decode step."""
    x = torch.tensor([prompt])
    ref = plain(x, max_new)
    oracle.target, oracle.demote = TARGET, 0.5  # paths through second-ranked nodes, so rows gather sparse keys
    with exact_verification(TARGET):
        out = speculative_generate(TARGET, DRAFTER, x, max_new_tokens=max_new, tree=True)
    assert torch.equal(ref, out)


def test_exact_tree_rows_gather_their_keys(monkeypatch):
    """Each tree row's attention runs over the cache plus its own ancestors, maskless, one call per row."""
    from hf_d3d.tree import DraftTree, tree_inputs

    seen = []
    real = exact.sdpa_attention_forward
    monkeypatch.setattr(
        exact,
        "sdpa_attention_forward",
        lambda m, q, k, v, mask, **kw: seen.append((k.shape[2], mask is None)) or real(m, q, k, v, mask, **kw),
    )
    tree = DraftTree([20, 30, 21], [-1, -1, 0], [1, 1, 2], [0] * 3)
    ids, pos, mask = tree_inputs(tree, [9], 5, torch.device("cpu"), TARGET.dtype, additive=False)
    with exact_verification(TARGET), torch.no_grad():
        cache = TARGET(torch.randint(4, VOCAB, (1, 5)), use_cache=True).past_key_values
        seen.clear()
        TARGET(ids, **{cache_kwarg(TARGET): cache}, position_ids=pos, attention_mask=mask)
    assert seen == [(6, True), (7, True), (7, True), (8, True)] * 3  # root, 20, 30 (sibling), 21 (child of 20)
