"""Rich renderables of the cache views (/blocks, /attention, /compare, /show N heat). They lay
themselves out for the width they are given; pure: they print nothing."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

from kvchat.chunks.blockmap import CACHED, PINNED, BlockCell, BlockMap
from kvchat.chunks.reports import AttentionReport, Comparison, ModeAnswer
from kvchat.cli.results import ChunkHeat

_BASE = ("blue", "green", "magenta", "cyan", "yellow", "red")
PALETTE = _BASE + tuple(f"bright_{c}" for c in _BASE)
KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # lowercase marks moved KV; chunks past Z share "#"
CELL = 3  # a key letter, a marker, a space
PCT = 7  # a space and "100.0%"
MAX_BAR = 24
MARKERS = "+ pinned  * pinned, shared  = shared  . cached  ·· free  - no chunk  lowercase: moved KV"


@dataclass(frozen=True)
class BlocksView:
    """The pool as rows of cells; a run of identical cells longer than a row becomes one line."""

    map: BlockMap

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        m = self.map
        yield Text(
            f"{m.num_blocks} blocks of {m.block_size} tokens · {m.num_used} used · {m.num_pinned} pinned · "
            f"{m.num_shared} shared · {m.num_moved} moved · {m.num_cached} cached · {m.num_free} free"
        )
        keys = {
            k.chunk_id: (KEYS[i] if i < len(KEYS) else "#", PALETTE[i % len(PALETTE)])
            for i, k in enumerate(m.chunks)
        }
        label = len(str(m.num_blocks - 1))
        per_row = max(1, (options.max_width - label - 1) // CELL)
        cells = {c.block_id: c for c in m.blocks}
        row: list[tuple[str, str]] = []
        row_start = 0
        for start, end, glyph in _runs([_glyph(cells.get(b), keys) for b in range(m.num_blocks)]):
            if end - start > per_row:
                if row:
                    yield _row(row_start, row, label)
                yield Text.assemble(
                    f"{start:>{label}} ", glyph, f" ×{end - start} (blocks {start}–{end - 1})"
                )
                row, row_start = [], end
                continue
            for block_id in range(start, end):
                if len(row) == per_row:
                    yield _row(row_start, row, label)
                    row, row_start = [], block_id
                row.append(glyph)
        if row:
            yield _row(row_start, row, label)
        yield _legend(m, keys)


def _glyph(cell: BlockCell | None, keys: dict[str, tuple[str, str]]) -> tuple[str, str]:
    if cell is None:
        return "··", "muted"
    key, color = keys.get(cell.chunk_ids[0], ("?", "white")) if cell.chunk_ids else ("-", "white")
    if cell.state == CACHED:
        return key + ".", color
    if cell.state == PINNED:
        marker = "*" if cell.ref_count > 1 else "+"
    else:
        marker = "=" if cell.ref_count > 1 else " "
    return (key if cell.exact else key.lower()) + marker, f"bold black on {color}"


def _runs(glyphs: list[tuple[str, str]]) -> list[tuple[int, int, tuple[str, str]]]:
    runs: list[tuple[int, int, tuple[str, str]]] = []
    for i, glyph in enumerate(glyphs):
        if runs and runs[-1][2] == glyph:
            runs[-1] = (runs[-1][0], i + 1, glyph)
        else:
            runs.append((i, i + 1, glyph))
    return runs


def _row(start: int, glyphs: list[tuple[str, str]], label: int) -> Text:
    text = Text(f"{start:>{label}} ", style="muted")
    for glyph in glyphs:
        text.append(*glyph)
        text.append(" ")
    text.rstrip()
    return text


def _legend(m: BlockMap, keys: dict[str, tuple[str, str]]) -> RenderableType:
    grid = Table.grid(padding=(0, 1))
    for k in m.chunks:
        key, color = keys[k.chunk_id]
        role = f"output {k.output_number}" if k.output_number is not None else str(k.role)
        plural = "s" if k.num_blocks != 1 else ""
        grid.add_row(
            Text(key, style=f"bold black on {color}"),
            f"#{k.number} {role} {k.chunk_id} · tokens in {k.num_blocks} block{plural}",
        )
    return Group(grid, Text(MARKERS, style="muted"))


@dataclass(frozen=True)
class AttentionView:
    """One row per chunk: the share of attention over all layers, then per layer group, as bars."""

    report: AttentionReport

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        r = self.report
        kv = "over the KV it used" if r.over_live_kv else "over its context's exact KV"
        yield Text(
            f"output {r.output_number} · {r.num_queries} generated tokens · {r.num_layers} layers · {kv}",
            style="muted",
        )
        groups = list(r.chunks[0].by_layer_group)
        labels = [_chunk_label(c.role, c.number, c.num_tokens) for c in r.chunks]
        room = options.max_width - max(len(x) for x in labels) - 1 - (1 + len(groups)) * (PCT + 1)
        bar_w = min(MAX_BAR, room // (1 + len(groups)))
        # Narrow: one bar for all layers, the groups as numbers only.
        widths = (
            [bar_w] * (1 + len(groups)) if bar_w >= 4 else [max(0, min(MAX_BAR, room))] + [0] * len(groups)
        )
        table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), show_header=True)
        table.add_column("chunk", no_wrap=True)
        for name in ["all", *groups]:
            table.add_column(name, no_wrap=True)
        for chunk, label in zip(r.chunks, labels, strict=True):
            shares = [chunk.attention_share] + [chunk.by_layer_group[g] for g in groups]
            style = "muted" if chunk.role == "sink" else ""
            table.add_row(
                Text(label, style=style), *(_bar(s, w) for s, w in zip(shares, widths, strict=True))
            )
        yield table


def _chunk_label(role: str, number: int | None, num_tokens: int) -> str:
    name = f"#{number} {role}" if number is not None else role
    return f"{name} ({num_tokens})"


def _bar(share: float, width: int) -> Text:
    eighths = round(max(0.0, min(1.0, share)) * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")
    pct = f"{share:.1%}".rjust(PCT - 1)
    return Text.assemble((bar.ljust(width), "ok"), " " + pct) if width else Text(pct)


@dataclass(frozen=True)
class CompareView:
    """The answers side by side (stacked when the width cannot hold a column each)."""

    comparison: Comparison

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        results = self.comparison.results
        yield Text(
            f"greedy answers; agreement and first difference against {self.comparison.reference}",
            style="muted",
        )
        if options.max_width >= 28 * len(results):
            table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0), expand=True)
            for r in results:
                table.add_column(str(r.mode), ratio=1)
            table.add_row(*(_answer_text(r) for r in results))
            table.add_row(*(_facts(r) for r in results))
            yield table
            return
        for r in results:
            yield Text(str(r.mode), style="id")
            yield _answer_text(r)
            yield _facts(r)


def _answer_text(r: ModeAnswer) -> Text:
    if r.first_difference_char is None:
        return Text(r.output or "(empty)")
    cut = r.first_difference_char
    return Text.assemble(r.output[:cut], ("▸", "error"), (r.output[cut:], "warning"))


def _facts(r: ModeAnswer) -> Text:
    diff = "same as reference" if r.first_difference is None else f"differs from token {r.first_difference}"
    return Text(
        f"ttft {r.ttft_s:.2f} s · {r.computed_tokens} computed · {r.reused_tokens} reused · "
        f"{r.repositioned_tokens} moved · agrees {r.agreement:.0%} · {diff}",
        style="muted",
    )


HEAT = ("grey23", "dark_red", "red3", "dark_orange", "orange1", "yellow")


def heat_view(heat: ChunkHeat, top: int = 5) -> RenderableType:
    """The chunk's text, each token shaded by its share of the answer's attention, and the top tokens."""
    info = heat.detail.info
    peak = max(heat.weights, default=0.0) or 1.0
    text = Text()
    for piece, weight in zip(heat.pieces, heat.weights, strict=True):
        level = min(len(HEAT) - 1, int(weight / peak * len(HEAT)))
        text.append(piece, style=f"black on {HEAT[level]}" if level else "")
    ranked = sorted(range(len(heat.weights)), key=lambda i: -heat.weights[i])[:top]
    tops = " · ".join(
        f"{heat.pieces[i].strip() or repr(heat.pieces[i])} {heat.weights[i]:.1%}" for i in ranked
    )
    head = Text(
        f"#{info.number} {info.role} {info.chunk_id} · {sum(heat.weights):.1%} of output "
        f"{heat.output_number}'s attention",
        style="muted",
    )
    return Group(head, text, Text(f"most attended: {tops}", style="muted"))
