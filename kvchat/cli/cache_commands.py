"""The argument handling of the cache views' commands, kept out of the shell's file. The modules that
run the model are imported when a command runs, so that starting the CLI loads no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvchat.chunks.reports import AttentionReport, Comparison, FidelityReport
from kvchat.chunks.types import ChunkDetail, ReuseMode
from kvchat.cli.results import ChunkHeat
from kvchat.errors import CommandError

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager
    from kvchat.engine.sampling import SamplingParams

DEFAULT_MODES = (ReuseMode.EXACT, ReuseMode.REPOSITION, ReuseMode.REPAIR)


@contextmanager
def cancellable(command: str, outcome: str = "") -> Iterator[None]:
    """Ctrl-C during a long command ends it with one line saying so (and `outcome`), as /compare does."""
    try:
        yield
    except KeyboardInterrupt:
        raise CommandError(f"/{command} cancelled{outcome}") from None


def attention(ctx: ContextManager, output_number: int | None) -> AttentionReport:
    from kvchat.chunks.attention import attention_map

    with cancellable("attention"):
        return attention_map(ctx, output_number)


def verify(ctx: ContextManager, num_tokens: int) -> FidelityReport:
    with cancellable("verify"):
        return ctx.verify(num_tokens)


def compare(
    ctx: ContextManager, arg: str, params: SamplingParams, notify: Callable[[str], None] | None = None
) -> Comparison:
    names = arg.split()
    known = [m.value for m in ReuseMode]
    for name in names:
        if name not in known:
            raise CommandError(f"unknown mode {name!r}: choose from {', '.join(known)}")
    modes = [ReuseMode(n) for n in names] if names else list(DEFAULT_MODES)
    from kvchat.chunks.compare import compare_modes

    if notify is None:
        return compare_modes(ctx, modes, params)
    distinct = list(dict.fromkeys(modes))
    done: list[ReuseMode] = []

    def answered(mode: ReuseMode, text: str) -> None:
        done.append(mode)
        notify(f"{mode} answered ({len(done)} of {len(distinct)}): {' '.join(text.split())[:60]}")

    notify(f"answering under {', '.join(distinct)}, greedily, up to {params.max_tokens} tokens each")
    return compare_modes(ctx, modes, params, answered)


def heat(ctx: ContextManager, detail: ChunkDetail) -> ChunkHeat:
    from kvchat.chunks.attention import attention_map, token_pieces

    report = attention_map(ctx)
    weights = report.heat(detail.info.chunk_id)
    if weights is None:
        raise CommandError(
            f"chunk {detail.info.number} is not in the context of the last answer "
            f"(output {report.output_number})"
        )
    return ChunkHeat(detail, report.output_number, token_pieces(ctx.tokenizer, detail.token_ids), weights)
