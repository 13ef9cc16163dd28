"""What a ContextManager tells about itself: the records of /chunks, /show, /stats and /info, and the
read API the cache views use (a snapshot of its state, a prefix's KV). Reads only: nothing here
changes the chunks, the context or the blocks, except that reading the context registers what the
template writes first (its default system prompt, or a BOS) when no system prompt is set."""

from __future__ import annotations

from abc import abstractmethod
from collections import Counter
from typing import Any

import torch

from kvchat.chunks import describe
from kvchat.chunks.chunk import Chunk, ChunkRegistry
from kvchat.chunks.placement import Placement
from kvchat.chunks.prefix_kv import read_prefix_kv
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import CacheStats, ChunkDetail, ChunkInfo
from kvchat.chunks.view_state import ViewState, make_view_state
from kvchat.engine.block_manager import Sequence
from kvchat.engine.engine import Engine
from kvchat.models.device import describe_runtime
from kvchat.models.info import ModelInfo


class ContextViews:
    """The ContextManager's reads, as methods of its own (it is the one class that takes them)."""

    engine: Engine
    format: ChatFormat
    tokenizer: Any  # a transformers tokenizer
    model_id: str
    registry: ChunkRegistry
    query: str | None
    turns: list[str]
    live: Sequence | None

    @abstractmethod  # the ContextManager's: what composes the context is not a read
    def context_chunks(self, with_query: bool = True) -> list[Chunk]: ...

    @abstractmethod
    def placement(
        self, with_query: bool = True, turn: Chunk | None = None, strict: bool = True
    ) -> Placement: ...

    def held_blocks(self) -> Counter[int]:
        """The references this manager holds on each block: the live sequence's and the pinned spans'."""
        held: Counter[int] = Counter(self.live.block_table if self.live else [])
        for chunk in self.registry.chunks.values():
            if chunk.span is not None and chunk.span.pinned:
                held.update(chunk.span.block_ids)
        return held

    def info(self, chunk_id: str) -> ChunkInfo:
        placed = [c.chunk_id for c in self.context_chunks()]
        place = placed.index(chunk_id) + 1 if chunk_id in placed else None
        return describe.chunk_info(self.registry.chunks[chunk_id], self.engine.blocks, place)

    def chunks(self) -> list[ChunkInfo]:
        self.context_chunks()  # registers what the template writes first, before the registry is walked
        return [self.info(i) for i in list(self.registry.chunks)]

    def context(self) -> list[ChunkInfo]:
        return [self.info(c.chunk_id) for c in self.context_chunks()]

    def outputs(self) -> list[ChunkInfo]:
        return [self.info(c.chunk_id) for c in self.registry.outputs()]

    def chunk(self, ref: str) -> ChunkDetail:
        chunk = self.registry.find(ref)
        positions = next((range(s, e) for c, s, e in self.placement(strict=False).ranges if c is chunk), None)
        return describe.chunk_detail(self.info(chunk.chunk_id), chunk, self.engine.blocks, positions)

    def resolved_settings(self) -> dict[str, str]:
        """What the model settings resolved to: `{"model.dtype": "bf16", ...}` (`auto` made concrete)."""
        return describe_runtime(self.model_id, self.engine.dtype, self.engine.device)

    def stats(self) -> CacheStats:
        return describe.cache_stats(self.engine.blocks, self.engine.bytes_per_block)

    def model_info(self) -> ModelInfo:
        """The model, its chat template and the KV budget (for `/info`)."""
        refusal = getattr(self, "move_refusal", None)
        return describe.model_summary(self.engine, self.tokenizer, self.format, self.model_id, refusal)

    def view_state(self, with_context: bool = False) -> ViewState:
        """A copy of what /blocks, /attention and /compare read: chunks, live sequence, blocks, and
        `with_context` the context (which registers the template's default system prompt if none is set)."""
        return make_view_state(
            self.engine.blocks,
            list(self.registry.chunks.values()),
            self.context_chunks() if with_context else [],
            self.live,
            can_answer=self.query is not None or bool(self.turns),
            format_ids=(self.format.generation_prompt_ids, self.format.assistant_close_ids),
        )

    def read_prefix_kv(self, token_ids: list[int], end: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """K/V (L, end, H, D) of the first `end` of `token_ids`, and whether it is the live sequence's (the
        KV the last inference used, moved KV included); otherwise exact KV, computed and freed again."""
        return read_prefix_kv(self.engine, self.live, token_ids, end)

    @property
    def model(self):
        """The transformers model the engine runs, for views that run their own forward."""
        return self.engine.model
