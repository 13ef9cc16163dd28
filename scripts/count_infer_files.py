"""Count the kvchat files one scripted `/infer` runs code in (a sys.setprofile trace of the call).

Opens a session on the packaged model, sets a system prompt, a context passage and a query, then
traces one `/infer` line through the same runner a script uses. Prints the files, then their count.

    python scripts/count_infer_files.py [--max-tokens N]
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import kvchat
from kvchat.cli.commands import Shell, run_line
from kvchat.cli.ui import UI
from kvchat.config import load_settings
from kvchat.session import open_session

PACKAGE = Path(kvchat.__file__).resolve().parent


def traced_files(func) -> set[str]:
    """The kvchat source files whose code runs while `func()` runs."""
    files: set[str] = set()

    def profile(frame, event, arg) -> None:
        if event == "call":
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        func()
    finally:
        sys.setprofile(None)
    return {str(Path(f).resolve().relative_to(PACKAGE.parent)) for f in files if _in_package(f)}


def _in_package(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(PACKAGE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    settings = load_settings(
        overrides={"sampling": {"max_tokens": args.max_tokens}, "cache": {"kv_memory_mb": 64}}
    )
    shell = Shell(open_session(settings), settings)
    ui = UI(color=False, file=io.StringIO())
    for line in ("/system You answer briefly.", "/context The river runs north.", "/query Where?"):
        run_line(shell, ui, line)
    run_line(shell, ui, "/infer")  # a first one warms the cache, so the traced one reuses KV too
    files = sorted(traced_files(lambda: run_line(shell, ui, "/infer")))
    print("\n".join(files))
    print(f"{len(files)} files")


if __name__ == "__main__":
    main()
