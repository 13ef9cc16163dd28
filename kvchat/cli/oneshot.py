"""`kvchat -p PROMPT`: one chat message answered on standard output, then exit.

The answer alone goes to stdout (with --json, its one JSON object, as a chat line of a script); errors
and a truncation warning go to stderr. The exit status is 0, or 1 when the answer failed or Ctrl-C cut
it short.
"""

from __future__ import annotations

from kvchat.cli.commands import Shell, consume
from kvchat.cli.ui import UI
from kvchat.errors import KvchatError


def run_prompt(shell: Shell, ui: UI, prompt: str) -> int:
    """Answer `prompt` as a chat message (a leading / is text, not a command); the exit status."""
    try:
        inference = shell.chat(prompt)
        show_thinking = shell.settings.ui.show_thinking
        result = consume(inference, lambda event: ui.step(event, show_thinking))
    except KvchatError as exc:
        ui.error("chat", str(exc))
        return 1
    except Exception as exc:  # a bug: one line, the traceback with --debug
        ui.error("chat", f"internal error: {type(exc).__name__}: {exc}")
        ui.exception(exc)
        return 1
    ui.answer_done("chat", result)
    if result.finish_reason == "length":
        ui.warn(f"the answer was cut at {shell.settings.sampling.max_tokens} tokens (--max-tokens)")
    return 1 if result.finish_reason == "cancelled" else 0
