"""The Hub path over real HTTP on loopback: downloads by repo id from olah (a self-hosted Hub mirror serving git
repos), and `hf-d3d publish` to a stand-in of the Hub's commit API, then a download of what was published."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import hub_standin
import pytest
import torch

from conftest import make_drafter, tiny_target
from hf_d3d import D3DDrafterModel
from hf_d3d.publish import METRICS, PublishError, assemble, publish

TESTS = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent

# Run in a fresh process, as a user would: HF_ENDPOINT is read when huggingface_hub is imported.
LOAD_AND_GENERATE = f"""
import sys, json, torch
sys.path.insert(0, {str(TESTS)!r})
from conftest import tiny_target
from transformers import AutoModelForCausalLM
repo, revision = sys.argv[1], sys.argv[2] or None
drafter = AutoModelForCausalLM.from_pretrained(repo, revision=revision, trust_remote_code=True)
target = tiny_target("qwen3")
x = torch.tensor([[5, 9, 17, 33, 40, 41]])
kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24, eos_token_id=None)
out = target.generate(x, assistant_model=drafter, **kw)
plain = target.generate(x, **kw)
want = drafter.config.base_model_checksum  # set where the drafter was converted from a whole LM
base_ok = want is None or abs(drafter.base_checksum() - want) <= 1e-9 * want
print(json.dumps({{"class": type(drafter).__name__, "block": drafter.config.block_size, "base_ok": base_ok,
                  "module": type(drafter).__module__, "identical": bool(torch.equal(out, plain))}}))
"""


def _run_client(repo: str, env: dict, revision: str = "") -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_AND_GENERATE, repo, revision], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git(folder: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", *args]
    return subprocess.run(cmd, cwd=folder, check=True, capture_output=True, text=True).stdout.strip()


def _client_env(tmp_path: Path, endpoint: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


@pytest.fixture(scope="module")
def olah(tmp_path_factory):
    """olah on a free port, serving org/tiny-d3d from a git repo with two commits: block size 4, then 2."""
    if shutil.which("olah-cli", path=str(BIN)) is None:
        pytest.fail("olah is not installed: `pip install -e .[test]` installs it")
    root = tmp_path_factory.mktemp("olah")
    repo = root / "mirrors" / "models" / "org" / "tiny-d3d"
    target = tiny_target("qwen3")
    make_drafter(target, block_size=4).save_pretrained(repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "block 4")
    first = _git(repo, "rev-parse", "HEAD")
    make_drafter(target, block_size=2).save_pretrained(repo)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "block 2")
    # A whole-LM drafter stored as its block adapters alone, whose base LM is another repo of the same Hub.
    base = root / "mirrors" / "models" / "org" / "tiny-base"
    target.save_pretrained(base)
    adapters = root / "mirrors" / "models" / "org" / "tiny-d3d-adapters"
    whole = D3DDrafterModel.from_pretrained_lm(target, block_size=4, block_adapter_rank=4, base_model="org/tiny-base")
    with torch.no_grad():
        for name, p in whole.named_parameters():
            if "block_adapters" in name:
                p.add_(torch.randn_like(p) * 0.5)
    whole.save_pretrained(adapters, omit_base_weights=True)
    for folder in (base, adapters):
        _git(folder, "init", "-q", "-b", "main")
        _git(folder, "add", "-A")
        _git(folder, "commit", "-qm", "first")
    port = _free_port()
    (root / "configs.toml").write_text(
        f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{root / "cache"}"\n'
        f'mirrors-path = ["{root / "mirrors"}"]\n\n[accessibility]\noffline = true\n'
    )
    log = open(root / "olah.log", "w")
    server = subprocess.Popen([str(BIN / "olah-cli"), "-c", "configs.toml"], cwd=root, stdout=log, stderr=log)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{endpoint}/org/tiny-d3d/resolve/main/config.json", timeout=1)
            break
        except OSError:
            if server.poll() is not None:
                pytest.fail(f"olah exited: {(root / 'olah.log').read_text()[-2000:]}")
            time.sleep(0.2)
    yield endpoint, first, server
    server.terminate()
    server.wait(timeout=10)


def test_download_by_repo_id_through_olah(olah, tmp_path):
    endpoint, first, _ = olah
    env = _client_env(tmp_path, endpoint)
    latest = _run_client("org/tiny-d3d", env)
    assert latest == {
        "class": "D3DDrafterModel",
        "block": 2,
        "module": latest["module"],
        "identical": True,
        "base_ok": True,
    }
    assert latest["module"].startswith("transformers_modules")  # the repo's own remote code, not hf_d3d
    pinned = _run_client("org/tiny-d3d", env, revision=first)
    assert pinned["block"] == 4 and pinned["identical"]
    # Reuse from the cache with the Hub switched off: nothing is fetched.
    offline = _run_client("org/tiny-d3d", {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert offline["block"] == 2 and offline["identical"]


def test_drafter_without_base_weights_fetches_its_base_by_repo_id(olah, tmp_path):
    endpoint, _, _ = olah
    env = _client_env(tmp_path, endpoint)
    online = _run_client("org/tiny-d3d-adapters", env)
    assert online["identical"] and online["base_ok"]  # the base LM's own weights, fetched by repo id
    offline = _run_client("org/tiny-d3d-adapters", {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert offline["identical"] and offline["base_ok"]  # the base came into the cache with the drafter


@pytest.fixture
def hub():
    server, state, endpoint = hub_standin.start()
    yield state, endpoint
    server.shutdown()


@pytest.fixture
def hub_folder(tmp_path):
    drafter = make_drafter(tiny_target("qwen3"), block_size=4)
    drafter.save_pretrained(tmp_path / "ckpt")
    rows = [{"dataset": "gsm8k:test", "tau": 1.23, "command": "hf-d3d eval-tau --drafter ckpt"}]
    (tmp_path / "ckpt" / METRICS).write_text(json.dumps({"base_model": "Qwen/Qwen3-0.6B", "rows": rows}))
    return tmp_path / "ckpt"


def test_publish_over_http_then_download_generates_the_same_tokens(hub, hub_folder, tmp_path):
    state, endpoint = hub
    env = _client_env(tmp_path, endpoint, HF_TOKEN=hub_standin.TOKEN)
    cli = subprocess.run(
        [str(BIN / "hf-d3d"), "publish", str(hub_folder), "--repo-id", "org/published-d3d"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert f"uploaded: {endpoint}/org/published-d3d/commit/" in cli.stdout
    sha, files = state.head("org/published-d3d")
    local = assemble(hub_folder, tmp_path / "expected", "org/published-d3d")
    assert {name: files[name] for name in files if name != ".gitattributes"} == {
        p.name: p.read_bytes() for p in local.iterdir()
    }
    result = _run_client("org/published-d3d", env)
    assert result["class"] == "D3DDrafterModel" and result["block"] == 4 and result["identical"]


def test_publish_refuses_an_existing_repo_without_force(hub, hub_folder, tmp_path):
    state, endpoint = hub
    folder = assemble(hub_folder, tmp_path / "hub", "org/x")
    publish(folder, "org/x", token=hub_standin.TOKEN, endpoint=endpoint)
    commits = len(state.repos["org/x"])
    with pytest.raises(PublishError, match="already exists"):
        publish(folder, "org/x", token=hub_standin.TOKEN, endpoint=endpoint)
    assert len(state.repos["org/x"]) == commits
    (folder / "prune_report.json").write_text("{}")  # a file the next upload no longer has
    publish(folder, "org/x", token=hub_standin.TOKEN, endpoint=endpoint, force=True)
    assert len(state.repos["org/x"]) == commits + 1
    (folder / "prune_report.json").unlink()
    publish(folder, "org/x", token=hub_standin.TOKEN, endpoint=endpoint, force=True)
    files = state.head("org/x")[1]  # the repo holds the folder, no leftover that contradicts its card
    assert sorted(files) == sorted([".gitattributes", *(p.name for p in folder.iterdir())])


def test_publish_with_a_bad_token_uploads_nothing(hub, hub_folder, tmp_path):
    state, endpoint = hub
    folder = assemble(hub_folder, tmp_path / "hub", "org/x")
    with pytest.raises(PublishError, match="authenticated"):
        publish(folder, "org/x", token="hf_wrong", endpoint=endpoint)
    assert state.repos == {}


def test_server_down_mid_upload_is_not_reported_as_published(hub, hub_folder, tmp_path):
    state, endpoint = hub
    folder = assemble(hub_folder, tmp_path / "hub", "org/x")
    state.drop_commit = True
    with pytest.raises(PublishError, match="no commit with the drafter was made"):
        publish(folder, "org/x", token=hub_standin.TOKEN, endpoint=endpoint)
    assert [sorted(files) for _, files in state.repos["org/x"]] == [[".gitattributes"]]


def test_a_checkpoint_with_stale_remote_code_is_refused(hub_folder, tmp_path):
    stale = hub_folder / "generation_d3d.py"
    stale.write_text(stale.read_text() + "\n# an older copy\n")
    with pytest.raises(PublishError, match="generation_d3d.py.*differs from the installed hf_d3d"):
        assemble(hub_folder, tmp_path / "hub", "org/x")
    assert not (tmp_path / "hub").exists()


def test_published_weights_load_bit_for_bit(hub, hub_folder, tmp_path):
    from safetensors.torch import load_file

    state, endpoint = hub
    folder = assemble(hub_folder, tmp_path / "hub", "org/x")
    publish(folder, "org/x", token=hub_standin.TOKEN, endpoint=endpoint)
    (tmp_path / "w.safetensors").write_bytes(state.head("org/x")[1]["model.safetensors"])
    theirs, mine = load_file(tmp_path / "w.safetensors"), load_file(hub_folder / "model.safetensors")
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in mine)
