"""Bad input to the prompt readers and the demo: clear messages, before any model work."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from test_training import ToyTokenizer

from hf_d3d.demo import MAX_NEW_TOKENS_LIMIT, validate_request
from hf_d3d.prompts import load_prompts, read_jsonl_field


def test_prompts_file_missing_the_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with pytest.raises(KeyError, match=r"p.jsonl:2: record has no field 'question'"):
        read_jsonl_field(path, "question")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    path.write_text('{"question": ""}\n')
    with pytest.raises(ValueError, match="empty"):
        read_jsonl_field(path, "question")
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_jsonl_field(path, "question")


def test_gzipped_jsonl_and_limit(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(5):
            f.write(json.dumps({"prompt": f"q{i}"}) + "\n")
    assert read_jsonl_field(path, "prompt", limit=3) == ["q0", "q1", "q2"]
    assert load_prompts(str(path), "prompt", limit=2, skip=2) == ["q2", "q3"]
    assert load_prompts(str(path), "prompt", skip=3) == ["q3", "q4"]
    with pytest.raises(ValueError, match="after skipping the first 5"):
        load_prompts(str(path), "prompt", skip=5)


def test_gsm8k_prompts_ship_with_the_package():
    prompts = load_prompts("gsm8k:test", limit=2)
    assert len(prompts) == 2 and all(isinstance(p, str) and p for p in prompts)
    assert load_prompts("gsm8k", limit=2) == prompts  # the test split by default


def test_a_jsonl_path_named_like_a_set_is_read_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("gsm8k_rest.jsonl").write_text(json.dumps({"question": "mine"}) + "\n")
    assert load_prompts("gsm8k_rest.jsonl") == ["mine"]


@pytest.mark.parametrize(
    ("prompt", "max_new", "message"),
    [
        ("", 8, "empty"),
        ("   ", 8, "empty"),
        ("5 6 7", 0, "positive integer"),
        ("5 6 7", MAX_NEW_TOKENS_LIMIT + 1, "too large"),
        (" ".join(["5"] * 600), 8, "exceeds the model's context"),
    ],
)
def test_demo_request_validation(prompt, max_new, message):
    with pytest.raises(ValueError, match=message):
        validate_request(prompt, max_new, ToyTokenizer(), context=512)


def test_demo_request_accepts_a_normal_prompt():
    assert validate_request("5 6 7", 16, ToyTokenizer(), context=512) == [5, 6, 7]


def test_demo_and_space_make_no_outside_requests(monkeypatch):
    import gradio as gr
    import huggingface_hub.constants

    from hf_d3d.demo import no_outside_requests

    monkeypatch.delenv("GRADIO_ANALYTICS_ENABLED", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", False)
    no_outside_requests()
    assert huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY is True
    with gr.Blocks() as blocks:
        gr.Markdown("x")
    assert blocks.analytics_enabled is False
    monkeypatch.delenv("GRADIO_ANALYTICS_ENABLED")  # restore what the test changed
    monkeypatch.delenv("HF_HUB_DISABLE_TELEMETRY", raising=False)


def test_sharegpt_training_slices_leave_out_variants_of_held_aside_prompts():
    """The split is distinct by exact text, so "hi" can be held aside while "Hi" is a train prompt; distill drops
    such variants from training slices."""
    from hf_d3d.prompts import without_heldout_variants

    held = load_prompts("sharegpt:heldout")
    train = load_prompts("sharegpt:train", limit=500)
    assert len(held) == 256 and not {p.strip() for p in held} & {p.strip() for p in train}
    variant = "  " + held[3].upper().replace(" ", "   ") + " !"
    kept, dropped = without_heldout_variants([train[0], variant, "a prompt of its own, 7f3a"])
    assert kept == [train[0], "a prompt of its own, 7f3a"] and dropped == 1


def test_training_refuses_answers_to_evaluation_prompts(tmp_path):
    from hf_d3d.train.distill import load_records
    from hf_d3d.train.token_file import write_token_file

    records = [{"prompt_ids": [5, 6], "response_ids": [7, 8]}]
    for source in ("sharegpt:heldout[0:20]", "gsm8k:test", "humaneval", "sharegpt", "gsm8k:train[0:5], humaneval"):
        path = write_token_file(records, tmp_path / "eval.safetensors", 64, {"target": "tiny", "source": source})
        with pytest.raises(ValueError, match="an evaluation set"):
            load_records(path)
    path = write_token_file(records, tmp_path / "train.safetensors", 64, {"target": "tiny", "source": "gsm8k:train"})
    assert len(load_records(path)) == 1
