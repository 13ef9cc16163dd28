"""A shell over a FakeContextManager and a UI writing to a string, for CLI transcript tests:
`h = make_harness(["Hi!"])`, then `h.run("/infer")` and `h.take()` for what it printed; and the
`kvchat` command run in-process on a fake session (`invoke(["-p", "Hi"])`)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from typer.testing import CliRunner

from kvchat.cli.app import make_app
from kvchat.cli.commands import Shell, Status, run_line
from kvchat.cli.ui import UI
from kvchat.config import load_settings
from tests.support.fake_context import FakeContextManager, Response


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


class Factory:
    """Records the settings it was opened with and returns a fake context manager."""

    def __init__(self, responses=None, error=None):
        self.ctx = FakeContextManager(responses)
        self.error = error
        self.settings = None

    def __call__(self, settings, progress):
        self.settings = settings
        if self.error:
            raise self.error
        if progress is not None:
            progress("loading", 1, 1)
        return self.ctx


def invoke(args, stdin="", factory=None, env=None):
    factory = factory or Factory(["Hi there."])
    result = CliRunner().invoke(make_app(factory), args, input=stdin, env=env)
    return result, factory


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]
