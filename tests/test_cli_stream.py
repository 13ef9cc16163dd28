"""Ctrl-C during generation: the contract between the stream and its consumer."""

import json

import pytest

from kvchat.chunks.types import InferenceResult, ReuseMode
from kvchat.cli.commands import Status, consume
from kvchat.errors import KvchatError
from tests.support.cli_harness import make_harness
from tests.support.fake_context import Response, fake_step


def interrupt_on_step(h, step_number):
    """Make the UI raise KeyboardInterrupt while it shows the given step, as a Ctrl-C would."""
    show = h.ui.step

    def step(event, show_thinking=True):
        if event.num_generated == step_number:
            raise KeyboardInterrupt
        show(event, show_thinking)

    h.ui.step = step


def test_ctrl_c_while_rendering_is_thrown_into_the_stream_and_keeps_the_text():
    h = make_harness(["one two three four five"])
    interrupt_on_step(h, 3)
    assert h.run("go") is Status.OK
    lines = h.take().splitlines()
    assert lines[0] == "one two"
    assert "cancelled — output truncated" in lines[1]
    assert h.ctx.outputs()[0].text == "one two three"  # what the generator kept when the throw arrived


def test_ctrl_c_while_computing_is_caught_by_the_stream_itself():
    h = make_harness([Response("one two three four", interrupt_at=2)], json_lines=True)
    h.run("go")
    result = json.loads(h.take())
    assert result["finish_reason"] == "cancelled" and result["output"] == "one two"


def result(text="x"):
    return InferenceResult(text, [1], "cancelled", None, None, ReuseMode.EXACT, 1, 0, 0, 1, 0.0, 0.0, 0.0)


def test_stray_steps_after_the_throw_are_drained_not_shown():
    closed = []

    def stream():
        try:
            yield fake_step("a", "", 1, 1)
            try:
                yield fake_step("b", "", 2, 2)
            except KeyboardInterrupt:
                yield fake_step("c", "", 3, 3)
                yield result("ab")
        finally:
            closed.append(True)

    shown = []

    def on_step(event):
        if event.text == "b":
            raise KeyboardInterrupt
        shown.append(event.text)

    assert consume(stream(), on_step).text == "ab"
    assert shown == ["a"] and closed == [True]


def test_a_stream_without_a_result_is_an_error():
    def stream():
        yield fake_step("a", "", 1, 1)

    with pytest.raises(KvchatError, match="without a result"):
        consume(stream(), lambda event: None)


def test_the_generator_is_closed_once_the_result_arrives():
    closed = []

    def stream():
        try:
            yield result()
            yield fake_step("never", "", 2, 2)
        finally:
            closed.append(True)

    consume(stream(), lambda event: None)
    assert closed == [True]
