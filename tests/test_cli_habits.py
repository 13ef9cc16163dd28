"""What users of ollama, llama-cli and mlx_lm reach for, over the fake context: -p, --system and
--ctx-size in the REPL, scripts and --json; tokens in /stats and the toolbar; starting; typed-ahead
keys. The slash commands (/retry, /info, /set KEY, aliases) are in test_cli_habit_commands.py."""

import json

import pytest

from kvchat.cli import app as app_module
from kvchat.cli.repl import short_name, toolbar
from kvchat.cli.settings import setting_values
from tests.support.cli_harness import Factory, invoke, json_lines, make_harness

# -- kvchat -p -------------------------------------------------------------------------------------


def test_prompt_answers_once_on_stdout_alone():
    result, factory = invoke(["-p", "Say hi.", "--max-tokens", "7", "--temperature", "0.5"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hi there.\n"
    assert factory.ctx.params_seen[0].max_tokens == 7 and factory.ctx.params_seen[0].temperature == 0.5
    assert [c.text for c in factory.ctx.chunks() if c.role == "user"] == ["Say hi."]


def test_prompt_with_json_prints_the_one_chat_object():
    result, _ = invoke(["--prompt", "Say hi.", "--json"])
    assert result.exit_code == 0, result.output
    (record,) = json_lines(result.stdout)
    assert record["cmd"] == "chat" and record["ok"] and record["output"] == "Hi there."


def test_prompt_that_fails_exits_one_with_the_error_on_stderr():
    result, _ = invoke(["-p", "   "])
    assert result.exit_code == 1
    assert result.stdout == "" and "empty message" in result.stderr


def test_prompt_cut_by_max_tokens_warns_on_stderr_and_succeeds():
    result, _ = invoke(["-p", "Say hi.", "--max-tokens", "1"], factory=Factory(["Hi there friend."]))
    assert result.exit_code == 0
    assert result.stdout == "Hi\n" and "cut at 1 tokens" in result.stderr


def test_prompt_starting_with_a_slash_is_text_not_a_command():
    result, factory = invoke(["-p", "/reset everything"])
    assert result.exit_code == 0 and result.stdout == "Hi there.\n"
    assert [c.text for c in factory.ctx.chunks() if c.role == "user"] == ["/reset everything"]


# -- --system ----------------------------------------------------------------------------------------


def test_system_flag_sets_the_system_prompt_for_a_prompt_and_a_script(tmp_path):
    result, factory = invoke(["-p", "hello", "--system", "Be terse."])
    assert result.exit_code == 0 and result.stdout == "Hi there.\n"
    assert factory.ctx.context()[0].text == "Be terse." and factory.ctx.context()[0].role == "system"
    script = tmp_path / "s.kv"
    script.write_text("hello\n", encoding="utf-8")
    result, factory = invoke(["run", str(script), "--system", "Be kind.", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["cmd"] for r in json_lines(result.stdout)] == ["chat"]  # set silently
    assert factory.ctx.context()[0].text == "Be kind."


def test_system_flag_reaches_the_repl(monkeypatch):
    seen = {}
    monkeypatch.setattr(app_module, "_stdin_is_terminal", lambda: True)
    monkeypatch.setattr(app_module, "make_prompt_session", lambda *args, **kwargs: None)
    monkeypatch.setattr(
        app_module, "run_interactive", lambda shell, ui, session: seen.setdefault("ctx", shell.ctx.context())
    )
    result, _ = invoke(["--system", "Be brief."])
    assert result.exit_code != 2, result.output
    assert [c.text for c in seen["ctx"]] == ["Be brief."]


def test_an_empty_system_prompt_stops_the_start():
    result, _ = invoke(["--system", " ", "-p", "hi"])
    assert result.exit_code == 2 and "empty system text" in result.stderr


# -- --ctx-size and tokens in /stats and the toolbar ------------------------------------------------


def test_ctx_size_is_a_setting_from_flag_config_and_set(tmp_path):
    result, factory = invoke(["--ctx-size", "4096"], stdin="/set cache.ctx_size\n")
    assert result.exit_code == 0, result.output
    assert setting_values(factory.settings)["cache.ctx_size"] == 4096
    assert "cache.ctx_size = 4096" in result.stdout
    result, _ = invoke(["--ctx-size", "0"])
    assert result.exit_code == 2 and "--ctx-size 0 must be >= 1" in result.stderr


def test_stats_and_the_toolbar_speak_tokens_too():
    h = make_harness()
    h.run("/context one two three four five")
    h.take()
    h.run("/stats")
    assert "8 in used blocks · 256 in all (the KV budget)" in h.take()
    h = make_harness(json_lines=True)
    h.run("/stats")
    stats = json.loads(h.take())["stats"]
    assert stats["num_tokens"] == stats["num_blocks"] * stats["block_size"] == 256
    assert toolbar(h.shell) == " fake/model · KV 0/256 tokens (0/64 blocks) · reuse exact "


def test_the_toolbar_shortens_the_model_name_never_the_mode():
    h = make_harness()
    h.ctx.model_id = "/home/someone/models/very/deep/folder/SmolLM2-135M-Instruct.Q4_1.gguf"
    bar = toolbar(h.shell, width=100)
    assert len(bar) <= 100 and bar.endswith("· reuse exact ")
    assert "…/SmolLM2-135M-Instruct.Q4_1.gguf" in bar
    narrow = toolbar(h.shell, width=60)
    assert narrow.endswith("· reuse exact ") and "…" in narrow and "gguf" in narrow
    assert short_name("Qwen/Qwen2.5-0.5B-Instruct", 40) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert short_name("Qwen/Qwen2.5-0.5B-Instruct", 12) == "…5B-Instruct"


# -- starting ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, spec, told",
    [
        ("--model", "./missing-folder", "no such model folder: ./missing-folder"),
        ("--model", "smollm9-1t", "unknown model 'smollm9-1t': give an alias (smollm2-135m"),
        ("--draft-model", "nowhere.gguf", "GGUF file not found"),
    ],
)
def test_a_model_that_names_nothing_is_told_before_anything_loads(flag, spec, told):
    factory = Factory()
    result, _ = invoke([flag, spec, "-p", "hi"], factory=factory)
    assert result.exit_code == 2 and told in result.stderr
    assert factory.settings is None  # the session (torch, the model) was never opened


def test_help_shows_the_defaults():
    result, _ = invoke(["--help"], env={"COLUMNS": "250"})
    text = " ".join(result.stdout.split())
    assert "Default: 512." in text and "Default: smollm2-135m." in text and "--prompt -p" in text
    assert "--ctx-size" in text and "--system" in text


# -- keys typed while an answer streams ----------------------------------------------------------------


def test_keys_typed_during_a_command_are_not_echoed_and_wait_for_the_next_prompt(monkeypatch):
    import os
    import pty
    import select
    import termios

    from kvchat.cli.repl import keys_held

    master, slave = pty.openpty()
    with open(slave, "rb", buffering=0, closefd=False) as stdin:
        monkeypatch.setattr("sys.stdin", stdin)
        before = termios.tcgetattr(slave)
        with keys_held():
            os.write(master, b"/mode bogus\n")
            echoed, _, _ = select.select([master], [], [], 0.2)
            assert echoed == []  # nothing printed into the answer
        assert termios.tcgetattr(slave) == before
        assert os.read(slave, 100) == b"/mode bogus\n"  # still there for the next prompt
    os.close(master)
    os.close(slave)


def test_which_model_specs_are_paths_that_are_missing(tmp_path):
    from kvchat.models.sources import missing_path

    assert missing_path("./missing-folder") == "no such model folder: ./missing-folder"
    assert missing_path(str(tmp_path / "nope")) is not None and missing_path("nope/") is not None
    assert missing_path(str(tmp_path / "x.gguf")).startswith("GGUF file not found")
    assert missing_path(str(tmp_path)) is None  # exists: whether it is a model is for the loader to say
    for spec in ("smollm2-135m", "Qwen/Qwen2.5-0.5B-Instruct", "unknown-name"):
        assert missing_path(spec) is None  # aliases, hub ids and unknown names are not paths


def test_the_habits_in_the_repl():
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from kvchat.cli.repl import make_prompt_session, run_interactive

    h = make_harness(["One.", "Two."])
    keys = "hello\r/retry\r/info\r/set temperature\r/?\r/bye\r/context never\r"
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        session = make_prompt_session(h.shell, None, input=pipe, output=DummyOutput())
        assert run_interactive(h.shell, h.ui, session) == 0
    out = h.take()
    assert "One." in out and "Two." in out and "output 2" in out
    assert "quantization" in out and "sampling.temperature = 0.0" in out and "/retry" in out
    assert [o.text for o in h.ctx.outputs()] == ["Two."] and "never" not in out
