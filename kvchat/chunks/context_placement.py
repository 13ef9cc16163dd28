"""How a ContextManager places its context with the chat template: the conversation's parts (system
prompt, passages, turns, answers, query) rendered whole, each chunk's ids cut from the rendering
(kvchat.chunks.placement), renderings kept for the conversations asked for again."""

from __future__ import annotations

from typing import Any

from kvchat.chunks.chunk import Chunk, ChunkRegistry
from kvchat.chunks.describe import kept_span
from kvchat.chunks.placement import Placement, place
from kvchat.chunks.rendering import Part, Rendering
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import Role
from kvchat.engine.engine import Engine
from kvchat.errors import ChunkError

_TEMPLATE_ROLE = {Role.SYSTEM: "system", Role.CONTEXT: "user", Role.QUERY: "user", Role.USER: "user"}
_NUM_RENDERINGS_KEPT = 16


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
