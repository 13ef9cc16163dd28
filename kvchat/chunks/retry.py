"""Which answer `/retry` generates again, and from what (bookkeeping over chunk ids), and the answer's
pinned KV lent to the new run until the new answer's first token replaces it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator

from kvchat.chunks.chunk import Chunk, ChunkRegistry, KVSpan
from kvchat.engine.block_manager import BlockManager
from kvchat.engine.records import GenerationStep, PrefillProgress
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


def unpin_replaced(chunk: Chunk, blocks: BlockManager) -> KVSpan | None:
    """Let the blocks of an answer being replaced go to the new run where it needs the room; the span
    is given back by `pin_again` where the new answer never came."""
    span, chunk.span = chunk.span, None
    if span is not None:
        span.release(blocks)
    return span


def pin_again(chunk: Chunk, span: KVSpan, blocks: BlockManager) -> None:
    """Give a span lent by `unpin_replaced` back to its chunk, where its blocks still hold its KV."""
    if not span.pinned or span.is_valid(blocks):
        if span.pinned:
            blocks.pin(list(span.block_ids))
        chunk.span = span


Steps = Generator[PrefillProgress | GenerationStep, None, None]


def at_first_token(steps: Steps, action: Callable[[], None]) -> Steps:
    """`yield from steps`, with `action` run just before the first generated token is passed on. What
    is thrown in (Ctrl-C) goes on to `steps`, as with `yield from`."""
    try:
        step = next(steps)
    except StopIteration:
        return
    while True:
        if isinstance(step, GenerationStep):
            action()
            action = _nothing
        try:
            yield step
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as thrown:  # noqa: BLE001 (handed on to `steps`, which decides)
            advance = functools.partial(steps.throw, thrown)
        else:
            advance = functools.partial(next, steps)
        try:
            step = advance()
        except StopIteration:
            return


def _nothing() -> None:
    pass
