"""State files at the edges: paths that cannot take a save, damaged metadata, what an output keeps."""

import json
import os
import stat
import subprocess

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from kvchat.chunks import save_target
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import ChunkError, StateFileError
from tests.support.managers import drain, make_manager, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture
def saved(model, tmp_path):
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
def test_damaged_metadata_is_refused_and_changes_nothing(saved, model, change, message):
    _, path = saved
    rewrite_meta(path, change)
    other = make_manager(model)
    other.set_query("keep me")
    with pytest.raises(StateFileError, match="damaged kvchat state file") as err:
        other.load(path)
    assert message in str(err.value)
    assert other.chunk(other.query).info.text == "keep me"


def test_a_truncated_output_says_so_and_keeps_it_through_save_and_load(model, tmp_path):
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


def test_save_refuses_links_devices_fifos_and_files_that_are_not_saves(saved, tmp_path):
    cm, path = saved
    fifo, link, other = tmp_path / "fifo", tmp_path / "link", tmp_path / "notes.txt"
    os.mkfifo(fifo)
    link.symlink_to(path)
    other.write_text("my notes")
    cases = {
        fifo: "not a regular file",
        "/dev/null": "not a regular file",
        link: "symbolic link",
        other: "it exists and is not a kvchat save",
    }
    for target, reason in cases.items():
        with pytest.raises(StateFileError, match="cannot save to") as err:
            cm.save(target)
        assert reason in str(err.value)
    assert other.read_text() == "my notes" and link.is_symlink() and stat.S_ISFIFO(fifo.stat().st_mode)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert cm.save(path) > 0  # an older kvchat save is replaced


def test_save_honours_the_umask_and_leaves_no_temporary(saved, tmp_path, monkeypatch):
    cm, _ = saved
    for umask, mode in ((0o022, 0o644), (0o077, 0o600)):
        previous = os.umask(umask)
        try:
            cm.save(tmp_path / f"u{umask:o}.kv")
        finally:
            os.umask(previous)
        assert stat.S_IMODE((tmp_path / f"u{umask:o}.kv").stat().st_mode) == mode

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    before = (tmp_path / "u22.kv").read_bytes()
    monkeypatch.setattr(save_target, "save_file", broken)
    with pytest.raises(KeyboardInterrupt):
        cm.save(tmp_path / "u22.kv")
    assert (tmp_path / "u22.kv").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_the_next_save_removes_temporaries_of_dead_saves_only(saved, tmp_path):
    cm, path = saved
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no process now
    stale = tmp_path / f".s.safetensors.kvchat-{gone.pid}-0a1b.tmp"
    alive = tmp_path / f".s.safetensors.kvchat-{os.getppid()}-0a1b.tmp"
    mine = tmp_path / "notes.kvchat-1-zz.tmp"  # not a name kvchat makes
    for p in (stale, alive, mine):
        p.write_bytes(b"x" * 10)
    cm.save(path)
    assert not stale.exists() and alive.exists() and mine.exists()


def test_load_of_a_device_or_fifo_is_not_a_regular_file(saved, tmp_path):
    cm, _ = saved
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for target in (fifo, "/dev/zero"):
        with pytest.raises(StateFileError, match="not a regular file"):
            cm.load(target)


def test_reset_holds_no_block_and_keeps_exact_kv_for_reuse(saved):
    cm, _ = saved
    cm.set_query("hello there")
    first = drain(cm.infer(SamplingParams(max_tokens=2)))
    cm.reset()
    stats = cm.stats()
    assert stats.num_used == 0 and stats.num_pinned == 0 and stats.num_cached > 0
    cm.set_query("hello there")
    again = drain(cm.infer(SamplingParams(max_tokens=2)))
    assert again.reused_tokens > 0 and again.token_ids == first.token_ids


def test_a_chat_answer_is_not_used_twice_and_is_deleted_with_its_question(model):
    cm = make_manager(model)
    drain(cm.chat("hello there", SamplingParams(max_tokens=2)))
    drain(cm.chat("and again", SamplingParams(max_tokens=2)))
    with pytest.raises(ChunkError, match="answer of the conversation"):
        cm.use_output(1)
    first_question = cm.turns[0]
    cm.delete_output(1)
    assert [cm.registry.chunks[i].role.value for i in cm.turns] == ["user", "output"]
    assert first_question not in cm.registry.chunks
    drain(cm.chat("once more", SamplingParams(max_tokens=2)))
    assert [cm.registry.chunks[i].role.value for i in cm.turns] == ["user", "output"] * 2


@pytest.mark.parametrize("finish_reason", ["stop", "stop_string", "length", "cancelled", None])
def test_every_way_an_output_ends_loads(saved, model, finish_reason):
    _, path = saved

    def end_outputs(meta):
        for record in meta["chunks"]:
            if record["role"] == "output":
                record["finish_reason"] = finish_reason

    rewrite_meta(path, end_outputs)
    fresh = make_manager(model)
    fresh.load(path)
    assert [o.finish_reason for o in fresh.outputs()] == [finish_reason]


def test_a_file_of_another_model_says_so_before_any_schema_fault(saved, model):
    _, path = saved

    def other_model(meta):
        meta["layout"]["fingerprint"] = "other-1"
        meta["live"]["token_ids"][0] = 10**6  # in that model's vocabulary, not in this one's

    rewrite_meta(path, other_model)
    with pytest.raises(StateFileError, match="made with another configuration of "):
        make_manager(model).load(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_id": "org/other", "fingerprint": "x"},
            "made with model 'org/other'; this session runs 'tiny'",
        ),
        ({"weights": "int4", "fingerprint": "x"}, "made with int4 weights; this session has fp32 weights"),
        (
            {"dtype": "float32", "block_size": 16},
            "made with blocks of 16 tokens; this session has blocks of 4",
        ),
    ],
)
def test_a_refusal_says_in_words_what_differs(saved, model, change, message):
    _, path = saved
    rewrite_meta(path, lambda meta: meta["layout"].update(change))
    with pytest.raises(StateFileError, match=message):
        make_manager(model).load(path)
