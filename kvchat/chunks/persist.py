"""Saving and loading the chunk set with its KV: one safetensors file that describes itself.

The file holds the live sequence's KV (so the next inference over the same context recomputes none
of it) and the KV of every other kept chunk, with the model fingerprint, dtype and shapes; a file
made for another model or layout is refused before anything in the session changes.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvchat.chunks.chunk import Chunk, KVSpan
from kvchat.chunks.types import Role
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import Sequence
from kvchat.errors import StateFileError

FORMAT = "kvchat-state/1"


@dataclass(frozen=True)
class Context:
    """Which chunks the next inference sees, by id."""

    system: str | None
    middle: list[str]
    turns: list[str]
    query: str | None


@dataclass(frozen=True)
class SavedState:
    """A state file read and checked, not yet applied to anything."""

    meta: dict
    tensors: dict[str, torch.Tensor]
    context: Context
    num_blocks: int  # KV blocks restoring it takes


def layout(engine: Engine, model_id: str, fingerprint: str) -> dict[str, object]:
    """What a state file must match to be loaded (the model id is informative only)."""
    return {
        "model_id": model_id,
        "fingerprint": fingerprint,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "block_size": engine.block_size,
        "num_layers": engine.num_layers,
        "num_kv_heads": engine.num_kv_heads,
        "head_dim": engine.head_dim,
    }


def _in_live(live: Sequence | None, span: KVSpan) -> bool:
    end = span.start_pos + span.num_tokens
    return (
        live is not None
        and end <= live.num_computed
        and tuple(live.blocks_covering(span.start_pos, end)) == span.block_ids
        and span.offset == span.start_pos % live.block_size
    )


def save(
    engine: Engine, layout: dict, chunks: list[Chunk], context: Context, live: Sequence | None, path: Path
) -> int:
    """Write the chunks and their KV to `path` atomically; returns the number of chunks saved."""
    tensors, records = {}, []
    if live is not None:
        tensors["live.keys"], tensors["live.values"] = engine.read_kv(live, 0, live.num_computed)
    for chunk in chunks:
        record = {k: getattr(chunk, k) for k in ("chunk_id", "number", "text", "token_ids", "output_number")}
        record |= {"role": chunk.role.value, "had_think": chunk.had_think, "is_default": chunk.is_default}
        record["finish_reason"] = chunk.finish_reason
        record["source_ids"] = list(chunk.source_ids)
        span = chunk.span
        if span is not None and span.is_valid(engine.blocks):
            where = "live" if _in_live(live, span) else "own"
            record["span"] = {k: getattr(span, k) for k in ("start_pos", "num_tokens", "exact", "pinned")}
            record["span"]["where"] = where
            if where == "own":
                keys, values = engine.gather(span.slots(engine.block_size))
                tensors[f"span.{chunk.chunk_id}.keys"], tensors[f"span.{chunk.chunk_id}.values"] = (
                    keys,
                    values,
                )
        records.append(record)
    meta = {
        "format": FORMAT,
        "layout": layout,
        "chunks": records,
        "context": {"system": context.system, "middle": context.middle, "turns": context.turns,
                    "query": context.query},
        "live": None
        if live is None
        else {"token_ids": live.token_ids[: live.num_computed], "exact": live.exact_limit},
    }  # fmt: skip
    _write(path, tensors, meta)
    return len(records)


def _write(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write atomically; a path that cannot take the file is one StateFileError naming why."""
    if path.is_dir():
        raise StateFileError(f"cannot save to {path}: it is a directory")
    blocker = next((p for p in path.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise StateFileError(f"cannot save to {path}: {blocker} is a file, not a directory")
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"kvchat": json.dumps(meta)})
        os.replace(tmp, path)
    except (OSError, SafetensorError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise StateFileError(f"cannot save to {path}: {reason}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def read(engine: Engine, layout: dict, path: Path) -> SavedState:
    """Read and check a state file against this session's layout; changes nothing."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("kvchat", "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise StateFileError(f"{path}: no such file") from None
    except (SafetensorError, OSError, ValueError, json.JSONDecodeError) as err:
        raise StateFileError(f"{path}: not a readable kvchat state file ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateFileError(f"{path}: not a kvchat state file")
    _check_meta(meta, tuple(layout), path)
    for key, want in layout.items():
        if key != "model_id" and meta["layout"].get(key) != want:
            raise StateFileError(
                f"{path}: made for {key}={meta['layout'].get(key)!r} "
                f"(model {meta['layout'].get('model_id')!r}), this session has {key}={want!r}"
            )
    c = meta["context"]
    context = Context(c["system"], list(c["middle"]), list(c["turns"]), c["query"])
    return SavedState(meta, tensors, context, _check_shapes(engine, meta, tensors))


_KEYS = {
    "context": ("system", "middle", "turns", "query"),
    "live": ("token_ids", "exact"),
    "chunk": tuple(
        "chunk_id number role text token_ids output_number had_think source_ids is_default".split()
    ),
    "span": ("start_pos", "num_tokens", "exact", "pinned", "where"),
}


def _check_meta(meta: dict, layout_keys: tuple[str, ...], path: Path) -> None:
    """Refuse metadata that lacks what `load` reads, before anything reads it."""
    if not isinstance(meta.get("chunks"), list) or "live" not in meta:
        raise StateFileError(f"{path}: damaged kvchat state file (no chunk list or live sequence)")
    parts: list[tuple[str, tuple[str, ...], Any]] = [
        ("layout", layout_keys, meta.get("layout")),
        ("context", _KEYS["context"], meta.get("context")),
    ]
    if meta["live"] is not None:
        parts.append(("live", _KEYS["live"], meta["live"]))
    for record in meta["chunks"]:
        parts.append(("chunk", _KEYS["chunk"], record))
        if isinstance(record, dict) and record.get("span") is not None:
            parts.append(("span", _KEYS["span"], record["span"]))
    for what, keys, part in parts:
        missing = [k for k in keys if not isinstance(part, dict) or k not in part]
        if missing:
            raise StateFileError(f"{path}: damaged kvchat state file ({what} lacks {', '.join(missing)})")
        if what == "chunk" and part["role"] not in {r.value for r in Role}:
            raise StateFileError(f"{path}: damaged kvchat state file (unknown role {part['role']!r})")


def _check_shapes(engine: Engine, meta: dict, tensors: dict[str, torch.Tensor]) -> int:
    """The KV blocks the file's tensors take, once checked against the engine's shapes."""
    e = engine
    need = 0
    expected: dict[str, int] = {}
    if meta["live"] is not None:
        expected["live"] = len(meta["live"]["token_ids"])
    for record in meta["chunks"]:
        span = record.get("span")
        if span and span["where"] == "own":
            expected[f"span.{record['chunk_id']}"] = span["num_tokens"]
    for name, num_tokens in expected.items():
        for part in ("keys", "values"):
            t = tensors.get(f"{name}.{part}")
            if t is None or tuple(t.shape) != (e.num_layers, num_tokens, e.num_kv_heads, e.head_dim):
                raise StateFileError(
                    f"state file is truncated or damaged: {name}.{part} is missing or misshapen"
                )
        need += -(-num_tokens // e.block_size)
    return need


def restore(engine: Engine, saved: SavedState) -> tuple[Sequence | None, list[Chunk]]:
    """Write a checked state's KV into the pool: the live sequence (owned by the caller) and the
    chunks with their spans. On any failure, every block it took is given back."""
    meta, tensors = saved.meta, saved.tensors
    live: Sequence | None = None
    chunks: list[Chunk] = []
    try:
        if meta["live"] is not None:
            live = engine.start(meta["live"]["token_ids"], reuse=False)
            exact, keys, values = meta["live"]["exact"], tensors["live.keys"], tensors["live.values"]
            engine.write_kv(live, 0, keys[:, :exact], values[:, :exact], exact=True)
            if exact < live.num_tokens:
                engine.write_kv(live, exact, keys[:, exact:], values[:, exact:])
        for record in meta["chunks"]:
            chunk = _chunk_of(record)
            chunks.append(chunk)
            if record.get("span") is not None:
                chunk.span = _restore_span(engine, live, chunk, record["span"], tensors)
    except BaseException:
        for chunk in chunks:
            if chunk.span is not None:
                chunk.span.release(engine.blocks)
        if live is not None:
            engine.free(live)
        raise
    return live, chunks


def _chunk_of(record: dict) -> Chunk:
    return Chunk(
        record["chunk_id"], record["number"], Role(record["role"]), record["text"], record["token_ids"],
        output_number=record["output_number"], had_think=record["had_think"],
        source_ids=tuple(record["source_ids"]), is_default=record["is_default"],
        finish_reason=record.get("finish_reason"),
    )  # fmt: skip


def _restore_span(
    engine: Engine, live: Sequence | None, chunk: Chunk, span: dict, tensors: dict[str, torch.Tensor]
) -> KVSpan:
    start, end = span["start_pos"], span["start_pos"] + span["num_tokens"]
    if span["where"] == "live":
        assert live is not None, "a span in the live sequence of a file that has none"
        return KVSpan.of(engine.blocks, live, start, end, span["exact"], span["pinned"])
    seq = engine.start(chunk.token_ids, reuse=False)
    try:
        engine.write_kv(
            seq, 0, tensors[f"span.{chunk.chunk_id}.keys"], tensors[f"span.{chunk.chunk_id}.values"]
        )
        own = KVSpan.of(engine.blocks, seq, 0, seq.num_tokens, span["exact"], span["pinned"])
    finally:
        engine.free(seq)
    return KVSpan(own.block_ids, own.generations, own.offset, own.num_tokens, start, own.exact, own.pinned)
