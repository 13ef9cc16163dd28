"""Chunks: every piece of text the user or the model brought in, with its token ids, where its KV is
kept (a KVSpan), and the registry that numbers them.

A span is a run of positions in blocks of the pool, computed at known positions. A pinned span holds a
reference on its blocks. An unpinned one holds none: it stays usable while its blocks were not handed
out again (their generation is unchanged), and is evicted with them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvchat.chunks.types import Role
from kvchat.engine.block_manager import BlockManager, Sequence
from kvchat.errors import ChunkError


@dataclass(frozen=True)
class KVSpan:
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    offset: int  # slot offset of the first token in block_ids[0]
    num_tokens: int
    start_pos: int  # position the KV was computed at
    exact: bool  # computed over an exactly computed prefix
    pinned: bool

    @classmethod
    def of(
        cls, blocks: BlockManager, seq: Sequence, start: int, end: int, exact: bool, pinned: bool
    ) -> KVSpan:
        block_ids = tuple(seq.blocks_covering(start, end))
        span = cls(
            block_ids,
            tuple(blocks.generation(b) for b in block_ids),
            start % seq.block_size,
            end - start,
            start,
            exact,
            pinned,
        )
        if pinned:
            blocks.pin(list(block_ids))
        return span

    def is_valid(self, blocks: BlockManager) -> bool:
        return all(blocks.generation(b) == g for b, g in zip(self.block_ids, self.generations, strict=True))

    def slots(self, block_size: int) -> list[int]:
        return [
            self.block_ids[(self.offset + i) // block_size] * block_size + (self.offset + i) % block_size
            for i in range(self.num_tokens)
        ]

    def release(self, blocks: BlockManager) -> None:
        if self.pinned:
            blocks.unpin(list(self.block_ids))


def chunk_id_of(role: Role, token_ids: list[int], salt: int = 0) -> str:
    """A short stable id from the role and the token ids (what the model sees); `salt` tells apart
    chunks that must stay distinct although their tokens are equal (two equal answers)."""
    h = hashlib.blake2b(digest_size=5)
    h.update(role.value.encode() + (f"#{salt}".encode() if salt else b""))
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.hexdigest()


@dataclass
class Chunk:
    chunk_id: str
    number: int
    role: Role
    text: str
    token_ids: list[int]
    span: KVSpan | None = None
    output_number: int | None = None
    had_think: bool = False
    source_ids: tuple[str, ...] = ()  # for outputs: the context they were generated from
    is_default: bool = False  # a system prompt the chat template would have inserted
    finish_reason: str | None = None  # for outputs: why generation ended ("length", "cancelled": cut short)


@dataclass
class ChunkRegistry:
    chunks: dict[str, Chunk] = field(default_factory=dict)
    _next_number: int = 1
    _next_output: int = 1

    def add(self, role: Role, text: str, token_ids: list[int], unique: bool = False, **extra) -> Chunk:
        """Register a chunk; the same role and tokens return the chunk already there, unless `unique`
        (a conversation turn: each is its own chunk, even when its text repeats an earlier one)."""
        chunk_id = chunk_id_of(role, token_ids, salt=self._next_number if unique else 0)
        if chunk_id in self.chunks:
            return self.chunks[chunk_id]
        return self._new(chunk_id, role, text, token_ids, **extra)

    def add_output(self, text: str, token_ids: list[int], **extra) -> Chunk:
        """Register an answer: always a new chunk with the next output number."""
        self._next_output += 1
        return self.add(
            Role.OUTPUT, text, token_ids, unique=True, output_number=self._next_output - 1, **extra
        )

    def restore(self, chunks: list[Chunk]) -> None:
        """Take the chunks of a saved session; numbering goes on after theirs."""
        self.chunks = {c.chunk_id: c for c in chunks}
        self._next_number = max((c.number for c in chunks), default=0) + 1
        self._next_output = max((c.output_number or 0 for c in chunks), default=0) + 1

    def _new(self, chunk_id: str, role: Role, text: str, token_ids: list[int], **extra) -> Chunk:
        assert chunk_id not in self.chunks
        chunk = Chunk(chunk_id, self._next_number, role, text, list(token_ids), **extra)
        self._next_number += 1
        self.chunks[chunk_id] = chunk
        return chunk

    def find(self, ref: str) -> Chunk:
        """A chunk by its number or a unique prefix of its id."""
        ref = ref.strip()
        if ref.isdigit():
            for chunk in self.chunks.values():
                if chunk.number == int(ref):
                    return chunk
            raise ChunkError(f"no chunk number {ref} (see /chunks)")
        matches = [c for c in self.chunks.values() if c.chunk_id.startswith(ref)] if ref else []
        if len(matches) != 1:
            raise ChunkError(f"no chunk with id {ref!r}" if not matches else f"chunk id {ref!r} is ambiguous")
        return matches[0]

    def output(self, number: int) -> Chunk:
        for chunk in self.chunks.values():
            if chunk.output_number == number:
                return chunk
        known = sorted(c.output_number for c in self.chunks.values() if c.output_number is not None)
        raise ChunkError(
            f"no output {number}" + (f" (outputs: {', '.join(map(str, known))})" if known else "")
        )

    def outputs(self) -> list[Chunk]:
        numbered = {c.output_number: c for c in self.chunks.values() if c.output_number is not None}
        return [numbered[n] for n in sorted(numbered)]

    def remove(self, chunk_id: str) -> Chunk:
        return self.chunks.pop(chunk_id)
