"""Random sequences of register, compose, infer, delete, save and load keep the cache coherent, and
exact mode always equals a full recompute."""

import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvchat.chunks.context import ContextManager
from kvchat.chunks.inference import build
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import ReuseMode
from kvchat.engine.engine import Engine
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import KvchatError
from tests.hf_tokenizers import load_smollm2_tokenizer
from tests.tiny_models import make_tiny_model

MODEL = make_tiny_model("qwen2", vocab_size=49152, seed=1)
TEXTS = st.lists(
    st.sampled_from("red green blue river stone cloud quick slow dog owl".split()), min_size=1, max_size=12
)
TMP = Path(tempfile.mkdtemp(prefix="kvchat-stateful-"))


def new_manager() -> ContextManager:
    tokenizer = load_smollm2_tokenizer()
    block_bytes = Engine(MODEL, kv_memory_bytes=1 << 20, block_size=4).bytes_per_block
    engine = Engine(MODEL, kv_memory_bytes=block_bytes * 96, block_size=4, prefill_chunk=8)
    return ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({2}), fingerprint="tiny")


class ContextMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cm = new_manager()

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
            *_, result = self.cm.infer(SamplingParams(max_tokens=max_tokens))
        except KvchatError:
            return  # a full cache is refused cleanly; the invariants still hold
        assert (
            result.reused_tokens + result.repositioned_tokens + result.computed_tokens == result.prompt_tokens
        )

    @rule(data=st.data())
    @precondition(lambda self: self.cm.outputs())
    def use_or_delete_output(self, data):
        number = data.draw(st.sampled_from([o.output_number for o in self.cm.outputs()]))
        if data.draw(st.booleans()):
            self.cm.use_output(number)
        else:
            self.cm.delete_output(number)

    @rule()
    def save_and_load(self):
        path = TMP / "state.safetensors"
        self.cm.save(path)
        fresh = new_manager()
        fresh.load(path)
        assert [c.chunk_id for c in fresh.context_chunks()] == [c.chunk_id for c in self.cm.context_chunks()]
        self.cm.reset()
        self.cm = fresh

    @rule()
    @precondition(lambda self: self.cm.query is not None)
    def exact_equals_full_recompute(self):
        self.cm.mode = ReuseMode.EXACT
        try:
            composed = build(self.cm, self.cm.context_chunks(), release_live=False)
        except KvchatError:
            return
        logits = self.cm.engine.compute(composed.seq)
        tokens = list(composed.seq.token_ids)
        self.cm.engine.free(composed.seq)
        with torch.inference_mode():
            full = MODEL(input_ids=torch.tensor([tokens])).logits[0, -1]
        assert (logits - full).abs().max() <= 1e-4

    @invariant()
    def bookkeeping_is_coherent(self):
        self.cm.engine.blocks.check_invariants()

    def teardown(self):
        self.cm.reset()
        blocks = self.cm.engine.blocks
        blocks.check_invariants()
        assert blocks.num_free == blocks.num_blocks and blocks.num_pinned == 0


TestContextMachine = ContextMachine.TestCase
TestContextMachine.settings = settings(
    max_examples=25, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
)
