"""Write the documentation that is made from the code and the measurements, so it cannot drift:

- docs/commands.md, from the slash commands' own help (what /help shows);
- the benchmark results in docs/benchmarks.md and the README's table, from docs/results/*.json
  (written by `scripts/bench_peer.py --json FILE`).

    python scripts/make_docs.py           # rewrite them
    python scripts/make_docs.py --check   # exit 1 when a page is not what this script writes

tests/test_docs.py checks the same.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench_report import load_results, readme_table, results_section

from kvchat.cli.commands import Shell
from kvchat.cli.settings import shown_value
from kvchat.config import Settings
from kvchat.settings_schema import all_settings

ROOT = Path(__file__).resolve().parent.parent
COMMANDS_PAGE = ROOT / "docs" / "commands.md"
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"
# The generated part of a hand-written page lies between these lines.
BENCH_MARKS = ("<!-- benchmark table: written by scripts/make_docs.py -->", "<!-- end of benchmark table -->")
RESULT_MARKS = ("<!-- results: written by scripts/make_docs.py -->", "<!-- end of results -->")


def commands_page() -> str:
    """Every slash command: a table of them, then each one's full help."""
    commands = list(Shell(None, Settings()).commands)  # type: ignore[arg-type]  # the registry alone
    lines = [
        "# Commands",
        "",
        "Type these at kvchat's prompt, or put them in a file for `kvchat run FILE`",
        "([scripts](scripting.md)). Anything that does not start with `/` is a chat message.",
        "`/help COMMAND` shows the same help as this page, which `scripts/make_docs.py` writes from it.",
        "",
        "At the prompt: Tab completes commands, output numbers, chunk ids, setting keys and file names.",
        'Enter sends the line; Alt-Enter (or Esc, Enter) starts a new one, as does Enter inside `"""`',
        "fences. Ctrl-C stops an answer within a token and keeps what came (marked truncated), or clears",
        "the line; Ctrl-D quits. Keys typed while an answer streams wait for the next prompt. The input",
        "history is kept in `~/.local/share/kvchat/history` (`ui.history_file`). The toolbar shows the",
        "model, the KV cache in use (tokens and blocks) and the reuse mode.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    # A | in a table cell, even in code, ends the cell unless escaped.
    lines += [f"| [`{c.synopsis.replace('|', chr(92) + '|')}`](#{c.name}) | {c.summary} |" for c in commands]
    for cmd in commands:
        aliases = f" (also {', '.join('`/' + a + '`' for a in cmd.aliases)})" if cmd.aliases else ""
        lines += ["", f"## {cmd.name}", "", f"`{cmd.synopsis}`{aliases}: {cmd.summary}."]
        if cmd.details:
            lines += ["", "```text", cmd.details.rstrip(), "```"]
    return "\n".join([*lines, *settings_section()]) + "\n"


def settings_section() -> list[str]:
    """Every setting `/set` takes, as settings_schema declares it."""
    lines = [
        "",
        "## Settings",
        "",
        "`/set KEY VALUE` changes one for the session (`live`: at once; the others at the next start, as",
        "`/set` says); the flag sets it for one run; [`configs/default.toml`](../configs/default.toml) has",
        "every default, and your config file keeps yours.",
        "",
        "| key | default | flag | live | what it does |",
        "|---|---|---|---|---|",
    ]
    for info in all_settings().values():
        default = "unset" if info.default is None else shown_value(info.default)
        text = " ".join(x for x in (info.spec.help, info.spec.detail) if x).replace("|", chr(92) + "|")
        flag = f"`{info.spec.flag}`" if info.spec.flag else ""
        live = "yes" if info.spec.live else ""
        lines.append(f"| `{info.key}` | `{default}` | {flag} | {live} | {text} |")
    return lines


def between(text: str, marks: tuple[str, str], body: str) -> str:
    """`text` with what lies between the two marker lines replaced by `body`."""
    start, end = text.index(marks[0]) + len(marks[0]), text.index(marks[1])
    return f"{text[:start]}\n{body}\n{text[end:]}"


def pages() -> dict[Path, str]:
    """What each page should hold."""
    runs = load_results(RESULTS)
    readme = between(README.read_text(encoding="utf-8"), BENCH_MARKS, readme_table(runs))
    benchmarks = between(BENCHMARKS_PAGE.read_text(encoding="utf-8"), RESULT_MARKS, results_section(runs))
    return {COMMANDS_PAGE: commands_page(), README: readme, BENCHMARKS_PAGE: benchmarks}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--check", action="store_true", help="only check that the pages are up to date")
    args = parser.parse_args()
    stale = []
    for path, text in pages().items():
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(text, encoding="utf-8")
    verb = "out of date" if args.check else "wrote"
    for path in stale:
        print(f"{verb}: {path}")
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
