"""What the text mode shows: wrapping on a terminal, clean lines into a pipe, tables and help."""

import io

from rich.console import Console

from kvchat.cli.commands import Status
from kvchat.cli.ui import THEME
from tests.support.cli_harness import make_harness
from tests.support.fake_context import Response

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


def table_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines()[1:]]


def test_chunks_are_listed_in_context_order_then_the_others():
    h = make_harness()
    h.run("/context Alpha beta.")
    h.run("/context Gamma delta.")
    h.run("/system Be brief.")  # registered last, placed first
    h.run("/drop 1")
    h.take()
    h.run("/chunks")
    rows = table_rows(h.take())
    assert [(row[0], row[6]) for row in rows] == [("3", "1"), ("2", "2"), ("1", "—")]


def test_output_marks_a_truncated_answer():
    h = make_harness(["Short.", "one two three four five", Response("six seven eight", interrupt_at=1)])
    h.run("hi")
    h.run("/set max_tokens 3")
    h.run("go on")
    h.run("/set max_tokens 50")
    h.run("and more")
    h.take()
    h.run("/output")
    rows = table_rows(h.take())
    ends = {row[0]: " ".join(row[-3:-1]) for row in rows}
    assert ends["1"].endswith("stop") and "truncated" not in ends["1"]
    assert ends["2"] == "length (truncated)" and ends["3"] == "cancelled (truncated)"


def test_show_prints_the_token_ids_it_promises():
    h = make_harness()
    h.run("/context " + " ".join(f"w{i}" for i in range(70)))
    h.take()
    h.run("/help show")
    assert "token ids" in h.take()
    h.run("/show 1")
    out = h.take()
    ids = h.ctx.chunk("1").token_ids
    flat = " ".join(out.split())  # the ids wrap inside their column
    assert "token ids " + " ".join(map(str, ids[:64])) + " … 6 more" in flat


def first_column(out: str) -> list[str]:
    """The labels of a two-column grid: each line's text before its first run of 2+ spaces."""
    return [line.split("  ")[0] for line in out.splitlines() if line.strip()]


def test_help_command_explains_every_number_that_command_shows():
    h = make_harness(["An answer."])
    h.run("/context Some facts here.")
    h.run("/query q")
    h.run("/infer")
    h.take()
    for shown_by, topic in (("/verify 4", "verify"), ("/stats", "stats")):
        h.run(shown_by)
        labels = first_column(h.take())
        h.run(f"/help {topic}")
        explained = h.take()
        assert len(labels) >= 4 and all(label in explained for label in labels), (labels, explained)
    for shown_by, topic in (("/chunks", "chunks"), ("/output", "output")):
        h.run(shown_by)
        headers = h.take().splitlines()[0].split()
        h.run(f"/help /{topic}")
        explained = h.take()
        assert all(f"\n  {header} " in explained for header in headers), (headers, explained)
    h.run("/help infer")
    explained = h.take()
    for word in ("reused", "repositioned", "computed", "ttft", "tok/s", "length", "cancelled", "table"):
        assert word in explained


def test_help_name_in_json_carries_the_longer_help():
    import json

    h = make_harness(json_lines=True)
    h.run("/help verify")
    command = json.loads(h.take())["command"]
    assert command["name"] == "verify" and "top-5 overlap" in command["details"]


def test_every_command_has_a_longer_help():
    h = make_harness()
    for cmd in h.shell.commands:
        assert len(cmd.details) > len(cmd.summary), cmd.name
        h.run(f"/help {cmd.name}")
        assert cmd.details.splitlines()[0] in h.take()


def test_the_per_chunk_table_shows_when_a_chunk_before_the_new_one_was_not_simply_reused():
    from dataclasses import replace

    h = make_harness(["Fine.", "Again.", "Moved."])
    h.run("/context First text.")
    h.take()
    h.run("hello")  # the fake reuses every chunk but the new turn
    assert len(h.take().splitlines()) == 2  # the answer and its summary line, no table
    report = h.ctx._report
    h.ctx._report = lambda chunk_id, last: replace(report(chunk_id, last), num_reused=0, num_computed=2)
    h.run("again")
    lines = h.take().splitlines()
    assert lines[2].split() == ["id", "role", "tokens", "reused", "repositioned", "computed"]
    assert len(lines) == 3 + len(h.ctx.context())  # a row per chunk of the context
    h.ctx._report = lambda chunk_id, last: replace(report(chunk_id, last), num_reused=0, num_repositioned=2)
    finish = h.ctx._finish
    h.ctx._finish = lambda *args: replace(finish(*args), repositioned_tokens=2)
    h.run("moved")
    assert "repositioned" in h.take().splitlines()[2]
