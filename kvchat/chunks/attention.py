"""Where an answer looked: the share of attention its generated tokens paid to each chunk of its context.

The answer is re-run teacher-forced over the context's KV with eager attention, which returns the
attention weights: one extra forward over the answer, paid only when asked. The last inference is
read over the KV it actually used (moved KV included); an older output over its context's exact KV.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from kvchat.chunks.blockmap import live_chunks
from kvchat.chunks.chunk import Chunk
from kvchat.chunks.compose import chunk_ranges
from kvchat.chunks.reports import AttentionReport, ChunkAttention
from kvchat.chunks.types import Role
from kvchat.chunks.view_state import ViewState
from kvchat.engine.forward_cache import cache_argument
from kvchat.errors import ChunkError

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager

# The first tokens draw a large, content-free share of attention (attention sinks); shown apart.
SINK_TOKENS = 4
QUERY_PIECE = 128  # answer tokens per forward: bounds the (layers, heads, q, k) weights held at once
LAYER_GROUPS = ("early", "middle", "late")


def layer_groups(num_layers: int) -> dict[str, range]:
    """Early, middle and late thirds of the layers; a group too small to hold a layer is left out."""
    edge = -(-num_layers // 3)
    groups = {
        "early": range(0, edge),
        "middle": range(edge, num_layers - edge),
        "late": range(num_layers - edge, num_layers),
    }
    return {name: layers for name, layers in groups.items() if len(layers)}


def attention_map(cm: ContextManager, output_number: int | None = None) -> AttentionReport:
    """The attention report of retained output `output_number` (default: the last answer)."""
    state = cm.view_state()
    context, output = _context_and_output(state, output_number)
    close = list(state.assistant_close_ids)
    tokens = [t for c in context for t in c.token_ids] + output.token_ids
    answer_start = len(tokens) - len(output.token_ids)
    prompt_len = answer_start + len(state.generation_prompt_ids)
    end = len(tokens) - (len(close) if tokens[-len(close) :] == close else 0)
    start = prompt_len - 1  # the query that produced the first answer token
    if end <= start:
        raise ChunkError(f"output {output.output_number} has no generated token")
    keys, values, live = cm.read_prefix_kv(tokens, start)  # (L, start, H, D) each
    weights = _teacher_forced(cm.model, keys, values, tokens, start, end)  # (L, end)
    ranges = [(c, a, b) for c, a, b in chunk_ranges(context)]
    report_chunks = _shares(weights, ranges, output, answer_start, end)
    return AttentionReport(
        output_number=output.output_number or 0,
        num_queries=end - start,
        num_layers=weights.shape[0],
        over_live_kv=live,
        chunks=report_chunks,
        token_weights=weights.mean(dim=0).tolist(),
        positions={c.chunk_id: (a, b) for c, a, b in ranges},
    )


def _context_and_output(state: ViewState, number: int | None) -> tuple[list[Chunk], Chunk]:
    """The answer's context and its output chunk; for the last inference, read off the live sequence."""
    chunks = live_chunks(state)
    held = sum(len(c.token_ids) for c in chunks)
    live = state.live
    if chunks and live is not None and held == live.num_tokens and chunks[-1].role is Role.OUTPUT:
        if number is None or chunks[-1].output_number == number:
            return chunks[:-1], chunks[-1]
    output = _output(state, number)
    return _context_of(state, output), output


def _output(state: ViewState, number: int | None) -> Chunk:
    if number is not None:
        return state.output(number)
    outputs = state.outputs()
    if not outputs:
        raise ChunkError("no answer yet: /infer or chat first")
    return outputs[-1]


def _context_of(state: ViewState, output: Chunk) -> list[Chunk]:
    context = [state.chunk(i) for i in output.source_ids]
    missing = [i for i, c in zip(output.source_ids, context, strict=True) if c is None]
    if missing or not output.source_ids:
        raise ChunkError(
            f"the context of output {output.output_number} is gone "
            f"(chunk {', '.join(missing) or '?'} was deleted)"
        )
    return [c for c in context if c is not None]


@torch.inference_mode()
def _teacher_forced(model, keys, values, tokens: list[int], start: int, end: int) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    for layer in range(keys.shape[0]):
        cache.update(
            keys[layer].transpose(0, 1).unsqueeze(0), values[layer].transpose(0, 1).unsqueeze(0), layer
        )
    device = keys.device
    sums = torch.zeros(keys.shape[0], end, dtype=torch.float64, device=device)  # (L, end)
    num_heads = model.config.num_attention_heads
    with eager_attention(model):
        for a in range(start, end, QUERY_PIECE):
            b = min(end, a + QUERY_PIECE)
            out = model(
                input_ids=torch.tensor([tokens[a:b]], device=device),  # (1, q)
                position_ids=torch.arange(a, b, device=device).unsqueeze(0),  # (1, q)
                **cache_argument(model, cache),
                use_cache=True,
                output_attentions=True,
                logits_to_keep=1,
            )
            for layer, attn in enumerate(out.attentions):  # (1, nh, q, b)
                sums[layer, :b] += attn[0].double().sum(dim=(0, 1))  # (b,)
    return (sums / (num_heads * (end - start))).float()  # (L, end)


@contextmanager
def eager_attention(model) -> Iterator[None]:
    """Eager attention for the duration: the one implementation that returns its weights."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _shares(
    weights: torch.Tensor, ranges, output: Chunk, answer_start: int, end: int
) -> list[ChunkAttention]:
    groups = layer_groups(weights.shape[0])
    sink = min(SINK_TOKENS, answer_start)
    spans: list[tuple[str | None, str, int | None, int, int]] = [(None, "sink", None, 0, sink)]
    for chunk, a, b in ranges:
        if max(a, sink) < b:
            spans.append((chunk.chunk_id, str(chunk.role), chunk.number, max(a, sink), b))
    spans.append((output.chunk_id, "answer", output.number, answer_start, end))
    out = []
    for chunk_id, role, number, a, b in spans:
        per_layer = weights[:, a:b].sum(dim=1)  # (L,)
        out.append(
            ChunkAttention(
                chunk_id,
                role,
                number,
                b - a,
                float(per_layer.mean()),
                {
                    name: float(per_layer[layers.start : layers.stop].mean())
                    for name, layers in groups.items()
                },
            )
        )
    return out


def token_pieces(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's text, cut from decodes of growing prefixes so multi-byte characters stay whole
    (a token that ends inside a character gets the empty string, the next one the character)."""
    pieces, done = [], ""
    for i in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:i])
        if text.endswith("\ufffd") and i < len(token_ids):
            pieces.append("")
            continue
        pieces.append(text[len(done) :])
        done = text
    return pieces
