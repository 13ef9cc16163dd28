"""The engine on the real SmolLM2-135M-Instruct: same logits and same greedy tokens as transformers."""

import copy

import pytest
import torch

from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.generate import generate
from kvchat.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # the real SmolLM2


def prompt_ids(tokenizer, text):
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_paged_logits_equal_full_forward(smollm2):
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, "Name three rivers in Europe and say one thing about each.")
    engine = Engine(model, kv_memory_bytes=64 << 20, block_size=16, prefill_chunk=8)
    seq = engine.start(ids[:-3])
    engine.compute(seq)
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([ids])).logits[0]  # (T, V)
    for i, token in enumerate(ids[-3:]):
        engine.extend(seq, [token])
        assert (engine.compute(seq) - full[len(ids) - 3 + i]).abs().max() <= 1e-4


def test_greedy_equals_model_generate(smollm2):
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, "Write a long story about a lighthouse keeper and a storm.")
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample, config.max_new_tokens = None, False, 40
    with torch.inference_mode():
        expected = model.generate(torch.tensor([ids]), generation_config=config, pad_token_id=0)[
            0, len(ids) :
        ]
    engine = Engine(model, kv_memory_bytes=64 << 20, block_size=16, prefill_chunk=512)
    seq = engine.start(ids)
    steps = list(
        generate(engine, seq, SamplingParams(max_tokens=40), frozenset(), StreamDetokenizer(tokenizer))
    )
    assert [s.token_id for s in steps] == expected.tolist()
    assert steps[-1].finish_reason == "length"
    assert "".join(s.text for s in steps) == tokenizer.decode(expected.tolist())


def test_each_eos_id_stops_generation(smollm2):
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, "Say hi.")
    engine = Engine(model, kv_memory_bytes=64 << 20, block_size=16, prefill_chunk=512)
    seq = engine.start(ids)
    first = next(
        iter(generate(engine, seq, SamplingParams(max_tokens=1), frozenset(), StreamDetokenizer(tokenizer)))
    )
    for eos in (first.token_id, 2):  # whatever comes first, declared as an EOS id, ends it at once
        seq = engine.start(ids)
        steps = list(
            generate(
                engine, seq, SamplingParams(max_tokens=20), frozenset({eos, 0}), StreamDetokenizer(tokenizer)
            )
        )
        if eos == first.token_id:
            assert len(steps) == 1 and steps[0].finish_reason == "stop"
    seq = engine.start(ids)
    steps = list(
        generate(engine, seq, SamplingParams(max_tokens=200), frozenset({2}), StreamDetokenizer(tokenizer))
    )
    assert steps[-1].finish_reason == "stop" and steps[-1].token_id == 2
