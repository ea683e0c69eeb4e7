"""Draft trees in the fast loop: the pure tree functions, cache compaction, and losslessness against plain greedy."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache
from transformers.generation import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from conftest import FAMILIES, VOCAB, make_drafter, prompts, tiny_target
from hf_d3d import speculative_generate
from hf_d3d.modeling.compat_d3d import cache_kwarg
from hf_d3d.tree import DraftTree, build_tree, keep_path, tree_inputs, tree_size, verify_tree_greedy

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}


def plain(target, x, max_new, **kw):
    return target.generate(
        x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, eos_token_id=None, **kw
    )


def _candidates(depth: int, width: int, seed: int) -> tuple[list[list[float]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(depth, 50, generator=g).mul(2).log_softmax(-1).topk(width, -1)
    return logp.values.tolist(), (logp.indices + 10).tolist()


@settings(max_examples=60)
@given(depth=st.integers(1, 4), width=st.integers(1, 3), nodes=st.integers(0, 12), seed=st.integers(0, 10_000))
def test_build_tree_is_the_best_tree_of_every_size(depth, width, nodes, seed):
    logp, toks = _candidates(depth, width, seed)
    tree = build_tree(logp, toks, nodes)
    # every path through the candidates, scored by its summed log-probability
    score = {}
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(width), repeat=d):
            score[ranks] = sum(logp[i][r] for i, r in enumerate(ranks))
    assert len(tree.tokens) == min(nodes, len(score))
    ranks_of = []
    for i, (parent, d) in enumerate(zip(tree.parents, tree.depths)):
        assert parent < i  # parents come first
        assert d == (1 if parent < 0 else tree.depths[parent] + 1)
        rank = toks[d - 1].index(tree.tokens[i])
        ranks_of.append((ranks_of[parent] if parent >= 0 else ()) + (rank,))
    assert len(set(ranks_of)) == len(ranks_of)
    # the chosen nodes are the best ones: no path left out scores higher than one taken
    taken = [score[r] for r in ranks_of]
    left = [v for r, v in score.items() if r not in set(ranks_of)]
    if taken and left:
        assert max(left) <= min(taken) + 1e-9
    assert all(a >= b - 1e-9 for a, b in zip(taken, taken[1:]))  # best first: each prefix is the best of its size
    expected = 1 + sum(math.exp(v) for v in taken)
    assert tree.value[-1] == pytest.approx(expected) if taken else tree.value == []


def test_tree_size_follows_the_round_costs():
    tree = DraftTree([5, 6, 7], [-1, -1, 0], [1, 1, 2], [1.6, 1.8, 2.1])
    assert tree_size(tree, None) == 3
    assert tree_size(tree, [1.2, 1.25, 1.3]) == 3  # 2.1 / 1.3 is the best ratio
    assert tree_size(tree, [1.0, 2.0, 3.0]) == 1
    assert tree_size(DraftTree([5], [-1], [1], [1.01]), [1.5]) == 1  # at least one node once there is a draft


def test_verify_tree_greedy_cases():
    # root -> a(5) -> c(7); root -> b(6) -> d(8) -> e(9)
    tree = DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 1, 3], [1, 1, 2, 2, 3], [0] * 5)
    rows = lambda root, a, b, c, d, e: [root, a, b, c, d, e]  # noqa: E731  (the target's argmax per row)
    assert verify_tree_greedy(tree, rows(6, 0, 8, 0, 9, 4)) == ([1, 3, 4], 4)  # the second branch, to its end
    assert verify_tree_greedy(tree, rows(5, 7, 0, 3, 0, 0)) == ([0, 2], 3)  # first branch, bonus after c
    assert verify_tree_greedy(tree, rows(5, 2, 0, 0, 0, 0)) == ([0], 2)  # correction after a
    assert verify_tree_greedy(tree, rows(1, 0, 0, 0, 0, 0)) == ([], 1)  # nothing accepted
    assert verify_tree_greedy(DraftTree([], [], [], []), [4]) == ([], 4)
    assert tree.best_chain(-1) == [0, 2] and tree.best_chain(1) == [3, 4] and tree.best_chain(4) == []
    assert tree.path_to(4) == [6, 8, 9] and tree.path_to(-1) == []


def test_tree_mask_rows_see_the_cache_the_committed_tokens_and_their_ancestors():
    tree = DraftTree([5, 6, 7], [-1, -1, 1], [1, 1, 2], [0] * 3)
    ids, pos, mask = tree_inputs(tree, [3, 4], past=2, device=torch.device("cpu"), dtype=torch.float32, additive=False)
    assert ids.tolist() == [[3, 4, 5, 6, 7]]
    assert pos.tolist() == [[2, 3, 4, 4, 5]]  # siblings share a position; the root (4) is at 3
    expect = [
        [1, 1, 1, 0, 0, 0, 0],  # committed 3: cache + itself
        [1, 1, 1, 1, 0, 0, 0],  # root 4
        [1, 1, 1, 1, 1, 0, 0],  # node 5
        [1, 1, 1, 1, 0, 1, 0],  # node 6
        [1, 1, 1, 1, 0, 1, 1],  # node 7, child of 6
    ]
    assert mask[0, 0].int().tolist() == expect
    _, _, add = tree_inputs(tree, [3, 4], past=2, device=torch.device("cpu"), dtype=torch.float32, additive=True)
    assert torch.equal(add[0, 0] == 0, mask[0, 0])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_keep_path_leaves_the_cache_a_chain_forward_would(family):
    target = TARGETS[family]
    prompt = [7, 8, 9, 10]
    cache = DynamicCache()
    with torch.no_grad():
        target(torch.tensor([prompt[:-1]]), **{cache_kwarg(target): cache})
        # root 10 -> 20 -> 21 -> 22 ; root -> 30 ; 20 -> 31 -> 32: accept 20, 31, 32 (nodes 0, 4, 5)
        tree = DraftTree([20, 30, 21, 22, 31, 32], [-1, -1, 0, 2, 0, 4], [1, 1, 2, 3, 2, 3], [0] * 6)
        ids, pos, mask = tree_inputs(tree, prompt[-1:], 3, torch.device("cpu"), target.dtype, additive=False)
        tree_logits = target(ids, **{cache_kwarg(target): cache}, position_ids=pos, attention_mask=mask).logits[0]
        keep_path(cache, 3, [0, 4, 5])
        chain = DynamicCache()
        chain_logits = target(torch.tensor([prompt + [20, 31, 32]]), **{cache_kwarg(target): chain}).logits[0]
    assert cache.get_seq_length() == chain.get_seq_length() == 7
    for kept, ref in zip(cache.layers, chain.layers):
        torch.testing.assert_close(kept.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kept.values, ref.values, atol=1e-5, rtol=1e-5)
    # each node's logits are those of its own path
    torch.testing.assert_close(tree_logits[[1, 5, 6]], chain_logits[[4, 5, 6]], atol=1e-4, rtol=1e-4)


@settings(max_examples=40)
@given(
    family=FAMILIES,
    block=st.sampled_from([1, 2, 4, 8]),
    prompt=prompts(16),
    max_new=st.integers(1, 40),
    demote=st.sampled_from([0.0, 0.3, 0.7]),
)
def test_tree_equals_plain_greedy_when_the_right_token_is_second(oracle, family, block, prompt, max_new, demote):
    target = TARGETS[family]
    oracle.target, oracle.demote = target, demote
    x = torch.tensor([prompt])
    out = speculative_generate(target, make_drafter(target, block_size=block), x, max_new, eos_token_id=None, tree=True)
    assert torch.equal(out, plain(target, x, max_new))


def test_tree_recovers_what_a_chain_misses(oracle):
    """With the right token often ranked second, a tree of the same size commits more tokens per forward."""
    target = TARGETS["llama"]
    drafter = make_drafter(target, block_size=8)
    oracle.target, oracle.demote = target, 0.5
    x = torch.tensor([[11, 12, 13]])
    tau = {}
    for tree in (False, True):
        torch.manual_seed(0)
        out = speculative_generate(target, drafter, x, 60, eos_token_id=None, tree=tree)
        assert torch.equal(out, plain(target, x, 60))
        tau[tree] = drafter.last_stats.tau
    assert tau[True] > tau[False] + 0.3, tau


def test_tree_with_eager_attention_and_a_logits_processor():
    target = tiny_target("qwen3")
    target.config._attn_implementation = "eager"  # the tree mask then goes in additive form
    drafter = make_drafter(target, block_size=4)
    x = torch.tensor([[5, 9, 5, 9, 30]])
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    ref = plain(target, x, 30, repetition_penalty=1.5)
    out = speculative_generate(target, drafter, x, 30, eos_token_id=None, logits_processor=penalty, tree=True)
    assert torch.equal(out, ref)


def test_tree_true_refuses_what_it_cannot_verify():
    target = TARGETS["llama"]
    drafter = make_drafter(target)
    x = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="greedy"):
        speculative_generate(target, drafter, x, 4, do_sample=True, tree=True)
    with pytest.raises(ValueError, match="dynamic cache"):
        speculative_generate(target, drafter, x, 4, cache_implementation="static", tree=True)
    with pytest.raises(ValueError, match="async"):
        speculative_generate(target, drafter, x, 4, async_drafting=True, tree=True)
    sliding = tiny_target("llama")
    sliding.config.sliding_window = 16
    with pytest.raises(ValueError, match="full-attention"):
        speculative_generate(sliding, make_drafter(sliding), x, 4, tree=True)


def test_targets_without_rotary_positions_fall_back_to_a_chain():
    """ALiBi (Bloom) builds positions from the 2D mask: no tree; the default quietly verifies chains instead."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)).eval()
    drafter = make_drafter(TARGETS["llama"], block_size=4)
    x = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(speculative_generate(bloom, drafter, x, 12, eos_token_id=None), plain(bloom, x, 12))
    with pytest.raises(ValueError, match="rotary"):
        speculative_generate(bloom, drafter, x, 4, tree=True)


def test_a_long_prompt_is_prefilled_apart_from_the_tree(monkeypatch):
    """Beyond _JOIN_PREFILL uncached tokens the prompt gets its own forward (no dense prompt-sized tree mask)."""
    from hf_d3d import speculative

    target = TARGETS["qwen3"]
    drafter = make_drafter(target, block_size=4)
    x = torch.tensor([list(range(10, 30))])
    widths = []

    def record(module, args, kwargs):
        widths.append((args[0] if args else kwargs["input_ids"]).shape[1])

    hook = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        monkeypatch.setattr(speculative, "_JOIN_PREFILL", 8)
        out = speculative_generate(target, drafter, x, 10, eos_token_id=None, tree=True)
    finally:
        hook.remove()
    assert torch.equal(out, plain(target, x, 10))
    assert widths[0] == 19  # the prompt but its last token, alone; the last token is the first tree's root
    assert all(w <= 1 + 4 for w in widths[1:])  # then root + at most 4 nodes per forward
