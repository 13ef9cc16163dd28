"""Qwen through the whole stack: tiny Qwen2/Qwen3 models with the real Qwen tokenizer and templates."""

import torch

from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import InferenceResult, Role
from kvchat.engine.engine import Engine
from kvchat.engine.forward_cache import cache_argument
from kvchat.engine.records import GenerationStep
from kvchat.engine.sampling import SamplingParams
from tests.support.hf_tokenizers import (
    BOS_CHATML_TEMPLATE,
    TemplateOverride,
    load_qwen3_tokenizer,
    load_qwen25_tokenizer,
)
from tests.support.tiny_models import make_tiny_model

THINK, END_THINK, IM_END = 151667, 151668, 151645


class ScriptedModel(torch.nn.Module):
    """A real model whose next token at each position after the prompt is forced to the script's."""

    def __init__(self, model, script: list[int]):
        super().__init__()
        self.inner, self.config, self.model, self.script = model, model.config, model.model, script
        self.prompt_len = 0

    def forward(self, input_ids, position_ids, cache=None, **kwargs):
        cache_kwarg = cache_argument(self.inner, cache)
        out = self.inner(input_ids=input_ids, position_ids=position_ids, **cache_kwarg, **kwargs)
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
    engine = Engine(model, kv_memory_bytes=1 << 24, block_size=8, prefill_chunk=512)
    cm = ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({IM_END, 151643}))
    cm.set_query("Hi!")
    model.prompt_len = sum(len(c.token_ids) for c in cm.context_chunks()) + len(
        cm.format.generation_prompt_ids
    )
    *steps, result = cm.infer(SamplingParams(max_tokens=40))
    assert isinstance(result, InferenceResult) and result.finish_reason == "stop"
    events = [s for s in steps if isinstance(s, GenerationStep)]
    assert "".join(e.thinking for e in events) == "The user greets me."
    assert "".join(e.text for e in events) == "\n\nHello there!"
    assert result.text == "Hello there!" and result.had_think
    output = cm.registry.output(result.output_number)
    assert THINK in output.token_ids and END_THINK in output.token_ids  # the KV keeps the span
    assert output.span is not None and output.span.num_tokens == len(output.token_ids)


def test_qwen25_default_system_prompt_is_an_explicit_chunk_and_exact_reuse_holds():
    tokenizer = load_qwen25_tokenizer()
    model = make_tiny_model("qwen2", vocab_size=len(tokenizer))
    engine = Engine(model, kv_memory_bytes=1 << 24, block_size=8, prefill_chunk=512)
    cm = ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({IM_END, 151643}))
    cm.add_context("Qwen2.5 inserts a system prompt when none is given.")
    cm.set_query("What does it insert?")
    system = cm.context_chunks()[0]
    assert system.role is Role.SYSTEM and system.is_default
    assert system.text == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    cm.infer_blocking(SamplingParams(max_tokens=4))
    cm.set_query("And when one is given?")
    composed = cm.compose()
    logits = engine.compute(composed.seq)
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([composed.seq.token_ids])).logits[0, -1]
    assert composed.num_reused > len(system.token_ids) and (logits - full).abs().max() <= 1e-4


def test_a_bos_the_template_writes_first_leads_a_context_without_a_system_prompt():
    qwen = load_qwen3_tokenizer()
    tokenizer = TemplateOverride(qwen, BOS_CHATML_TEMPLATE)
    bos = qwen.convert_tokens_to_ids("<|endoftext|>")
    model = make_tiny_model("qwen2", vocab_size=len(qwen))
    engine = Engine(model, kv_memory_bytes=1 << 24, block_size=8, prefill_chunk=512)
    cm = ContextManager(engine, ChatFormat(tokenizer), tokenizer, frozenset({IM_END}))
    cm.add_context("A passage.")
    cm.set_query("Where does the BOS go?")
    messages = [
        {"role": "user", "content": "A passage."},
        {"role": "user", "content": "Where does the BOS go?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert rendered[0] == bos
    lead = cm.context_chunks()[0]
    assert lead.role is Role.SYSTEM and lead.is_default and lead.token_ids == [bos]
    assert lead.text == "<|endoftext|>"
    assert cm.compose().seq.token_ids == rendered
    cm.set_system("Be brief.")
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert (
        cm.compose().seq.token_ids
        == tokenizer.apply_chat_template(with_system, tokenize=True, add_generation_prompt=True)["input_ids"]
    )
