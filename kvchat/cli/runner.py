"""Run one line through the shell and show what it returned; shared by the REPL and the script runner."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from enum import Enum

from kvchat.chunks.types import InferenceResult
from kvchat.cli.commands import Shell
from kvchat.cli.results import Quit
from kvchat.cli.slash_commands import split_command
from kvchat.cli.ui import UI
from kvchat.engine.records import GenerationStep, PrefillProgress
from kvchat.errors import KvchatError


class Status(Enum):
    OK = "ok"
    FAILED = "failed"
    QUIT = "quit"


def run_line(shell: Shell, ui: UI, line: str, lineno: int | None = None) -> Status:
    """Execute `line`, render its record or its error; a failure never ends the session."""
    parts = split_command(line)
    typed_name = parts[0] if parts else "chat"
    try:
        cmd, record = shell.execute(line, parts)
        if isinstance(record, Generator):  # an inference, streamed as it runs
            show_thinking = shell.settings.ui.show_thinking
            record = consume(record, lambda event: ui.step(event, show_thinking))
    except KvchatError as exc:
        ui.error(typed_name, str(exc), lineno)
        return Status.FAILED
    except Exception as exc:  # a bug must not take the session and its cache down with it
        ui.error(typed_name, f"internal error: {type(exc).__name__}: {exc}", lineno)
        ui.exception(exc)
        return Status.FAILED
    ui.show(cmd, record, lineno)
    return Status.QUIT if isinstance(record, Quit) else Status.OK


def consume(
    stream: Iterator[PrefillProgress | GenerationStep | InferenceResult],
    on_step: Callable[[PrefillProgress | GenerationStep], None],
) -> InferenceResult:
    """Drive an inference stream to its InferenceResult, showing each step.

    Ctrl-C while a step is being shown is thrown into the generator, which stops within a token and
    answers with its (cancelled) result; Ctrl-C while it computes is caught by the generator itself,
    which then yields that result next.
    """
    assert isinstance(stream, Generator), "inference streams are generators: Ctrl-C is thrown into them"
    try:
        for item in stream:
            if isinstance(item, InferenceResult):
                return item
            try:
                on_step(item)
            except KeyboardInterrupt:
                return _drain(stream.throw(KeyboardInterrupt()), stream)
    finally:
        stream.close()  # run the generator's finally now, not at garbage collection
    raise KvchatError("the inference ended without a result")


def _drain(
    item: PrefillProgress | GenerationStep | InferenceResult,
    stream: Iterator[PrefillProgress | GenerationStep | InferenceResult],
) -> InferenceResult:
    # After a throw the contract is an immediate result; tolerate stray steps without showing them.
    while not isinstance(item, InferenceResult):
        item = next(stream)
    return item
