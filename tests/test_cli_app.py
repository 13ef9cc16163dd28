"""The `kvchat` command: options, settings overrides, exit statuses, with the session factory faked."""

import io
import json

import pytest
from typer.testing import CliRunner

from kvchat import __version__
from kvchat.cli import app as app_module
from kvchat.cli.app import make_app
from kvchat.cli.settings import setting_values
from kvchat.cli.ui import UI
from kvchat.errors import ModelLoadError
from tests.fake_context import FakeContextManager, isolated_user_dirs  # noqa: F401  (autouse fixture)

ESC = "\x1b["


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


def test_version():
    result, _ = invoke(["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"kvchat {__version__}"


def test_help_lists_the_options_of_both_forms():
    for args in (["--help"], ["run", "--help"]):
        result, _ = invoke(args)
        assert result.exit_code == 0
        for option in (
            "--model",
            "--kv-memory",
            "--block-size",
            "--repetition-penalty",
            "--reuse",
            "--json",
            "--no-color",
            "--config",
        ):
            assert option in result.stdout


def test_piped_stdin_is_a_script_and_exit_status_zero():
    result, factory = invoke([], stdin="# greet\nhello\n/stats\n")
    assert result.exit_code == 0, result.output
    assert "Hi there." in result.stdout and "hit rate" in result.stdout


def test_any_failed_command_makes_exit_status_one_and_the_rest_runs():
    result, _ = invoke([], stdin="/nope\nhello\n")
    assert result.exit_code == 1
    assert "error: line 1: unknown command /nope" in result.stdout and "Hi there." in result.stdout


def test_flags_become_setting_overrides():
    args = [
        "--model",
        "some/model",
        "--temperature",
        "0.5",
        "--top-k",
        "20",
        "--max-tokens",
        "9",
        "--reuse",
        "repair",
        "--repair-strategy",
        "deviation",
        "--block-size",
        "32",
        "--kv-memory",
        "64",
    ]
    result, factory = invoke(args, stdin="hello\n")
    assert result.exit_code == 0, result.output
    values = setting_values(factory.settings)
    assert values["model.model"] == "some/model"
    assert values["sampling.temperature"] == 0.5 and values["sampling.top_k"] == 20
    assert values["reuse.mode"] == "repair" and values["cache.block_size"] == 32
    assert values["reuse.repair_strategy"] == "deviation"
    assert values["cache.kv_memory_mb"] == 64
    assert factory.ctx.params_seen[0].max_tokens == 9


@pytest.mark.parametrize("before_run", [True, False])
def test_run_file_takes_the_options_before_or_after_it(tmp_path, before_run):
    script = tmp_path / "cmds.kv"
    script.write_text("/context <<<\nSome text.\n>>>\nhello\n", encoding="utf-8")
    flags = ["--model", "other/model", "--json"]
    args = [*flags, "run", str(script)] if before_run else ["run", str(script), *flags]
    result, factory = invoke(args)
    assert result.exit_code == 0, result.output
    assert setting_values(factory.settings)["model.model"] == "other/model"
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [o["cmd"] for o in lines] == ["context", "chat"]
    assert lines[0]["chunk"]["text"] == "Some text."


def test_run_flags_win_over_the_same_flags_before_run(tmp_path):
    script = tmp_path / "cmds.kv"
    script.write_text("/stats\n", encoding="utf-8")
    args = ["--model", "first", "--temperature", "0.5", "--json", "run", str(script), "--model", "second"]
    result, factory = invoke([*args, "--temperature", "0"])
    assert result.exit_code == 0
    values = setting_values(factory.settings)
    assert values["model.model"] == "second" and values["sampling.temperature"] == 0.0
    assert json.loads(result.stdout)["cmd"] == "stats"  # --json before `run` still counts


def test_a_missing_script_file_cannot_start(tmp_path):
    result, factory = invoke(["run", str(tmp_path / "missing.kv")])
    assert result.exit_code == 2 and factory.settings is None


def test_a_model_that_cannot_load_is_one_red_line_and_exit_two():
    factory = Factory(error=ModelLoadError("no model called nope/nope"))
    result, _ = invoke(["--model", "nope/nope"], stdin="hello\n", factory=factory)
    assert result.exit_code == 2
    assert result.stderr == "kvchat: no model called nope/nope\n"
    assert result.stdout == ""


@pytest.mark.parametrize("args", [["--reuse", "sideways"], ["--temperature", "hot"], ["--bogus"]])
def test_bad_options_exit_two(args):
    result, factory = invoke(args, stdin="hello\n")
    assert result.exit_code == 2
    assert factory.ctx.params_seen == []


def test_a_bad_config_file_exits_two(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[sampling]\nno_such_key = 1\n", encoding="utf-8")
    result, _ = invoke(["--config", str(config)], stdin="hello\n")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1


def test_a_config_file_is_read_and_flags_beat_it(tmp_path):
    config = tmp_path / "mine.toml"
    config.write_text("[sampling]\ntemperature = 0.3\ntop_k = 5\n", encoding="utf-8")
    result, factory = invoke(["--config", str(config), "--top-k", "7"], stdin="/stats\n")
    assert result.exit_code == 0, result.output
    values = setting_values(factory.settings)
    assert values["sampling.temperature"] == 0.3 and values["sampling.top_k"] == 7


def test_the_user_config_file_is_read_and_flags_beat_it(tmp_path):
    user_file = tmp_path / "XDG_CONFIG_HOME" / "kvchat" / "config.toml"  # where the fixture points
    user_file.parent.mkdir(parents=True)
    user_file.write_text('[ui]\njson = true\n[model]\nmodel = "from/user-file"\n', encoding="utf-8")
    result, factory = invoke(["--model", "from/flag"], stdin="/mode\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"cmd": "mode", "ok": True, "error": None, "line": 1, "mode": "exact"}
    assert setting_values(factory.settings)["model.model"] == "from/flag"


def test_no_color_means_no_escape_codes_even_on_a_forced_terminal():
    colored, _ = invoke([], stdin="/nope\n", env={"FORCE_COLOR": "1"})
    assert ESC in colored.stdout
    plain, _ = invoke(["--no-color"], stdin="/nope\n", env={"FORCE_COLOR": "1"})
    assert ESC not in plain.stdout and "error: line 1: unknown command /nope" in plain.stdout


def test_internal_errors_show_a_traceback_only_with_debug():
    factory = Factory(error=RuntimeError("boom"))
    result, _ = invoke([], stdin="", factory=factory)
    assert result.exit_code == 2 and "internal error: RuntimeError: boom" in result.stderr
    assert "Traceback" not in result.stderr
    result, _ = invoke(["--debug"], stdin="", factory=Factory(error=RuntimeError("boom")))
    assert "Traceback" in result.stderr


def test_no_stdin_at_all_is_an_empty_script(monkeypatch):
    monkeypatch.setattr(app_module.sys, "stdin", None)
    assert app_module._stdin_bytes().read() == b""
    assert not app_module._stdin_is_terminal()


def test_progress_callback_drives_a_bar_on_a_terminal(monkeypatch):
    with UI(color=False, err_file=io.StringIO()).progress() as progress:
        assert progress is None  # not a terminal: no bar
    monkeypatch.setenv("FORCE_COLOR", "1")
    err = io.StringIO()
    ui = UI(err_file=err, file=io.StringIO())
    with ui.progress() as progress:
        assert progress is not None
        progress("converting", 0, 4)
        progress("converting", 4, 4)
        progress("loading", 1, None)
    assert "converting" in err.getvalue()
