"""A shell over a FakeContextManager and a UI writing to a string, for CLI transcript tests:
`h = make_harness(["Hi!"])`, then `h.run("/infer")` and `h.take()` for what it printed."""

from __future__ import annotations

import io
from dataclasses import dataclass

from kvchat.cli.commands import Shell, Status, run_line
from kvchat.cli.ui import UI
from kvchat.config import load_settings
from tests.fake_context import FakeContextManager, Response


@dataclass
class Harness:
    """What make_harness returns."""

    ctx: FakeContextManager
    shell: Shell
    ui: UI
    out: io.StringIO

    def run(self, line: str) -> Status:
        return run_line(self.shell, self.ui, line)

    def take(self) -> str:
        """The output since the last take."""
        text = self.out.getvalue()
        self.out.seek(0)
        self.out.truncate()
        return text

    def refused(self, line: str) -> str:
        """Run `line`, check that it failed in one error line and changed neither the context nor the
        settings, and return that line."""
        self.take()
        before, settings = self.ctx.state(), self.shell.settings
        assert self.run(line) is Status.FAILED
        out = self.take()
        assert out.count("\n") == 1 and out.startswith("error: ")
        assert self.ctx.state() == before and self.shell.settings == settings
        return out


def make_harness(
    responses: list[str | Response] | None = None, *, json_lines: bool = False, overrides: dict | None = None
) -> Harness:
    ctx = FakeContextManager(responses)
    out = io.StringIO()
    # Text transcripts read errors in place; a JSON stream is stdout alone (errors go to stderr too).
    ui = UI(color=False, json_lines=json_lines, file=out, err_file=io.StringIO() if json_lines else out)
    return Harness(ctx, Shell(ctx, load_settings(None, overrides or {})), ui, out)
