"""The cache views' commands: /show, /stats, /blocks, /attention, /compare and /verify, which the
shell offers after its own (kvchat.cli.commands.COMMAND_MODULES).
The modules that run the model are imported when a command runs, so that starting the CLI loads no
torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

from kvchat.chunks.blockmap import BlockMap, cache_map
from kvchat.chunks.reports import AttentionReport, Comparison, FidelityReport
from kvchat.chunks.types import CacheStats, ChunkDetail, ReuseMode
from kvchat.cli.arguments import count
from kvchat.cli.results import ChunkHeat
from kvchat.cli.slash_commands import ArgKind, ShellState, command
from kvchat.errors import CommandError

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager
    from kvchat.engine.sampling import SamplingParams

DEFAULT_MODES = (ReuseMode.EXACT, ReuseMode.REPOSITION, ReuseMode.REPAIR)


@command(
    "show",
    "Show one chunk: text, token ids, positions, blocks; with heat, what the last answer attended to",
    usage="N|ID [heat]",
    arg=ArgKind.CHUNK,
)
def show(shell: ShellState, arg: str) -> ChunkDetail | ChunkHeat:
    """Everything about one chunk, by number or id: its number, role and id; its tokens and token
    ids (the first 64; --json has all); the positions it takes in the current context; the positions
    its kept KV was computed at (where these differ, reuse must reposition or recompute it); the
    blocks holding that KV and their references; for outputs, the number, the chunks of the context
    it came from and whether thinking was hidden; then the text.
    With `heat`: the chunk's tokens shaded by the share of attention the last answer paid to each,
    and the most attended tokens (the shares sum to the chunk's row of /attention).
    """
    ref, _, option = arg.partition(" ")
    if option.strip() not in ("", "heat"):
        raise CommandError(f"unknown option {option.strip()!r}: /show N|ID [heat]")
    detail = shell.ctx.chunk(ref)
    if not option.strip():
        return detail
    return _heat(_real(shell), detail)


@command("stats", "KV cache blocks, bytes and hit rate")
def stats(shell: ShellState, arg: str) -> CacheStats:
    """The paged KV cache, whose size --ctx-size (tokens) or --kv-memory (MiB) sets.
    Rows:
      blocks      used (referenced by the live sequence or a chunk), pinned (retained outputs),
                  cached (unreferenced but holding reusable KV, evicted least recently used first),
                  free, and total
      tokens      tokens the used blocks hold room for, and the whole budget in tokens
      block size  tokens per block, and the bytes one block takes
      KV memory   bytes of the used blocks, of the whole budget (--kv-memory)
      hit rate    prompt tokens found in the cache, of those looked up, since start or /reset
    """
    return shell.ctx.stats()


@command("blocks", "Map of the KV pool: each block's chunk, sharing, pins, moved KV")
def blocks(shell: ShellState, arg: str) -> BlockMap:
    """One cell per block of the KV pool, lettered by the chunk whose KV it holds (the legend gives
    each letter's chunk number, role, id and the blocks its tokens are in). Marks: + pinned (a
    retained output), * pinned and shared, = shared (more than one reference), . cached
    (unreferenced, reusable KV, evicted least recently used first), ·· free. A lowercase letter:
    the block holds moved (repositioned, not exact) KV. The letter - : no chunk holds the block
    now (-. is KV an earlier sequence, a deleted output or /verify left cached, still reusable).
    Long runs of equal cells are one line with their block range.
    The legend counts every block holding a chunk's tokens: its own kept KV and the live
    conversation's blocks (a block shared by two chunks counts for both). /chunks counts only
    the blocks kept for the chunk itself, so a query or a user turn, held only by the live
    conversation, shows blocks here and 0 there.
    """
    return cache_map(_real(shell))


@command(
    "attention",
    "Share of attention the last answer (or output N) paid to each chunk of its context",
    usage="[N]",
    arg=ArgKind.OUTPUT,
)
def attention(shell: ShellState, arg: str) -> AttentionReport:
    """Re-reads the last answer (or output N) teacher-forced with attention weights, one extra
    forward over the answer, and shows the share of attention its tokens paid to each chunk of its
    context, averaged over heads and layers, and per layer group (early, middle, late thirds).
    The first 4 tokens (attention sinks) have a row of their own; the shares sum to 1.
    """
    from kvchat.chunks.attention import attention_map

    with cancellable("attention"):
        return attention_map(_real(shell), count(arg) if arg else None)


@command(
    "compare",
    "Answer the query under each mode (default: exact reposition repair), greedily, side by side",
    usage="[MODE...]",
    arg=ArgKind.MODE,
)
def compare(shell: ShellState, arg: str) -> Comparison:
    """Answers the current query once per MODE (exact, reposition, repair; default all three) from
    the same cached chunks, greedily and without speculative drafts whatever the settings, so
    differences come from the KV alone. Shows each answer with the first differing token marked,
    its time to first token, the prompt tokens it computed and its per-token agreement with the
    reference (exact if compared, else the first mode).
    Nothing is kept: no output, the live sequence unchanged.
    """
    return compare_modes_told(_real(shell), arg, shell.settings.sampling, shell.notify)


@command(
    "verify", "Compare the reuse mode with a full recompute over N tokens", usage="[N]", arg=ArgKind.TEXT
)
def verify(shell: ShellState, arg: str) -> FidelityReport:
    """Runs the current context twice: once composed in the reuse mode, once fully recomputed, and
    compares them. N (default reuse.verify_tokens, 16) is how many answer positions are compared. It
    needs room for a second copy of the context's KV; nothing is kept.
      logits          identical (bitwise equal at every compared position, as exact reuse gives where
                      /info says batch-invariant), or the first position where they differ
      KL divergence   KL(full || mode) of the next-token distributions, in nats; 0 is identical
      next token      whether both pick the same most likely next token
      top-5 overlap   how many of the 5 most likely next tokens both share
      max logit diff  the largest difference between the two next-token logits
      greedy agrees   leading greedy tokens that agree before the first difference, of N
      top-1 rate      share of the N positions whose most likely token agrees, both fed the full
                      recompute's tokens (so one difference does not spoil the rest)
      tokens          reused, repositioned and computed prompt tokens in the reuse mode
    Fewer than N positions are compared when the full recompute's answer ends sooner.
    """
    with cancellable("verify"):
        return shell.ctx.verify(count(arg) if arg else shell.settings.reuse.verify_tokens)


def _real(shell: ShellState) -> ContextManager:
    """The shell's manager as the real ContextManager: the views read its pool, model and tokenizer,
    which the contract keeps out of the rest of the CLI's reach. Only these commands reach past it."""
    return cast("ContextManager", shell.ctx)


@contextmanager
def cancellable(command: str, outcome: str = "") -> Iterator[None]:
    """Ctrl-C during a long command ends it with one line saying so (and `outcome`), as /compare does."""
    try:
        yield
    except KeyboardInterrupt:
        raise CommandError(f"/{command} cancelled{outcome}") from None


def compare_modes_told(
    ctx: ContextManager, arg: str, params: SamplingParams, notify: Callable[[str], None] | None = None
) -> Comparison:
    """/compare's modes (`arg`, default exact reposition repair) answered greedily; each answer is told
    to `notify`, when given, as it comes."""
    names = arg.split()
    known = [m.value for m in ReuseMode]
    for name in names:
        if name not in known:
            raise CommandError(f"unknown mode {name!r}: choose from {', '.join(known)}")
    modes = [ReuseMode(n) for n in names] if names else list(DEFAULT_MODES)
    from kvchat.chunks.compare import compare_modes

    if notify is None:
        return compare_modes(ctx, modes, params)
    from kvchat.chunks.compare import runnable_modes

    distinct = runnable_modes(ctx, list(dict.fromkeys(modes)))
    for mode in dict.fromkeys(modes):
        if mode not in distinct:
            notify(f"{mode} left out: {getattr(ctx, 'move_refusal', None)}")
    done: list[ReuseMode] = []

    def answered(mode: ReuseMode, text: str) -> None:
        done.append(mode)
        notify(f"{mode} answered ({len(done)} of {len(distinct)}): {' '.join(text.split())[:60]}")

    notify(f"answering under {', '.join(distinct)}, greedily, up to {params.max_tokens} tokens each")
    return compare_modes(ctx, modes, params, answered)


def _heat(ctx: ContextManager, detail: ChunkDetail) -> ChunkHeat:
    from kvchat.chunks.attention import attention_map, token_pieces

    report = attention_map(ctx)
    weights = report.heat(detail.info.chunk_id)
    if weights is None:
        raise CommandError(
            f"chunk {detail.info.number} is not in the context of the last answer "
            f"(output {report.output_number})"
        )
    return ChunkHeat(detail, report.output_number, token_pieces(ctx.tokenizer, detail.token_ids), weights)
