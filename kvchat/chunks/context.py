"""The ContextManager: the chunks the user registered, the context the next inference sees, and the
KV kept alive for them (retained outputs and the live conversation)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvchat.chunks import describe, persist
from kvchat.chunks.budget import refuse_oversized
from kvchat.chunks.chunk import Chunk, ChunkRegistry
from kvchat.chunks.compose import NO_REPAIR, ComposedSequence, RepairPolicy
from kvchat.chunks.context_views import ContextViews
from kvchat.chunks.inference import Inference, Setup
from kvchat.chunks.placement import ContextPlacement, Placement
from kvchat.chunks.rendering import Rendering
from kvchat.chunks.reports import FidelityReport
from kvchat.chunks.retry import answer_to_retry, at_first_token, pin_again, unpin_replaced
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import (
    ChunkInfo,
    InferenceResult,
    InferenceStream,
    ReuseMode,
    Role,
)
from kvchat.chunks.verify import measure_fidelity
from kvchat.engine.block_manager import Sequence
from kvchat.engine.engine import Engine
from kvchat.engine.rope import KeyRotation, refusal
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.speculate import NO_SPECULATION, Speculation
from kvchat.errors import CacheFullError, ChunkError


class ContextManager(ContextPlacement, ContextViews):
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
        self.repair = repair or NO_REPAIR
        self.speculation = speculation or NO_SPECULATION
        self.registry = ChunkRegistry()
        self.system: str | None = None  # chunk ids
        self.middle: list[str] = []
        self.turns: list[str] = []
        self.query: str | None = None
        self.live: Sequence | None = None  # the last inference's sequence, kept for the next turn
        # Why reposition and repair cannot run on this model (its keys cannot be re-rotated), or None.
        self.move_refusal = refusal(engine.model)
        self._rotation = KeyRotation(engine.model) if self.move_refusal is None else None
        self._renderings: dict[tuple, Rendering] = {}  # by the conversation's chunk ids and roles

    # -- registering and composing -----------------------------------------------------------------

    def register(self, role: Role, text: str, unique: bool = False) -> Chunk:
        if not text.strip():
            raise ChunkError(f"empty {role.value} text")
        capacity = self.engine.capacity_tokens
        refuse_oversized(self.tokenizer, text, capacity, role.value)
        token_ids = self.format.text_ids(text)  # what identifies it; its ids in place come from the template
        if len(token_ids) >= capacity:
            raise CacheFullError(
                f"{role.value} chunk of {len(token_ids)} tokens is larger than the whole KV budget "
                f"({capacity} tokens); raise --kv-memory"
            )
        return self.registry.add(role, text, token_ids, unique=unique)

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
        if self.is_chat_answer(number):
            raise ChunkError(f"output {number} is an answer of the conversation, in the context already")
        if chunk.chunk_id not in self.middle:
            self.middle.append(chunk.chunk_id)
        return self.info(chunk.chunk_id)

    def drop(self, ref: str) -> ChunkInfo:
        chunk = self.registry.find(ref)
        if chunk.is_default:
            what = "default system prompt" if self.format.default_system_prompt else "opening"
            raise ChunkError(
                f"chunk {chunk.number} is the chat template's {what}, used while no system prompt is set; "
                "replace it with /system TEXT"
            )
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
        self.engine.blocks.reset_stats()

    def evict_cached(self) -> int:
        """Drop the KV that no chunk or sequence holds (the draft model's too), so the next prompt
        computes whatever is not kept; returns the main cache's blocks that held some."""
        draft_engine = self.speculation.draft_engine
        if draft_engine is not None:
            draft_engine.evict_cached()
        return self.engine.evict_cached()

    def is_chat_answer(self, number: int) -> bool:
        """Whether output `number` is a turn of the conversation (a /chat answer)."""
        return self.registry.output(number).chunk_id in self.turns

    def delete_output(self, number: int) -> ChunkInfo:
        chunk = self.registry.output(number)
        info = self.info(chunk.chunk_id)
        place = self.turns.index(chunk.chunk_id) if self.is_chat_answer(number) else 0
        question = self.registry.chunks[self.turns[place - 1]] if place else None
        if question is not None and question.role is Role.USER:  # it goes too: turns stay in pairs
            self._remove_from_context(question.chunk_id)
            self._delete(question)
        self._remove_from_context(chunk.chunk_id)
        self._delete(chunk)
        return info

    def context_chunks(self, with_query: bool = True) -> list[Chunk]:
        """The chunks the next inference sees, in the conversation's order; what the template writes first
        when no system prompt is set stands in explicitly."""
        return self.placement(with_query, strict=False).sources

    # -- inference ---------------------------------------------------------------------------------

    def infer(self, params: SamplingParams) -> InferenceStream:
        """Generate from the current context and query; yields steps, then the InferenceResult."""
        if self.query is None and not self.turns:
            raise ChunkError("no query to answer: set one with /query TEXT")
        return self._run(self.placement(), params)

    def chat(self, text: str, params: SamplingParams) -> InferenceStream:
        """Append a user turn, generate, and append the answer as an assistant turn."""
        turn = self.register(Role.USER, text, unique=True)
        return self._run(self.placement(turn=turn), params, turn=turn)

    def retry(self, params: SamplingParams) -> InferenceStream:
        """Generate the newest answer again from the context it came from, in its place. The run is
        composed and its room reserved first; the answer it replaces is deleted at the new answer's
        first token (its KV blocks left cached until evicted), and a chat answer's user turn stays, with
        the new answer after it. Refused or interrupted before that, the conversation is as it was."""
        ids = [c.chunk_id for c in self.context_chunks(with_query=False)]
        last, turn = answer_to_retry(self.registry, ids, self.query, self.turns)
        if turn is None:
            return self._run(self.placement(), params, replacing=last)
        assert self.turns[-2:] == [turn.chunk_id, last.chunk_id]
        placement = self.placement(turn=turn, turns=self.turns[:-2])
        return self._run(placement, params, turn=turn, replacing=last)

    def infer_blocking(self, params: SamplingParams) -> InferenceResult:
        """`infer` without streaming: the InferenceResult alone."""
        *_, result = self.infer(params)
        assert isinstance(result, InferenceResult)
        return result

    def chat_blocking(self, text: str, params: SamplingParams) -> InferenceResult:
        *_, result = self.chat(text, params)
        assert isinstance(result, InferenceResult)
        return result

    def compose(self, reserve_tokens: int = 0) -> ComposedSequence:
        """The current context's sequence as the mode composes it. The caller frees `.seq`."""
        with self._hinting(), Inference(self.setup, self.placement()) as run:
            composed = run.compose(reserve_tokens)
            run.hand_over()
        return composed

    def verify(self, num_tokens: int) -> FidelityReport:
        """Compare the reuse mode with a full recompute of the current context over `num_tokens`."""
        if self.query is None and not self.turns:
            raise ChunkError("nothing to verify: set a query with /query TEXT")
        if num_tokens < 1:
            raise ChunkError("verify needs at least 1 token to compare")
        with self._hinting(), Inference(self.setup, self.placement()) as run:
            composed = run.compose(reserve_tokens=num_tokens)
            return measure_fidelity(composed, self.engine, self.mode, self.eos_token_ids, num_tokens)

    @property
    def setup(self) -> Setup:
        return Setup(
            self.engine,
            self.format,
            self.tokenizer,
            self.eos_token_ids,
            self.mode,
            self.repair,
            self.speculation,
            self._rotation,
        )

    @contextmanager
    def _hinting(self) -> Iterator[None]:
        """A CacheFullError inside names the outputs whose deletion would make room."""
        try:
            yield
        except CacheFullError as err:
            raise CacheFullError(f"{err}. {describe.deletable_outputs(self.registry)}") from None

    def _run(
        self,
        placement: Placement,
        params: SamplingParams,
        turn: Chunk | None = None,
        replacing: Chunk | None = None,
    ) -> InferenceStream:
        """One inference, owned from composing to settling by its `with` block: whatever way it ends (an
        answer, an error, Ctrl-C anywhere, the stream closed), its blocks are kept here or given back.
        An answer `replacing` another (/retry) takes its place at its first token, not before."""
        self._release_live()  # its blocks stay cached, so the new sequence can still share them
        registry = self.registry  # replaced by a reset: an answer from before it is not kept after
        output: Chunk | None = None
        lent = unpin_replaced(replacing, self.engine.blocks) if replacing is not None else None
        replaced: list[Chunk] = []  # the answer replaced, once the new one's first token came

        def replace() -> None:
            assert replacing is not None
            self._replace(replacing, turn)
            replaced.append(replacing)

        try:
            with self._hinting(), Inference(self.setup, placement, params) as run:
                try:
                    yield from run.steps() if replacing is None else at_first_token(run.steps(), replace)
                except GeneratorExit:
                    if self.registry is registry and (replacing is None or replaced):
                        self._settle(run, turn)  # the answer so far is kept
                    raise
                if self.registry is registry and (replacing is None or replaced):
                    output = self._settle(run, turn)
        finally:
            if replacing is not None and lent is not None and not replaced:
                pin_again(replacing, lent, self.engine.blocks)
            if output is None and turn is not None and turn.chunk_id not in self.turns:
                # A turn joins only together with its answer (unless it went with a reset meanwhile).
                if self.registry.chunks.get(turn.chunk_id) is turn:
                    self.registry.remove(turn.chunk_id)
        yield run.result(output)

    def _replace(self, old: Chunk, turn: Chunk | None) -> None:
        """A retried answer's first token came: the answer it replaces goes; its user turn leaves the
        turns, to rejoin them with the new answer."""
        if turn is not None:
            self.turns.remove(turn.chunk_id)
        self._remove_from_context(old.chunk_id)
        self._delete(old)

    def _settle(self, run: Inference, turn: Chunk | None) -> Chunk | None:
        """Keep the answer: its output chunk, the spans of the chunks it computed, the live sequence.
        Ctrl-C is ignored meanwhile: the turn is ending anyway."""
        with _interrupts_ignored():
            kept = run.keep(self.registry)
            if kept is None:
                return None
            output, seq = kept
            self._release_live()
            self.live = seq
            if turn is not None:
                self.turns += [turn.chunk_id, output.chunk_id]
            return output

    # -- persistence -------------------------------------------------------------------------------

    def save(self, path: Path) -> int:
        """Write the chunks, the context and their KV to `path`; returns the number of chunks saved."""
        context = persist.Context(self.system, self.middle, self.turns, self.query)
        chunks = list(self.registry.chunks.values())
        return persist.save(self.engine, self._layout(), chunks, context, self.live, Path(path))

    def load(self, path: Path) -> int:
        """Replace the session with the one saved in `path` in one swap; returns the number of chunks.
        The whole file is checked and its KV staged beside the session first: a file refused, too big
        or interrupted changes nothing."""
        saved = persist.read(self.engine, self._layout(), Path(path))
        live, chunks = persist.stage(self.engine, saved)
        committed = False
        try:
            with _interrupts_ignored():  # the swap is bookkeeping over ints: once begun, it runs to the end
                self.reset()
                self.registry.restore(chunks)
                self.live, committed = live, True
                c = saved.context
                self.system, self.middle, self.turns, self.query = c.system, c.middle, c.turns, c.query
                if live is not None:
                    self.engine.index(live)
        finally:
            if not committed:
                persist.unstage(self.engine, live, chunks)
        return len(chunks)

    # -- internals ---------------------------------------------------------------------------------

    def _layout(self) -> dict[str, object]:
        """What a state file must match to be loaded into this session."""
        return persist.layout(self.engine, self.model_id, self.fingerprint)

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


@contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """Ignore SIGINT while the block runs: for the steps that end an operation already under way (keeping
    a cancelled turn's answer, swapping a loaded session in), where a second Ctrl-C would lose state and
    stop nothing sooner. Outside the main thread, or under a handler Python did not install, this
    changes nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
