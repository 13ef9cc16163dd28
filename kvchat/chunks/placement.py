"""A context placed by the chat template: its chunks in the order the template writes them, each with the
ids it has there, and the generation prompt after them. The ids joined are what `apply_chat_template`
gives for the context's messages.

A chunk's own `token_ids` are the ids its kept KV was computed for; where it is placed now may give it
other ids (a passage first in a user turn has the turn's header before it, a later one the separator; a
template may move the system prompt). Composition compares the two: what they share can be reused.

`ContextPlacement` is how a ContextManager places its context: the conversation's parts (system prompt,
passages, turns, answers, query) rendered whole, each chunk's ids cut from the rendering (`place`),
renderings kept for the conversations asked for again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvchat.chunks.chunk import Chunk, ChunkRegistry
from kvchat.chunks.describe import kept_span
from kvchat.chunks.rendering import Part, Rendering
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import Role
from kvchat.errors import ChunkError

if TYPE_CHECKING:
    from kvchat.engine.engine import Engine

_TEMPLATE_ROLE = {Role.SYSTEM: "system", Role.CONTEXT: "user", Role.QUERY: "user", Role.USER: "user"}
_NUM_RENDERINGS_KEPT = 16


@dataclass(frozen=True)
class Placement:
    chunks: list[Chunk]  # in the order of their ids in the context
    piece_ids: list[list[int]]  # each chunk's ids here
    tail_ids: list[int]  # the generation prompt
    sources: list[Chunk]  # the same chunks in the conversation's order (system, context, turns, query)

    @property
    def token_ids(self) -> list[int]:
        return [t for ids in self.piece_ids for t in ids] + self.tail_ids

    @property
    def ranges(self) -> list[tuple[Chunk, int, int]]:
        """Each chunk and its positions [start, end)."""
        ranges, pos = [], 0
        for chunk, ids in zip(self.chunks, self.piece_ids, strict=True):
            ranges.append((chunk, pos, pos + len(ids)))
            pos += len(ids)
        return ranges


def place(rendering: Rendering, chunks: list[Chunk], lead: Chunk | None) -> Placement:
    """The placement of `chunks` (part i of the rendering is chunks[i]), with `lead` standing for what
    the template writes before the first message (left out when it wrote nothing there)."""
    pieces = [list(rendering.part_ids(i)) for i in rendering.order]
    ordered, sources = [chunks[i] for i in rendering.order], list(chunks)
    lead_ids = rendering.lead_ids
    if lead is not None and lead_ids:
        ordered, pieces, sources = [lead, *ordered], [lead_ids, *pieces], [lead, *sources]
    elif lead_ids:  # no chunk stands for it: the first chunk's piece holds it
        pieces[0] = lead_ids + pieces[0]
    return Placement(ordered, pieces, rendering.tail_ids, sources)


def shared_runs(own_ids: list[int], placed_ids: list[int]) -> list[tuple[int, int, int]]:
    """Where a chunk's own ids (its kept KV) and its ids as placed agree: (own offset, placed offset,
    length) of their common head and their common tail, the runs whose KV can be moved."""
    limit = min(len(own_ids), len(placed_ids))
    head = 0
    while head < limit and own_ids[head] == placed_ids[head]:
        head += 1
    tail = 0
    while tail < limit - head and own_ids[-1 - tail] == placed_ids[-1 - tail]:
        tail += 1
    runs = [(0, 0, head)] if head else []
    if tail:
        runs.append((len(own_ids) - tail, len(placed_ids) - tail, tail))
    return runs


class ContextPlacement:
    """The ContextManager's placing of its context, as methods of its own."""

    engine: Engine
    format: ChatFormat
    tokenizer: Any
    registry: ChunkRegistry
    eos_token_ids: frozenset[int]
    system: str | None
    middle: list[str]
    turns: list[str]
    query: str | None
    _renderings: dict[tuple, Rendering]

    def placement(
        self,
        with_query: bool = True,
        turn: Chunk | None = None,
        strict: bool = True,
        turns: list[str] | None = None,
    ) -> Placement:
        """The context (with the query, or with a new user `turn` instead) as the chat template renders
        it, each chunk's ids there; `turns` in place of the conversation's (a retry answers again without
        the last pair). A chunk whose KV is not kept takes those ids as its own. Unless `strict`, a
        context the template cannot render (a system prompt alone) is shown with the chunks' own ids."""
        last = [turn.chunk_id] if turn else [self.query] if with_query and self.query else []
        turns = self.turns if turns is None else turns
        ids = ([self.system] if self.system else []) + self.middle + turns + last
        chunks = [self.registry.chunks[i] for i in ids]
        lead = None if self.system else self._template_lead()
        try:
            placement = place(self._render(chunks), chunks, lead) if chunks else None
        except ChunkError:
            if strict:
                raise
            placement = None
        if placement is None:
            listed = ([lead] if lead else []) + chunks
            return Placement(listed, [list(c.token_ids) for c in listed], [], listed)
        for chunk, piece in zip(placement.chunks, placement.piece_ids, strict=True):
            if chunk.token_ids != piece and kept_span(chunk, self.engine.blocks) is None:
                chunk.token_ids = list(piece)
        return placement

    def _render(self, chunks: list[Chunk]) -> Rendering:
        parts = [self._part(c) for c in chunks]
        key = tuple((c.chunk_id, p.role) for c, p in zip(chunks, parts, strict=True))
        rendering = self._renderings.get(key)
        if rendering is None:
            if len(self._renderings) >= _NUM_RENDERINGS_KEPT:
                self._renderings.clear()
            rendering = self._renderings[key] = self.format.render(parts)
        return rendering

    def _part(self, chunk: Chunk) -> Part:
        """A chunk as a part of the conversation: an answer is an assistant message in the turns (and
        among the context where the template takes one between user messages), else user text."""
        if chunk.role is not Role.OUTPUT:
            return Part(_TEMPLATE_ROLE[chunk.role], chunk.text)
        text = self.format.answer_text(chunk.token_ids, self.eos_token_ids)
        as_turn = chunk.chunk_id in self.turns or not self.format.layout.joins_users
        return Part("assistant" if as_turn else "user", text)

    def _template_lead(self) -> Chunk | None:
        """The chunk for what the template writes before a conversation without a system message: its
        default system prompt (Qwen2.5's), or what opens the text (a BOS, Llama 3's dated header)."""
        ids = list(self.format.lead_ids)
        if not ids:
            return None
        text = self.format.default_system_prompt or self.tokenizer.decode(ids)
        return self.registry.add(Role.SYSTEM, text, ids, is_default=True)
