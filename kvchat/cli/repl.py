"""The interactive loop: prompt_toolkit for input, the runner for everything else.

Enter sends the line; Alt-Enter (or Esc then Enter) starts a new line. Text between `\"\"\"` fences
may span lines too: Enter adds a new line while a fence is open, so
`/context \"\"\"` ... `\"\"\"` sends the lines between as the argument. Ctrl-C clears the line (while
generating it stops the output and keeps what came so far); Ctrl-D quits.
"""

from __future__ import annotations

import os
import sys
import termios
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.application import get_app
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.output import ColorDepth, Output

from kvchat.cli.commands import Shell, Status, run_line
from kvchat.cli.completion import ShellCompleter
from kvchat.cli.slash_commands import join_block
from kvchat.cli.ui import UI

FENCE = '"""'
PROMPT = "› "
MIN_NAME_WIDTH = 12  # the model name keeps at least this much of its end


def run_interactive(shell: Shell, ui: UI, session: PromptSession[str]) -> int:
    """Read and run lines until Ctrl-D or /quit; the exit status is always 0."""
    ui.banner(shell.ctx.model_id)
    while True:
        try:
            text = unfence(session.prompt()).strip()
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt: drop the line
        except EOFError:
            return 0
        if not text:
            continue
        try:
            with keys_held():
                status = run_line(shell, ui, text)
        except KeyboardInterrupt:
            continue  # a Ctrl-C that missed the generation (e.g. while a table printed)
        if status is Status.QUIT:
            return 0


@contextmanager
def keys_held() -> Iterator[None]:
    """While a command runs, keys typed on the terminal are not echoed into its output: they wait,
    unread, and the next prompt takes them as typed-ahead input. Ctrl-C still interrupts."""
    fd = _terminal_fd()
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)  # lflags; ISIG stays, so Ctrl-C is still SIGINT
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)  # TCSANOW: keep what was typed meanwhile


def _terminal_fd() -> int | None:
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, ValueError, OSError):
        return None
    return fd if os.isatty(fd) else None


def make_prompt_session(
    shell: Shell,
    history_file: Path | None,
    *,
    color: bool = True,
    input: Input | None = None,
    output: Output | None = None,
) -> PromptSession[str]:
    """The prompt: history, completion, multi-line keys and a toolbar with the cache's state.

    Without `color` the prompt is monochrome; a line editor still needs its cursor escapes.
    """
    return PromptSession(
        PROMPT,
        history=_history(history_file),
        completer=ShellCompleter(shell),
        complete_while_typing=False,
        multiline=True,
        key_bindings=_key_bindings(),
        bottom_toolbar=lambda: toolbar(shell, _terminal_width()),
        color_depth=None if color else ColorDepth.MONOCHROME,
        input=input,
        output=output,
    )


def toolbar(shell: Shell, width: int | None = None) -> str:
    """The model, the KV cache in use (tokens and blocks) and the reuse mode; within `width`
    columns the model name is shortened, never the rest."""
    stats = shell.ctx.stats()
    used, total = stats.num_used * stats.block_size, stats.num_blocks * stats.block_size
    tail = (
        f" · KV {used:,}/{total:,} tokens ({stats.num_used}/{stats.num_blocks} blocks)"
        f" · reuse {shell.ctx.mode} "
    )
    room = None if width is None else width - len(tail) - 1
    return f" {short_name(shell.ctx.model_id, room)}{tail}"


def short_name(model_id: str, width: int | None) -> str:
    """`model_id` in at most `width` characters: a path by its file name, then cut from the left."""
    if width is None or len(model_id) <= width:
        return model_id
    name = model_id.rstrip("/").rsplit("/", 1)[-1] if model_id.startswith(("/", "~", ".")) else model_id
    name = f"…/{name}" if name != model_id else name
    width = max(width, MIN_NAME_WIDTH)
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def _terminal_width() -> int | None:
    try:
        return get_app().output.get_size().columns
    except Exception:  # no running application (a test drawing the toolbar by hand)
        return None


def unfence(text: str) -> str:
    """`/context \"\"\"a\\nb\"\"\"` -> `/context\\na\\nb`: the fenced text becomes the argument."""
    head, fence, rest = text.partition(FENCE)
    if not fence:
        return text
    body = rest.rsplit(FENCE, 1)[0] if FENCE in rest else rest
    return join_block(head.strip(), body.split("\n"))


def is_fence_open(text: str) -> bool:
    return text.count(FENCE) % 2 == 1


def _key_bindings() -> KeyBindings:
    bindings = KeyBindings()

    @bindings.add("enter")
    def _send_or_newline(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if is_fence_open(buffer.text):
            buffer.insert_text("\n")
        else:
            buffer.validate_and_handle()

    @bindings.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    return bindings


def _history(path: Path | None) -> History:
    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    except OSError:
        return InMemoryHistory()  # an unwritable home must not stop the chat
    return FileHistory(str(path))
