"""Commands as transcripts: a line in, the rendered text out, over the fake context manager."""

import os
from dataclasses import replace

import pytest

from kvchat.chunks.types import RepairStrategy, ReuseMode
from kvchat.cli.arguments import MAX_FILE_BYTES
from kvchat.cli.commands import Status
from tests.support.cli_harness import make_harness


def test_chat_streams_the_answer_then_one_summary_line():
    h = make_harness(["Hello there, friend."])
    assert h.run("hi") is Status.OK
    out = h.take()
    assert out.startswith("Hello there, friend.\n")
    summary = out.splitlines()[1]
    assert "reused" in summary and "computed" in summary and "tok/s" in summary and "stop" in summary
    assert "output 1" in summary


def test_thinking_is_shown_on_its_own_line_or_hidden():
    from tests.support.fake_context import Response

    h = make_harness([Response("Answer.", thinking="Let me think.")])
    h.run("q")
    assert h.take().startswith("Let me think.\nAnswer.\n")
    h = make_harness([Response("Answer.", thinking="Let me think.")])
    h.run("/set ui.show_thinking false")
    h.take()
    h.run("q")
    assert h.take().startswith("Answer.\n")


def test_context_query_infer_output_and_use_output():
    h = make_harness(["Paris is the capital."])
    h.run("/system You are terse.")
    assert "system prompt set: #1 system" in h.take()
    h.run("/context France is in Europe.")
    assert "added: #2 context" in h.take()
    h.run("/query What is the capital?")
    assert "query set" in h.take()
    assert h.run("/infer") is Status.OK
    assert "Paris is the capital." in h.take()
    h.run("/output")
    table = h.take()
    assert "Paris is the capital." in table and "1" in table
    assert h.run("/use-output 1") is Status.OK
    assert "added output" in h.take()
    assert [c.role for c in h.ctx.context()][-1] == "output"


def test_chunks_table_lists_every_chunk_with_its_place():
    h = make_harness()
    h.run("/system Be brief.")
    h.run("/context Some facts here.")
    h.take()
    h.run("/chunks")
    out = h.take()
    for header in ("role", "id", "tokens", "blocks", "refs", "place"):
        assert header in out
    assert "system" in out and "context" in out and h.ctx.chunks()[1].chunk_id in out


def test_show_stats_verify_and_mode():
    h = make_harness()
    h.run("/context Some facts here.")
    h.take()
    h.run("/show 1")
    out = h.take()
    assert "Some facts here." in out and "positions" in out and "1–3, 7" in out
    h.run("/stats")
    out = h.take()
    assert "hit rate" in out and "KiB" in out
    h.run("/verify")
    assert "16 of 16" in h.take()  # reuse.verify_tokens
    h.run("/verify 8")
    out = h.take()
    assert "KL divergence" in out and "8 of 8" in out
    assert "first differ at position 1 of 8" in out  # the fake's logits differ from the first
    report = h.ctx.verify(8)
    h.ctx.verify = lambda n: replace(report, first_difference=None)
    h.run("/verify 8")
    assert "identical at all 8 positions, to the bit" in h.take()
    h.run("/mode repair")
    assert h.ctx.mode is ReuseMode.REPAIR
    assert "reuse mode: repair" in h.take()


def test_set_changes_the_next_inference_and_lists_settings():
    h = make_harness(["a b c d e f"])
    h.run("/set sampling.temperature 0.7")
    assert "sampling.temperature = 0.7" in h.take()
    h.run("/set sampling.max_tokens 3")
    h.run("hello")
    assert h.ctx.params_seen[-1].temperature == 0.7
    assert h.ctx.params_seen[-1].max_tokens == 3
    h.take()
    h.run("/set")
    listing = h.take()
    assert "sampling.temperature" in listing and "reuse.mode" in listing
    h.run("/set reuse.mode reposition")
    assert h.ctx.mode is ReuseMode.REPOSITION
    h.take()
    h.run("/set reuse.repair_strategy prefix")
    assert h.ctx.repair.strategy is RepairStrategy.PREFIX
    assert "takes effect" not in h.take()
    h.run("/set reuse.repair_taper 0.5")
    assert h.ctx.repair.taper == 0.5 and h.ctx.repair.strategy is RepairStrategy.PREFIX
    h.take()
    h.run("/set reuse.repair_taper 1")  # a taper of 1 would run every moved token through a layer
    assert "in [0, 1)" in h.take() and h.ctx.repair.taper == 0.5
    h.run("/set top_k 5")  # a key unique across tables needs no table
    assert "sampling.top_k = 5" in h.take()
    h.run("/set cache.block_size 32")
    assert "takes effect when kvchat starts again" in h.take()


def test_context_from_a_file(tmp_path):
    h = make_harness()
    doc = tmp_path / "doc.txt"
    doc.write_text("Line one.\nLine two.\n", encoding="utf-8")
    assert h.run(f"/context @{doc}") is Status.OK
    assert h.ctx.chunks()[0].text == "Line one.\nLine two."


def test_drop_clear_reset_save_load(tmp_path):
    h = make_harness()
    h.run("/context Alpha beta.")
    h.run("/context Gamma delta.")
    h.run("/drop 1")
    assert [c.text for c in h.ctx.context()] == ["Gamma delta."]
    h.run("/clear")
    assert h.ctx.context() == [] and len(h.ctx.chunks()) == 2
    h.take()
    state = tmp_path / "state.kv"
    h.run(f"/save {state}")
    assert f"saved 2 chunks to {state}" in h.take()
    h.run("/reset")
    assert h.ctx.chunks() == []
    h.run(f"/load {state}")
    assert "loaded 2 chunks" in h.take()


def test_help_lists_every_registered_command_and_explains_one():
    h = make_harness()
    h.run("/help")
    out = h.take()
    for cmd in h.shell.commands:
        assert cmd.synopsis in out
    names = {cmd.name for cmd in h.shell.commands}
    assert {
        "system",
        "context",
        "query",
        "infer",
        "output",
        "use-output",
        "delete-output",
        "chunks",
        "show",
        "drop",
        "clear",
        "reset",
        "stats",
        "set",
        "mode",
        "verify",
        "save",
        "load",
        "help",
        "quit",
    } <= names
    h.run("/help show")
    assert "/show N|ID" in h.take()


def test_quit_and_exit_end_the_session():
    h = make_harness()
    assert h.run("/quit") is Status.QUIT
    assert h.run("/exit") is Status.QUIT


def test_delete_output():
    h = make_harness(["One."])
    h.run("hi")
    h.take()
    h.run("/delete-output 1")
    assert "deleted output" in h.take()
    assert h.ctx.outputs() == []


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/contxt hello", "did you mean /context?"),
        ("/frobnicate", "unknown command /frobnicate"),
        ("/system", "missing argument: /system TEXT"),
        ("/context", "missing argument"),
        ("/context @/no/such/file.txt", "no such file: /no/such/file.txt"),
        ("/context @", "@ needs a file name: @FILE"),
        ("/context @  ", "@ needs a file name: @FILE"),
        ("/use-output 7", "no output 7"),
        ("/use-output seven", "not a number: 'seven'"),
        ("/use-output 0", "must be 1 or more"),
        ("/delete-output 3", "no output 3"),
        ("/show 42", "no chunk '42'"),
        ("/drop", "missing argument: /drop N|ID"),
        ("/mode sideways", "must be one of exact, reposition, repair"),
        ("/set sampling.temperature hot", ""),
        ("/set no.such.key 1", ""),
        ("/verify -1", "must be 1 or more"),
        ("/load /no/such/state.kv", "no such file"),
        ("/load /tmp", "/tmp is a directory, not a state file"),
        ("/clear now", "/clear takes no argument"),
        ("/help nothing", "unknown command /nothing"),
        ("/infer", "no query"),
        ("   ", "empty message"),
    ],
)
def test_bad_input_gives_one_clear_line_and_changes_nothing(line, message):
    h = make_harness()
    h.run("/system Be brief.")
    h.run("/context Known text.")
    assert message in h.refused(line)


def test_model_text_is_never_read_as_markup():
    h = make_harness(["[bold]not bold[/bold] and [red]"])
    h.run("hi")
    assert h.take().startswith("[bold]not bold[/bold] and [red]\n")


def test_set_lists_toml_values_and_what_auto_resolved_to():
    h = make_harness()
    h.run("/set stop ###")
    h.take()
    h.run("/set")
    lines = {line.split()[0]: " ".join(line.split()[1:]) for line in h.take().splitlines() if line.strip()}
    assert lines["model.dtype"] == '"auto" (fp32)'
    assert lines["model.device"] == '"auto" (cpu)'
    assert lines["model.threads"] == "0 (1)"
    assert lines["sampling.stop"] == '["###"]'
    assert lines["ui.show_thinking"] == "true" and lines["sampling.seed"] == "none"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/set min_p 1", "sampling.min_p = 1 must be in [0, 1)"),
        ("/set temperature nan", "sampling.temperature = nan must be a finite number"),
        ("/set top_p inf", "sampling.top_p = inf must be a finite number"),
    ],
)
def test_set_refuses_what_the_sampler_would(line, message):
    h = make_harness()
    before = h.shell.settings
    assert h.run(line) is Status.FAILED
    assert message in h.take()
    assert h.shell.settings == before


def test_context_from_a_bad_file_is_one_clear_line(tmp_path):
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used
    exact = tmp_path / "exact.txt"
    exact.write_bytes(b"a" * MAX_FILE_BYTES)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    cases = {
        "/dev/zero": "/dev/zero is larger than 16 MiB",
        str(huge): "is larger than 16 MiB",
        str(tmp_path): "is a directory, not a file",
        str(tmp_path / "missing.txt"): "no such file",
        str(latin): "is not UTF-8 text (byte 3)",
        str(fifo): "is a pipe, not a file",
    }
    h = make_harness()
    for path, message in cases.items():
        assert h.run(f"/context @{path}") is Status.FAILED
        out = h.take()
        assert out.count("\n") == 1 and out.startswith("error: ") and message in out, out
    assert h.ctx.chunks() == []
    assert h.run(f"/context @{exact}") is Status.OK  # the limit itself is allowed
