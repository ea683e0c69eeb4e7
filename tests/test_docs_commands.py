"""Every ``hf-d3d`` command the README, docs, examples, cards and scripts show names a subcommand and options that
exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from hf_d3d.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    {ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/**/*.md"), *ROOT.glob("hub_cards/*.md")}
    | set(ROOT.glob("checkpoints/*/README.md"))
    | set(ROOT.glob("scripts/*.sh"))
)
# `hf-d3d SUB` where a shell command starts (after env assignments, `nohup`, a path, `$D3D` in scripts) or
# `-m hf_d3d.cli SUB` (accelerate launch), up to the end of the shell command
COMMAND = re.compile(
    r"(?:(?:^\s*|[;&|(]\s*|\$\s+|\S+=\S*\s+|nohup\s+|/)hf-d3d|\$\{?D3D\}?|-m hf_d3d\.cli) ([a-z][a-z-]*)([^`|;&>#\n]*)"
)


def _snippets(text: str) -> list[str]:
    """Code blocks (comments dropped, line continuations joined) and inline code spans; a shell script is one block."""
    if text.startswith("#!"):
        text = f"```\n{text}```"
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        lines = [re.sub(r"(^|\s)#.*$", "", line) for line in block.splitlines()]
        out += "\n".join(lines).replace("\\\n", " ").splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out += re.findall(r"`([^`]+)`", prose.replace("\n", " "))
    return [re.sub(r"<[^<>\n]*>", "X", snippet) for snippet in out]  # <placeholders> are values, not redirections


def _options(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}


def _problems(doc: Path, options: dict[str, set[str]]) -> tuple[int, list[str]]:
    """How many commands ``doc`` shows, and what in them the CLI does not have."""
    seen, wrong = 0, []
    for snippet in _snippets(doc.read_text()):
        for match in COMMAND.finditer(snippet):
            name, rest = match.groups()
            if name not in options and not rest.strip().startswith("-") and snippet[match.end() :].strip():
                continue  # prose ("hf-d3d needs >=5.23"), not a command
            seen += 1
            if name not in options:
                wrong.append(f"{doc.name}: no subcommand {name!r}")
                continue
            flags = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)
            wrong += [f"{doc.name}: `{name} {f}` is not an option" for f in flags if f not in options[name]]
    return seen, wrong


def test_documented_commands_use_existing_options():
    options = _options(build_parser())
    results = [_problems(doc, options) for doc in DOCS]
    assert sum(seen for seen, _ in results) > 50, "few commands found: the extraction no longer matches the docs"
    wrong = [w for _, problems in results for w in problems]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "snippet, problem",
    [("hf-d3d eval-tau --drafter d --num-promts 5", "--num-promts"), ("hf-d3d evaluate --drafter d", "'evaluate'")],
)
def test_a_stale_command_is_caught(tmp_path, snippet, problem):
    doc = tmp_path / "README.md"
    block = "```bash\nhf-d3d bench --drafter <a folder> \\\n  --num-prompts 3  # --not-an-option in a comment\n```\n"
    doc.write_text(f"Run `{snippet}` to measure, after `pip install hf-d3d torch`.\n\n{block}")
    seen, wrong = _problems(doc, _options(build_parser()))
    assert seen == 2 and len(wrong) == 1 and problem in wrong[0], wrong
