"""One target forward that verifies and drafts (hf_d3d.fused): same tokens as greedy generate, the same drafts as
the drafter's own pass, and a clear refusal of drafters it cannot fuse."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from conftest import EOS, FAMILIES, prompts, tiny_target
from hf_d3d import D3DDrafterModel, d3d_generate, fused, speculative_generate
from hf_d3d.fused import fusable, fused_generate, likely_ends
from hf_d3d.modeling.attention_d3d import pack_blocks

TARGETS = {fam: tiny_target(fam) for fam in ("llama", "qwen3")}


def _adapted(target, seed: int = 0, scale: float = 0.3, **kw) -> D3DDrafterModel:
    """A whole-LM drafter of ``target`` whose block adapters are random (as after training: they change the blocks)."""
    drafter = D3DDrafterModel.from_pretrained_lm(target, block_size=4, block_adapter_rank=4, **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "block_adapters" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return drafter.eval()


DRAFTERS = {fam: _adapted(t) for fam, t in TARGETS.items()}


@settings(max_examples=30)
@given(family=FAMILIES, prompt=prompts(12), max_new=st.integers(1, 24), hyps=st.integers(1, 4))
def test_same_tokens_as_greedy_generate(family, prompt, max_new, hyps):
    target = TARGETS[family]
    x = torch.tensor([prompt])
    want = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False)
    got = fused_generate(target, DRAFTERS[family], x, max_new_tokens=max_new, num_hypotheses=hyps)
    assert got.tolist() == want.tolist()
    stats = DRAFTERS[family].last_stats
    assert stats.committed_tokens >= got.shape[1] - x.shape[1]


def test_stops_at_eos_like_generate():
    target = TARGETS["llama"]
    for seed in range(12):
        torch.manual_seed(seed)
        x = torch.randint(4, 96, (1, 6))
        want = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False)
        got = fused_generate(target, DRAFTERS["llama"], x, max_new_tokens=40, eos_token_id=EOS)
        assert got.tolist() == want.tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("hyps", [1, 4])
def test_every_draft_is_the_drafters_own(family, hyps):
    """Each round's chain is what the drafter itself drafts in a block anchored after the text before the target's
    last token: slot 0 sits where that token goes, slots 0..S-2 give the S-1 tokens after it."""
    target, drafter = TARGETS[family], DRAFTERS[family]
    torch.manual_seed(1)
    prompt = torch.randint(4, 96, (1, 9))
    rounds, text = [], prompt[0].tolist()

    def on_round(draft, accepted, new):
        rounds.append((list(text), list(draft)))
        text.extend(new)

    fused_generate(
        target, drafter, prompt, max_new_tokens=24, num_hypotheses=hyps, eos_token_id=[], on_round=on_round, tree=False
    )
    checked = 0
    for before, draft in rounds:
        if not draft:
            continue
        prefix = torch.tensor([before[:-1]])  # the block was anchored at the token before the last committed one
        ids, layout = pack_blocks(prefix, 0, [prefix.shape[1] - 1], drafter.config.block_size, fill_id=0)
        with torch.no_grad():
            own = drafter(ids, layout=layout, use_cache=False).logits[0, prefix.shape[1] :].argmax(-1).tolist()
        assert own[0] == before[-1]  # the shift: slot 0 is the target's own token
        assert draft == own[1 : 1 + len(draft)]
        checked += 1
    assert checked >= 3


def test_likely_ends():
    assert likely_ends([], [], 3) == [-1]
    chain = [-1, 0, 1]
    assert likely_ends(chain, [0.9, 0.9, 0.9], 1) == [2]  # 0.73 for all three
    assert likely_ends(chain[:2], [0.1, 0.9], 2) == [-1, 1]  # 0.9 for none, 0.09 for both, 0.01 for one
    assert likely_ends(chain[:2], [0.5, 0.5], 5) == [-1, 0, 1]
    # root -> a (0.6) -> c (0.5); root -> b (0.3): ends root 0.1, a 0.3, b 0.3, c 0.3
    assert likely_ends([-1, -1, 0], [0.6, 0.3, 0.5], 1) in ([0], [1], [2])
    assert likely_ends([-1, -1, 0], [0.6, 0.3, 0.5], 3) == [0, 1, 2]


def test_refuses_drafters_it_cannot_fuse():
    target = TARGETS["llama"]
    x = torch.tensor([[5, 6, 7]])
    small = D3DDrafterModel.from_target(target, num_hidden_layers=2, block_size=4)
    with pytest.raises(ValueError, match="whole LM|keeps target layers"):
        fused_generate(target, small, x)
    other = _adapted(tiny_target("llama", seed=3))
    assert "differ" in fusable(target, other)
    with pytest.raises(ValueError, match="base weights differ"):
        fused_generate(target, other, x)
    no_adapters = D3DDrafterModel.from_pretrained_lm(target, block_size=4)
    with pytest.raises(ValueError, match="block adapters"):
        fused_generate(target, no_adapters, x)
    with pytest.raises(ValueError, match="batch size 1"):
        fused_generate(target, DRAFTERS["llama"], torch.tensor([[5, 6], [7, 8]]))


def test_hooks_are_removed():
    target = TARGETS["qwen3"]
    x = torch.tensor([[5, 6, 7, 8]])
    before = target(x).logits
    fused_generate(target, DRAFTERS["qwen3"], x, max_new_tokens=5)
    torch.testing.assert_close(target(x).logits, before, rtol=0, atol=0)


def test_bench_runs_the_fused_path():
    from hf_d3d import bench

    target = TARGETS["llama"]
    result = bench.run_bench(target, DRAFTERS["llama"], [[5, 6, 7], [8, 9, 10, 11]], ["d3d_fused"], max_new_tokens=12)
    fused_row = result["methods"]["d3d_fused"]
    assert fused_row["identical_to_plain"]
    last = result["records"]["d3d_fused"][-1]
    # every target forward is counted: the prompt's prefill and one per fused round
    assert last["target_forwards"] == DRAFTERS["llama"].last_stats.rounds + 1


def test_the_fast_loop_and_generate_run_it_with_fused_true():
    target, drafter = TARGETS["qwen3"], DRAFTERS["qwen3"]
    x = torch.tensor([[5, 17, 33, 8, 9]])
    want = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False)
    rounds = []
    got = speculative_generate(target, drafter, x, max_new_tokens=20, fused=True, on_round=lambda *a: rounds.append(a))
    assert got.tolist() == want.tolist()
    assert sum(len(new) for _, _, new in rounds) == got.shape[1] - x.shape[1]
    assert all(new[:accepted] == draft[:accepted] for draft, accepted, new in rounds)
    via_generate = target.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=20,
        do_sample=False,
        custom_generate=d3d_generate,
        drafter=drafter,
        fused=True,
    )
    assert via_generate.tolist() == want.tolist()
    assert drafter.last_stats.rounds == len(rounds)  # the fused rounds ran, not the two-pass loop


def test_fused_true_refuses_what_it_does_not_do():
    target, drafter = TARGETS["llama"], DRAFTERS["llama"]
    x = torch.tensor([[5, 6, 7]])
    for kwargs, what in [
        (dict(do_sample=True), "sampling"),
        (dict(cache_implementation="static"), "static cache"),
        (dict(repetition_penalty=1.3), "logits processors"),
    ]:
        with pytest.raises(ValueError, match=what):
            speculative_generate(target, drafter, x, max_new_tokens=4, fused=True, **kwargs)


def test_fused_keeps_the_callers_eos_and_refuses_the_configs_processors():
    """eos_token_id=None through generate stops on no EOS, though the target's config names one; called directly,
    fused_generate refuses a target whose generation config plain greedy generate would apply processors from."""
    target, drafter = TARGETS["llama"], DRAFTERS["llama"]
    x = torch.tensor([[5, 6, 7, 40]])
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False)
    free = target.generate(x, eos_token_id=None, **kw)[0, x.shape[1] :].tolist()
    config = copy.deepcopy(target.generation_config)
    target.generation_config.eos_token_id = next(t for t in free if free.index(t) >= 2)
    try:
        out = target.generate(x, eos_token_id=None, custom_generate=d3d_generate, drafter=drafter, fused=True, **kw)
        assert out[0, x.shape[1] :].tolist() == free
        target.generation_config.repetition_penalty = 1.05  # as Qwen2.5-Instruct ships
        with pytest.raises(ValueError, match="asks for \\['RepetitionPenaltyLogitsProcessor'\\]"):
            fused_generate(target, drafter, x, max_new_tokens=16)
    finally:
        target.generation_config = config


def test_fused_streams_and_ignores_eos_when_told():
    target, drafter = TARGETS["llama"], DRAFTERS["llama"]
    x = torch.tensor([[5, 6, 7, 40]])

    class Collect:
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, t):
            self.parts.append(t.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = speculative_generate(target, drafter, x, max_new_tokens=30, fused=True, eos_token_id=None, streamer=streamer)
    want = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=30, do_sample=False, eos_token_id=None)
    assert out.tolist() == want.tolist() and out.shape[1] == x.shape[1] + 30
    assert [t for part in streamer.parts for t in part] == out[0].tolist() and streamer.ended


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_norm.weight", "model.layers.2.mlp.up_proj.weight"])
def test_any_changed_base_weight_is_caught(name):
    """Adapters-only training leaves every base weight; a drafter whose norms or projections moved is another
    model, whose context rows the target's forward would not compute."""
    target = TARGETS["qwen3"]
    drafter = copy.deepcopy(DRAFTERS["qwen3"])
    assert fusable(target, drafter) is None
    with torch.no_grad():
        drafter.state_dict()[name].add_(1e-3)
    assert "differ" in fusable(target, drafter)


def test_bench_refuses_the_fused_method_for_a_drafter_it_cannot_fuse():
    from hf_d3d import bench

    target = TARGETS["llama"]
    small = D3DDrafterModel.from_target(target, num_hidden_layers=2, block_size=4)
    with pytest.raises(ValueError, match="d3d_fused cannot run this pair: .*whole LM"):
        bench.run_bench(target, small, [[5, 6, 7]], ["d3d_fused"], max_new_tokens=4)
    # --exact with the fused method: refused up front (plain would otherwise run its warm-up first)
    calls = []
    handle = target.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="d3d_fused runs blocks beside the verification rows"):
            bench.run_bench(target, DRAFTERS["llama"], [[5, 6, 7]], ["d3d_fused"], max_new_tokens=4, exact=True)
    finally:
        handle.remove()
    assert not calls


def test_refuses_targets_a_custom_mask_cannot_serve():
    from transformers import LlamaConfig, LlamaForCausalLM

    flash_like = copy.deepcopy(TARGETS["llama"])
    flash_like.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="custom mask"):
        fused_generate(flash_like, DRAFTERS["llama"], torch.tensor([[5, 6, 7]]))
    windowed = LlamaForCausalLM(LlamaConfig(**TARGETS["llama"].config.to_dict())).eval()
    windowed.load_state_dict(TARGETS["llama"].state_dict())
    windowed.config.sliding_window = 4
    with pytest.raises(ValueError, match="full-attention"):
        fused_generate(windowed, DRAFTERS["llama"], torch.tensor([[5, 6, 7]]))


@settings(max_examples=20)
@given(family=FAMILIES, prompt=prompts(10), draft=st.lists(st.integers(4, 95), min_size=1, max_size=3), data=st.data())
def test_a_fused_pass_is_the_targets_forward_and_the_drafters_blocks(family, prompt, draft, data):
    """Verification rows give the target's own logits; the block anchored after context row j gives what the drafter
    itself drafts after the text up to that row (positions, mask and anchors all agree)."""
    target, drafter = TARGETS[family], DRAFTERS[family]
    text = prompt + draft
    cached = data.draw(st.integers(0, len(prompt) - 1))
    anchors = sorted(data.draw(st.sets(st.integers(0, len(text) - cached - 1), min_size=1, max_size=3)))
    cache = DynamicCache()
    with torch.no_grad():
        if cached:
            target(torch.tensor([text[:cached]]), cache=cache)
        with fused.FusedPass(target, drafter) as run:
            logits, blocks = run(cache, cached, torch.tensor([text[cached:]]), 0, anchors)
        want = target(torch.tensor([text])).logits[0, cached:]
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        size = drafter.config.block_size
        for i, a in enumerate(anchors):
            prefix = torch.tensor([text[: cached + a + 1]])
            ids, layout = pack_blocks(prefix, 0, [prefix.shape[1] - 1], size, fill_id=0)
            own = drafter(ids, layout=layout, use_cache=False).logits[0, prefix.shape[1] :]
            mine = torch.nn.functional.linear(blocks[i], target.get_output_embeddings().weight)
            # slot s + 1 of the drafter's own block reads the row of slot s (the shift)
            torch.testing.assert_close(mine[: size - 1], own[1:], rtol=1e-4, atol=1e-4)


def _oracle(monkeypatch, target, x, max_new, eos, corrupt, seed):
    """Make fused_generate draft the target's own greedy continuation, with some tokens corrupted, so rounds accept
    runs of every length: the loop's bookkeeping (accepted runs, cache crops, EOS and limits inside a run) is what
    is tested. Returns the on_round callback that tells the oracle where decoding stands."""
    ref = target.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new + 16, do_sample=False, eos_token_id=None
    )[0].tolist()
    rng = torch.Generator().manual_seed(seed)
    state = {"len": x.shape[1]}

    def draft_from(hidden, head, draft_vocab, width):
        chain = ref[state["len"] : state["len"] + hidden.shape[0]]
        chain = [(t + 1) % 96 if torch.rand((), generator=rng) < corrupt else t for t in chain]
        confidence = (0.05 + 0.9 * torch.rand(len(chain), generator=rng)).log().tolist()
        return [[c] for c in confidence], [[t] for t in chain]

    def on_round(draft, accepted, new):
        assert new[:accepted] == draft[:accepted]
        state["len"] += len(new)

    monkeypatch.setattr(fused, "draft_from", draft_from)
    return on_round


@settings(max_examples=30)
@given(
    family=FAMILIES,
    prompt=prompts(8),
    max_new=st.integers(1, 30),
    hyps=st.integers(1, 4),
    corrupt=st.sampled_from([0.0, 0.1, 0.4]),
    seed=st.integers(0, 99),
    with_eos=st.booleans(),
)
def test_runs_of_accepted_drafts_give_greedy_tokens(family, prompt, max_new, hyps, corrupt, seed, with_eos):
    target = TARGETS[family]
    x = torch.tensor([prompt])
    eos = EOS if with_eos else None
    with pytest.MonkeyPatch.context() as mp:
        on_round = _oracle(mp, target, x, max_new, eos, corrupt, seed)
        got = fused_generate(
            target,
            DRAFTERS[family],
            x,
            max_new_tokens=max_new,
            num_hypotheses=hyps,
            eos_token_id=eos if with_eos else [],
            on_round=on_round,
        )
    want = target.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, eos_token_id=eos
    )
    assert got.tolist() == want.tolist()
    stats = DRAFTERS[family].last_stats
    if corrupt == 0.0 and want.shape[1] - x.shape[1] > 8:  # greedy ran past a block (an early EOS may stop it)
        assert max(stats.acceptance_lengths) >= 2  # whole runs were accepted and committed


def test_eos_inside_an_accepted_run(monkeypatch):
    """A prompt whose greedy continuation reaches EOS: the oracle drafts through it, so EOS arrives mid-run."""
    target = TARGETS["llama"]
    for seed in range(200):
        torch.manual_seed(seed)
        x = torch.randint(4, 96, (1, 5))
        want = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False)
        if want[0, -1].item() == EOS and want.shape[1] - x.shape[1] >= 3:
            break
    else:
        pytest.skip("no seed reaches EOS")
    on_round = _oracle(monkeypatch, target, x, 40, EOS, 0.0, 0)
    got = fused_generate(target, DRAFTERS["llama"], x, max_new_tokens=40, eos_token_id=EOS, on_round=on_round)
    assert got.tolist() == want.tolist()


def test_stopping_criteria_and_zero_new_tokens_and_a_draft_vocabulary():
    from transformers import StoppingCriteria, StoppingCriteriaList

    target = TARGETS["qwen3"]
    for seed in range(100):  # a prompt whose continuation runs past 10 tokens before any EOS
        torch.manual_seed(seed)
        x = torch.randint(4, 96, (1, 4))
        free = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=30, do_sample=False)
        if free.shape[1] - x.shape[1] > 10:
            break
    stop_at = free[0, x.shape[1] + 5].item()

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_at

    criteria = StoppingCriteriaList([StopAt()])
    want = target.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=30, do_sample=False, stopping_criteria=criteria
    )
    got = fused_generate(target, DRAFTERS["qwen3"], x, max_new_tokens=30, stopping_criteria=criteria)
    assert got.tolist() == want.tolist() and got[0, -1].item() == stop_at
    assert fused_generate(target, DRAFTERS["qwen3"], x, max_new_tokens=0).tolist() == x.tolist()
    small = copy.deepcopy(DRAFTERS["qwen3"])
    small.set_draft_vocab(list(range(4, 60)))
    drafts = []
    got = fused_generate(target, small, x, max_new_tokens=30, on_round=lambda d, a, n: drafts.extend(d))
    assert got.tolist() == free.tolist()
    assert drafts and all(4 <= t < 60 for t in drafts)


def test_refuses_a_target_whose_projections_the_hooks_do_not_see():
    """A kernel that computes a projection without calling its module (a fused MLP) would skip that adapter."""
    target = copy.deepcopy(TARGETS["llama"])
    mlp = target.model.layers[1].mlp
    mlp.forward = lambda x: mlp.down_proj(
        mlp.act_fn(torch.nn.functional.linear(x, mlp.gate_proj.weight))
        * torch.nn.functional.linear(x, mlp.up_proj.weight)
    )
    with pytest.raises(ValueError, match="adapted projections ran"):
        fused_generate(target, DRAFTERS["llama"], torch.tensor([[5, 6, 7]]), max_new_tokens=3)


def test_refuses_a_target_dispatched_over_devices():
    """Refused by `fusable`, so the bench refuses the method before any model runs (`--device-map`)."""
    from hf_d3d import bench

    target = copy.deepcopy(TARGETS["llama"])
    target.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": "disk"}
    assert "one device" in fusable(target, DRAFTERS["llama"])
    with pytest.raises(ValueError, match="one device"):
        fused_generate(target, DRAFTERS["llama"], torch.tensor([[5, 6, 7]]), max_new_tokens=3)
    calls = []
    handle = target.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="d3d_fused cannot run this pair: the target must run on one device"):
        bench.run_bench(target, DRAFTERS["llama"], [[5, 6, 7]], ["plain", "d3d_fused"], max_new_tokens=4)
    handle.remove()
    assert not calls
    target.hf_device_map = {"": "cpu"}  # dispatched whole onto one device: fusable as before
    assert fusable(target, DRAFTERS["llama"]) is None


@pytest.mark.parametrize("batch", [1, 2])
def test_adapters_added_in_place_at_inference_match_training_arithmetic(batch):
    """Without autograd the block adapters are added into the projections' outputs in place; same numbers."""
    drafter = DRAFTERS["qwen3"]
    ids, layout = pack_blocks(torch.tensor([[5, 6, 7, 8, 9]] * batch), 0, [2, 4], 4, fill_id=0)
    with torch.no_grad():
        fast = drafter(ids, layout=layout, use_cache=False).logits
    with torch.enable_grad():
        slow = drafter(ids, layout=layout, use_cache=False).logits
    assert slow.requires_grad
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(
        fast,
        D3DDrafterModel.from_pretrained_lm(TARGETS["qwen3"], block_size=4)(
            ids, layout=layout, use_cache=False
        ).logits.detach(),
    )  # the adapters do change the blocks


@settings(max_examples=15)
@given(family=FAMILIES, prompt=prompts(8), nodes=st.lists(st.integers(4, 95), min_size=3, max_size=3), data=st.data())
def test_a_fused_tree_pass_sees_each_nodes_path_only(family, prompt, nodes, data):
    """Tree context: node rows give the target's logits after their own path, and a block anchored at a node drafts
    what the drafter drafts after that path (siblings and their blocks stay invisible)."""
    from hf_d3d.modeling.attention_d3d import pack_tree_blocks
    from hf_d3d.tree import DraftTree, tree_rows, tree_visibility

    target, drafter = TARGETS[family], DRAFTERS[family]
    tree = DraftTree(nodes, [-1, -1, 0], [1, 1, 2], [0.0] * 3)  # root -> a -> c, root -> b
    cached = data.draw(st.integers(0, len(prompt) - 1))
    pending = prompt[cached:]
    ends = sorted(data.draw(st.sets(st.sampled_from([-1, 0, 1, 2]), min_size=1, max_size=4)))
    cache = DynamicCache()
    with torch.no_grad():
        if cached:
            target(torch.tensor([prompt[:cached]]), cache=cache)
        ids, positions = tree_rows(tree, pending, cached, torch.device("cpu"))
        m = len(pending)
        sees = tree_visibility(tree.parents, m)
        ids, layout = pack_tree_blocks(ids, positions, sees, cached, [m + e for e in ends], 4, fill_id=0)
        with fused.FusedPass(target, drafter) as run:
            logits, blocks = run.run(cache, ids, layout, verify_from=m - 1)
        paths = {-1: [], 0: [nodes[0]], 1: [nodes[1]], 2: [nodes[0], nodes[2]]}
        for row, node in enumerate([-1, 0, 1, 2]):
            want = target(torch.tensor([prompt + paths[node]])).logits[0, -1]
            torch.testing.assert_close(logits[row], want, rtol=1e-4, atol=1e-4)
        head = target.get_output_embeddings().weight
        for i, end in enumerate(ends):
            prefix = torch.tensor([prompt + paths[end]])
            own_ids, own_layout = pack_blocks(prefix, 0, [prefix.shape[1] - 1], 4, fill_id=0)
            own = drafter(own_ids, layout=own_layout, use_cache=False).logits[0, prefix.shape[1] :]
            torch.testing.assert_close(torch.nn.functional.linear(blocks[i], head)[:3], own[1:], rtol=1e-4, atol=1e-4)


@settings(max_examples=20)
@given(family=FAMILIES, prompt=prompts(10), max_new=st.integers(1, 24), hyps=st.integers(1, 5))
def test_fused_trees_give_greedy_tokens(family, prompt, max_new, hyps):
    target = TARGETS[family]
    x = torch.tensor([prompt])
    want = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False)
    got = fused_generate(target, DRAFTERS[family], x, max_new_tokens=max_new, num_hypotheses=hyps, tree=True)
    assert got.tolist() == want.tolist()
    via_loop = speculative_generate(target, DRAFTERS[family], x, max_new_tokens=max_new, fused=True, tree=True)
    assert via_loop.tolist() == want.tolist()
