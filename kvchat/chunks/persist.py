"""Saving and loading the chunk set with its KV: one safetensors file that describes itself.

The file holds the live sequence's KV (so the next inference over the same context recomputes none
of it) and the KV of every other kept chunk, with the model fingerprint, dtype and shapes. A file is
untrusted input: `read` checks all of it (save_schema's declared metadata, then every tensor) before
`stage` writes any KV, and the caller swaps the staged state in.
"""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvchat.chunks import save_schema, save_target
from kvchat.chunks.chunk import Chunk, KVSpan
from kvchat.chunks.save_schema import ChunkRecord, SaveMeta, SpanRecord
from kvchat.engine.block_manager import Sequence
from kvchat.engine.engine import Engine
from kvchat.errors import StateFileError


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

    path: Path
    meta: SaveMeta
    tensors: dict[str, torch.Tensor]
    num_blocks: int  # KV blocks restoring it takes

    @property
    def context(self) -> Context:
        c = self.meta.context
        return Context(c.system, list(c.middle), list(c.turns), c.query)


def layout(engine: Engine, model_id: str, fingerprint: str) -> dict[str, object]:
    """What a state file must match to be loaded (the model id and the weights' description are
    informative: the fingerprint covers them, they say in words what it differs by)."""
    return {
        "model_id": model_id,
        "weights": _weights(engine),
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
    n = live.num_computed if live is not None else 0
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
        "format": save_schema.FORMAT,
        "layout": layout,
        "chunks": records,
        "context": {"system": context.system, "middle": context.middle, "turns": context.turns,
                    "query": context.query},
        "live": None if live is None else {"token_ids": live.token_ids[:n],
                                           "exact": min(live.exact_limit, n)},
    }  # fmt: skip
    save_target.write(path, tensors, {"kvchat": json.dumps(meta)}, is_state_meta)
    return len(records)


def read(engine: Engine, layout: dict, path: Path) -> SavedState:
    """Read a state file and check all of it (schema, layout, tensors) against this session; changes
    nothing. Anything wrong is one StateFileError naming the first fault."""
    text, tensors = _read_file(path)
    _check_layout(json.loads(text).get("layout"), layout, path)  # before the schema: its fault says more
    try:
        meta = save_schema.parse_meta(text, _limits(engine))
    except save_schema.SchemaError as err:
        raise StateFileError(f"{path}: damaged kvchat state file ({err})") from None
    num_blocks = _check_tensors(engine, meta, tensors, path)
    return SavedState(path, meta, {k: t.to(engine.device) for k, t in tensors.items()}, num_blocks)


def _weights(engine: Engine) -> str:
    """The weights in a word: their quantization (int4, int8, ...), else their dtype (bf16, fp32)."""
    from kvchat.models.device import DTYPE_NAMES
    from kvchat.models.info import describe_quantization

    mode = describe_quantization(engine.model).split()[0]
    return DTYPE_NAMES.get(engine.dtype, str(engine.dtype)) if mode == "none" else mode


# How a layout's entries read in a refusal: "made with int4 weights; this session runs bf16 weights".
_IN_WORDS = {
    "weights": "{} weights",
    "dtype": "KV in {}",
    "block_size": "blocks of {} tokens",
    "num_layers": "{} layers",
    "num_kv_heads": "{} KV heads",
    "head_dim": "heads of {} dimensions",
}


def _check_layout(have: object, want: dict, path: Path) -> None:
    """Refuse a file made for another model or KV layout, saying in words what differs (what it
    lacks, the schema names)."""
    if not isinstance(have, dict):
        return
    for key, value in want.items():
        if key == "model_id" or key not in have or have[key] == value:
            continue
        if key == "fingerprint":
            model = want["model_id"]
            if have.get("model_id") != model:
                raise StateFileError(
                    f"{path}: made with model {have.get('model_id')!r}; this session runs {model!r}"
                )
            raise StateFileError(f"{path}: made with another configuration of {want['model_id']}")
        words = _IN_WORDS.get(key, f"{key} {{}}")
        raise StateFileError(
            f"{path}: made with {words.format(have[key])}; this session has {words.format(value)}"
        )


def _read_file(path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """The metadata text and the tensors of a file that claims to be a kvchat state file."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise StateFileError(f"{path}: not a regular file")
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get("kvchat", "null")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise StateFileError(f"{path}: no such file") from None
    except (SafetensorError, OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
        raise StateFileError(f"{path}: not a readable kvchat state file ({reason})") from None
    if not is_state_meta(text):
        raise StateFileError(f"{path}: not a kvchat state file")
    return text, tensors


def is_state_meta(text: str) -> bool:
    """Whether a safetensors file's "kvchat" metadata names this format (a kvchat save, sound or not)."""
    try:
        meta = json.loads(text)
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("format") == save_schema.FORMAT


def _limits(engine: Engine) -> save_schema.Limits:
    return save_schema.Limits(engine.model.config.vocab_size, engine.max_positions)


def _check_tensors(engine: Engine, meta: SaveMeta, tensors: dict[str, torch.Tensor], path: Path) -> int:
    """The KV blocks the file's tensors take, once each is checked: named by the metadata, of the
    engine's shape and dtype, every value finite."""
    expected = {"live": len(meta.live.token_ids)} if meta.live is not None else {}
    for record in meta.chunks:
        if record.span is not None and record.span.where == "own":
            expected[f"span.{record.chunk_id}"] = record.span.num_tokens
    names = {f"{name}.{part}": n for name, n in expected.items() for part in ("keys", "values")}
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise StateFileError(f"{path}: damaged kvchat state file (tensor {unknown[0]} belongs to nothing)")
    for name, num_tokens in names.items():
        t = tensors.get(name)
        shape = (engine.num_layers, num_tokens, engine.num_kv_heads, engine.head_dim)
        fault = (
            "is missing" if t is None
            else f"has shape {tuple(t.shape)}, not {shape}" if tuple(t.shape) != shape
            else f"has dtype {t.dtype}, not {engine.dtype}" if t.dtype != engine.dtype
            else "holds a NaN or infinite value" if not bool(torch.isfinite(t).all())
            else None
        )  # fmt: skip
        if fault is not None:
            raise StateFileError(f"{path}: damaged kvchat state file (tensor {name} {fault})")
    return sum(-(-n // engine.block_size) for n in expected.values())


def stage(engine: Engine, saved: SavedState) -> tuple[Sequence | None, list[Chunk]]:
    """Write a checked state's KV into free blocks beside what the session holds (refused when too
    few are free): the live sequence (owned by the caller, not yet indexed: `engine.index` it once
    committed) and the chunks with their spans. On any failure or interrupt, every block it took is
    given back."""
    if saved.num_blocks > engine.num_free_blocks:
        raise StateFileError(
            f"{saved.path}: needs {saved.num_blocks} KV blocks beside this session's, "
            f"{engine.num_free_blocks} free: /reset first or raise --kv-memory"
        )
    meta, tensors = saved.meta, saved.tensors
    live: Sequence | None = None
    chunks: list[Chunk] = []
    try:
        if meta.live is not None:
            live = engine.start(list(meta.live.token_ids), reuse=False, index=False)
            exact, keys, values = meta.live.exact, tensors["live.keys"], tensors["live.values"]
            engine.write_kv(live, 0, keys[:, :exact], values[:, :exact], exact=True)
            if exact < live.num_tokens:
                engine.write_kv(live, exact, keys[:, exact:], values[:, exact:])
        for record in meta.chunks:
            chunk = _chunk_of(record)
            chunks.append(chunk)
            if record.span is not None:
                chunk.span = _restore_span(engine, live, chunk, record.span, tensors)
    except BaseException:
        unstage(engine, live, chunks)
        raise
    return live, chunks


def unstage(engine: Engine, live: Sequence | None, chunks: list[Chunk]) -> None:
    """Give back the blocks `stage` took."""
    for chunk in chunks:
        if chunk.span is not None:
            chunk.span.release(engine.blocks)
    if live is not None:
        engine.free(live)


def _chunk_of(record: ChunkRecord) -> Chunk:
    return Chunk(
        record.chunk_id, record.number, record.role, record.text, list(record.token_ids),
        output_number=record.output_number, had_think=record.had_think,
        source_ids=tuple(record.source_ids), is_default=record.is_default,
        finish_reason=record.finish_reason,
    )  # fmt: skip


def _restore_span(
    engine: Engine, live: Sequence | None, chunk: Chunk, span: SpanRecord, tensors: dict[str, torch.Tensor]
) -> KVSpan:
    start, end = span.start_pos, span.end
    if span.where == "live":
        assert live is not None, "a span in the live sequence of a file that has none"
        return KVSpan.of(engine.blocks, live, start, end, span.exact, span.pinned)
    seq = engine.start(chunk.token_ids, reuse=False, index=False)
    try:
        engine.write_kv(
            seq, 0, tensors[f"span.{chunk.chunk_id}.keys"], tensors[f"span.{chunk.chunk_id}.values"]
        )
        own = KVSpan.of(engine.blocks, seq, 0, seq.num_tokens, span.exact, span.pinned)
    finally:
        engine.free(seq)
    return KVSpan(own.block_ids, own.generations, own.offset, own.num_tokens, start, own.exact, own.pinned)
