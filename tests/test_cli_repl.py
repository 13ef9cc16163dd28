"""The interactive loop and completion, driven through prompt_toolkit's pipe input."""

from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from kvchat.cli.completion import ShellCompleter
from kvchat.cli.repl import is_fence_open, make_prompt_session, run_interactive, toolbar, unfence
from tests.support.cli_harness import make_harness

ESC_ENTER = "\x1b\r"
CTRL_C, CTRL_D = "\x03", "\x04"


def run_keys(h, keys, history_file=None):
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        session = make_prompt_session(h.shell, history_file, input=pipe, output=DummyOutput())
        status = run_interactive(h.shell, h.ui, session)
    return status, h.take()


def test_a_message_a_command_and_ctrl_d(tmp_path):
    h = make_harness(["Hello back."])
    history = tmp_path / "state" / "history"
    status, out = run_keys(h, f"hello\r/stats\r{CTRL_D}", history)
    assert status == 0
    assert "Hello back." in out and "hit rate" in out
    assert "hello" in history.read_text() and "/stats" in history.read_text()


def test_ctrl_c_at_the_prompt_drops_the_line():
    h = make_harness()
    status, out = run_keys(h, f"/context never sent{CTRL_C}/context kept\r{CTRL_D}")
    assert status == 0
    assert [c.text for c in h.ctx.chunks()] == ["kept"]


def test_alt_enter_adds_a_line_and_fences_span_lines():
    h = make_harness()
    run_keys(h, f'/context first{ESC_ENTER}second\r/context """\rthird\rfourth\r"""\r{CTRL_D}')
    assert [c.text for c in h.ctx.chunks()] == ["first\nsecond", "third\nfourth"]


def test_errors_do_not_end_the_loop_and_quit_does():
    h = make_harness()
    status, out = run_keys(h, "/nope\r/quit\r/context never\r")
    assert status == 0
    assert "error: unknown command /nope" in out
    assert h.ctx.chunks() == []


def test_unfence():
    assert unfence('/context """a\nb"""') == "/context\na\nb"
    assert unfence('"""\nhello\n"""') == "hello"
    assert unfence("plain") == "plain"
    assert is_fence_open('/context """a') and not is_fence_open('/context """a"""')


def test_toolbar_shows_model_blocks_and_mode():
    h = make_harness()
    h.run("/context some words here")
    assert toolbar(h.shell) == " fake/model · KV 4/256 tokens (1/64 blocks) · reuse exact "


def completions(h, text):
    found = ShellCompleter(h.shell).get_completions(Document(text, len(text)), CompleteEvent())
    return [(c.text, c.display_meta_text) for c in found]


def test_completion_offers_commands_with_their_help():
    h = make_harness()
    got = dict(completions(h, "/"))
    assert set(got) >= {"/" + cmd.name for cmd in h.shell.commands} | {"/exit"}
    assert got["/show"] == h.shell.commands.get("show").summary
    assert [text for text, _ in completions(h, "/de")] == ["/delete-output"]


def test_completion_offers_output_numbers_and_chunk_ids():
    h = make_harness(["First answer.", "Second answer."])
    h.run("hi")
    h.run("again")
    assert completions(h, "/use-output ") == [("1", "First answer."), ("2", "Second answer.")]
    chunk_id = h.ctx.chunks()[0].chunk_id
    offered = [text for text, _ in completions(h, "/show ")]
    assert "1" in offered and chunk_id in offered
    assert [text for text, _ in completions(h, f"/drop {chunk_id[:3]}")] == [chunk_id]


def test_completion_of_modes_settings_help_topics_and_paths(tmp_path):
    h = make_harness()
    assert [text for text, _ in completions(h, "/mode re")] == ["reposition", "repair"]
    assert "sampling.temperature" in [text for text, _ in completions(h, "/set sampling.t")]
    assert dict(completions(h, "/set sampling.t"))["sampling.top_p"].startswith("1.0 · Keep the most likely")
    assert [text for text, _ in completions(h, "/set dtype b")] == ["bf16"]
    assert [text for text, _ in completions(h, "/set reuse.mode ")] == ["exact", "reposition", "repair"]
    assert [text for text, _ in completions(h, "/set ui.color f")] == ["false"]
    assert completions(h, "/set temperature ") == [] and completions(h, "/set nope ") == []
    assert ("verify", h.shell.commands.get("verify").summary) in completions(h, "/help ve")
    (tmp_path / "notes.txt").write_text("x")
    assert [text for text, _ in completions(h, f"/context @{tmp_path}/no")] == ["tes.txt"]
    assert [text for text, _ in completions(h, f"/save {tmp_path}/no")] == ["tes.txt"]
    assert completions(h, "plain text") == [] and completions(h, "/nope ") == []
