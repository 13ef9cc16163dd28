"""The argument handling of the cache views' commands, kept out of the shell's file."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvchat.chunks.attention import attention_map, token_pieces
from kvchat.chunks.compare import DEFAULT_MODES, Comparison, compare_modes
from kvchat.chunks.types import ChunkDetail, ReuseMode
from kvchat.cli.results import ChunkHeat
from kvchat.engine.sampling import SamplingParams
from kvchat.errors import CommandError

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager


def compare(ctx: ContextManager, arg: str, params: SamplingParams) -> Comparison:
    names = arg.split()
    known = [m.value for m in ReuseMode]
    for name in names:
        if name not in known:
            raise CommandError(f"unknown mode {name!r}: choose from {', '.join(known)}")
    modes = [ReuseMode(n) for n in names] if names else list(DEFAULT_MODES)
    return compare_modes(ctx, modes, params)


def heat(ctx: ContextManager, detail: ChunkDetail) -> ChunkHeat:
    report = attention_map(ctx)
    weights = report.heat(detail.info.chunk_id)
    if weights is None:
        raise CommandError(
            f"chunk {detail.info.number} is not in the context of the last answer "
            f"(output {report.output_number})"
        )
    return ChunkHeat(detail, report.output_number, token_pieces(ctx.tokenizer, detail.token_ids), weights)
