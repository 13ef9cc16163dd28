"""Every `python scripts/...` command line the documentation shows is one its script accepts: each is
parsed by the script's own argument parser (the script stops there, nothing is measured or written)."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "scripts" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = PAGES + sorted((ROOT / "scripts").glob("*.py"))  # the scripts' docstrings show usage too
COMMAND = re.compile(r"python3? (scripts/\w+\.py)([^`|\n]*)")


def documented_commands() -> list[tuple[str, tuple[str, ...]]]:
    """Each distinct (script, arguments) the pages and the scripts' docstrings show; a usage line's
    optional parts ([--tokens N]) given."""
    found: set[tuple[str, tuple[str, ...]]] = set()
    for source in SOURCES:
        text = re.sub(r"\\{1,2}\n\s*", " ", source.read_text(encoding="utf-8"))  # lines continued by \\
        for script, rest in COMMAND.findall(text):
            line = rest.split("#", 1)[0].strip().rstrip(")").rstrip(":")
            words = shlex.split(line.replace("[", " ").replace("]", " "))
            found.add((script, tuple("1" if word == "N" else word for word in words)))  # N: a count
    return sorted(found)


class Parsed(Exception):
    """Raised where a script's parser accepted its arguments, to stop the script there."""


def test_the_pages_show_script_commands() -> None:
    scripts = {script for script, _ in documented_commands()}
    assert {"scripts/bench_peer.py", "scripts/bench_quant.py", "scripts/make_docs.py"} <= scripts


@pytest.mark.parametrize(
    ("script", "words"), [pytest.param(s, w, id=" ".join([s, *w])) for s, w in documented_commands()]
)
def test_a_documented_command_line_is_accepted(script: str, words: tuple[str, ...], monkeypatch) -> None:
    path = ROOT / script
    assert path.is_file(), f"{script} is documented but does not exist"
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        if self.prog != path.name:  # another parser the script builds (none yet): parse as usual
            return parse_args(self, args, namespace)
        raise Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(path), *words])
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    if path.name == "readme_commands.py":  # reads sys.argv itself: it prints one README line
        runpy.run_path(str(path), run_name="__main__")
        return
    with pytest.raises((Parsed, SystemExit)) as stopped:
        runpy.run_path(str(path), run_name="__main__")
    if stopped.type is SystemExit:  # --help prints the script's help and exits 0
        assert "--help" in words and stopped.value.code == 0
