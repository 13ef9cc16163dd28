"""Print one of the README's two quick-start commands, so CI runs them as written (standard library
only: CI reads them before anything is installed):

    python3 scripts/readme_commands.py kvchat   # sets up and runs kvchat
    python3 scripts/readme_commands.py tests    # sets up and runs the tests

Each is the fenced block under its marker line in README.md, `<!-- ci: the NAME command -->`.
"""

from __future__ import annotations

import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
NAMES = {"kvchat": "<!-- ci: the kvchat command -->", "tests": "<!-- ci: the test command -->"}


def readme_command(text: str, name: str) -> str:
    """The one-line command in the fenced block right after `name`'s marker line."""
    lines = text.splitlines()
    at = lines.index(NAMES[name])
    fence = next(i for i in range(at + 1, len(lines)) if lines[i].startswith("```"))
    end = lines.index("```", fence + 1)
    body = [line for line in lines[fence + 1 : end] if line.strip()]
    assert len(body) == 1, f"{name}: the block under {NAMES[name]} must hold one command line"
    return body[0]


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in NAMES:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(NAMES)}")
    print(readme_command(README.read_text(encoding="utf-8"), sys.argv[1]))


if __name__ == "__main__":
    main()
