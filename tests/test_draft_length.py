"""Cost-aware draft length: the pure choice, its losslessness in every path, and the calibration that feeds it."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper

from conftest import EOS, FAMILIES, make_drafter, prompts, tiny_target
from hf_d3d import D3DCandidateGenerator, D3DConfig, speculative_generate
from hf_d3d.calibrate import measure_round_cost, write_round_cost
from hf_d3d.evaluate import count_forwards
from hf_d3d.modeling.generation_d3d import cpu_kind, draft_length, round_cost_key

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}
DRAFTERS = {(fam, b): make_drafter(t, block_size=b) for fam, t in TARGETS.items() for b in (2, 4, 8)}
probability = st.floats(0.0, 1.0)
cost = st.floats(0.1, 10.0)


def expected_tokens(confidence: list[float], k: int) -> float:
    total, reach = 1.0, 1.0
    for p in confidence[:k]:
        reach *= p
        total += reach
    return total


def test_draft_length_examples():
    steps = [1.2, 1.25, 1.6, 1.6, 1.6]  # a CPU-like verify cost: flat within a kernel's row tile, then a step
    assert draft_length([0.99] * 5, steps) == 5  # sure drafts: the step is worth crossing, and 5 costs as 3
    assert draft_length([0.9, 0.6, 0.3, 0.3, 0.3], steps) == 2  # the step does not pay for unlikely tokens
    assert draft_length([0.9] * 4, [1.0] * 4) == 4  # free tokens are always worth proposing
    assert draft_length([0.5, 0.5], [1.0, 3.0]) == 1
    assert draft_length([0.3, 0.3], [1.8, 1.9]) == 0  # no draft beats a plain step: 1.3 tokens for 1.8 steps
    assert draft_length([], [1.0]) == 0 and draft_length([0.5], []) == 0


@given(st.lists(st.tuples(probability, cost), min_size=1, max_size=12))
def test_draft_length_maximises_expected_tokens_per_cost(pairs):
    confidence, costs = [p for p, _ in pairs], [c for _, c in pairs]
    k = draft_length(confidence, costs)
    rates = [1.0] + [expected_tokens(confidence, j) / costs[j - 1] for j in range(1, len(pairs) + 1)]  # k = 0..n
    assert 0 <= k <= len(pairs)
    assert rates[k] == pytest.approx(max(rates))
    assert all(r < rates[k] or j >= k for j, r in enumerate(rates))  # ties go to the shorter draft


def plain(target, x, max_new, eos, **kw):
    return target.generate(
        x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, eos_token_id=eos, **kw
    )


def decode(target, drafter, x, max_new, eos, fast: bool, costs: list[float], tree: bool = False):
    """Decode through the fast loop (a chain, or a draft tree sized by the same costs) or
    ``generate(assistant_model=...)`` with ``costs`` as the CPU round cost."""
    drafter.config.round_cost = {"cpu": costs}
    try:
        if fast:
            return speculative_generate(target, drafter, x, max_new_tokens=max_new, eos_token_id=eos, tree=tree)
        return plain(target, x, max_new, eos, assistant_model=drafter)
    finally:
        drafter.config.round_cost = None


@settings(max_examples=30)
@given(
    family=FAMILIES,
    block=st.sampled_from([2, 4, 8]),
    prompt=prompts(16),
    max_new=st.integers(1, 40),
    noise=st.sampled_from([None, 0.0, 0.3]),
    costs=st.lists(cost, min_size=1, max_size=8),
    eos_on=st.booleans(),
    fast=st.booleans(),
    tree=st.booleans(),
)
def test_any_round_cost_is_lossless(oracle, family, block, prompt, max_new, noise, costs, eos_on, fast, tree):
    """Whatever the measured costs, both paths (chain or tree) give plain greedy's tokens; only the drafts change."""
    target, drafter = TARGETS[family], DRAFTERS[(family, block)]
    oracle.target, oracle.noise = (target, noise) if noise is not None else (None, 0.0)
    x = torch.tensor([prompt])
    eos = EOS if eos_on else None
    assert torch.equal(decode(target, drafter, x, max_new, eos, fast, costs, tree), plain(target, x, max_new, eos))


@pytest.mark.parametrize("fast", [True, False])
def test_costly_rounds_propose_one_token_and_free_ones_the_whole_block(oracle, fast):
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    oracle.target = target  # right every time: confidences near 1
    x = torch.tensor([[5, 6, 7, 8]])
    ref = plain(target, x, 30, None)
    for costs, per_round in (([1.0, 50.0, 50.0, 50.0], 1), ([1.0, 1.0, 1.0, 1.0], 4)):
        assert torch.equal(decode(target, drafter, x, 30, None, fast, costs), ref)
        full = drafter.last_stats.acceptance_lengths[:-1]  # the last round may be cut by max_new_tokens
        assert full and all(a == per_round for a in full)


@pytest.mark.parametrize("fast", [True, False])
def test_rounds_that_cannot_pay_propose_nothing(oracle, fast):
    """Where no draft beats a plain decode step, greedy rounds verify the target's own token alone."""
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    oracle.target = target
    x = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(decode(target, drafter, x, 20, None, fast, [9.0] * 4), plain(target, x, 20, None))
    stats = drafter.last_stats
    assert stats.rounds >= 19 and stats.drafted_tokens == 0 and set(stats.acceptance_lengths) == {0}


@pytest.mark.parametrize("fast", [True, False])
def test_rounds_after_unpaying_ones_skip_the_drafter(oracle, fast):
    """After a round with nothing worth verifying the drafter rests 1, 2, 4, 8 rounds; a paying draft resets it."""
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    oracle.target = target
    x = torch.tensor([[5, 6, 7, 8]])
    with count_forwards(drafter) as drafts:
        assert torch.equal(decode(target, drafter, x, 20, None, fast, [9.0] * 4), plain(target, x, 20, None))
    rounds = drafter.last_stats.rounds  # one-token rounds; the fast loop's first token comes from the prefill
    assert rounds >= 19 and drafts["n"] == sum(r <= rounds for r in (1, 3, 6, 11, 20))


def test_a_paying_draft_ends_the_drafters_rest():
    drafter = DRAFTERS[("llama", 4)]
    gen = D3DCandidateGenerator(drafter)
    seq = torch.tensor([[5, 6, 7, 8]])
    drafted = []
    for costs in [[9.0] * 4] * 3 + [[1.0] * 4] * 3 + [[9.0] * 4] * 3:
        gen.round_cost = costs
        with count_forwards(drafter) as n:
            seq = gen.get_candidates(seq)[0][:, : seq.shape[1] + 1]  # the target commits one token
        drafted.append(n["n"])
    # rest 1 round, then 2; the costs fall and the third round after drafts 4 tokens; then rest 1 round again
    assert drafted == [1, 0, 1, 0, 0, 1, 1, 0, 1]


@pytest.mark.parametrize("fast", [True, False])
def test_sampling_rounds_that_cannot_pay(fast):
    """Sampling drafts nothing in the fast loop, and one token through transformers' loop (whose speculative sampling
    needs a draft row)."""
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    drafter.config.round_cost = {"cpu": [9.0] * 4}
    x = torch.tensor([[5, 6, 7, 8]])
    try:
        if fast:
            out = speculative_generate(target, drafter, x, max_new_tokens=12, do_sample=True, eos_token_id=None)
        else:
            out = target.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                max_new_tokens=12,
                eos_token_id=None,
                assistant_model=drafter,
            )
    finally:
        drafter.config.round_cost = None
    stats = drafter.last_stats
    assert out.shape[1] == x.shape[1] + 12
    assert stats.drafted_tokens == (0 if fast else stats.rounds)


def test_costly_rounds_verify_a_one_node_tree(oracle):
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    oracle.target = target
    x = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(
        decode(target, drafter, x, 30, None, True, [1.0, 50.0, 50.0, 50.0], tree=True), plain(target, x, 30, None)
    )
    stats = drafter.last_stats
    assert stats.drafted_tokens == stats.rounds and set(stats.acceptance_lengths[:-1]) == {1}


def test_sampled_draft_length_depends_on_the_distributions_only():
    """The cut may not look at the drawn tokens, or verification would see a biased sample of them."""
    target = tiny_target("llama", vocab=16, seed=3)
    drafter = make_drafter(target, block_size=6)
    # Cheap extra tokens: the cut falls where confidence runs out, so it would move with confidences of drawn tokens.
    drafter.config.round_cost = {"cpu": [1.0, 1.05, 1.1, 1.15, 1.2, 1.25]}
    x = torch.tensor([[4, 5, 6, 7]])
    procs = LogitsProcessorList([TemperatureLogitsWarper(1.5)])
    torch.manual_seed(0)
    lengths, drafts = set(), set()
    for _ in range(200):
        gen = D3DCandidateGenerator(drafter, procs, do_sample=True)
        seq, scores = gen.get_candidates(x)
        lengths.add(seq.shape[1] - x.shape[1])
        drafts.add(tuple(seq[0, x.shape[1] :].tolist()))
        assert scores.shape[1] == seq.shape[1] - x.shape[1]  # every proposed token keeps the q it was drawn from
    assert lengths == {2}  # one length whatever was drawn (reading the drawn tokens gives 1 or 2), and a cut
    assert len(drafts) > 20


def test_sampled_draft_length_ignores_how_far_the_draws_let_the_draft_run():
    """A processor that rules out every token after some drawn tokens ends the draft there (a stopping time, which
    keeps sampling exact); the cost cut must still be chosen over the whole block, or whether a token is proposed
    would depend on its own value."""
    target = tiny_target("llama", vocab=16, seed=3)
    drafter = make_drafter(target, block_size=6)
    # k = 1 beats k = 2 or 3, the whole block beats them all: a cut judged on a draft the draws ended at 2 or 3
    # slots would keep 1
    drafter.config.round_cost = {"cpu": [1.0, 1.3, 1.3, 1.3, 1.3, 0.5]}
    x = torch.tensor([[4, 5, 6, 7]])

    def after_odd_nothing(ids, scores):  # the slot after an odd drafted token has nothing proposable
        return torch.full_like(scores, float("-inf")) if ids.shape[1] > x.shape[1] and ids[0, -1] % 2 else scores

    torch.manual_seed(0)
    cut_short = 0
    for _ in range(100):
        gen = D3DCandidateGenerator(drafter, LogitsProcessorList([after_odd_nothing]), do_sample=True)
        draft = gen.get_candidates(x)[0][0, x.shape[1] :].tolist()
        assert all(t % 2 == 0 for t in draft[:-1])  # the draws end it only at an odd token
        assert len(draft) == 6 or draft[-1] % 2  # and nothing else does: the cost cut is the whole block
        cut_short += len(draft) in (2, 3)
    assert cut_short > 5


def test_costs_measured_with_few_row_linears_go_with_them(oracle):
    from hf_d3d import skinny_linears

    target = TARGETS["llama"]
    oracle.target, oracle.noise = target, 0.0  # every draft right: only the costs decide the draft length
    drafter = make_drafter(target, block_size=4)
    costs = {"cpu": [1.0, 50.0, 50.0, 50.0], round_cost_key("cpu", skinny=True): [1.0, 1.0, 1.0, 1.0]}
    drafter.config.round_cost = costs
    try:
        assert D3DCandidateGenerator(drafter).round_cost == costs["cpu"]
        assert D3DCandidateGenerator(drafter, skinny=True).round_cost == [1.0] * 4
        x = torch.tensor([[5, 6, 7]])
        kw = dict(assistant_model=drafter, do_sample=False, max_new_tokens=20, eos_token_id=None)
        # the bare assisted loop: the drafter gives the fp32 target's verify forwards few-row linears itself, so the
        # few-row costs apply (long drafts); so they do where the caller's skinny_linears marks the generation config
        target.generate(x, **kw)
        assert drafter.last_stats.drafted_tokens > 2 * drafter.last_stats.rounds
        with skinny_linears(target, drafter):
            target.generate(x, **kw)
        assert drafter.last_stats.drafted_tokens > 2 * drafter.last_stats.rounds
        assert not hasattr(target.generation_config, "d3d_skinny")
        drafted = {}
        for skinny in (None, False):  # None: on, as for any fp32 CPU target
            speculative_generate(target, drafter, x, max_new_tokens=20, eos_token_id=None, tree=False, skinny=skinny)
            stats = drafter.last_stats
            drafted[skinny] = stats.drafted_tokens / stats.rounds
        assert drafted[False] == 1.0 and drafted[None] > 2.0
        del costs[round_cost_key("cpu", skinny=True)]  # none measured that way: the plain ones
        assert D3DCandidateGenerator(drafter, skinny=True).round_cost == costs["cpu"]
    finally:
        drafter.config.round_cost = None


def test_round_cost_is_validated_and_chosen_by_device():
    with pytest.raises(ValueError, match="round_cost"):
        D3DConfig(round_cost={"cpu": []})
    with pytest.raises(ValueError, match="round_cost"):
        D3DConfig(round_cost={"cpu": [1.0, 0.0]})
    drafter = DRAFTERS[("qwen3", 4)]
    drafter.config.round_cost = {"cuda": [1.0, 1.0, 1.0, 1.0]}
    try:
        assert D3DCandidateGenerator(drafter).round_cost is None  # costs measured elsewhere do not apply here
        drafter.config.round_cost["cpu"] = [1.2, 1.3, 1.9, 2.0]
        assert D3DCandidateGenerator(drafter).round_cost == [1.2, 1.3, 1.9, 2.0]
        # a bf16 target has its own costs ("cpu" means fp32), and none recorded means the whole block
        assert D3DCandidateGenerator(drafter, target_dtype=torch.bfloat16).round_cost is None
        drafter.config.round_cost["cpu:bfloat16"] = [1.2, 1.2, 1.3, 1.3]
        assert D3DCandidateGenerator(drafter, target_dtype=torch.bfloat16).round_cost == [1.2, 1.2, 1.3, 1.3]
        assert D3DCandidateGenerator(drafter, target_dtype="float32").round_cost == [1.2, 1.3, 1.9, 2.0]
        # costs measured on this kind of CPU come before the plain "cpu" ones; another kind's never apply
        drafter.config.round_cost["cpu-some-other-isa"] = [9.0, 9.0, 9.0, 9.0]
        assert D3DCandidateGenerator(drafter).round_cost == [1.2, 1.3, 1.9, 2.0]
        drafter.config.round_cost[round_cost_key("cpu", None, cpu_kind())] = [1.1, 1.1, 1.1, 1.1]
        assert D3DCandidateGenerator(drafter).round_cost == [1.1, 1.1, 1.1, 1.1]
        assert D3DCandidateGenerator(drafter, target_dtype=torch.bfloat16).round_cost == [1.2, 1.2, 1.3, 1.3]
    finally:
        drafter.config.round_cost = None


def test_calibration_measures_every_length_and_records_it(tmp_path):
    target, drafter = TARGETS["llama"], DRAFTERS[("llama", 4)]
    costs = measure_round_cost(target, drafter, context_length=32, repeats=2)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    drafter.save_pretrained(tmp_path)
    write_round_cost(tmp_path, "cuda", [1.0, 1.0, 1.0, 1.0])
    write_round_cost(tmp_path, "cpu", costs)  # a second device keeps the first
    saved = json.loads((tmp_path / "config.json").read_text())["round_cost"]
    assert saved == {"cuda": [1.0, 1.0, 1.0, 1.0], "cpu": costs}
    assert type(drafter).from_pretrained(tmp_path).config.round_cost == saved
    assert not list(tmp_path.glob(".*"))  # no scratch file left behind
    with pytest.raises(FileNotFoundError):
        write_round_cost(tmp_path / "missing", "cpu", costs)
