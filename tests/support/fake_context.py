"""A ContextManager fake for CLI tests: pure Python, queued responses, the same records and errors.

`FakeContextManager(responses=["Hi!"])` answers the next inference with "Hi!" streamed word by word;
`Response("text", interrupt_at=2)` simulates a Ctrl-C that reaches the generator while it computes the
third step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator
from dataclasses import dataclass, replace
from pathlib import Path

from kvchat.chunks.compose import NO_REPAIR
from kvchat.chunks.contract import ContextManagerContract
from kvchat.chunks.reports import FidelityReport
from kvchat.chunks.types import (
    CacheStats,
    ChunkDetail,
    ChunkInfo,
    ChunkReport,
    InferenceResult,
    ReuseMode,
    Role,
)
from kvchat.engine.records import GenerationStats, GenerationStep
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.speculate import NO_SPECULATION
from kvchat.errors import ChunkError, StateFileError
from kvchat.models.info import ModelInfo

BLOCK_SIZE = 4
NUM_BLOCKS = 64

Stream = Generator[GenerationStep | InferenceResult, None, None]


def fake_step(text: str, thinking: str, token_id: int, num_generated: int) -> GenerationStep:
    """A streamed step with no cost figures."""
    return GenerationStep(token_id, text, thinking, None, GenerationStats(0, 0, 0, num_generated, 0, 0, 0))


@dataclass(frozen=True)
class Response:
    text: str
    thinking: str = ""
    interrupt_at: int | None = None  # step at which a Ctrl-C reaches the generator itself


@dataclass
class _Chunk:
    info: ChunkInfo
    token_ids: list[int]


class FakeContextManager(ContextManagerContract):
    """Implements the ContextManager contract over words instead of tokens."""

    def __init__(self, responses: list[str | Response] | None = None, model_id: str = "fake/model") -> None:
        self.model_id = model_id
        self.mode = ReuseMode.EXACT
        self.repair = NO_REPAIR
        self.speculation = NO_SPECULATION
        self.responses: list[Response] = []
        self.queue(*responses or [])
        self.params_seen: list[SamplingParams] = []
        self._chunks: dict[str, _Chunk] = {}  # id -> chunk, in registration order
        self._context: list[str] = []
        self._system: str | None = None
        self._query: str | None = None
        self._outputs: dict[int, str] = {}
        self._num_outputs = 0
        self._hits = 0
        self._lookups = 0

    def queue(self, *responses: str | Response) -> None:
        self.responses.extend(r if isinstance(r, Response) else Response(r) for r in responses)

    def state(self) -> tuple:
        """Everything a command could change, to check that bad input changed nothing."""
        return (
            self.mode,
            dict(self._chunks),
            list(self._context),
            self._system,
            self._query,
            dict(self._outputs),
        )

    # -- chunks -----------------------------------------------------------------------------------

    def _register(
        self, role: Role, text: str, output_number: int | None = None, finish_reason: str | None = None
    ) -> ChunkInfo:
        if not text.strip():
            raise ChunkError(f"empty {role} text")
        chunk_id = hashlib.sha1(f"{role}:{text}".encode()).hexdigest()[:8]
        token_ids = [hash(word) % 1000 for word in text.split()]
        num_blocks = -(-len(token_ids) // BLOCK_SIZE)
        info = ChunkInfo(
            len(self._chunks) + 1, chunk_id, role, text, len(token_ids), num_blocks, 1, None, False
        )
        info = replace(info, output_number=output_number, finish_reason=finish_reason)
        if chunk_id in self._chunks:
            info = self._chunks[chunk_id].info
        self._chunks[chunk_id] = _Chunk(info, token_ids)
        return self._info(chunk_id)

    def _info(self, chunk_id: str) -> ChunkInfo:
        info = self._chunks[chunk_id].info
        place = self._context.index(chunk_id) + 1 if chunk_id in self._context else None
        return replace(info, place=place, pinned=chunk_id == self._system)

    def _find(self, ref: str) -> str:
        for chunk_id, chunk in self._chunks.items():
            if ref == str(chunk.info.number) or chunk_id.startswith(ref):
                return chunk_id
        raise ChunkError(f"no chunk {ref!r}")

    def set_system(self, text: str) -> ChunkInfo:
        info = self._register(Role.SYSTEM, text)
        self._context = [c for c in self._context if c != self._system]
        self._system = info.chunk_id
        self._context.insert(0, info.chunk_id)
        return self._info(info.chunk_id)

    def add_context(self, text: str) -> ChunkInfo:
        info = self._register(Role.CONTEXT, text)
        if info.chunk_id not in self._context:
            self._context.append(info.chunk_id)
        return self._info(info.chunk_id)

    def set_query(self, text: str) -> ChunkInfo:
        info = self._register(Role.QUERY, text)
        self._query = info.chunk_id
        return info

    def use_output(self, number: int) -> ChunkInfo:
        if number not in self._outputs:
            raise ChunkError(f"no output {number}")
        self._context.append(self._outputs[number])
        return self._info(self._outputs[number])

    def drop(self, ref: str) -> ChunkInfo:
        chunk_id = self._find(ref)
        if chunk_id not in self._context:
            raise ChunkError(f"chunk {ref} is not in the context")
        self._context.remove(chunk_id)
        return self._info(chunk_id)

    def clear(self) -> None:
        self._context.clear()
        self._system = self._query = None

    def reset(self) -> None:
        self._chunks.clear()
        self._outputs.clear()
        self._num_outputs = 0
        self._hits = self._lookups = 0
        self.clear()

    def evict_cached(self) -> int:
        return 0  # the fake keeps no KV beyond its chunks

    def chunks(self) -> list[ChunkInfo]:
        return [self._info(chunk_id) for chunk_id in self._chunks]

    def chunk(self, ref: str) -> ChunkDetail:
        chunk_id = self._find(ref)
        chunk = self._chunks[chunk_id]
        start = (
            sum(self._chunks[c].info.num_tokens for c in self._context[: self._context.index(chunk_id)])
            if chunk_id in self._context
            else None
        )
        positions = range(start, start + chunk.info.num_tokens) if start is not None else None
        return ChunkDetail(self._info(chunk_id), chunk.token_ids, positions, positions, [1, 2, 3, 7])

    def context(self) -> list[ChunkInfo]:
        return [self._info(chunk_id) for chunk_id in self._context]

    def outputs(self) -> list[ChunkInfo]:
        return [self._info(chunk_id) for chunk_id in self._outputs.values()]

    def is_chat_answer(self, number: int) -> bool:
        return False

    def delete_output(self, number: int) -> ChunkInfo:
        if number not in self._outputs:
            raise ChunkError(f"no output {number}")
        chunk_id = self._outputs.pop(number)
        info = self._info(chunk_id)
        if chunk_id in self._context:
            self._context.remove(chunk_id)
        del self._chunks[chunk_id]
        return info

    # -- inference --------------------------------------------------------------------------------

    def infer(self, params: SamplingParams) -> Stream:
        if self._query is None:
            raise ChunkError("no query: set one with /query")
        return self._generate(params, [*self._context, self._query])

    def chat(self, text: str, params: SamplingParams) -> Stream:
        turn = self._register(Role.USER, text)
        self._context.append(turn.chunk_id)
        return self._generate(params, list(self._context))

    def retry(self, params: SamplingParams) -> Stream:
        if not self._outputs:
            raise ChunkError("nothing to retry: no answer yet")
        self.delete_output(max(self._outputs))
        last = self._chunks[self._context[-1]].info if self._context else None
        was_chat = last is not None and last.role == Role.USER
        return self._generate(params, list(self._context) if was_chat else [*self._context, self._query])

    def _generate(self, params: SamplingParams, context: list[str]) -> Stream:
        self.params_seen.append(params)
        response = self.responses.pop(0) if self.responses else Response("ok")
        words = response.text.split(" ")[: params.max_tokens]
        kept: list[str] = []
        finish = "stop" if len(words) == len(response.text.split(" ")) else "length"
        if response.thinking:
            yield fake_step("", response.thinking, 0, 0)
        try:
            for step, word in enumerate(words):
                if step == response.interrupt_at:
                    raise KeyboardInterrupt  # Ctrl-C while "computing": caught here, as the contract says
                delta = word if step == 0 else " " + word
                kept.append(delta)
                yield fake_step(delta, "", step, step + 1)
        except KeyboardInterrupt:
            finish = "cancelled"
        yield self._finish("".join(kept), finish, context)

    def _finish(self, text: str, finish: str, context: list[str]) -> InferenceResult:
        reports = [self._report(chunk_id, last=i == len(context) - 1) for i, chunk_id in enumerate(context)]
        number = self._num_outputs = self._num_outputs + 1  # a deleted output's number is not used again
        output = self._register(Role.OUTPUT, text or "(empty)", output_number=number, finish_reason=finish)
        self._outputs[number] = output.chunk_id
        prompt = sum(r.num_tokens for r in reports)
        reused = sum(r.num_reused for r in reports)
        self._hits, self._lookups = self._hits + reused, self._lookups + prompt
        ids = list(range(len(text.split())))
        counts = (prompt, reused, 0, prompt - reused, 0.05, 100.0, 20.0)
        return InferenceResult(text, ids, finish, number, output.chunk_id, self.mode, *counts, reports)

    def _report(self, chunk_id: str, last: bool) -> ChunkReport:
        info = self._chunks[chunk_id].info
        reused = 0 if last else info.num_tokens
        return ChunkReport(chunk_id, info.role, info.num_tokens, reused, 0, info.num_tokens - reused)

    # -- the rest ---------------------------------------------------------------------------------

    def verify(self, num_tokens: int) -> FidelityReport:
        return FidelityReport(
            mode=self.mode,
            first_difference=0,
            kl_divergence=0.001,
            top1_agree=True,
            top5_overlap=5,
            max_logit_diff=0.02,
            greedy_agree=num_tokens,
            greedy_tokens=num_tokens,
            top1_rate=1.0,
            reused_tokens=10,
            repositioned_tokens=0,
            computed_tokens=2,
        )

    def resolved_settings(self) -> dict[str, str]:
        return {
            "model.model": self.model_id,
            "model.dtype": "fp32",
            "model.device": "cpu",
            "model.threads": "1",
        }

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            self.model_id,
            "llama",
            "LlamaForCausalLM",
            1_000_000,
            "fp32",
            2048,
            "ChatML (the tokenizer's own)",
            None,
            NUM_BLOCKS * BLOCK_SIZE,
            NUM_BLOCKS * 4096,
            BLOCK_SIZE,
            "cpu",
            1,
        )

    def stats(self) -> CacheStats:
        used = sum(c.info.num_blocks for c in self._chunks.values())
        pinned, free = (1 if self._system else 0), NUM_BLOCKS - used
        sizes = (BLOCK_SIZE, NUM_BLOCKS * 4096, 4096)
        return CacheStats(NUM_BLOCKS, used, pinned, 0, free, *sizes, self._hits, self._lookups)

    def save(self, path: Path) -> int:
        path.write_text("\n".join(c.info.text for c in self._chunks.values()), encoding="utf-8")
        return len(self._chunks)

    def load(self, path: Path) -> int:
        lines = path.read_text(encoding="utf-8").splitlines()
        if not lines:
            raise StateFileError(f"{path} holds no kvchat state")
        for line in lines:
            self.add_context(line)
        return len(lines)
