"""The `kvchat` command: options, settings overrides, exit statuses, with the session factory faked."""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat import __version__
from kvchat.cli import app as app_module
from kvchat.cli.settings import setting_values
from kvchat.cli.ui import UI
from kvchat.errors import ModelLoadError
from tests.support.cli_harness import Factory, invoke

ESC = "\x1b["


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
    assert "error: line 1: unknown command /nope" in result.stderr and "Hi there." in result.stdout
    assert "error" not in result.stdout  # answers on stdout, errors on stderr


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
        "prefix",
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
    assert values["reuse.repair_strategy"] == "prefix"
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
    before = ["--model", "org/first", "--temperature", "0.5", "--json"]
    result, factory = invoke([*before, "run", str(script), "--model", "org/second", "--temperature", "0"])
    assert result.exit_code == 0
    values = setting_values(factory.settings)
    assert values["model.model"] == "org/second" and values["sampling.temperature"] == 0.0
    assert json.loads(result.stdout)["cmd"] == "stats"  # --json before `run` still counts


def test_a_missing_script_file_cannot_start(tmp_path):
    result, factory = invoke(["run", str(tmp_path / "missing.kv")])
    assert result.exit_code == 2 and factory.settings is None
    assert "missing.kv: no such file" in result.stderr
    result, factory = invoke(["run", str(tmp_path)])
    assert result.exit_code == 2 and "is not a file" in result.stderr


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


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--config", "~nosuchuser/x"], None, "kvchat: --config: ~nosuchuser/x: no such user 'nosuchuser'\n"),
        (["--config", "a\0b"], None, "kvchat: --config: 'a\\x00b': a path cannot hold a NUL byte\n"),
        (
            [],
            {"KVCHAT_CONFIG": "~nosuchuser/x"},
            "kvchat: $KVCHAT_CONFIG: ~nosuchuser/x: no such user 'nosuchuser'\n",
        ),
    ],
)
def test_a_config_path_that_cannot_name_a_file_is_one_line_and_exit_two(args, env, message):
    result, factory = invoke(args, stdin="hello\n", env=env)
    assert result.exit_code == 2 and result.stderr == message
    assert factory.ctx.params_seen == []


def test_a_config_path_expands_the_home_directory(tmp_path):
    (tmp_path / "mine.toml").write_text("[sampling]\ntop_k = 5\n", encoding="utf-8")
    result, factory = invoke(["--config", "~/mine.toml"], stdin="/stats\n", env={"HOME": str(tmp_path)})
    assert result.exit_code == 0, result.stderr
    assert factory.settings.sampling.top_k == 5


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
    colored, _ = invoke([], stdin="/nope\n/stats\n", env={"FORCE_COLOR": "1"})
    assert ESC in colored.stderr
    plain, _ = invoke(["--no-color"], stdin="/nope\n/stats\n", env={"FORCE_COLOR": "1"})
    # No style codes (SGR); a progress bar on a forced terminal still moves its cursor.
    assert ESC not in plain.stdout and not re.search(r"\x1b\[[0-9;]*m", plain.stderr)
    assert "error: line 1: unknown command /nope" in plain.stderr


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
    quiet = io.StringIO()
    with UI(color=False, err_file=quiet).progress() as progress:  # not a terminal: no bar
        progress("building kvchat's kernels for this CPU", 0, 5)
        progress("loading fake/model", 0, 1)
        progress("converting x.gguf (once): tokenizer", 0, None)
        progress("building kvchat's kernels for this CPU: a.cpp", 0, 5)
        progress("converting x.gguf (once): tensors", 3, 9)
        progress.note("the int4 weights kept in /x were damaged (y); quantizing again")
    assert quiet.getvalue().splitlines() == [
        "kvchat: building kvchat's kernels for this CPU (5 files, once) while the model loads; later starts "
        "skip this",
        "kvchat: converting x.gguf (once), into the cache; later starts skip this",
        "kvchat: the int4 weights kept in /x were damaged (y); quantizing again",
    ]
    monkeypatch.setenv("FORCE_COLOR", "1")
    err = io.StringIO()
    ui = UI(err_file=err, file=io.StringIO())
    with ui.progress() as progress:
        assert progress is not None
        progress("converting", 0, 4)
        progress("building kvchat's kernels for this CPU: a.cpp, b.cpp", 1, 5)  # from the build's thread
        progress("converting", 4, 4)
        progress("loading", 1, None)
        progress("building kvchat's kernels for this CPU: b.cpp", 2, 5)
        shown = [(t.description, t.completed) for t in progress.bar.tasks]
    assert shown == [("building kvchat's kernels for this CPU: b.cpp", 2), ("loading", 1)]
    assert "converting" in err.getvalue()


def test_json_errors_go_to_the_json_stream_and_to_stderr():
    result, _ = invoke(["--json"], stdin="/nope\nhello\n")
    assert result.exit_code == 1
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(o["cmd"], o["ok"]) for o in objects] == [("nope", False), ("chat", True)]
    assert "unknown command /nope" in result.stderr


def test_run_dash_reads_stdin():
    result, _ = invoke(["run", "-"], stdin="hello\n")
    assert result.exit_code == 0, result.output
    assert "Hi there." in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "1.5"], "kvchat: --top-p 1.5 must be in (0, 1]"),
        (["--temperature", "nan"], "kvchat: --temperature nan must be a finite number"),
        (["--min-p", "1"], "kvchat: --min-p 1.0 must be in [0, 1)"),
        (["--dtype", "int8"], "kvchat: --dtype int8 must be one of auto, bf16, fp32, fp16"),
        (["--model", " "], "kvchat: --model   must not be empty"),
        (["--threads", "100000"], "kvchat: --threads 100000 must be in [0, 1024] (0 picks automatically)"),
    ],
)
def test_bad_flags_are_named(args, message):
    result, factory = invoke(args, stdin="hello\n")
    assert result.exit_code == 2 and factory.settings is None
    assert result.stderr.startswith(message)


def test_dtype_takes_the_torch_names():
    result, factory = invoke(["--dtype", "bfloat16"], stdin="/stats\n")
    assert result.exit_code == 0
    assert factory.settings.model.dtype == "bf16"


def test_help_shows_switches_as_switches():
    result, _ = invoke(["--help"], env={"COLUMNS": "160"})
    assert "<bool>" not in result.stdout
    assert "--json" in result.stdout and "--min-p" in result.stdout


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"]])
def test_help_into_a_pipe_is_wide_enough_to_cut_no_value(args):
    result, _ = invoke(args, env={"COLUMNS": None, "TERMINAL_WIDTH": None})
    lines = result.stdout.splitlines()
    assert result.exit_code == 0 and max(map(len, lines)) == app_module.HELP_WIDTH
    assert "…" not in result.stdout and "~/.config/kvchat/config.toml" in result.stdout


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"]])
def test_help_imports_no_torch(args):
    code = (
        "import sys\n"
        "from kvchat.cli.app import main\n"
        f"try: main({args!r})\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_env())
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _env():
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def test_a_switch_undoes_what_the_config_file_turned_on(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[ui]\njson = true\n")
    result, factory = invoke(["--config", str(config), "--no-json"], stdin="/stats\n")
    assert result.exit_code == 0 and factory.settings.ui.json is False
    assert "hit rate" in result.stdout


@pytest.mark.parametrize("json_lines", [False, True])
def test_ctrl_c_between_script_commands_is_one_line_and_status_1(monkeypatch, json_lines):
    def interrupted(shell, ui, script):
        raise KeyboardInterrupt

    monkeypatch.setattr(app_module, "_run", interrupted)
    result, _ = invoke(["--json"] if json_lines else [], stdin="/stats\n/stats\n")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == ["error: interrupted; the commands after it did not run"]
    if json_lines:
        (record,) = [json.loads(line) for line in result.stdout.splitlines()]
        assert record["ok"] is False and "interrupted" in record["error"]


def test_ctrl_c_outside_any_command_exits_with_one_line_and_then_is_ignored(monkeypatch, capsys):
    import signal

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(app_module, "_app", interrupted)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exit_info:
            app_module.main([])
        assert exit_info.value.code == 1
        assert capsys.readouterr().err == "kvchat: interrupted\n"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # while the process exits
    finally:
        signal.signal(signal.SIGINT, handler)
