"""The real `kvchat` command, as a user runs it: command files piped in, and a terminal."""

import json
import re
import signal
import subprocess

import pexpect
import pytest

from tests.support.processes import KVCHAT, user_env
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow  # kvchat in subprocesses and a pseudo-terminal, on real models

# Seconds after which a kvchat process is taken to hang: several times a first start with its kernel
# build on a busy machine, so that only a hang reaches it.
HANG = 900


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A local model folder: a tiny random Llama with the real SmolLM2 tokenizer and chat template."""
    from transformers import AutoTokenizer

    from kvchat.models.packaged import ensure_converted

    folder = tmp_path_factory.mktemp("tiny-model")
    make_tiny_model("llama", vocab_size=49152).save_pretrained(folder)
    AutoTokenizer.from_pretrained(ensure_converted()).save_pretrained(folder)
    return folder


def kvchat(args, stdin: bytes, home) -> subprocess.CompletedProcess:
    env = user_env(home)
    return subprocess.run(KVCHAT + args, input=stdin, capture_output=True, env=env, timeout=HANG)


def records(proc) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]


SCRIPT = b"""# a comment, then a blank line

/system You are terse.
/context <<<
The Rhine flows north.
It ends in the North Sea.
>>>
/query Where does the Rhine end?
/infer
/infer
/output
/use-output 1
/use-output 9
/bogus
/query
/set temperature hot
/show 1
/stats
/verify 4
/mode reposition
/system Another system prompt.
/infer
/save STATE
/load STATE
/delete-output 1
/chunks
/save TMPDIR
/context @/dev/zero
>>>
"""


def test_script_with_json_on_a_local_model_folder(tiny_folder, tmp_path):
    script = SCRIPT.replace(b"STATE", str(tmp_path / "s.safetensors").encode())
    script = script.replace(b"TMPDIR", str(tmp_path).encode())
    args = ["--model", str(tiny_folder), "--json", "--max-tokens", "6", "--seed", "1"]
    proc = kvchat(args, script, tmp_path)
    out = records(proc)
    assert proc.returncode == 1, proc.stderr.decode()  # some commands failed; the rest still ran
    assert [r["cmd"] for r in out][:4] == ["system", "context", "query", "infer"]
    assert all({"cmd", "ok", "error"} <= r.keys() for r in out)
    failed = {r["cmd"]: r["error"] for r in out if not r["ok"]}
    assert all(message in proc.stderr.decode() for message in failed.values())  # on stderr too
    assert set(failed) == {"use-output", "bogus", "query", "set", "save", "context", None}
    assert "no output 9" in failed["use-output"] and "unknown command" in failed["bogus"]
    assert "is a directory" in failed["save"] and "larger than 16 MiB" in failed["context"]
    assert "no block open" in failed[None] and not any("internal error" in e for e in failed.values())
    first, second, moved = (r for r in out if r["cmd"] == "infer")
    for r in (first, second, moved):
        assert {"output", "output_number", "chunk_id", "prompt_tokens", "reused_tokens", "computed_tokens",
                "ttft_s", "decode_tok_s", "finish_reason", "chunks"} <= r.keys()  # fmt: skip
    assert first["reused_tokens"] == 0 and second["reused_tokens"] == second["prompt_tokens"] - 1
    assert moved["mode"] == "reposition" and moved["repositioned_tokens"] > 0
    assert next(r for r in out if r["cmd"] == "load")["num_chunks"] >= 5
    assert next(r for r in out if r["cmd"] == "verify")["fidelity"]["greedy_tokens"] >= 1


def test_clean_script_exits_0_and_bad_model_exits_2(tiny_folder, tmp_path):
    ok = kvchat(
        ["--model", str(tiny_folder), "--max-tokens", "3"], b"/query hi\n/infer\n/stats\n/set\n", tmp_path
    )
    assert ok.returncode == 0, ok.stderr.decode()
    assert b"computed" in ok.stdout and b"\x1b[" not in ok.stdout  # plain output when not a terminal
    # `/set` shows what auto resolved to in this process.
    assert re.search(r'model\.dtype +"auto" \((bf16|fp32)\)', ok.stdout.decode())
    assert re.search(r"model\.threads +0 \(\d+\)", ok.stdout.decode())
    bad = kvchat(["--model", str(tmp_path / "nowhere")], b"/stats\n", tmp_path)
    assert bad.returncode == 2 and bad.stdout == b""
    assert b"Traceback" not in bad.stderr and len(bad.stderr.decode().strip().splitlines()) == 1


def test_a_config_setting_a_removed_key_is_told_so_in_one_line(tiny_folder, tmp_path):
    config = tmp_path / ".config" / "kvchat" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("[model]\ncompile = true\n")
    proc = kvchat(["--model", str(tiny_folder)], b"/stats\n", tmp_path)
    assert proc.returncode == 2 and proc.stdout == b""
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "model.compile was removed" in lines[0] and str(config) in lines[0]


def test_invalid_utf8_and_long_lines_are_errors_not_crashes(tiny_folder, tmp_path):
    stdin = b"/query caf\xe9\n/query " + b"x" * (1 << 21) + b"\n/query fine\n"
    proc = kvchat(["--model", str(tiny_folder), "--json"], stdin, tmp_path)
    out = records(proc)
    assert proc.returncode == 1 and [r["ok"] for r in out] == [False, False, True]
    assert "UTF-8" in out[0]["error"] and "long" in out[1]["error"]


def test_packaged_smollm2_answers_and_reuses(tmp_path):
    # a question whose first token leads by ~1.1 logits in fp32 and bf16: "What is the capital of
    # France?" under this system prompt is a tie between "The" and "La" (0.002 apart in fp32), which
    # bf16's rounding decides one way in a prefill and may decide the other in a one-row step
    script = (
        b"/system You are a concise assistant.\n/query Name the capital city of France.\n/infer\n/infer\n"
    )
    proc = kvchat(["--json", "--max-tokens", "24"], script, tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    first, second = (r for r in records(proc) if r["cmd"] == "infer")
    assert "Paris" in first["output"] and first["output"] == second["output"]
    assert second["computed_tokens"] == 1 and first["finish_reason"] == "stop"


def default_interrupt() -> None:
    """Ctrl-C as an interactive shell gives it. A process inherits an ignored SIGINT (a test run that a
    non-interactive shell started in the background has one), and kvchat would then never see one."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interactive_terminal(tmp_path):
    # An answer that cannot end before the Ctrl-C, however fast the machine: no end token is picked and
    # max_tokens is as long as the model's positions allow. The Ctrl-C follows the answer's first words.
    # pexpect answers no cursor position request: told so, prompt_toolkit sends none, and prints no
    # warning (whose words, on a busy machine, came while Enter was still unread).
    env = {**user_env(tmp_path), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    child = pexpect.spawn(
        KVCHAT[0],
        KVCHAT[1:] + ["--ignore-eos", "--max-tokens", "8000"],
        env=env,
        timeout=HANG,
        dimensions=(40, 120),
        encoding="utf-8",
        preexec_fn=default_interrupt,
    )
    try:
        child.expect("›")
        child.send("/he\t")  # Tab completes the command
        child.expect("/help")
        child.send("\r")
        child.expect("delete-output")
        child.expect("›")
        # No three words of three letters in a row here, nor in the toolbar or an escape code: once
        # they appear, the answer is streaming (a Ctrl-C before Enter is read would clear the line).
        child.send("Write a story, as long as you can, about a lighthouse keeper.\r")
        child.expect(r"[A-Za-z]{3,} [A-Za-z]{3,} [A-Za-z]{3,} ")
        child.sendintr()  # Ctrl-C stops it and keeps what came
        child.expect("cancelled")
        child.expect("›")
        child.send("/output\r")
        # the kept answer: number, text, tokens, how it ended (styled), id
        child.expect(r"1\s+\S.*\s\d+\s+\S*cancelled \(truncated\)\S*\s+[0-9a-f]{10}")
        child.expect("›")
        child.sendeof()  # Ctrl-D quits
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_save_then_load_in_a_fresh_process_gives_the_same_answer_without_recomputing(tiny_folder, tmp_path):
    state = str(tmp_path / "state.safetensors").encode()
    args = ["--model", str(tiny_folder), "--json", "--max-tokens", "8"]
    setup = b"/system You are terse.\n/context The Rhine ends in the North Sea.\n/query Where?\n/infer\n"
    first = kvchat(args, setup + b"/save " + state + b"\n", tmp_path)
    second = kvchat(args, b"/load " + state + b"\n/infer\n", tmp_path)
    assert first.returncode == 0 and second.returncode == 0, second.stderr.decode()
    before = next(r for r in records(first) if r["cmd"] == "infer")
    after = next(r for r in records(second) if r["cmd"] == "infer")
    assert after["output"] == before["output"]
    assert after["computed_tokens"] == 1  # the last prompt token, for logits; no loaded chunk recomputed
    *chunks, answer_prompt = after["chunks"]
    assert all(c["num_computed"] == 0 for c in chunks) and answer_prompt["chunk_id"] is None
