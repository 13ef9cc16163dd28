"""Random sequences of register, compose, infer, chat, verify, delete, save and load, with Ctrl-C and
failures injected at random points and two inferences interleaved, keep the cache coherent: after
every step the block manager's references are exactly what the kept chunks and the live sequence
hold, and after `reset()` every block is free. Exact mode always equals a full recompute."""

import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvchat.chunks.types import InferenceResult, ReuseMode
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import KvchatError
from tests.support.faults import fault_at
from tests.support.managers import assert_refs_match, drain_maybe, small_pool_manager, small_pool_model

pytestmark = pytest.mark.slow  # a long hypothesis state machine

TEXTS = st.lists(
    st.sampled_from("red green blue river stone cloud quick slow dog owl".split()), min_size=1, max_size=12
)
TMP = Path(tempfile.mkdtemp(prefix="kvchat-stateful-"))
# Engine entry points a fault can be injected into; _forward, _record and pool writes land mid-operation.
FAULT_POINTS = ("start", "extend", "compute", "write_kv", "gather", "_forward", "_record")
FAULTS = st.sampled_from([KeyboardInterrupt, RuntimeError])


class ContextMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cm = small_pool_manager()

    @rule(words=TEXTS)
    def add_context(self, words):
        self.cm.add_context(" ".join(words))

    @rule(words=TEXTS)
    def set_system(self, words):
        self.cm.set_system(" ".join(words))

    @rule(words=TEXTS)
    def set_query(self, words):
        self.cm.set_query(" ".join(words))

    @rule(data=st.data())
    @precondition(lambda self: self.cm.middle)
    def reorder_or_drop(self, data):
        self.cm.middle = data.draw(st.permutations(self.cm.middle))[
            : data.draw(st.integers(0, len(self.cm.middle)))
        ]

    @rule(mode=st.sampled_from(ReuseMode), max_tokens=st.integers(1, 6))
    @precondition(lambda self: self.cm.query is not None)
    def infer(self, mode, max_tokens):
        self.cm.mode = mode
        try:
            result = drain_maybe(self.cm.infer(SamplingParams(max_tokens=max_tokens)))
        except KvchatError:
            return  # a full cache is refused cleanly; the invariants still hold
        assert result is not None and result.output_number is not None
        assert sum(r.num_computed for r in result.chunks) == result.computed_tokens
        assert (
            result.reused_tokens + result.repositioned_tokens + result.computed_tokens == result.prompt_tokens
        )

    @rule(
        op=st.sampled_from(["infer", "chat", "verify", "load"]),
        mode=st.sampled_from(ReuseMode),
        at=st.integers(1, 40),
        fault=FAULTS,
    )
    def fault_injected(self, op, mode, at, fault):
        cm = self.cm
        cm.mode = mode
        path = TMP / "fault.safetensors"
        if op == "load":
            cm.save(path)
        with fault_at([(cm.engine, name) for name in FAULT_POINTS], at, fault):
            try:
                if op == "infer" and cm.query is not None:
                    drain_maybe(cm.infer(SamplingParams(max_tokens=4)))
                elif op == "chat":
                    drain_maybe(cm.chat("hello there", SamplingParams(max_tokens=4)))
                elif op == "verify" and cm.query is not None:
                    cm.verify(3)
                elif op == "load":
                    cm.load(path)
            except (KeyboardInterrupt, RuntimeError, KvchatError):
                pass

    @rule(data=st.data(), max_tokens=st.integers(1, 6), at=st.integers(1, 8))
    @precondition(lambda self: self.cm.query is not None)
    def stopped_mid_stream(self, data, max_tokens, at):
        """Ctrl-C thrown in at a yield, or the stream closed, after `at` items (a stream never started
        has taken nothing: a throw into it just raises)."""
        stream = self.cm.infer(SamplingParams(max_tokens=max_tokens))
        try:
            for _ in range(at):
                last = next(stream)
            if isinstance(last, InferenceResult):
                stream.close()  # the REPL throws Ctrl-C in only while a step is shown, never after the result
            elif data.draw(st.booleans()):
                result = drain_thrown(stream)
                assert result is None or result.finish_reason in ("cancelled", "stop", "length")
            else:
                stream.close()
        except (StopIteration, KvchatError):
            pass

    @rule(data=st.data(), mode=st.sampled_from(ReuseMode))
    @precondition(lambda self: self.cm.query is not None)
    def interleaved_streams(self, data, mode):
        self.cm.mode = mode
        streams = [
            self.cm.infer(SamplingParams(max_tokens=3)),
            self.cm.chat("and then?", SamplingParams(max_tokens=3)),
        ]
        try:
            while streams:
                stream = data.draw(st.sampled_from(streams))
                try:
                    next(stream)
                except StopIteration:
                    streams.remove(stream)
        except KvchatError:
            for stream in streams:
                stream.close()

    @rule(temperature=st.sampled_from([1e-40, 1e-30, 0.5]), min_p=st.sampled_from([0.0, 0.999, 1.0]))
    @precondition(lambda self: self.cm.query is not None)
    def extreme_sampling(self, temperature, min_p):
        try:
            drain_maybe(
                self.cm.infer(SamplingParams(temperature=temperature, min_p=min_p, max_tokens=3, seed=0))
            )
        except Exception:  # a failing inference (bad sampling values) must still leak nothing
            pass

    @rule(data=st.data())
    @precondition(lambda self: self.cm.outputs())
    def use_or_delete_output(self, data):
        number = data.draw(st.sampled_from([o.output_number for o in self.cm.outputs()]))
        if data.draw(st.booleans()):
            if self.cm.is_chat_answer(number):  # refused: it is in the conversation already
                return
            self.cm.use_output(number)
        else:
            self.cm.delete_output(number)

    @rule()
    def save_and_load(self):
        path = TMP / "state.safetensors"
        self.cm.save(path)
        fresh = small_pool_manager()
        fresh.load(path)
        assert [c.chunk_id for c in fresh.context_chunks()] == [c.chunk_id for c in self.cm.context_chunks()]
        self.cm.reset()
        self.cm = fresh

    @rule()
    def reset(self):
        self.cm.reset()
        blocks = self.cm.engine.blocks
        assert blocks.num_free == blocks.num_blocks and blocks.num_pinned == 0

    @rule()
    @precondition(lambda self: self.cm.query is not None)
    def exact_equals_full_recompute(self):
        self.cm.mode = ReuseMode.EXACT
        try:
            composed = self.cm.compose()
        except KvchatError:
            return
        logits = self.cm.engine.compute(composed.seq)
        tokens = list(composed.seq.token_ids)
        self.cm.engine.free(composed.seq)
        with torch.inference_mode():
            full = small_pool_model()(input_ids=torch.tensor([tokens])).logits[0, -1]
        assert (logits - full).abs().max() <= 1e-4

    @invariant()
    def references_are_accounted_for(self):
        assert_refs_match(self.cm)

    def teardown(self):
        self.cm.reset()
        blocks = self.cm.engine.blocks
        blocks.check_invariants()
        assert blocks.num_free == blocks.num_blocks and blocks.num_pinned == 0


def drain_thrown(stream) -> InferenceResult | None:
    """Throw KeyboardInterrupt in at the current yield, as the REPL's Ctrl-C does, and drain the rest."""
    try:
        first = stream.throw(KeyboardInterrupt)
    except StopIteration:
        return None
    rest = list(stream)
    last = (rest or [first])[-1]
    return last if isinstance(last, InferenceResult) else None


TestContextMachine = ContextMachine.TestCase
TestContextMachine.settings = settings(
    max_examples=int(os.environ.get("KVCHAT_STATEFUL_EXAMPLES", 200)),
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
