"""Saving and loading the chunk set with its KV: one safetensors file that describes itself.

The file holds the live sequence's KV (so the next inference over the same context recomputes none
of it) and the KV of every other kept chunk, with the model fingerprint, dtype and shapes; a file
made for another model or layout is refused before anything in the session changes.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvchat.chunks.registry import Chunk
from kvchat.chunks.spans import KVSpan
from kvchat.chunks.types import Role
from kvchat.errors import StateFileError

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager

FORMAT = "kvchat-state/1"


def _layout(cm: ContextManager) -> dict:
    e = cm.engine
    return {
        "model_id": cm.model_id,
        "fingerprint": cm.fingerprint,
        "dtype": str(e.dtype).removeprefix("torch."),
        "block_size": e.block_size,
        "num_layers": e.num_layers,
        "num_kv_heads": e.num_kv_heads,
        "head_dim": e.head_dim,
    }


def _in_live(cm: ContextManager, span: KVSpan) -> bool:
    live = cm.live
    end = span.start_pos + span.num_tokens
    return (
        live is not None
        and end <= live.num_computed
        and tuple(live.blocks_covering(span.start_pos, end)) == span.block_ids
        and span.offset == span.start_pos % live.block_size
    )


def save(cm: ContextManager, path: Path) -> int:
    """Write the chunk set and its KV to `path` atomically; returns the number of chunks saved."""
    engine, tensors, records = cm.engine, {}, []
    live = cm.live
    if live is not None:
        tensors["live.keys"], tensors["live.values"] = engine.read_kv(live, 0, live.num_computed)
    for chunk in cm.registry.chunks.values():
        record = {k: getattr(chunk, k) for k in ("chunk_id", "number", "text", "token_ids", "output_number")}
        record |= {"role": chunk.role.value, "had_think": chunk.had_think, "is_default": chunk.is_default}
        record["finish_reason"] = chunk.finish_reason
        record["source_ids"] = list(chunk.source_ids)
        span = chunk.span
        if span is not None and span.is_valid(engine.blocks):
            where = "live" if _in_live(cm, span) else "own"
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
        "layout": _layout(cm),
        "chunks": records,
        "context": {"system": cm.system, "middle": cm.middle, "turns": cm.turns, "query": cm.query},
        "live": None
        if live is None
        else {"token_ids": live.token_ids[: live.num_computed], "exact": live.exact_limit},
    }
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


def _read(cm: ContextManager, path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
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
    mine = _layout(cm)
    _check_meta(meta, tuple(mine), path)
    for key, want in mine.items():
        if key != "model_id" and meta["layout"].get(key) != want:
            raise StateFileError(
                f"{path}: made for {key}={meta['layout'].get(key)!r} "
                f"(model {meta['layout'].get('model_id')!r}), this session has {key}={want!r}"
            )
    return meta, tensors


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


def _check_shapes(cm: ContextManager, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    e = cm.engine
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
    if need > e.blocks.num_blocks:
        raise StateFileError(f"state file needs {need} KV blocks, this session has {e.blocks.num_blocks}")


def load(cm: ContextManager, path: Path) -> int:
    """Replace the session's chunks and KV with those saved in `path`; returns the number of chunks."""
    meta, tensors = _read(cm, path)
    _check_shapes(cm, meta, tensors)
    cm.reset()
    engine = cm.engine
    if meta["live"] is not None:
        live = engine.start(meta["live"]["token_ids"], reuse=False)
        exact, keys, values = meta["live"]["exact"], tensors["live.keys"], tensors["live.values"]
        engine.write_kv(live, 0, keys[:, :exact], values[:, :exact], exact=True)
        if exact < live.num_tokens:
            engine.write_kv(live, exact, keys[:, exact:], values[:, exact:])
        cm.live = live
    for record in meta["chunks"]:
        chunk = Chunk(
            record["chunk_id"], record["number"], Role(record["role"]), record["text"], record["token_ids"],
            output_number=record["output_number"], had_think=record["had_think"],
            source_ids=tuple(record["source_ids"]), is_default=record["is_default"],
            finish_reason=record.get("finish_reason"),
        )  # fmt: skip
        span = record.get("span")
        if span is not None:
            chunk.span = _restore_span(cm, chunk, span, tensors)
        cm.registry.chunks[chunk.chunk_id] = chunk
    numbers = [r["number"] for r in meta["chunks"]] or [0]
    outputs = [r["output_number"] or 0 for r in meta["chunks"]] or [0]
    cm.registry._next_number, cm.registry._next_output = max(numbers) + 1, max(outputs) + 1
    context = meta["context"]
    cm.system, cm.middle, cm.turns, cm.query = (
        context["system"],
        context["middle"],
        context["turns"],
        context["query"],
    )
    return len(meta["chunks"])


def _restore_span(cm: ContextManager, chunk: Chunk, span: dict, tensors: dict[str, torch.Tensor]) -> KVSpan:
    engine = cm.engine
    start, end = span["start_pos"], span["start_pos"] + span["num_tokens"]
    if span["where"] == "live":
        assert cm.live is not None, "a span in the live sequence of a file that has none"
        return KVSpan.of(engine.blocks, cm.live, start, end, span["exact"], span["pinned"])
    seq = engine.start(chunk.token_ids, reuse=False)
    engine.write_kv(seq, 0, tensors[f"span.{chunk.chunk_id}.keys"], tensors[f"span.{chunk.chunk_id}.values"])
    own = KVSpan.of(engine.blocks, seq, 0, seq.num_tokens, span["exact"], span["pinned"])
    engine.free(seq)
    return KVSpan(own.block_ids, own.generations, own.offset, own.num_tokens, start, own.exact, own.pinned)
