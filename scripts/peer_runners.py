"""The engines bench_peer.py compares, behind one small interface: decode tok/s from a prompt (its
prefix reused after the first call), cold TTFT, and turn-2 TTFT after a first turn."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from bench_common import DTYPES, QWEN25_3B
from peer_gguf import BIG_SEED, big_path, weight_bytes, write_big
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvchat.engine.detokenizer import StreamDetokenizer
from kvchat.engine.engine import Engine
from kvchat.engine.generate import GenerationStep, generate
from kvchat.engine.sampling import SamplingParams
from kvchat.engine.speculate import Speculation
from kvchat.linears.bf16_linears import PackedLinear
from kvchat.linears.rescored_head import RescoredHead
from kvchat.settings_schema import DecodeSettings


class Runner(Protocol):
    weight_bytes: int

    def decode(self, prompt: list[int], num_tokens: int) -> float: ...
    def ttft_cold(self, prompt: list[int]) -> float: ...
    def ttft_turn2(self, turn1: list[int], turn2: list[int]) -> float: ...


def apply_kind(model, kind: str):
    """`kind` is <dtype>[-int8|-int4[-head-<format>]]: quantize with kvchat.models.quantize where it
    asks to, the output layer in <format> where named (else as --quantize does)."""
    _, _, mode = kind.partition("-")
    mode, _, head = mode.partition("-head-")
    if mode:
        from kvchat.models.quantize import quantize_model  # the --quantize option, where it exists

        quantize_model(model, mode, head_mode=head or None)
    return model.eval()


def make_kvchat_models(folder: Path, names: list[str]) -> dict[str, object]:
    """One model per kvchat-<kind> (its -spec variant shares it)."""
    kinds = sorted({name.removeprefix("kvchat-").removesuffix("-spec") for name in names})
    models = {}
    for kind in kinds:
        dtype = DTYPES[kind.partition("-")[0]]
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        models[f"kvchat-{kind}"] = apply_kind(model, kind)
    return models


def make_big_model(kind: str, device: str = "cpu"):
    """A random-weight model with Qwen2.5-3B's shapes, in `kind` (bf16[-int8|-int4]), on `device`; the
    same weights each time on a CPU (peer_gguf.write_big writes them for llama.cpp)."""
    config = Qwen2Config(**QWEN25_3B)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    model.tie_weights()  # to_empty gave the output layer its own storage
    with torch.no_grad():
        torch.manual_seed(BIG_SEED)
        for param in model.parameters():
            param.normal_(0, 0.02)
        with torch.device(device):
            model.model.rotary_emb.__init__(config)  # its buffers were left empty by to_empty
    return apply_kind(model, kind)


def write_big_files(types: list[str]) -> None:
    """The 3B-shaped model's GGUF files of these llama.cpp types (peer_gguf.write_big), where missing:
    the model is made once for all of them."""
    missing = [name for name in types if not big_path(name).is_file()]
    if missing:
        model = make_big_model("bf16")
        for name in missing:
            write_big(name, model)


def model_bytes(model) -> int:
    """Bytes a decode step reads: every weight but the input embedding (one row a token), which counts
    only where it is the output layer too (tied); a packed linear's as the bf16 matrix it holds; ; of a
    rescored output layer, its int4 weight and the rows it reads again."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tensors = {t.data_ptr(): t.nbytes for t in [*model.parameters(), *model.buffers()] if t is not embedding}
    if isinstance(head, RescoredHead):
        tensors[embedding.data_ptr()] = head.exact_bytes
    elif getattr(head, "weight", None) is embedding:
        tensors[embedding.data_ptr()] = embedding.nbytes
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return sum(tensors.values()) + sum(2 * m.in_features * m.out_features for m in packed)


class KvchatRunner:
    def __init__(self, model, tokenizer, speculate: bool):
        self.engine = Engine(model, kv_memory_bytes=768 << 20, block_size=16, prefill_chunk=512)
        self.tokenizer = tokenizer
        draft_max = DecodeSettings().draft_max  # kvchat's default
        self.speculation = Speculation("prompt-lookup", draft_max) if speculate else None
        self.weight_bytes = model_bytes(model)

    def _run(self, prompt: list[int], num_tokens: int, reuse: bool = True) -> GenerationStep:
        seq = self.engine.start(prompt, reuse=reuse)
        detok = StreamDetokenizer(self.tokenizer or _NoText())
        params = SamplingParams(max_tokens=num_tokens)
        try:
            steps = generate(self.engine, seq, params, frozenset(), detok, self.speculation)
            return [s for s in steps if isinstance(s, GenerationStep)][-1]
        finally:
            self.engine.free(seq)

    def decode(self, prompt: list[int], num_tokens: int) -> float:
        return self._run(prompt, num_tokens).stats.decode_tok_s

    def tokens(self, prompt: list[int], num_tokens: int) -> Iterator[None]:
        """Greedy decode after `prompt`, a token a step: the first next() prefills and samples the
        first token, each of the `num_tokens` after it decodes one more."""
        seq = self.engine.start(prompt)
        detok = StreamDetokenizer(self.tokenizer or _NoText())
        params = SamplingParams(max_tokens=num_tokens + 1)
        steps = generate(self.engine, seq, params, frozenset(), detok, self.speculation)
        try:
            for step in steps:
                if isinstance(step, GenerationStep):
                    yield
        finally:
            steps.close()  # before the sequence goes: closing puts it back to what was yielded
            self.engine.free(seq)

    def ttft_cold(self, prompt: list[int]) -> float:
        return self._run(prompt, 1, reuse=False).stats.ttft_s

    def ttft_turn2(self, turn1: list[int], turn2: list[int]) -> float:
        self._run(turn1, 1)
        return self._run(turn2, 1).stats.ttft_s


class _NoText:
    """The tokenizer of the random-weight model: its tokens have no text."""

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return ""


class LlamaRunner:
    def __init__(self, path: Path):
        from llama_cpp import Llama  # the `bench` extra

        self.llm = Llama(str(path), n_ctx=8192, n_threads=1, n_threads_batch=1, n_batch=512, verbose=False)
        self.weight_bytes = weight_bytes(path)

    def _tokens(self, prompt: list[int], num_tokens: int) -> list[float]:
        """Times at which each of `num_tokens` greedy tokens came."""
        times = []
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
            times.append(time.perf_counter())
            if len(times) == num_tokens:
                break
        return times

    def decode(self, prompt: list[int], num_tokens: int) -> float:
        times = self._tokens(prompt, num_tokens)
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0

    def ttft_cold(self, prompt: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        return self._tokens(prompt, 1)[0] - start

    def ttft_turn2(self, turn1: list[int], turn2: list[int]) -> float:
        self._tokens(turn1, 1)
        start = time.perf_counter()
        return self._tokens(turn2, 1)[0] - start
