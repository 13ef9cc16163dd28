"""State files at the edges: paths that cannot take a save, damaged metadata, what an output keeps."""

import json
import os

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from kvchat.engine.sampling import SamplingParams
from kvchat.errors import StateFileError
from tests.test_context import drain, make_manager, model  # noqa: F401  (module fixture)


@pytest.fixture
def saved(model, tmp_path):  # noqa: F811
    cm = make_manager(model)
    cm.set_query("hello there")
    drain(cm.infer(SamplingParams(max_tokens=3)))
    path = tmp_path / "s.safetensors"
    cm.save(path)
    return cm, path


def rewrite_meta(path, change) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["kvchat"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(meta)
    save_file(tensors, str(path), metadata={"kvchat": json.dumps(meta)})


def test_save_to_a_path_that_cannot_take_it_is_one_clear_error(saved, tmp_path):
    cm, _ = saved
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = {
        tmp_path: "it is a directory",
        a_file / "s.kv": f"{a_file} is a file, not a directory",
        a_file / "deeper" / "s.kv": f"{a_file} is a file, not a directory",
        "/sys/s.kv": "Permission denied",  # unwritable even for root
    }
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases[locked / "s.kv"] = "Permission denied"
    for path, reason in cases.items():
        with pytest.raises(StateFileError, match="cannot save to") as err:
            cm.save(path)
        assert reason in str(err.value) and "\n" not in str(err.value)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.pop("layout"), "the file lacks layout"),
        (lambda m: m["layout"].pop("block_size"), "layout lacks block_size"),
        (lambda m: m.pop("chunks"), "the file lacks chunks"),
        (lambda m: m["chunks"][0].pop("token_ids"), "chunks.0 lacks token_ids"),
        (lambda m: m["chunks"][0].update(role="wizard"), "chunks.0.role: Input should be"),
        (lambda m: m["context"].pop("turns"), "context lacks turns"),
        (lambda m: m["live"].pop("exact"), "live lacks exact"),
        (lambda m: m.update(context=[]), "context: Input should be an object"),
    ],
)
def test_damaged_metadata_is_refused_and_changes_nothing(saved, model, change, message):  # noqa: F811
    _, path = saved
    rewrite_meta(path, change)
    other = make_manager(model)
    other.set_query("keep me")
    with pytest.raises(StateFileError, match="damaged kvchat state file") as err:
        other.load(path)
    assert message in str(err.value)
    assert other.chunk(other.query).info.text == "keep me"


def test_a_truncated_output_says_so_and_keeps_it_through_save_and_load(model, tmp_path):  # noqa: F811
    cm = make_manager(model)
    cm.set_query("count to ten")
    result = drain(cm.infer(SamplingParams(max_tokens=2)))
    assert result.finish_reason == "length"
    [output] = cm.outputs()
    assert output.finish_reason == "length" and output.truncated
    cm.save(tmp_path / "s.safetensors")
    fresh = make_manager(model)
    fresh.load(tmp_path / "s.safetensors")
    assert fresh.outputs()[0].finish_reason == "length"


def test_reset_starts_the_hit_counts_afresh(saved):
    cm, _ = saved
    cm.set_query("hello there")
    drain(cm.infer(SamplingParams(max_tokens=2)))
    assert cm.stats().hit_tokens > 0 and cm.stats().lookup_tokens > 0
    cm.reset()
    stats = cm.stats()
    assert (stats.hit_tokens, stats.lookup_tokens, stats.hit_rate) == (0, 0, 0.0)
