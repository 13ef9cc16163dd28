"""Scripted input: line reading, the block syntax, bad bytes, exit statuses and the JSON lines."""

import io
import json

from kvchat.cli.commands import Status
from kvchat.cli.script import MAX_LINE_BYTES, ScriptCommand, read_commands, run_script
from tests.support.cli_harness import make_harness


def commands(data: bytes) -> list[ScriptCommand]:
    return list(read_commands(io.BytesIO(data)))


def test_comments_and_blank_lines_are_skipped():
    got = commands(b"# a comment\n\n/system Be brief.\n   \n  # indented comment\nhello\n")
    assert got == [ScriptCommand(3, "/system Be brief."), ScriptCommand(6, "hello")]


def test_a_block_becomes_the_argument_of_the_line_that_opens_it():
    data = b"/context <<<\nFirst line.\n\n# kept: blocks are verbatim\n  indented\n>>>\n/infer\n"
    got = commands(data)
    assert got == [
        ScriptCommand(1, "/context\nFirst line.\n\n# kept: blocks are verbatim\n  indented"),
        ScriptCommand(7, "/infer"),
    ]


def test_a_bare_block_is_a_chat_message_and_crlf_is_fine():
    assert commands(b"<<<\r\nHello\r\nthere\r\n>>>\r\n") == [ScriptCommand(1, "Hello\nthere")]


def test_an_unclosed_block_is_one_error():
    got = commands(b"/context <<<\ntext\n")
    assert len(got) == 1 and got[0].text is None and "no closing >>>" in got[0].error


def test_invalid_utf8_is_an_error_for_that_line_only():
    got = commands(b"/system ok\n/context caf\xe9\nhello\n")
    assert got[0] == ScriptCommand(1, "/system ok")
    assert got[1].lineno == 2 and got[1].text is None and "invalid UTF-8 at byte 13" in got[1].error
    assert got[2] == ScriptCommand(3, "hello")


def test_invalid_utf8_inside_a_block_fails_the_block():
    got = commands(b"/context <<<\ngood\nbad \xff\n>>>\nnext\n")
    assert got[0].lineno == 1 and got[0].text is None and "line 3" in got[0].error
    assert got[1] == ScriptCommand(5, "next")


def test_a_line_over_one_mebibyte_is_an_error_and_reading_goes_on():
    data = b"/context " + b"x" * (3 * MAX_LINE_BYTES) + b"\nhello\n"
    got = commands(data)
    assert got[0].text is None and "longer than 1 MiB" in got[0].error
    assert got[1] == ScriptCommand(2, "hello")


def test_a_bom_is_ignored():
    assert commands("\ufeff/stats\n".encode()) == [ScriptCommand(1, "/stats")]


def test_exit_status_is_zero_when_all_succeed_and_one_when_any_fails():
    h = make_harness(["Hi."])
    assert run_script(h.shell, h.ui, io.BytesIO(b"/system Be brief.\nhello\n/stats\n")) == 0
    h = make_harness(["Hi."])
    status = run_script(h.shell, h.ui, io.BytesIO(b"/nope\nhello\n/context caf\xe9\n/stats\n"))
    assert status == 1
    out = h.take()
    assert "error: line 1: unknown command /nope" in out
    assert "Hi." in out  # the rest still ran
    assert "error: line 3: invalid UTF-8" in out and "hit rate" in out


def test_quit_stops_reading():
    h = make_harness(["Hi."])
    assert run_script(h.shell, h.ui, io.BytesIO(b"/quit\n/nope\n")) == 0


def test_json_prints_one_object_per_command():
    h = make_harness(["Paris is the capital."], json_lines=True)
    script = (
        b"/system Be brief.\n/context France <<<\nis in Europe.\n>>>\n/query Capital?\n/infer\n/bad\n"
        b"/output\n/chunks\n/show 2\n/stats\n/verify 4\n/set\n/mode exact\n/help\n/clear\n\xff\n"
    )
    assert run_script(h.shell, h.ui, io.BytesIO(script)) == 1
    lines = [json.loads(line) for line in h.take().splitlines()]
    assert [o["cmd"] for o in lines] == [
        "system",
        "context",
        "query",
        "infer",
        "bad",
        "output",
        "chunks",
        "show",
        "stats",
        "verify",
        "set",
        "mode",
        "help",
        "clear",
        None,
    ]
    for obj in lines:
        assert {"cmd", "ok", "error", "line"} <= obj.keys()
    by_cmd = {o["cmd"]: o for o in lines}
    infer = by_cmd["infer"]
    for key in (
        "output",
        "output_number",
        "chunk_id",
        "prompt_tokens",
        "reused_tokens",
        "repositioned_tokens",
        "computed_tokens",
        "ttft_s",
        "decode_tok_s",
        "finish_reason",
        "chunks",
    ):
        assert key in infer
    assert infer["output"] == "Paris is the capital." and infer["ok"] is True and infer["error"] is None
    assert {"chunk_id", "role", "num_tokens", "num_reused", "num_repositioned", "num_computed"} <= infer[
        "chunks"
    ][0].keys()
    assert by_cmd["context"]["chunk"]["text"] == "France\nis in Europe." and by_cmd["context"]["line"] == 2
    assert by_cmd["bad"]["ok"] is False and "unknown command /bad" in by_cmd["bad"]["error"]
    assert by_cmd["output"]["outputs"][0]["output_number"] == 1
    assert by_cmd["show"]["chunk"]["positions"] == [2, 6]
    assert 0.0 <= by_cmd["stats"]["stats"]["hit_rate"] <= 1.0
    assert by_cmd["verify"]["fidelity"]["greedy_tokens"] == 4
    assert by_cmd["set"]["settings"]["reuse.mode"] == "exact"
    assert by_cmd["mode"]["mode"] == "exact"
    assert {c["name"] for c in by_cmd["help"]["commands"]} >= {"infer", "quit"}
    assert lines[-1]["ok"] is False and "invalid UTF-8" in lines[-1]["error"]


def test_a_stray_block_close_is_an_error_not_a_chat_message():
    got = commands(b"/system ok\n>>>\n/context <<<\ntext\n>>>\n  >>>\n")
    assert got[0] == ScriptCommand(1, "/system ok")
    assert got[1].lineno == 2 and got[1].text is None and "no block open" in got[1].error
    assert got[2] == ScriptCommand(3, "/context\ntext")
    assert got[3].lineno == 6 and got[3].text is None
    h = make_harness(["Hi."])
    assert run_script(h.shell, h.ui, io.BytesIO(b">>>\n")) == 1
    assert h.take() == "error: line 1: >>> with no block open (a line ending in <<<)\n"
    assert h.ctx.outputs() == []


def strict_json(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_json_stays_valid_when_a_number_is_not_finite():
    from dataclasses import replace

    h = make_harness(json_lines=True)
    report = h.ctx.verify(4)
    h.ctx.verify = lambda n: replace(report, kl_divergence=float("inf"), max_logit_diff=float("nan"))
    h.run("/query q")
    h.take()
    assert h.run("/verify") is Status.OK
    fidelity = strict_json(h.take())["fidelity"]
    assert fidelity["kl_divergence"] is None and fidelity["max_logit_diff"] is None
    assert fidelity["top5_overlap"] == 5
    assert fidelity["identical"] is False and fidelity["first_difference"] == 0
    finish = h.ctx._finish

    def infinite_rates(*args):
        return replace(finish(*args), decode_tok_s=float("inf"), prefill_tok_s=float("-inf"))

    h.ctx._finish = infinite_rates
    h.run("hello")
    answer = strict_json(h.take())
    assert answer["decode_tok_s"] is None and answer["prefill_tok_s"] is None and answer["ok"] is True
