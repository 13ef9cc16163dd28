"""The records that describe chunks and the cache to a user, read off the registry and the pool."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvchat.chunks.chunk import Chunk, ChunkRegistry, KVSpan
from kvchat.chunks.types import CacheStats, ChunkDetail, ChunkInfo
from kvchat.engine.block_manager import BlockManager
from kvchat.models.info import ModelInfo, model_info

if TYPE_CHECKING:
    from kvchat.chunks.template import ChatFormat
    from kvchat.engine.engine import Engine


def kept_span(chunk: Chunk, blocks: BlockManager) -> KVSpan | None:
    """The chunk's kept KV, unless its blocks were handed out again since."""
    return chunk.span if chunk.span and chunk.span.is_valid(blocks) else None


def chunk_info(chunk: Chunk, blocks: BlockManager, place: int | None) -> ChunkInfo:
    span = kept_span(chunk, blocks)
    return ChunkInfo(
        number=chunk.number,
        chunk_id=chunk.chunk_id,
        role=chunk.role,
        text=chunk.text,
        num_tokens=len(chunk.token_ids),
        num_blocks=len(span.block_ids) if span else 0,
        num_refs=max((blocks.ref_count(b) for b in span.block_ids), default=0) if span else 0,
        place=place,
        pinned=bool(span and span.pinned),
        output_number=chunk.output_number,
        finish_reason=chunk.finish_reason,
    )


def chunk_detail(info: ChunkInfo, chunk: Chunk, blocks: BlockManager, positions: range | None) -> ChunkDetail:
    span = kept_span(chunk, blocks)
    return ChunkDetail(
        info=info,
        token_ids=list(chunk.token_ids),
        positions=positions,
        kv_positions=range(span.start_pos, span.start_pos + span.num_tokens) if span else None,
        block_ids=list(span.block_ids) if span else [],
        had_think=chunk.had_think,
        source=" ".join(chunk.source_ids) or None,
    )


def cache_stats(blocks: BlockManager, bytes_per_block: int) -> CacheStats:
    return CacheStats(
        num_blocks=blocks.num_blocks,
        num_used=blocks.num_used,
        num_pinned=blocks.num_pinned,
        num_cached=blocks.num_cached,
        num_free=blocks.num_free - blocks.num_cached,
        block_size=blocks.block_size,
        bytes_total=blocks.num_blocks * bytes_per_block,
        bytes_per_block=bytes_per_block,
        hit_tokens=blocks.hit_tokens,
        lookup_tokens=blocks.lookup_tokens,
    )


def model_summary(
    engine: Engine, tokenizer: Any, chat_format: ChatFormat, model_id: str, move_refusal: str | None = None
) -> ModelInfo:
    """The model, its chat template, the reuse modes it runs and the KV budget (for `/info`)."""
    reuse = "exact, reposition, repair" if move_refusal is None else f"exact only: {move_refusal}"
    info = model_info(
        engine.model,
        getattr(tokenizer, "chat_template", None),
        chat_format.default_system_prompt,
        model_id=model_id,
        num_blocks=engine.blocks.num_blocks,
        block_size=engine.block_size,
        bytes_per_block=engine.bytes_per_block,
    )
    return replace(
        info,
        chat_template=chat_format.describe(),
        decode=engine.decode_path,
        reuse=reuse,
        batch_variance=engine.batch_invariance,
    )


def deletable_outputs(registry: ChunkRegistry) -> str:
    """What a user could delete to make room, for a cache-full message."""
    kept = [(c.output_number, len(c.span.block_ids)) for c in registry.outputs() if c.span is not None]
    if not kept:
        return "Nothing is kept that could be deleted; raise --kv-memory or lower --max-tokens."
    listed = ", ".join(f"/delete-output {number} ({blocks} blocks)" for number, blocks in kept)
    return f"Kept outputs that could be deleted: {listed}"
