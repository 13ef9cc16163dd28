"""The ContextManager: the chunks the user registered, the context the next inference sees, and the
KV kept alive for them (retained outputs and the live conversation)."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

from kvchat.chunks import inference, persist
from kvchat.chunks.compose import RepairPolicy, chunk_ranges
from kvchat.chunks.registry import Chunk, ChunkRegistry
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import (
    CacheStats,
    ChunkDetail,
    ChunkInfo,
    FidelityReport,
    InferenceResult,
    ReuseMode,
    Role,
    StepEvent,
)
from kvchat.engine.engine import Engine
from kvchat.engine.generate import PrefillProgress
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.sequence import Sequence
from kvchat.engine.speculate import Speculation
from kvchat.errors import CacheFullError, ChunkError

InferenceStream = Generator[PrefillProgress | StepEvent | InferenceResult, None, None]

_TEMPLATE_ROLE = {
    Role.SYSTEM: "system",
    Role.CONTEXT: "user",
    Role.QUERY: "user",
    Role.USER: "user",
}


class ContextManager:
    """Keeps chunks, composes the context (system, context and outputs, turns, query) and runs it."""

    def __init__(
        self,
        engine: Engine,
        chat_format: ChatFormat,
        tokenizer,
        eos_token_ids: frozenset[int],
        *,
        model_id: str = "",
        fingerprint: str = "",
        mode: ReuseMode = ReuseMode.EXACT,
        repair: RepairPolicy | None = None,
        speculation: Speculation | None = None,
    ):
        self.engine, self.format, self.tokenizer = engine, chat_format, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids) | (
            {chat_format.end_of_turn_id} if chat_format.end_of_turn_id is not None else set()
        )
        self.model_id, self.fingerprint = model_id, fingerprint
        self.mode = ReuseMode(mode)
        self.repair = repair or RepairPolicy()
        self.speculation = speculation or Speculation()
        self.registry = ChunkRegistry()
        self.system: str | None = None  # chunk ids
        self.middle: list[str] = []
        self.turns: list[str] = []
        self.query: str | None = None
        self.live: Sequence | None = None  # the last inference's sequence, kept for the next turn

    # -- registering and composing -----------------------------------------------------------------

    def register(self, role: Role, text: str) -> Chunk:
        if not text.strip():
            raise ChunkError(f"empty {role.value} text")
        token_ids = self.format.segment_ids(_TEMPLATE_ROLE[role], text)
        capacity = self.engine.blocks.num_blocks * self.engine.block_size
        if len(token_ids) >= capacity:
            raise CacheFullError(
                f"{role.value} chunk of {len(token_ids)} tokens is larger than the whole KV budget "
                f"({capacity} tokens); raise --kv-memory"
            )
        return self.registry.add(role, text, token_ids)

    def set_system(self, text: str) -> ChunkInfo:
        self.system = self.register(Role.SYSTEM, text).chunk_id
        return self.info(self.system)

    def add_context(self, text: str) -> ChunkInfo:
        chunk = self.register(Role.CONTEXT, text)
        if chunk.chunk_id not in self.middle:
            self.middle.append(chunk.chunk_id)
        return self.info(chunk.chunk_id)

    def set_query(self, text: str) -> ChunkInfo:
        self.query = self.register(Role.QUERY, text).chunk_id
        return self.info(self.query)

    def use_output(self, number: int) -> ChunkInfo:
        chunk = self.registry.output(number)
        if chunk.chunk_id not in self.middle:
            self.middle.append(chunk.chunk_id)
        return self.info(chunk.chunk_id)

    def drop(self, ref: str) -> ChunkInfo:
        chunk = self.registry.find(ref)
        if not self._remove_from_context(chunk.chunk_id):
            raise ChunkError(f"chunk {chunk.number} is not in the context")
        return self.info(chunk.chunk_id)

    def clear(self) -> None:
        self.system, self.middle, self.turns, self.query = None, [], [], None
        self._release_live()

    def reset(self) -> None:
        self.clear()
        for chunk in list(self.registry.chunks.values()):
            self._delete(chunk)
        self.registry = ChunkRegistry()

    def delete_output(self, number: int) -> ChunkInfo:
        chunk = self.registry.output(number)
        info = self.info(chunk.chunk_id)
        self._remove_from_context(chunk.chunk_id)
        self._delete(chunk)
        return info

    def context_chunks(self, with_query: bool = True) -> list[Chunk]:
        """The chunks the next inference sees, in order; the template's default system prompt
        stands in explicitly when none is set."""
        ids = [self.system] if self.system else []
        if not ids and self.format.default_system_prompt:
            default = self.registry.add(
                Role.SYSTEM,
                self.format.default_system_prompt,
                self.format.segment_ids("system", self.format.default_system_prompt),
                is_default=True,
            )
            ids = [default.chunk_id]
        ids += self.middle + self.turns + ([self.query] if with_query and self.query else [])
        return [self.registry.chunks[i] for i in ids]

    # -- inference ---------------------------------------------------------------------------------

    def infer(self, params: SamplingParams) -> InferenceStream:
        """Generate from the current context and query; yields steps, then the InferenceResult."""
        if self.query is None and not self.turns:
            raise ChunkError("no query to answer: set one with /query TEXT")
        return inference.run(self, self.context_chunks(), params)

    def chat(self, text: str, params: SamplingParams) -> InferenceStream:
        """Append a user turn, generate, and append the answer as an assistant turn."""
        turn = self.register(Role.USER, text)
        chunks = self.context_chunks(with_query=False) + [turn]
        return inference.run(self, chunks, params, turn=turn)  # the turn joins the context with its answer

    def infer_blocking(self, params: SamplingParams) -> InferenceResult:
        """`infer` without streaming: the InferenceResult alone."""
        *_, result = self.infer(params)
        assert isinstance(result, InferenceResult)
        return result

    def chat_blocking(self, text: str, params: SamplingParams) -> InferenceResult:
        *_, result = self.chat(text, params)
        assert isinstance(result, InferenceResult)
        return result

    def verify(self, num_tokens: int = 16) -> FidelityReport:
        from kvchat.chunks.fidelity import verify

        return verify(self, num_tokens)

    # -- views -------------------------------------------------------------------------------------

    def info(self, chunk_id: str) -> ChunkInfo:
        chunk = self.registry.chunks[chunk_id]
        placed = [c.chunk_id for c in self.context_chunks()]
        span = chunk.span if chunk.span and chunk.span.is_valid(self.engine.blocks) else None
        blocks = self.engine.blocks.blocks
        return ChunkInfo(
            number=chunk.number,
            chunk_id=chunk.chunk_id,
            role=chunk.role,
            text=chunk.text,
            num_tokens=len(chunk.token_ids),
            num_blocks=len(span.block_ids) if span else 0,
            num_refs=max((blocks[b].ref_count for b in span.block_ids), default=0) if span else 0,
            place=placed.index(chunk_id) + 1 if chunk_id in placed else None,
            pinned=bool(span and span.pinned),
            output_number=chunk.output_number,
        )

    def chunks(self) -> list[ChunkInfo]:
        return [self.info(i) for i in self.registry.chunks]

    def context(self) -> list[ChunkInfo]:
        return [self.info(c.chunk_id) for c in self.context_chunks()]

    def outputs(self) -> list[ChunkInfo]:
        return [self.info(c.chunk_id) for c in self.registry.outputs()]

    def chunk(self, ref: str) -> ChunkDetail:
        chunk = self.registry.find(ref)
        positions = next((range(s, e) for c, s, e in chunk_ranges(self.context_chunks()) if c is chunk), None)
        span = chunk.span if chunk.span and chunk.span.is_valid(self.engine.blocks) else None
        return ChunkDetail(
            info=self.info(chunk.chunk_id),
            token_ids=list(chunk.token_ids),
            positions=positions,
            kv_positions=range(span.start_pos, span.start_pos + span.num_tokens) if span else None,
            block_ids=list(span.block_ids) if span else [],
            had_think=chunk.had_think,
            source=" ".join(chunk.source_ids) or None,
        )

    def stats(self) -> CacheStats:
        blocks = self.engine.blocks
        return CacheStats(
            num_blocks=blocks.num_blocks,
            num_used=blocks.num_used,
            num_pinned=blocks.num_pinned,
            num_cached=blocks.num_cached,
            num_free=blocks.num_free - blocks.num_cached,
            block_size=blocks.block_size,
            bytes_total=blocks.num_blocks * self.engine.bytes_per_block,
            bytes_per_block=self.engine.bytes_per_block,
            hit_tokens=blocks.hit_tokens,
            lookup_tokens=blocks.lookup_tokens,
        )

    # -- persistence -------------------------------------------------------------------------------

    def save(self, path: Path) -> int:
        return persist.save(self, Path(path))

    def load(self, path: Path) -> int:
        return persist.load(self, Path(path))

    # -- internals ---------------------------------------------------------------------------------

    def _remove_from_context(self, chunk_id: str) -> bool:
        found = chunk_id in self.middle or chunk_id in self.turns or chunk_id in (self.system, self.query)
        self.middle = [i for i in self.middle if i != chunk_id]
        self.turns = [i for i in self.turns if i != chunk_id]
        if self.system == chunk_id:
            self.system = None
        if self.query == chunk_id:
            self.query = None
        return found

    def _delete(self, chunk: Chunk) -> None:
        if chunk.span is not None:
            chunk.span.release(self.engine.blocks)
        self.registry.remove(chunk.chunk_id)

    def _release_live(self) -> None:
        if self.live is not None:
            self.engine.free(self.live)
            self.live = None
