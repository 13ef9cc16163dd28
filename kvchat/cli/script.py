"""Commands read from a file or a non-terminal stdin, one per line.

The format:

- Each line is one command (`/context some text`) or a chat message (plain text).
- Blank lines and lines starting with `#` are skipped.
- A block carries text over several lines. A line ending with `<<<` opens it; the lines after it,
  kept verbatim (blank lines and `#` included), up to a line `>>>` are its text. The block's text
  goes on a new line after what stands before `<<<`, so

      /context <<<
      First line.
      Second line.
      >>>

  runs `/context` with the two lines as its text, and a line that is only `<<<` makes the block a
  chat message. The opening line carries the command, so each command runs as soon as its last line
  is read: a program can drive kvchat through a pipe and read each answer before sending more.
- A `>>>` line with no block open is an error (it is never sent as a chat message).
- Lines are UTF-8 (a byte-order mark starting a line is ignored; CRLF endings are fine). A line that is not
  valid UTF-8 or longer than 1 MiB is reported as a failed command, and so is a block holding one or
  left open at the end of input; reading goes on with the next line.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from kvchat.cli.commands import Shell, Status, run_line
from kvchat.cli.slash_commands import join_block
from kvchat.cli.ui import UI

MAX_LINE_BYTES = 1 << 20
BLOCK_OPEN = "<<<"
BLOCK_CLOSE = ">>>"


@dataclass(frozen=True)
class ScriptCommand:
    """One command of a script: its text, or why its lines could not be read."""

    lineno: int  # where the command starts, 1-based
    text: str | None
    error: str | None = None


def run_script(shell: Shell, ui: UI, stream: BinaryIO) -> int:
    """Run every command of `stream`; 0 when all succeeded, 1 when any failed (the rest still ran)."""
    failed = False
    for item in read_commands(stream):
        if item.text is None:
            ui.error(None, item.error or "unreadable line", item.lineno)
            failed = True
            continue
        status = run_line(shell, ui, item.text, item.lineno)
        failed |= status is Status.FAILED
        if status is Status.QUIT:
            break
    return 1 if failed else 0


def read_commands(stream: BinaryIO) -> Iterator[ScriptCommand]:
    """The commands of a script, blocks joined; see the module docstring for the format."""
    lines = _decoded_lines(stream)
    for lineno, text, error in lines:
        if text is None:
            yield ScriptCommand(lineno, None, error)
            continue
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped == BLOCK_OPEN or stripped.endswith(" " + BLOCK_OPEN):
            yield _read_block(lineno, stripped.removesuffix(BLOCK_OPEN).rstrip(), lines)
        elif stripped == BLOCK_CLOSE:
            yield ScriptCommand(
                lineno, None, f"{BLOCK_CLOSE} with no block open (a line ending in {BLOCK_OPEN})"
            )
        else:
            yield ScriptCommand(lineno, stripped)


def _read_block(start: int, head: str, lines: Iterator[tuple[int, str | None, str | None]]) -> ScriptCommand:
    body: list[str] = []
    error: str | None = None
    for lineno, text, line_error in lines:
        if text is None:
            error = error or f"the block has a bad line {lineno}: {line_error}"
        elif text.strip() == BLOCK_CLOSE:
            return (
                ScriptCommand(start, None, error) if error else ScriptCommand(start, join_block(head, body))
            )
        else:
            body.append(text)
    return ScriptCommand(start, None, f"the block opened here has no closing {BLOCK_CLOSE} line")


def _decoded_lines(stream: BinaryIO) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text without its line ending, None) or (line number, None, error) per line."""
    lineno = 0
    while raw := stream.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            _skip_rest_of_line(stream)
            yield lineno, None, f"line longer than {MAX_LINE_BYTES >> 20} MiB"
            continue
        try:
            text = raw.decode("utf-8").removeprefix("\ufeff")  # a BOM starts each file joined with cat
        except UnicodeDecodeError as exc:
            yield lineno, None, f"invalid UTF-8 at byte {exc.start + 1} of the line"
            continue
        yield lineno, text.rstrip("\r\n"), None


def _skip_rest_of_line(stream: BinaryIO) -> None:
    # Read on in bounded pieces so a huge line never sits in memory whole.
    while (piece := stream.readline(MAX_LINE_BYTES)) and not piece.endswith(b"\n"):
        pass
