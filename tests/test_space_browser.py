"""The Gradio Space in a real browser: headless Chromium submits prompts and reads what the page renders."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("space") / "app.log"
    env = {**os.environ, "PORT": str(port), "HOST": "127.0.0.1", "GRADIO_ANALYTICS_ENABLED": "False"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "examples/space/app.py"], cwd=ROOT, env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the Space app exited early:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail(f"the Space app did not start:\n{log.read_text()[-3000:]}")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def page(app_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(app_url)
        page.wait_for_selector("#go")
        yield page
        browser.close()


def _submit(page, prompt: str, max_new: str, expect: str) -> str:
    """Submit, then wait until the status line shows ``expect`` and no progress overlay (the new, final result)."""
    page.fill("#prompt textarea", prompt)
    page.fill("#max_new input", max_new)
    page.click("#go")
    page.wait_for_function(
        "(want) => { const t = document.querySelector('#stats').innerText; "
        "return t.includes(want) && !t.includes('queue') && !/\\d+\\.\\ds/.test(t.split('\\n')[0]); }",
        arg=expect,
        timeout=180_000,
    )
    return page.inner_text("#stats")


def test_space_decodes_and_shows_identical_outputs(page, tmp_path):
    stats = _submit(page, "What is 12 times 7? Answer briefly.", "32", "identical:")
    page.screenshot(path=str(tmp_path / "space.png"), full_page=True)
    assert "identical: yes" in stats
    assert "speedup" in stats and "tau" in stats
    plain = page.input_value("#plain textarea")
    d3d_text = page.inner_text("#d3d")
    assert plain.strip() and d3d_text.strip()
    assert page.locator("#d3d span.tgt").count() >= 1  # every round shows the target's own token
    assert (tmp_path / "space.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("prompt", "max_new", "message"),
    [
        ("   ", "16", "prompt is empty"),
        ("Hi", "0", "positive integer"),
        ("Hi", "100000", "too large"),
        ("word " * 9000, "16", "exceeds the model's context"),
    ],
)
def test_space_bad_input_gives_a_message(page, prompt, max_new, message):
    stats = _submit(page, prompt, max_new, message)
    assert "Input error" in stats
