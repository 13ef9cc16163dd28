"""/load is a transaction: a real save, randomly damaged in its metadata and its tensors, is either
refused with the session exactly as it was, or loaded into a session whose invariants hold (block
references equal what the chunks hold, an inference works, exact mode equals a full recompute). Ctrl-C
at any point of a load leaves the session as it was."""

import copy
import functools
import json
import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from kvchat.chunks import persist, save_schema
from kvchat.chunks.context import ContextManager
from kvchat.chunks.types import ReuseMode
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import StateFileError
from tests.support.faults import fault_at
from tests.support.managers import assert_refs_match, drain_maybe, small_pool_manager, small_pool_model

TMP = Path(tempfile.mkdtemp(prefix="kvchat-load-"))
EXAMPLES = int(os.environ.get("KVCHAT_LOAD_EXAMPLES", 500))
FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


def make_source() -> ContextManager:
    """A session whose save has a live sequence, spans in it, an own span and two outputs."""
    cm = small_pool_manager()
    moved = cm.add_context("red river stone").chunk_id
    cm.set_query("blue owl")
    drain_maybe(cm.infer(SamplingParams(max_tokens=3)))
    cm.middle.remove(moved)  # its span stays where it was computed: saved as its own
    drain_maybe(cm.chat("quick dog", SamplingParams(max_tokens=2)))
    return cm


def read_save(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["kvchat"]), {k: f.get_tensor(k) for k in f.keys()}


@functools.cache
def saved_source() -> tuple[Path, dict, dict[str, torch.Tensor]]:
    """The source session saved (at first use, not at import): its path, metadata and tensors."""
    path = TMP / "source.safetensors"
    make_source().save(path)
    return (path, *read_save(path))


def snapshot(cm: ContextManager) -> tuple:
    """Everything a load could change: chunks, context, live, references, prefix index, kept KV."""
    blocks = cm.engine.blocks
    kept = [b for b in blocks.blocks if b.ref_count or b.parent_hash is not None]
    pool = cm.engine.pool
    assert pool is not None
    bs = cm.engine.block_size
    kv = [pool.keys[:, :, b.block_id * bs : (b.block_id + 1) * bs].clone() for b in kept]
    return (
        copy.deepcopy(cm.registry),
        (cm.system, list(cm.middle), list(cm.turns), cm.query),
        copy.deepcopy(cm.live),
        [
            (b.block_id, b.ref_count, b.pin_count, b.parent_hash, list(b.token_ids), b.generation)
            for b in kept
        ],
        dict(blocks._by_hash),
        kv,
    )


def assert_same(before: tuple, after: tuple) -> None:
    *plain_before, kv_before = before
    *plain_after, kv_after = after
    assert plain_before == plain_after
    assert all(torch.equal(a, b) for a, b in zip(kv_before, kv_after, strict=True))


def make_target() -> ContextManager:
    cm = small_pool_manager()
    cm.set_query("slow cloud")
    drain_maybe(cm.infer(SamplingParams(max_tokens=2)))
    return cm


def assert_sound(cm: ContextManager) -> None:
    """A loaded session keeps its references straight, answers, and exact equals a full recompute."""
    assert_refs_match(cm)
    cm.mode = ReuseMode.EXACT
    cm.set_query("green stone")
    composed = cm.compose()
    logits = cm.engine.compute(composed.seq)
    tokens = list(composed.seq.token_ids)
    cm.engine.free(composed.seq)
    with torch.inference_mode():
        full = small_pool_model()(input_ids=torch.tensor([tokens])).logits[0, -1]
    assert (logits - full).abs().max() <= 1e-4
    assert cm.infer_blocking(SamplingParams(max_tokens=2)).output_number is not None
    assert_refs_match(cm)


# -- mutations ---------------------------------------------------------------------------------------

ODD_VALUES = [None, -5, -1, 0, 1, 2**40, 10**30, 1.5, "x", "", "0123456789", True, [], {}, [1, "a"]]


def paths(obj, prefix=()) -> list[tuple]:
    """Every place in a JSON value, containers included."""
    found = [prefix]
    if isinstance(obj, dict):
        for key in sorted(obj):
            found += paths(obj[key], (*prefix, key))
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            found += paths(item, (*prefix, i))
    return found


@st.composite
def damaged_meta(draw) -> dict:
    meta = copy.deepcopy(saved_source()[1])
    where = draw(st.sampled_from(paths(meta)[1:]))
    *parent_path, key = where
    parent = meta
    for part in parent_path:
        parent = parent[part]
    value = parent[key]
    kind = draw(st.sampled_from(["odd", "nudge", "remove", "duplicate", "other_ref", "extra"]))
    if kind == "odd":
        parent[key] = draw(st.sampled_from(ODD_VALUES))
    elif kind == "nudge" and isinstance(value, int) and not isinstance(value, bool):
        parent[key] = value + draw(st.sampled_from([-1, 1, -value - 1, 49152, 10**6]))
    elif kind == "nudge" and isinstance(value, bool):
        parent[key] = not value
    elif kind == "remove":
        del parent[key]
    elif kind == "duplicate" and isinstance(value, list) and value:
        value.append(copy.deepcopy(draw(st.sampled_from(value))))
    elif kind == "other_ref":
        parent[key] = draw(st.sampled_from([c["chunk_id"] for c in meta["chunks"]]))
    elif kind == "extra" and isinstance(value, dict):
        value["surplus"] = 1
    return meta


@st.composite
def damaged_tensors(draw) -> dict[str, torch.Tensor]:
    tensors = {k: v.clone() for k, v in saved_source()[2].items()}
    name = draw(st.sampled_from(sorted(tensors)))
    t = tensors[name]
    kind = draw(st.sampled_from(["poison", "shape", "dtype", "remove", "extra"]))
    if kind == "poison":
        flat = t.view(-1)
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(
            st.sampled_from([float("nan"), float("inf"), -float("inf")])
        )
    elif kind == "shape":
        tensors[name] = draw(st.sampled_from([t[:, :-1], torch.cat([t, t[:, :1]], 1), t[None], t[..., :-1]]))
    elif kind == "dtype":
        tensors[name] = t.to(draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float64])))
    elif kind == "remove":
        del tensors[name]
    else:
        tensors["span.0123456789.keys"] = t.clone()
    return tensors


TARGET: list[ContextManager] = []


def load_and_check(path: Path) -> bool:
    """Load `path` into a session; True when it loaded (and was sound), False when refused unchanged."""
    if not TARGET:
        TARGET.append(make_target())
    cm = TARGET[0]
    before = snapshot(cm)
    try:
        cm.load(path)
    except StateFileError as err:
        assert "\n" not in str(err) and str(err).startswith(str(path))
        assert_same(before, snapshot(cm))
        assert_refs_match(cm)
        return False
    TARGET.clear()
    assert_sound(cm)
    return True


DAMAGE = {"how": st.sampled_from(["meta", "tensors", "truncate"]), "data": st.data()}


@settings(FAST, max_examples=min(50, EXAMPLES))
@given(**DAMAGE)
def test_a_damaged_save_is_refused_unchanged_or_loads_soundly(how, data):
    refused_unchanged_or_loaded_soundly(how, data)


@pytest.mark.slow  # the same over ten times the saves
@FAST
@given(**DAMAGE)
def test_many_damaged_saves_are_refused_unchanged_or_load_soundly(how, data):
    refused_unchanged_or_loaded_soundly(how, data)


def refused_unchanged_or_loaded_soundly(how: str, data: st.DataObject) -> None:
    _, meta, tensors = saved_source()
    meta = data.draw(damaged_meta()) if how == "meta" else meta
    tensors = data.draw(damaged_tensors()) if how == "tensors" else tensors
    path = TMP / "damaged.safetensors"
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"kvchat": json.dumps(meta)}
    )
    if how == "truncate":
        os.truncate(path, int(path.stat().st_size * data.draw(st.floats(0, 1, exclude_max=True))))
    loaded = load_and_check(path)
    assert not (loaded and how != "meta")  # every tensor fault and truncation is caught


def test_the_undamaged_save_loads_soundly():
    TARGET.clear()
    assert load_and_check(saved_source()[0])


# Calls of a load that an interrupt is injected into: reading, checking and staging.
INTERRUPT_POINTS = [
    (persist, "safe_open"),
    (save_schema.SaveMeta, "model_validate_json"),
    (persist.torch, "isfinite"),
    (persist, "_chunk_of"),
]
ENGINE_POINTS = ("start", "write_kv")
BLOCK_POINTS = ("allocate", "pin")


@FAST
@given(at=st.integers(1, 40))
def test_an_interrupt_anywhere_in_a_load_changes_nothing(at):
    cm = make_target()
    before = snapshot(cm)
    targets = [
        *INTERRUPT_POINTS,
        *((cm.engine, name) for name in ENGINE_POINTS),
        *((cm.engine.blocks, name) for name in BLOCK_POINTS),
    ]
    with fault_at(targets, at, KeyboardInterrupt) as counter:
        try:
            cm.load(saved_source()[0])
        except KeyboardInterrupt:
            assert_same(before, snapshot(cm))
            assert_refs_match(cm)
            return
    assert counter.num_calls < at  # no interrupt reached it: it loaded
    assert_sound(cm)


def test_ctrl_c_during_the_swap_is_ignored(monkeypatch):
    cm = make_target()
    index = cm.engine.index

    def signalled(seq):
        os.kill(os.getpid(), signal.SIGINT)
        index(seq)

    monkeypatch.setattr(cm.engine, "index", signalled)
    cm.load(saved_source()[0])
    assert [c.chunk_id for c in cm.registry.chunks.values()] == [
        c["chunk_id"] for c in saved_source()[1]["chunks"]
    ]
    assert_sound(cm)
