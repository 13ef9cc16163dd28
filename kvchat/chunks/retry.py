"""Which answer `/retry` generates again, and from what: pure bookkeeping over chunk ids."""

from __future__ import annotations

from kvchat.chunks.chunk import Chunk, ChunkRegistry
from kvchat.errors import ChunkError


def answer_to_retry(
    registry: ChunkRegistry, context_ids: list[str], query_id: str | None, turns: list[str]
) -> tuple[Chunk, Chunk | None]:
    """The newest output and, for a chat answer, its user turn. `context_ids` is the context without
    the query, as the ContextManager composes it now. ChunkError when there is no answer, or when the
    context it was generated from is no longer the current one (the output itself reused in it
    included)."""
    outputs = registry.outputs()
    if not outputs:
        raise ChunkError("nothing to retry: no answer yet")
    last = outputs[-1]
    is_turn = turns[-1:] == [last.chunk_id]
    expected = context_ids[:-1] if is_turn else context_ids + ([query_id] if query_id else [])
    if tuple(expected) != last.source_ids:
        raise ChunkError(
            f"the context changed since output {last.output_number} was generated; "
            "/infer or a message answers the current one"
        )
    return last, registry.chunks[expected[-1]] if is_turn else None
