"""Qwen3 thinking through the whole stack: a tiny Qwen3 with the real Qwen tokenizer, its logits
steered to emit a scripted answer with a <think> span."""

import torch

from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import InferenceResult, StepEvent
from kvchat.engine.engine import Engine
from kvchat.engine.sampling import SamplingParams
from tests.tiny_models import make_tiny_model
from tests.tokenizers import load_qwen3_tokenizer

THINK, END_THINK, IM_END = 151667, 151668, 151645


class ScriptedModel(torch.nn.Module):
    """A real model whose next token at each position after the prompt is forced to the script's."""

    def __init__(self, model, script: list[int]):
        super().__init__()
        self.inner, self.config, self.model, self.script = model, model.config, model.model, script
        self.prompt_len = 0

    def forward(self, input_ids, position_ids, **kwargs):
        out = self.inner(input_ids=input_ids, position_ids=position_ids, **kwargs)
        k = int(position_ids[0, -1]) + 1 - self.prompt_len
        if 0 <= k < len(self.script):
            out.logits[0, -1] = float("-inf")
            out.logits[0, -1, self.script[k]] = 0.0
        return out


def test_think_spans_stream_apart_leave_the_text_and_stay_in_the_kv():
    tokenizer = load_qwen3_tokenizer()
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    script = [THINK, *encode("The user greets me."), END_THINK, *encode("\n\nHello there!"), IM_END]
    model = ScriptedModel(make_tiny_model("qwen3", vocab_size=len(tokenizer)), script)
    engine = Engine(model, kv_memory_bytes=1 << 24, block_size=8)
    cm = ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({IM_END, 151643}))
    cm.set_query("Hi!")
    model.prompt_len = sum(len(c.token_ids) for c in cm.context_chunks()) + len(
        cm.format.generation_prompt_ids()
    )
    *steps, result = cm.infer(SamplingParams(max_tokens=40))
    assert isinstance(result, InferenceResult) and result.finish_reason == "stop"
    events = [s for s in steps if isinstance(s, StepEvent)]
    assert "".join(e.thinking for e in events) == "The user greets me."
    assert "".join(e.text for e in events) == "\n\nHello there!"
    assert result.text == "Hello there!" and result.had_think
    output = cm.registry.output(result.output_number)
    assert THINK in output.token_ids and END_THINK in output.token_ids  # the KV keeps the span
    assert output.span is not None and output.span.num_tokens == len(output.token_ids)
