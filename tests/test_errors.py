"""Bad input gets a clear error before any decoding work starts."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import VOCAB, make_drafter, tiny_target
from hf_d3d import D3DCandidateGenerator, D3DConfig, tokenizer_fingerprint
from hf_d3d.checks import check_pair
from hf_d3d.evaluate import count_forwards


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_vocab_mismatch_is_refused():
    target = tiny_target("llama")
    other = make_drafter(tiny_target("llama", vocab=64))
    with pytest.raises(ValueError, match="vocab_size"):
        check_pair(target, other)
    x = torch.tensor([[4, 5, 6]])
    with count_forwards(target) as calls, pytest.raises(ValueError, match="tokenizer"):
        target.generate(x, attention_mask=torch.ones_like(x), assistant_model=other, max_new_tokens=5)
    assert calls["n"] == 0


def test_tokenizer_mismatch_is_refused():
    target = tiny_target("llama")
    mine = FakeTokenizer({f"t{i}": i for i in range(96)})
    theirs = FakeTokenizer({f"u{i}": i for i in range(96)})
    drafter = make_drafter(target, tokenizer_fingerprint=tokenizer_fingerprint(mine))
    assert drafter.config.tokenizer_fingerprint == tokenizer_fingerprint(mine)
    check_pair(target, drafter, mine)
    with pytest.raises(ValueError, match="tokenizer"):
        check_pair(target, drafter, theirs)


def test_batch_above_one_is_refused_before_work():
    target = tiny_target("qwen3")
    drafter = make_drafter(target)
    x = torch.tensor([[4, 5, 6], [7, 8, 9]])
    with count_forwards(target) as calls, pytest.raises(ValueError, match="batch"):
        target.generate(x, attention_mask=torch.ones_like(x), assistant_model=drafter, max_new_tokens=5)
    assert calls["n"] == 0
    with pytest.raises(ValueError, match="batch size 1"):
        D3DCandidateGenerator(drafter).get_candidates(x)


def test_padded_input_is_refused():
    target = tiny_target("qwen3")
    drafter = make_drafter(target)
    x = torch.tensor([[0, 5, 6]])
    with pytest.raises(ValueError, match="padded"):
        target.generate(
            x, attention_mask=torch.tensor([[0, 1, 1]]), assistant_model=drafter, max_new_tokens=5, pad_token_id=0
        )


@pytest.mark.parametrize("bad", [-1, 96, 10_000])
def test_mask_token_out_of_range(bad):
    with pytest.raises(ValueError, match="mask_token_id"):
        D3DConfig(vocab_size=96, mask_token_id=bad)
    with pytest.raises(ValueError, match="mask_token_id"):
        make_drafter(tiny_target("llama"), mask_token_id=bad)


def test_bad_block_size_and_layers():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="block_size"):
        make_drafter(target, block_size=0)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        make_drafter(target, layers=10)
    with pytest.raises(ValueError, match="layer_ids"):
        make_drafter(target, layer_ids=[0, 7])


def test_atomic_folder_is_complete_or_absent(tmp_path):
    from hf_d3d.atomic import atomic_folder

    out = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic_folder(out) as tmp:
            (tmp / "half.safetensors").write_text("x")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its scratch copy is left
    with atomic_folder(out) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(FileExistsError):
        with atomic_folder(out):
            pass
    with pytest.raises(RuntimeError):
        with atomic_folder(out, overwrite=True) as tmp:
            (tmp / "b").write_text("new")
            raise RuntimeError
    assert [p.name for p in out.iterdir()] == ["a"]  # a failed overwrite keeps the old folder whole
    with atomic_folder(out, overwrite=True) as tmp:
        (tmp / "b").write_text("new")
    assert [p.name for p in out.iterdir()] == ["b"] and [p.name for p in tmp_path.iterdir()] == ["model"]
    assert out.stat().st_mode & 0o055  # not left private to its writer, as mkdtemp made it

    out.rename(tmp_path / ".model.old")  # killed between the two renames: only the old complete copy exists
    (tmp_path / ".model-stale123").mkdir()  # and a scratch copy from a run killed mid-write
    with atomic_folder(out, overwrite=True) as tmp:
        assert [p.name for p in out.iterdir()] == ["b"]  # the complete copy is back before anything else happens
        (tmp / "c").write_text("newer")
    assert [p.name for p in out.iterdir()] == ["c"] and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_scratch(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_d3d.atomic import save_figure, write_text_atomic

    text, png = tmp_path / "t.json", tmp_path / "f.png"
    text.write_text("old")
    png.write_bytes(b"old")
    real_fsync = os.fsync

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(text, "new")
    monkeypatch.setattr(os, "fsync", real_fsync)
    fig = plt.figure()

    def half_written(path, **kwargs):
        open(path, "wb").write(b"\x89PNG")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fig, "savefig", half_written)
    with pytest.raises(OSError, match="No space"):
        save_figure(fig, png)
    plt.close(fig)
    assert text.read_text() == "old" and png.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.png", "t.json"]


def test_written_files_get_the_umasks_permissions(tmp_path):
    import stat

    from safetensors.torch import save_file

    from hf_d3d.atomic import atomic_folder
    from hf_d3d.train.token_file import write_token_file

    old_umask = os.umask(0o022)
    try:
        with atomic_folder(tmp_path / "model") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))  # safetensors writes it 0600
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "run.sh").write_text("")
            (tmp / "sub" / "run.sh").chmod(0o700)
        records = [{"prompt_ids": [1, 2], "response_ids": [3]}]
        token_file = write_token_file(records, tmp_path / "data.safetensors", 8, {"target": "tiny"})
    finally:
        os.umask(old_umask)
    names = ("model.safetensors", "sub", "sub/run.sh")
    modes = {p: stat.S_IMODE((tmp_path / "model" / p).stat().st_mode) for p in names}
    assert modes["model.safetensors"] == 0o644  # readable by the other users of a shared cache
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o644
    assert modes["sub"] == 0o755 and modes["sub/run.sh"] == 0o744  # readable too; nothing is taken away


def test_atomic_folder_leaves_a_running_writers_scratch_alone(tmp_path):
    """Two processes writing the same folder at once (a benchmark started beside a distillation both converting the
    embedded target) must not delete each other's scratch copies; a killed writer's copy is still cleaned up."""
    import os
    import subprocess
    import sys

    from hf_d3d.atomic import atomic_folder

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f".model-{int(dead.stdout)}-abc"
    running = tmp_path / f".model-{os.getpid()}-xyz"  # this process stands in for the other writer
    killed.mkdir()
    running.mkdir()
    (running / "half.safetensors").write_text("being written")
    # a sibling output's scratch copy, whose writer is dead or alive: "model-whole" is not "model"
    sibling = tmp_path / f".model-whole-{int(dead.stdout)}-abc"
    sibling.mkdir()
    with atomic_folder(tmp_path / "model") as tmp:
        (tmp / "a").write_text("done")
    assert not killed.exists() and (running / "half.safetensors").exists() and sibling.exists()
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["a"]


def test_embedded_target_is_converted_once_when_processes_start_together(tmp_path, monkeypatch):
    """A process that finds another converting the packaged GGUF waits for it and reads its copy."""
    import threading

    from filelock import FileLock

    from hf_d3d import targets

    monkeypatch.setenv("HF_D3D_CACHE", str(tmp_path))
    conversions = []
    monkeypatch.setattr(targets, "_convert_gguf", lambda gguf_dir, out: conversions.append(out))
    out = tmp_path / "SmolLM2-135M-Instruct"
    result = []
    with FileLock(str(tmp_path / ".SmolLM2-135M-Instruct.lock")):  # the other process is converting
        waiter = threading.Thread(target=lambda: result.append(targets._embedded_smollm2_dir()))
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive()  # it waits rather than writing beside the other
        out.mkdir()
        (out / "model.safetensors").write_text("done")
        (out / "tokenizer.json").write_text("done")
    waiter.join(timeout=10)
    assert result == [out] and conversions == []


def _rescaling_target(rope: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    params = {"rope_type": rope, "rope_theta": 10000.0, "factor": 2.0}
    if rope == "longrope":
        params |= {"short_factor": [1.0] * 6, "long_factor": [4.0] * 6, "original_max_position_embeddings": 32}
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32 if rope == "dynamic" else 128, rope_parameters=params,
        bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharp logits, as tiny_target's, so that a small difference can flip a greedy token
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_a_rope_that_rescales_with_length_is_refused_past_that_length(rope, monkeypatch):
    """transformers rescales dynamic and long RoPE by the longest position of a forward: a verify forward over the
    crossing rescales its earlier rows too, where plain generate's decode steps do not. Below 32 tokens nothing
    rescales and every path is plain generate's; a generation that could pass 32 is refused before it starts, and
    without the refusal some outputs do part from plain generate's."""
    from hf_d3d import D3DDrafterModel, bench, exact_verification, speculative, speculative_generate
    from hf_d3d.fused import fused_generate

    target = _rescaling_target(rope)
    drafter = make_drafter(target, block_size=4)
    x = torch.randint(4, VOCAB, (1, 10))
    ones = torch.ones_like(x)
    plain = target.generate(x, attention_mask=ones, max_new_tokens=22, do_sample=False)
    assert torch.equal(speculative_generate(target, drafter, x, max_new_tokens=22), plain)
    hub = target.generate(x, attention_mask=ones, assistant_model=drafter, max_new_tokens=22, do_sample=False)
    assert torch.equal(hub, plain)
    with pytest.raises(ValueError, match=f"RoPE \\({rope}\\) rescales once a sequence passes 32 tokens"):
        speculative_generate(target, drafter, x, max_new_tokens=23)
    with pytest.raises(ValueError, match="passes 32 tokens"):
        target.generate(x, attention_mask=ones, assistant_model=drafter, max_new_tokens=23, do_sample=False)
    # the bench refuses before any forward, for its longest prompt, not partway through a run
    calls = []
    handle = target.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="passes 32 tokens"):
            bench.run_bench(target, drafter, [x[0].tolist(), x[0].tolist() * 2], ["d3d_fast"], max_new_tokens=13)
    finally:
        handle.remove()
    assert not calls
    # exact verification's promise to prompt lookup and other assistants holds to the same length
    with exact_verification(target):
        lookup = target.generate(x, attention_mask=ones, prompt_lookup_num_tokens=3, max_new_tokens=22, do_sample=False)
        assert torch.equal(lookup, plain)
        with pytest.raises(ValueError, match="passes 32 tokens"):
            target.generate(x, attention_mask=ones, prompt_lookup_num_tokens=3, max_new_tokens=23, do_sample=False)
    # the fused pass's draft blocks reach a block past the last verified position
    whole = D3DDrafterModel.from_pretrained_lm(target, block_size=4, block_adapter_rank=4).eval()
    assert torch.equal(fused_generate(target, whole, x, max_new_tokens=18), plain[:, :28])
    with pytest.raises(ValueError, match="max_new_tokens <= 28 \\(its forwards reach up to 4 positions further\\)"):
        fused_generate(target, whole, x, max_new_tokens=19)
    monkeypatch.setattr(speculative, "refuse_rescaling_rope", lambda *a: None)

    def parts_from_plain(seed: int) -> bool:
        x = torch.randint(4, VOCAB, (1, 10), generator=torch.Generator().manual_seed(seed))
        plain = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False)
        return not torch.equal(speculative_generate(target, drafter, x, max_new_tokens=40, tree=False), plain)

    assert any(parts_from_plain(seed) for seed in range(10))


def test_the_rope_check_reads_per_layer_type_and_unstandardised_parameters():
    from transformers import LlamaConfig

    from hf_d3d.modeling.generation_d3d import refuse_rescaling_rope

    config = LlamaConfig(max_position_embeddings=64)
    config.rope_parameters = {"type": "dynamic", "factor": 2.0}  # as a config never standardised holds it
    refuse_rescaling_rope(config, 64)
    with pytest.raises(ValueError, match="dynamic"):
        refuse_rescaling_rope(config, 65)
    long = {"rope_type": "longrope", "original_max_position_embeddings": 16}
    config.rope_parameters = {"full_attention": {"rope_type": "default"}, "sliding_attention": long, "other": None}
    refuse_rescaling_rope(config, 16)
    with pytest.raises(ValueError, match="longrope"):
        refuse_rescaling_rope(config, 17)
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0}  # static: no limit
    refuse_rescaling_rope(config, 10**6)


def test_two_threads_writing_one_file_atomically_do_not_share_a_scratch_file(tmp_path, monkeypatch):
    """Both threads reach the rename at once: with one shared scratch file, the second rename finds it gone."""
    import threading

    from hf_d3d import atomic

    path, both_written = tmp_path / "rows.json", threading.Barrier(2, timeout=10)
    real_replace, errors = os.replace, []

    def replace_when_both_wrote(src, dst):
        both_written.wait()
        real_replace(src, dst)

    def write(text):
        try:
            atomic.write_text_atomic(path, text)
        except Exception as err:  # noqa: BLE001 - the failure this test looks for
            errors.append(err)

    monkeypatch.setattr(atomic.os, "replace", replace_when_both_wrote)
    threads = [threading.Thread(target=write, args=(text,)) for text in ("a" * 100, "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and path.read_text() in ("a" * 100, "b")
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]


def test_a_failed_token_file_write_leaves_no_scratch(tmp_path, monkeypatch):
    from hf_d3d.train import token_file

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_file.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        token_file.write_token_file([{"prompt_ids": [1], "response_ids": [2]}], tmp_path / "d.safetensors", 8, {})
    assert list(tmp_path.iterdir()) == []
