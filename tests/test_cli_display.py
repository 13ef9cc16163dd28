"""What the text mode shows: wrapping on a terminal, clean lines into a pipe, tables and help."""

import io

from rich.console import Console

from kvchat.cli.runner import Status
from kvchat.cli.ui import THEME
from tests.fake_context import Response, isolated_user_dirs, make_harness  # noqa: F401  (autouse fixture)

ANSWER = "The Rhine rises in the Swiss Alps and flows north through Germany into the North Sea."


def on_terminal(h, width: int) -> io.StringIO:
    """Point the harness's UI at a terminal `width` columns wide (no colors, to read it back)."""
    out = io.StringIO()
    h.ui.console = Console(
        file=out, force_terminal=True, width=width, color_system=None, theme=THEME, highlight=False
    )
    return out


def test_streamed_text_and_the_summary_wrap_at_spaces_on_a_terminal():
    h = make_harness([ANSWER])
    out = on_terminal(h, 30)
    assert h.run("hello") is Status.OK
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 30 for line in lines), lines
    text = " ".join(lines)
    assert ANSWER in text  # no word was cut at the edge
    for piece in ("reused", "repositioned", "computed", "tok/s", "output 1"):
        assert piece in text


def test_into_a_pipe_a_result_stays_one_line_and_no_line_ends_in_spaces():
    h = make_harness([ANSWER + " " + ANSWER])
    h.run("/system Be brief.")
    h.run("/context Some facts here, and some more of them.")
    h.run("hello")
    for line in ("/chunks", "/output", "/stats", "/show 2", "/verify 4", "/set", "/help", "/help verify"):
        assert h.run(line) is Status.OK
    assert h.run("/show " + "x" * 200) is Status.FAILED
    out = h.take()
    lines = out.split("\n")
    assert [line for line in lines if line != line.rstrip()] == []
    assert ANSWER + " " + ANSWER in lines  # the answer was not wrapped at 80 columns
    assert any(line.startswith("error: no chunk") and len(line) > 200 for line in lines)
