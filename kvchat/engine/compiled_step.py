"""The decode step of one token as one compiled graph (`torch.compile`, inductor), opt-in.

The eager lean step spends about half of a small model's token in per-op dispatch. Compiled with
frozen weights, inductor fuses the small ops into generated C++, calls them from a C++ wrapper, and
runs each linear through its own GEMV template over weights it packs once (~25 GB/s here, and faster
in a graph than kvchat's bf16 kernel, whose calls cost more there: TiledLinear keeps its weight for
it); int8 and int4 layers (`--quantize`) run kvchat's own kernels in the graph (models/quantized_linears.py),
or inductor's weight-only templates where those are not built. A token takes about 60% of the eager
step's time. The price: compiling takes a minute or two at load, and bf16 and fp32 weights are packed
into a second copy (quantized ones on kvchat's kernels are read in place). Prefill and speculation's
few tokens take the eager step: in bf16 over a third copy, the tiles of kvchat's bf16 kernel, which
checks 4 drafts at the cost of ~2.4 tokens where `F.linear` over the model's own weights took ~4.5.

The graph reads the K/V of earlier positions from the pool by slot (one dynamic length, so one
compile serves every context) and returns the token's new K/V, which the caller writes once. Its
attention is kvchat's kernel over the pool (native_attention.py), which reads each past row once in
place; where that kernel cannot be built, the graph gathers each layer's K/V and multiplies. Only
families the lean step reproduces (Llama, Qwen2, Qwen3) take it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
from torch import nn
from torch._dynamo.decorators import mark_unbacked

from kvchat.engine import native_attention
from kvchat.engine.bf16_linears import PackedLinear, TiledLinear
from kvchat.engine.decode_step import make_decode_step, rms_norm, rope, rotation
from kvchat.engine.paged_attention import KVPool
from kvchat.errors import ConfigError

# Frozen weights let inductor pack them. Plain linears take the C++ GEMM template alone (it beat
# oneDNN's kernel at every shape measured, so autotuning between the two only costs compile time);
# quantized ones may take torch's kernel too, since the int4 template refuses some shapes.
# Autotuning's reports (written to stderr) stay off the user's terminal.
# The graph's wrapper, which calls its kernels in turn, is C++ (`cpp_wrapper`), not Python: ~15% less
# time a SmolLM2 token, for ~30 s more of compiling.
_QUIET = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
_COMMON = {"freezing": True, "cpp_wrapper": True, **_QUIET}
# mode="max-autotune" without its CUDA graphs, which never apply on CPU (inductor says so on stderr)
COMPILE_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"max_autotune": True}
PLAIN_OPTIONS = {**_COMMON, "max_autotune_gemm_backends": "CPP"}
QUANTIZED_OPTIONS = {**_COMMON, "max_autotune_gemm_backends": "CPP,ATEN"}
# The graph's guards check the model's modules by their dicts' version tags, and walk them only where
# one changed: ~0.6 ms of a ~15 ms SmolLM2 token less than checking every module each token.
DYNAMO_OPTIONS = {"use_recursive_dict_tags_for_guards": True}
MIN_PAST = 2  # the graph's length is taken to be neither 0 nor 1: shorter pasts take the eager step
FP32_PAST_UP_TO = 256  # attention's products over the past run in fp32 up to this length
# glibc's mallopt parameters, and what keep_freed_memory sets them to
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this size come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept up to this much


@torch.library.custom_op("kvchat::past_scores", mutates_args=())
def _past_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scores of the grouped query (Hk, G, D) against past keys (Hk, T, D): fp32 (Hk, G, T).

    An op opaque to inductor: its length changes every token, which its GEMM templates do not take.
    Up to FP32_PAST_UP_TO positions bf16 operands are multiplied in fp32 (MKL's small fp32 products
    cost a third of oneDNN's bf16 ones there); beyond, in their own dtype, the query on the left."""
    if keys.shape[1] <= FP32_PAST_UP_TO:
        return torch.matmul(query.float(), keys.float().transpose(1, 2))
    return torch.matmul(query, keys.transpose(1, 2)).float()


@_past_scores.register_fake
def _(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return query.new_empty(*query.shape[:2], keys.shape[1], dtype=torch.float32)


@torch.library.custom_op("kvchat::past_mix", mutates_args=())
def _past_mix(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The past values (Hk, T, D) weighted by fp32 probabilities (Hk, G, T): fp32 (Hk, G, D), in the
    same dtypes as `_past_scores`."""
    if values.shape[1] <= FP32_PAST_UP_TO:
        return torch.matmul(probs, values.float())
    return torch.matmul(probs.to(values.dtype), values).float()


@_past_mix.register_fake
def _(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return probs.new_empty(*probs.shape[:2], values.shape[2], dtype=torch.float32)


class _DecodeGraph(nn.Module):
    """One token through a Llama-like model over K/V in the pool. The same arithmetic as the lean
    step, except in attention: kvchat's kernel (`native`) computes it in fp32; the gather path takes
    the token's own score as an fp32 dot product, and over pasts up to FP32_PAST_UP_TO positions the
    products are fp32 ones, where the lean step multiplies bf16."""

    def __init__(self, model, native: bool):
        super().__init__()
        self.model = model
        self.native = native
        first = model.model.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        self.has_qk_norm = hasattr(first, "q_norm")

    def forward(self, input_ids, position_ids, past_slots, pool_keys, pool_values):
        """input_ids, position_ids (1, 1); past_slots (T,) where positions 0..T-1 are; pool K/V
        (L, Hk, S, D). Returns logits (1, V) and the token's keys and values (L, Hk, 1, D)."""
        base = self.model.model
        hidden = base.embed_tokens(input_ids)  # (1, 1, d)
        cos, sin = rotation(base, hidden, position_ids)  # (1, 1, 1, D) each
        new_keys, new_values = [], []
        for index, layer in enumerate(base.layers):
            attn = layer.self_attn
            x = rms_norm(layer.input_layernorm, hidden)
            query, keys, values = self._project(attn, x)  # (H, D) each
            query, keys = rope(query, cos[0, 0], sin[0, 0]), rope(keys, cos[0, 0], sin[0, 0])
            new_keys.append(keys)
            new_values.append(values)
            if self.native:
                grouped = query.view(keys.shape[0], -1, self.head_dim)  # (Hk, G, D)
                out = torch.ops.kvchat.paged_decode_attention(
                    grouped, keys, values, pool_keys, pool_values, index, past_slots, self.scaling
                ).to(query.dtype)
            else:
                out = self._attend(query, keys, values, pool_keys[index], pool_values[index], past_slots)
            hidden = hidden + attn.o_proj(out.view(1, 1, -1))
            hidden = hidden + layer.mlp(rms_norm(layer.post_attention_layernorm, hidden))
        logits = self.model.lm_head(rms_norm(base.norm, hidden))[0]  # (1, V)
        return logits, torch.stack(new_keys).unsqueeze(2), torch.stack(new_values).unsqueeze(2)

    def _project(self, attn, x):
        """Query (Hq, D), keys and values (Hk, D) before RoPE."""
        query = attn.q_proj(x).view(-1, self.head_dim)
        keys = attn.k_proj(x).view(-1, self.head_dim)
        if self.has_qk_norm:
            query, keys = rms_norm(attn.q_norm, query), rms_norm(attn.k_norm, keys)
        return query, keys, attn.v_proj(x).view(-1, self.head_dim)

    def _attend(self, query, keys, values, layer_keys, layer_values, past_slots):
        """Attention of the query (Hq, D) over the past (layer K/V (Hk, S, D) at past_slots) and the
        token's own keys and values (Hk, D), the query heads grouped per KV head -> (Hq, D)."""
        num_kv_heads = keys.shape[0]
        grouped = query.view(num_kv_heads, -1, self.head_dim)  # (Hk, G, D)
        past_keys = layer_keys.index_select(1, past_slots)  # (Hk, T, D)
        past_values = layer_values.index_select(1, past_slots)
        past = _past_scores(grouped, past_keys)  # (Hk, G, T)
        own = (grouped.float() * keys.float()[:, None]).sum(-1, keepdim=True)  # (Hk, G, 1)
        probs = (torch.cat([past, own], dim=-1) * self.scaling).softmax(dim=-1)  # (Hk, G, T+1)
        out = _past_mix(probs[..., :-1], past_values) + probs[..., -1:] * values.float()[:, None]
        return out.to(query.dtype).view(-1, self.head_dim)


class CompiledDecodeStep:
    """Decodes one token at a time over the pool through the compiled graph (compiled at first use)."""

    def __init__(self, model, pool: KVPool):
        if not has_cpp_compiler():
            raise ConfigError("--compile needs a C++ compiler (g++, or $CXX) for torch.compile; none found")
        self.pool = pool
        keep_freed_memory()
        self.native = native_attention.for_pool(pool.keys.dtype, pool.keys.device) is not None
        self.graph = torch.compile(_DecodeGraph(model, self.native), options=COMPILE_OPTIONS)
        plain = all(type(module) in (nn.Linear, TiledLinear) for module in _linear_layers(model))
        self.options = PLAIN_OPTIONS if plain else QUANTIZED_OPTIONS

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_slots: torch.Tensor,
        slot: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (1, V) of the token input_ids (1, 1) at position_ids (1, 1), attending over the
        earlier positions at `past_slots` (T,), T >= MIN_PAST; its K/V are written at `slot` (1,)."""
        # Unbacked: the graph holds for any length. A dynamic (backed) one let inductor decide the
        # softmax's fp32 sum on the first length's value, with a guard that recompiled the graph (a
        # minute or more) at 4,096 positions.
        mark_unbacked(past_slots, 0)
        with dynamo_config.patch(DYNAMO_OPTIONS), inductor_config.patch(self.options):
            logits, keys, values = self.graph(
                input_ids, position_ids, past_slots, self.pool.keys, self.pool.values
            )
        self.pool.scatter(slot, keys.transpose(1, 2), values.transpose(1, 2))  # (L, 1, Hk, D) each
        return logits


def can_compile(model) -> bool:
    """A family the lean step reproduces, on CPU, none of its projections packed for oneDNN (an opaque
    weight torch.compile cannot trace; inductor packs plain and int8/int4 layers itself)."""
    if make_decode_step(model) is None or next(model.parameters()).device.type != "cpu":
        return False
    return not any(isinstance(module, PackedLinear) for module in model.modules())


def _linear_layers(model) -> list[nn.Module]:
    """The projections of every layer and the output layer."""
    projections = [
        child
        for layer in model.model.layers
        for part in (layer.self_attn, layer.mlp)
        for name, child in part.named_children()
        if name.endswith("_proj")
    ]
    return [*projections, model.lm_head]


@contextmanager
def quiet_compile() -> Iterator[None]:
    """Around the calls that compile the graph: inductor's autotuner trips torch's own deprecation of
    TypedStorage, which is no news to the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        yield


def keep_freed_memory() -> None:
    """Keep memory the process frees for its next allocation, instead of handing it back to the OS.

    The graph allocates its buffers anew each token, sized by the context (one layer's gathered K/V:
    1.5 MB for SmolLM2 at 4,000 positions). glibc serves such blocks by mmap, or trims them off the
    heap's top once freed, so the next token faults the same pages in again: 4,000-7,000 page faults a
    token at 4,000 positions, and 45-59 ms a token instead of 32-36. Raising glibc's mmap and trim
    thresholds keeps them in the heap. This is process-wide; off glibc (no `mallopt`) it does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def has_cpp_compiler() -> bool:
    return any(shutil.which(name) for name in (os.environ.get("CXX") or "g++", "clang++"))
