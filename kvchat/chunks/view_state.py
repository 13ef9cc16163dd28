"""What the cache views (/blocks, /attention, /compare) read of a ContextManager: one snapshot, copied at
one moment, so a view neither walks the manager's attributes nor can change them.

Pure Python over ints, like the block manager it copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvchat.chunks.chunk import Chunk, KVSpan
from kvchat.chunks.describe import kept_span
from kvchat.chunks.types import Role
from kvchat.engine.block_manager import BlockManager, Sequence
from kvchat.errors import ChunkError


@dataclass(frozen=True)
class BlockState:
    ref_count: int
    pin_count: int
    holds_kv: bool  # an unreferenced block with this keeps reusable KV (cached); without, it is free


@dataclass(frozen=True)
class ViewState:
    chunks: tuple[Chunk, ...]  # every registered chunk, in registration order
    context: tuple[Chunk, ...]  # what the next inference sees, in order (when asked for)
    can_answer: bool  # there is a query or a turn to answer
    live: Sequence | None  # the last inference's sequence, kept for the next turn
    blocks: tuple[BlockState, ...]  # by block id
    block_size: int
    kept_spans: Mapping[str, KVSpan] = field(default_factory=dict)  # chunk id -> KV its blocks still hold
    generation_prompt_ids: tuple[int, ...] = ()  # what opens an assistant turn
    assistant_close_ids: tuple[int, ...] = ()  # what closes one

    def outputs(self) -> list[Chunk]:
        """The retained outputs, by output number."""
        return sorted((c for c in self.chunks if c.role is Role.OUTPUT), key=lambda c: c.output_number or 0)

    def output(self, number: int) -> Chunk:
        outputs = self.outputs()
        for chunk in outputs:
            if chunk.output_number == number:
                return chunk
        known = ", ".join(str(c.output_number) for c in outputs)
        raise ChunkError(f"no output {number}" + (f" (outputs: {known})" if known else ""))

    def chunk(self, chunk_id: str) -> Chunk | None:
        return next((c for c in self.chunks if c.chunk_id == chunk_id), None)


def make_view_state(
    blocks: BlockManager,
    chunks: list[Chunk],
    context: list[Chunk],
    live: Sequence | None,
    can_answer: bool = False,
    format_ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
) -> ViewState:
    """Copy what the views read: the chunks and the live sequence as they are now, each block's counts."""
    copies = {c.chunk_id: dataclasses.replace(c, token_ids=list(c.token_ids)) for c in chunks}
    spans = {c.chunk_id: span for c in chunks if (span := kept_span(c, blocks)) is not None}
    live_copy = None
    if live is not None:
        table = list(live.block_table)
        live_copy = dataclasses.replace(live, token_ids=list(live.token_ids), block_table=table)
    return ViewState(
        chunks=tuple(copies.values()),
        context=tuple(copies.get(c.chunk_id, c) for c in context),
        can_answer=can_answer,
        live=live_copy,
        blocks=tuple(BlockState(*state) for state in blocks.states()),
        block_size=blocks.block_size,
        kept_spans=spans,
        generation_prompt_ids=tuple(format_ids[0]),
        assistant_close_ids=tuple(format_ids[1]),
    )
