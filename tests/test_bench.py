"""The benchmark harness on tiny models: schema, alternation, and that a wrong output is flagged."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_drafter, tiny_target
from hf_d3d import bench

KEYS = {"tau", "tokens_per_second", "speedup", "identical_to_plain", "hit_rate", "acceptance_histogram"}


def test_bench_schema_and_outputs(tmp_path):
    target = tiny_target("llama")
    drafter = make_drafter(target, block_size=4)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    methods = ["plain", "prompt_lookup", "d3d_sync", "d3d_async", "d3d_fast", "d3d_fast_chain"]
    result = bench.run_bench(target, drafter, prompts, methods, max_new_tokens=12)
    assert set(result["methods"]) == set(methods)
    for m, v in result["methods"].items():
        assert KEYS <= set(v), m
        assert v["identical_to_plain"], m
        assert v["tau"] >= 1.0 and v["tokens_per_second"] > 0
    assert result["methods"]["plain"]["tau"] == 1.0
    assert result["methods"]["d3d_async"]["hit_rate"] is not None
    assert result["all_identical"]
    paths = bench.write_outputs(result, tmp_path / "r.json")
    assert json.loads(paths[0].read_text())["methods"]["d3d_fast"]["identical_to_plain"] is True
    assert "| d3d_fast |" in paths[1].read_text()
    assert paths[2].stat().st_size > 1000  # a real PNG


def test_outputs_are_written_as_a_set(tmp_path, monkeypatch):
    """A failure while writing (here the plot) leaves the previous JSON, table and figure as they were."""
    first = {"methods": {"plain": {"tau": 1.0, "speedup": 1.0}}, "all_identical": True}
    monkeypatch.setattr(bench, "markdown_table", lambda result: f"table {result['methods']['plain']['tau']}")
    monkeypatch.setattr(
        bench, "plot", lambda result, path: path.write_bytes(b"png %r" % result["methods"]["plain"]["tau"])
    )
    paths = bench.write_outputs(first, tmp_path / "r.json")
    before = [p.read_bytes() for p in paths]

    def broken(result, path):
        path.write_bytes(b"half a figure")
        raise OSError("disk full")

    monkeypatch.setattr(bench, "plot", broken)
    second = {"methods": {"plain": {"tau": 2.0, "speedup": 1.0}}, "all_identical": True}
    with pytest.raises(OSError, match="disk full"):
        bench.write_outputs(second, tmp_path / "r.json")
    assert [p.read_bytes() for p in paths] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md", "r.png"]  # no scratch file left
    for name in ("r.md", "r.PNG"):  # the JSON would be written over the table or the figure
        with pytest.raises(ValueError, match="--out names the JSON file"):
            bench.write_outputs(first, tmp_path / name)


def test_bench_refuses_an_out_that_is_not_a_json_path_before_it_runs(monkeypatch, capsys, tmp_path):
    from hf_d3d import cli

    monkeypatch.setattr(cli, "_device", lambda name: pytest.fail("refused after arguments were checked"))
    assert cli.main(["bench", "--out", str(tmp_path / "r.png")]) == 2
    assert "--out names the JSON file" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_every_method_is_greedy_on_a_sampling_target_and_the_drafters_own_setting_stays(tmp_path):
    """Qwen3 and Llama 3 ship generation configs that sample: the fast loop took them up while every peer was
    greedy. And a drafter configured to draft asynchronously is still so after the d3d_sync runs."""
    target = tiny_target("llama")
    target.generation_config.update(do_sample=True, temperature=0.7, top_k=5)
    drafter = make_drafter(target, block_size=4)
    drafter.config.async_drafting = True
    methods = ["plain", "d3d_sync", "d3d_fast", "d3d_fast_chain"]
    result = bench.run_bench(target, drafter, [[5, 6, 7], [8, 9, 10, 11]], methods, max_new_tokens=12)
    assert result["all_identical"]
    assert drafter.config.async_drafting is True


def test_bench_exact_runs_every_method_but_plain_under_exact_verification(monkeypatch):
    from hf_d3d.exact import is_exact

    target = tiny_target("llama").to(torch.bfloat16)
    drafter = make_drafter(target, block_size=4)
    seen = {}
    real = bench.speculative_generate

    def spy(target, drafter, x, **kw):
        seen["fast"] = is_exact(target)
        return real(target, drafter, x, **kw)

    monkeypatch.setattr(bench, "speculative_generate", spy)
    methods = ["d3d_sync", "d3d_fast"]
    result = bench.run_bench(target, drafter, [[5, 6, 7], [8, 9]], methods, max_new_tokens=10, exact=True)
    assert seen["fast"] and not is_exact(target)
    assert result["all_identical"]
    # the first round prefills the prompt alone and so accepts nothing
    assert all(r["acceptance_lengths"][0] == 0 for r in result["records"]["d3d_sync"])


def test_bench_gives_every_method_but_plain_and_the_hub_path_the_skinny_linears(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    target = tiny_target("llama")
    drafter = make_drafter(target, block_size=4)
    ar = tiny_target("llama", seed=1)  # an autoregressive assistant with the same vocabulary
    drafter.save_pretrained(tmp_path / "d")
    hub = AutoModelForCausalLM.from_pretrained(tmp_path / "d", trust_remote_code=True).eval()
    now, seen = {}, []  # seen: (method, model, was its LM head's forward the skinny one) per LM head call
    real_runner = bench._runner

    def tagged_runner(method, *args):
        run = real_runner(method, *args)
        return lambda x: (now.update(method=method), run(x))[1]

    monkeypatch.setattr(bench, "_runner", tagged_runner)
    for name, model in (("target", target), ("drafter", drafter), ("ar", ar), ("hub", hub)):
        model.lm_head.register_forward_pre_hook(
            lambda module, args, name=name: seen.append((now["method"], name, "forward" in module.__dict__))
        )
    methods = ["plain", "assisted_ar", "prompt_lookup", "d3d_hub", "d3d_sync", "d3d_fast"]
    result = bench.run_bench(
        target, drafter, [[5, 6, 7], [8, 9]], methods, max_new_tokens=6, ar_drafter=ar, hub_drafter=hub
    )
    assert result["skinny"] and result["all_identical"]  # fp32 on CPU: on by default
    want = {("plain", "target"), ("assisted_ar", "ar"), ("d3d_sync", "drafter"), ("d3d_hub", "hub")}
    assert {(m, who) for m, who, _ in seen} >= want
    assert ("d3d_hub", "drafter") not in {(m, who) for m, who, _ in seen}  # the Hub path drafts with its own copy
    assert result["methods"]["d3d_hub"]["acceptance_histogram"]  # its rounds, read from its own stats
    for method, who, patched in seen:  # plain and the Hub path as users run them; every other peer patched
        if method != "d3d_hub":
            assert patched == (method != "plain"), (method, who)
    # the bench leaves the Hub path alone: its drafter gives its own drafts and the target's verifies few-row linears
    hub_target = [patched for method, who, patched in seen if (method, who) == ("d3d_hub", "target")]
    assert all(patched for method, who, patched in seen if (method, who) == ("d3d_hub", "hub"))
    assert not hub_target[0] and any(hub_target)  # not the prefill; verify forwards
    with pytest.raises(ValueError, match="d3d_hub needs"):
        bench.run_bench(target, drafter, [[5, 6]], ["d3d_hub"], max_new_tokens=4)
    seen.clear()
    result = bench.run_bench(target, drafter, [[5, 6]], ["d3d_sync", "d3d_fast"], max_new_tokens=6, skinny=False)
    assert seen and not any(patched for *_, patched in seen) and not result["skinny"]


def test_bench_flags_a_non_identical_method(monkeypatch, tmp_path):
    target = tiny_target("qwen3")
    drafter = make_drafter(target, block_size=4)

    def wrong(target, drafter, x, max_new_tokens, **kw):
        out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
        out[0, -1] = (out[0, -1] + 1) % 96
        return out

    monkeypatch.setattr(bench, "speculative_generate", wrong)
    result = bench.run_bench(target, drafter, [[5, 6, 7], [9, 9]], ["d3d_fast"], max_new_tokens=6)
    assert result["methods"]["d3d_fast"]["identical_to_plain"] is False
    assert result["all_identical"] is False
    assert result["methods"]["plain"]["identical_to_plain"] is True
    assert result["methods"]["d3d_fast"]["speedup"] is None  # no speedup is claimed for a wrong output
    assert "| d3d_fast | " in bench.markdown_table(result) and "invalid | invalid | NO |" in bench.markdown_table(
        result
    )
    bench.plot(result, tmp_path / "bench.png")


def test_run_methods_times_any_named_runners(oracle):
    target = tiny_target("llama")
    oracle.target = target  # every draft is right, so a round accepts exactly its draft length
    drafter = make_drafter(target, block_size=4)
    plain = (lambda x: target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False), None)

    def fast(k):
        def run(x):
            drafter.generation_config.num_assistant_tokens = k
            return bench.speculative_generate(target, drafter, x, max_new_tokens=8, tree=False)

        return run, drafter

    result = bench.run_methods(target, {"plain": plain, "k1": fast(1), "k4": fast(4)}, [[5, 6, 7], [8, 9]], 8)
    assert list(result["methods"]) == ["plain", "k1", "k4"] and result["all_identical"]
    for key, k in (("k1", 1), ("k4", 4)):
        lengths = [a for r in result["records"][key] for a in r["acceptance_lengths"]]
        assert lengths and max(lengths) == k  # each runner's own drafter stats, at its own draft length
    with pytest.raises(ValueError, match="'plain'"):
        bench.run_methods(target, {"k1": fast(1)}, [[5, 6]], 8)


def test_published_commands_show_the_home_folder_as_tilde(monkeypatch, tmp_path):
    from hf_d3d.cli import _shown

    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    assert _shown(str(tmp_path / "me" / ".cache" / "peer")) == "~/.cache/peer"
    assert _shown(str(tmp_path / "meme")) == str(tmp_path / "meme")  # a sibling whose name starts the same
    assert _shown("checkpoints/x") == "checkpoints/x"


@pytest.mark.parametrize("command", ["bench", "eval-tau", "calibrate", "distill"])
def test_a_device_that_is_not_there_is_refused_up_front(command, monkeypatch, capsys, tmp_path):
    """`--device auto` (the default) is the GPU where there is one; a GPU asked for on a machine without one, or a
    device torch does not know, is a clear error before any model loads or any file is written."""
    import torch

    from hf_d3d import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli._device("auto") == torch.device("cpu") and cli._device("cpu") == torch.device("cpu")
    monkeypatch.setattr(cli, "_update_metrics", lambda *a: pytest.fail("nothing may be written"))
    extra = {
        "bench": ["--out", str(tmp_path / "r.json")],
        "eval-tau": ["--drafter", str(tmp_path)],
        "calibrate": [],
        "distill": ["--prompts", "gsm8k:train", "--num-prompts", "2", "--out", str(tmp_path / "d")],
    }
    for device, message in (("cuda", "CUDA is not available"), ("tpu9", "not a device torch knows")):
        assert cli.main([command, "--device", device, *extra[command]]) == 2
        assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli._device("auto") == torch.device("cuda")
    assert cli._device_flag(torch.device("cpu")) == "" and cli._device_flag(torch.device("cuda")) == " --device cuda"


def test_eval_tau_refuses_to_write_metrics_into_a_hub_id_before_measuring(capsys):
    from hf_d3d import cli

    assert cli.main(["eval-tau", "--drafter", "org/some-drafter", "--write-metrics"]) == 2
    assert "needs a local drafter folder" in capsys.readouterr().err


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_balance_positions_and_predecessors(n):
    from collections import Counter

    rows = bench.balanced_orders(n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    positions = Counter((m, i) for row in rows for i, m in enumerate(row))
    assert len(set(positions.values())) == 1 and len(positions) == n * n  # every method at every position alike
    follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1  # and after every other method alike
