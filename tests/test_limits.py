"""Limits and odd input at the edges: each is one clear line, and changes nothing."""

import copy
import io

import pytest
import torch
from typer.testing import CliRunner

from kvchat.chunks.rendering import Part
from kvchat.chunks.template import ChatFormat
from kvchat.cli.app import make_app
from kvchat.cli.commands import Status
from kvchat.cli.script import read_commands
from kvchat.errors import ConfigError
from kvchat.session import check_kv_memory
from tests.support.cli_harness import make_harness
from tests.support.fake_context import FakeContextManager
from tests.support.hf_tokenizers import load_smollm2_tokenizer


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("/context @~nosuchuser/notes.txt", "no such user 'nosuchuser'"),
        ("/save ~nosuchuser/s.kv", "no such user 'nosuchuser'"),
        ("/load ~nosuchuser/s.kv", "no such user 'nosuchuser'"),
        ("/context @notes\0.txt", "a path cannot hold a NUL byte"),
        ("/save s\0.kv", "a path cannot hold a NUL byte"),
        ("/load s\0.kv", "a path cannot hold a NUL byte"),
    ],
)
def test_paths_that_cannot_name_a_file_are_one_line(line, message):
    h = make_harness()
    h.run("/context Known text.")
    assert message in h.refused(line)


def test_a_kv_budget_larger_than_the_memory_is_refused():
    asked = "--kv-memory 999999999 MiB"
    with pytest.raises(
        ConfigError, match=rf"{asked} needs 999999999 MiB of KV cache, more than the \d+ MiB of memory"
    ):
        check_kv_memory(999999999 << 20, asked, torch.device("cpu"))
    check_kv_memory(1 << 20, "--kv-memory 1 MiB", torch.device("cpu"))


def test_a_history_file_that_cannot_name_a_file_stops_the_start(tmp_path):
    opened: list[int] = []
    for value in ("~nosuchuser/history", "hist\\u0000ory"):
        config = tmp_path / "config.toml"
        config.write_text(f'[ui]\nhistory_file = "{value}"\n')
        result = CliRunner().invoke(
            make_app(lambda settings, progress: opened.append(1) or FakeContextManager()),
            ["--config", str(config)],
            input="",
        )
        assert result.exit_code == 2, result.output
        assert result.stderr.count("\n") == 1 and "ui.history_file" in result.stderr
    assert not opened  # refused before the model loads


def test_reset_says_what_it_keeps():
    h = make_harness()
    h.run("/context Known text.")
    h.take()
    assert h.run("/reset") is Status.OK
    assert "no block is held" in h.take()


def test_a_byte_order_mark_starting_any_script_line_is_ignored():
    script = "\ufeff/context a\n\ufeff/query b\n\ufeffhello\n".encode()
    assert [c.text for c in read_commands(io.BytesIO(script))] == ["/context a", "/query b", "hello"]


def test_set_none_clears_the_stop_list():
    h = make_harness()
    assert h.run('/set sampling.stop ["###", "none"]') is Status.OK
    assert h.shell.settings.sampling.stop == ("###", "none")
    assert h.run("/set sampling.stop none") is Status.OK
    assert h.shell.settings.sampling.stop == ()
    assert h.run('/set sampling.stop "none"') is Status.OK
    assert h.shell.settings.sampling.stop == ("none",)


def test_a_text_longer_than_the_model_window_is_tokenized_without_a_warning(capfd):
    tokenizer = copy.deepcopy(load_smollm2_tokenizer())  # the shared one is never mutated
    tokenizer.model_max_length = 50
    ids = ChatFormat(tokenizer).render([Part("user", "word " * 200)]).token_ids
    assert len(ids) > 200
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_ctrl_c_during_verify_or_attention_says_it_was_cancelled(monkeypatch):
    from kvchat.chunks import attention

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    h = make_harness()
    monkeypatch.setattr(h.ctx, "verify", interrupted)
    monkeypatch.setattr(attention, "attention_map", interrupted)
    for line, message in (("/verify", "/verify cancelled"), ("/attention", "/attention cancelled")):
        assert h.run(line) is Status.FAILED
        out = h.take()
        assert out.count("\n") == 1 and message in out


def test_ctrl_c_during_save_or_load_says_nothing_changed(monkeypatch, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    h = make_harness()
    h.run("/context Known text.")
    h.run(f"/save {tmp_path / 's.kv'}")
    h.take()
    before = h.ctx.state()
    monkeypatch.setattr(h.ctx, "save", interrupted)
    monkeypatch.setattr(h.ctx, "load", interrupted)
    for line, message in (("/save", "is as it was"), ("/load", "the session is as it was")):
        assert h.run(f"{line} {tmp_path / 's.kv'}") is Status.FAILED
        out = h.take()
        assert out.count("\n") == 1 and f"{line} cancelled" in out and message in out
    assert h.ctx.state() == before
