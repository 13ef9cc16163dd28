"""Run the README's example session on the packaged model and write what kvchat printed into
README.md, between its session markers, so the README shows real output:

    python scripts/readme_session.py

The commands run through kvchat's own shell, one line at a time, as a script piped into `kvchat`
would; the block shows each command after the prompt `› `, then its output. tests/test_docs.py checks
that the README's block has this script's commands and form.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from kvchat.cli.commands import Shell, run_line
from kvchat.cli.ui import UI
from kvchat.config import load_settings

README = Path(__file__).resolve().parent.parent / "README.md"
MARKS = ("<!-- session: written by scripts/readme_session.py -->", "<!-- end of session -->")
FLAGS = {"--max-tokens": 40}
START = "$ kvchat --max-tokens 40"
PROMPT = "› "
COMMANDS = (
    "/system You are a concise assistant.",
    "/context The Rhine rises in the Swiss Alps and flows north through Germany and the Netherlands "
    "into the North Sea.",
    "/query Where does the Rhine end?",
    "/infer",
    "/query Which countries does it flow through?",
    "/infer",
    "/system You are a geography teacher.",
    "/use-output 1",
    "/query Is the earlier answer right?",
    "/mode reposition",
    "/infer",
    "/verify 8",
)


def run_session() -> list[tuple[str, str]]:
    """Each command and the text kvchat printed for it (standard output, no colors)."""
    from kvchat.session import open_session

    settings = load_settings(None, flags=FLAGS)
    shell = Shell(open_session(settings), settings)
    entries = []
    for line in COMMANDS:
        out = io.StringIO()
        run_line(shell, UI(color=False, file=out, err_file=io.StringIO()), line)
        entries.append((line, out.getvalue().rstrip("\n")))
    return entries


def render(entries: list[tuple[str, str]]) -> str:
    """The session as a text block: the command line that started it, each command, its output."""
    lines = ["```text", START]
    for command, output in entries:
        lines.append(PROMPT + command)
        lines += output.split("\n") if output else []
    return "\n".join([*lines, "```"])


def parse(block: str) -> list[tuple[str, str]]:
    """The commands and outputs of a block `render` wrote."""
    entries: list[tuple[str, list[str]]] = []
    for line in block.split("\n")[2:-1]:
        if line.startswith(PROMPT):
            entries.append((line.removeprefix(PROMPT), []))
        else:
            entries[-1][1].append(line)
    return [(command, "\n".join(output)) for command, output in entries]


def readme_block(text: str) -> str:
    """The session block of the README's text."""
    return text[text.index(MARKS[0]) + len(MARKS[0]) : text.index(MARKS[1])].strip("\n")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    argparse.ArgumentParser(description=__doc__, formatter_class=formatter).parse_args()
    text = README.read_text(encoding="utf-8")
    block = render(run_session())
    start, end = text.index(MARKS[0]) + len(MARKS[0]), text.index(MARKS[1])
    README.write_text(f"{text[:start]}\n{block}\n{text[end:]}", encoding="utf-8")
    print(block)


if __name__ == "__main__":
    main()
