"""Exact means identical, as a user sees it: the real `kvchat` on the packaged SmolLM2 with default
settings (bf16 where the CPU runs it), over a ~2,000-token context. /verify in exact mode finds the
logits identical to a full recompute; /retry at temperature 0, an answer with prompt lookup off and one
after /load in a new process give the first answer's text."""

import json
import os
import random
import subprocess
import sys

import pytest

from kvchat.native import kernels

pytestmark = [
    pytest.mark.slow,
    # identical needs batch-invariant linears: kvchat's (the portable tier's are torch's)
    pytest.mark.skipif(
        not kernels.linears_built(), reason=f"kvchat's linear kernels ({kernels.tier()} tier)"
    ),
]

WORDS = (
    "harbour lantern keeper storm gull rope tide ledger boat netting winter salt compass cliff "
    "signal fog anchor bell shore mast cargo current reef pilot"
).split()


def long_context() -> str:
    """A log of ~2,000 tokens: numbered entries of seeded words."""
    rng = random.Random(0)
    entries = [f"Entry {i}: the {' '.join(rng.choice(WORDS) for _ in range(12))}." for i in range(100)]
    return "\n".join(entries)


def kvchat(stdin: str, home) -> list[dict]:
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    env.pop("KVCHAT_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "kvchat", "--json", "--max-tokens", "40"],
        input=stdin.encode(),
        capture_output=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]


SETUP = f"/context <<<\n{long_context()}\n>>>\n/query Copy the last entry of the log above, word for word.\n"


def test_retry_verify_and_prompt_lookup_off_give_the_first_answer_to_the_bit(tmp_path):
    out = kvchat(SETUP + "/infer\n/info\n/retry\n/verify 16\n/set speculate off\n/infer\n", tmp_path)
    info = next(r for r in out if r["cmd"] == "info")["info"]
    assert info["dtype"] == "bf16" and info["batch_variance"] is None
    first, retried, no_drafts = (r for r in out if r["cmd"] in ("infer", "retry"))
    assert first["prompt_tokens"] > 1900 and first["drafted_tokens"] > 0  # prompt lookup drafted
    assert retried["output"] == first["output"]
    assert no_drafts["drafted_tokens"] == 0 and no_drafts["output"] == first["output"]
    assert no_drafts["computed_tokens"] == 1  # the cached context reused: its last token alone
    fidelity = next(r for r in out if r["cmd"] == "verify")["fidelity"]
    assert fidelity["identical"] and fidelity["first_difference"] is None
    assert fidelity["kl_divergence"] == 0 and fidelity["max_logit_diff"] == 0
    assert fidelity["greedy_agree"] == fidelity["greedy_tokens"] >= 1


def test_an_answer_after_load_in_a_new_process_is_the_first_answer(tmp_path):
    state = tmp_path / "state.safetensors"
    first = next(r for r in kvchat(SETUP + f"/infer\n/save {state}\n", tmp_path) if r["cmd"] == "infer")
    after = next(r for r in kvchat(f"/load {state}\n/infer\n", tmp_path) if r["cmd"] == "infer")
    assert after["computed_tokens"] == 1 and after["output"] == first["output"]
