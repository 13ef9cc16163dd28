"""Rich renderables for each record. Pure: builds Text and Table objects, prints nothing."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvchat.chunks.reports import FidelityReport
from kvchat.chunks.types import (
    CacheStats,
    ChunkDetail,
    ChunkInfo,
    ChunkReport,
    InferenceResult,
)
from kvchat.cli.results import ChunkChange, HelpView, SettingsView
from kvchat.cli.settings import shown_value
from kvchat.models.info import ModelInfo

PREVIEW_CHARS = 48
SHOWN_TOKEN_IDS = 64


def preview(text: str, width: int = PREVIEW_CHARS) -> str:
    """The start of `text` on one line, cut with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def human_bytes(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    size = num_bytes / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def span(positions: range | None) -> str:
    if positions is None or not positions:
        return "—"
    return f"{positions.start}–{positions.stop - 1}"


def id_ranges(ids: list[int]) -> str:
    """`[3, 4, 5, 9]` -> `"3–5, 9"`: block lists get long, runs are the common case."""
    runs: list[list[int]] = []
    for block_id in ids:
        if runs and block_id == runs[-1][1] + 1:
            runs[-1][1] = block_id
        else:
            runs.append([block_id, block_id])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs) or "—"


def token_list(token_ids: list[int], limit: int = SHOWN_TOKEN_IDS) -> str:
    """The first `limit` ids; the rest are counted (`--json` has them all)."""
    shown = " ".join(map(str, token_ids[:limit]))
    more = len(token_ids) - limit
    return f"{shown} … {more} more (--json lists all)" if more > 0 else shown or "—"


def chunk_line(change: ChunkChange) -> Text:
    info = change.chunk
    place = f"in context at {info.place}" if info.place is not None else "not in context"
    return Text.assemble(
        (f"{change.action}: ", "ok"),
        (f"#{info.number} {info.role} {info.chunk_id}", "id"),
        f" · {info.num_tokens} tokens · {info.num_blocks} blocks · {place}",
    )


def chunks_table(chunks: list[ChunkInfo]) -> RenderableType:
    if not chunks:
        return Text("no chunks", style="muted")
    # Sized to fit 80 columns: narrow padding, the text preview last and cut short.
    table = Table(
        "#",
        "role",
        "id",
        "tokens",
        "blocks",
        "refs",
        "place",
        "pin",
        "text",
        box=None,
        pad_edge=False,
        padding=(0, 1, 0, 0),
    )
    for c in chunks:
        role = f"{c.role} {c.output_number}" if c.output_number is not None else str(c.role)
        place = str(c.place) if c.place is not None else "—"
        table.add_row(
            str(c.number),
            role,
            c.chunk_id,
            str(c.num_tokens),
            str(c.num_blocks),
            str(c.num_refs),
            place,
            "yes" if c.pinned else "",
            preview(c.text, 28),
        )
    return table


def outputs_table(outputs: list[ChunkInfo]) -> RenderableType:
    if not outputs:
        return Text("no retained outputs", style="muted")
    table = Table("output", "text", "tokens", "end", "id", box=None, pad_edge=False)
    for c in outputs:
        end = (
            Text(f"{c.finish_reason} (truncated)", style="warning") if c.truncated else c.finish_reason or ""
        )
        table.add_row(str(c.output_number), preview(c.text), str(c.num_tokens), end, c.chunk_id)
    return table


def detail_view(detail: ChunkDetail) -> RenderableType:
    info = detail.info
    facts = Table.grid(padding=(0, 2))
    facts.add_row("chunk", f"#{info.number} {info.role} {info.chunk_id}")
    facts.add_row("tokens", str(info.num_tokens))
    facts.add_row("token ids", token_list(detail.token_ids))
    facts.add_row("positions", span(detail.positions) if detail.positions is not None else "not in context")
    facts.add_row(
        "KV computed at", span(detail.kv_positions) if detail.kv_positions is not None else "no KV kept"
    )
    facts.add_row("blocks", f"{id_ranges(detail.block_ids)} · {info.num_refs} references")
    if info.output_number is not None:
        facts.add_row("output", str(info.output_number))
    if detail.source:
        facts.add_row("from context", detail.source)
    if detail.had_think:
        facts.add_row("thinking", "kept in KV, hidden from the text")
    return Group(facts, Text(""), Text(info.text))


def stats_table(stats: CacheStats) -> RenderableType:
    table = Table.grid(padding=(0, 2))
    table.add_row(
        "blocks",
        f"{stats.num_used} used · {stats.num_pinned} pinned · {stats.num_cached} cached · "
        f"{stats.num_free} free · {stats.num_blocks} total",
    )
    table.add_row(
        "tokens",
        f"{stats.num_used * stats.block_size:,} in used blocks · "
        f"{stats.num_blocks * stats.block_size:,} in all (the KV budget)",
    )
    table.add_row("block size", f"{stats.block_size} tokens · {human_bytes(stats.bytes_per_block)}")
    table.add_row(
        "KV memory",
        f"{human_bytes(stats.num_used * stats.bytes_per_block)} used of {human_bytes(stats.bytes_total)}",
    )
    table.add_row("hit rate", f"{stats.hit_rate:.1%} ({stats.hit_tokens} of {stats.lookup_tokens} tokens)")
    return table


def fidelity_table(report: FidelityReport) -> RenderableType:
    table = Table.grid(padding=(0, 2))
    table.add_row("mode", f"{report.mode} vs full recompute")
    first, compared = report.first_difference, report.greedy_tokens
    if first is None:
        table.add_row("logits", f"identical at all {compared} positions, to the bit")
    else:
        table.add_row("logits", f"first differ at position {first + 1} of {compared}")
    table.add_row("KL divergence", f"{report.kl_divergence:.3g}")
    table.add_row("next token", "same top-1" if report.top1_agree else "different top-1")
    table.add_row("top-5 overlap", f"{report.top5_overlap} of 5")
    table.add_row("max logit diff", f"{report.max_logit_diff:.3g}")
    table.add_row("greedy agrees", f"{report.greedy_agree} of {report.greedy_tokens} leading tokens")
    table.add_row("top-1 rate", f"{report.top1_rate:.0%} of {report.greedy_tokens} positions")
    table.add_row(
        "tokens",
        f"{report.reused_tokens} reused · {report.repositioned_tokens} repositioned · "
        f"{report.computed_tokens} computed",
    )
    return table


def inference_line(result: InferenceResult) -> Text:
    finish = result.finish_reason
    if finish == "cancelled":
        finish = "cancelled — output truncated" if result.token_ids else "cancelled before the first token"
    parts = [
        f"tokens: {result.reused_tokens} reused · {result.repositioned_tokens} repositioned · "
        f"{result.computed_tokens} computed",
        f"ttft {result.ttft_s:.2f} s",
        f"{result.decode_tok_s:.1f} tok/s",
        finish,
    ]
    if result.drafted_tokens:
        parts.insert(
            3, f"drafts {result.acceptance:.0%} accepted ({result.accepted_tokens}/{result.drafted_tokens})"
        )
    if result.output_number is not None:
        parts.append(f"output {result.output_number}")
    return Text(" · ".join(parts), style="warning" if result.finish_reason == "cancelled" else "muted")


def needs_chunk_table(result: InferenceResult) -> bool:
    """True when some chunk was not simply reused; the last chunk (the new turn or query) and the
    answer prompt after it are always computed."""
    chunks = [c for c in result.chunks if c.role is not None]
    return result.repositioned_tokens > 0 or any(c.num_computed for c in chunks[:-1])


def chunk_reports_table(reports: list[ChunkReport]) -> RenderableType:
    repaired = any(r.num_recomputed for r in reports)
    columns = ["id", "role", "tokens", "reused", "repositioned", "computed"] + (
        ["recomputed"] if repaired else []
    )
    table = Table(*columns, box=None, pad_edge=False)
    for r in reports:
        cells = [r.chunk_id or "", str(r.role) if r.role else "answer prompt", str(r.num_tokens)]
        cells += [str(r.num_reused), str(r.num_repositioned), str(r.num_computed)]
        table.add_row(*cells, *([str(r.num_recomputed)] if repaired else []))
    return table


def settings_table(view: SettingsView) -> RenderableType:
    table = Table("setting", "value", box=None, pad_edge=False)
    for key, value in view.values.items():
        table.add_row(key, shown_value(value, view.resolved.get(key)))
    return table


def info_table(info: ModelInfo) -> RenderableType:
    table = Table.grid(padding=(0, 2))
    table.add_row("model", info.model_id)
    table.add_row("source", info.source or "—")
    table.add_row("family", f"{info.family} ({info.architecture})")
    table.add_row("parameters", f"{info.num_parameters:,} ({info.num_parameters / 1e6:.0f}M)")
    table.add_row("dtype", info.dtype)
    table.add_row("quantization", info.quantization)
    table.add_row("decode", info.decode)
    if info.kernels:
        table.add_row("kernels", info.kernels)
    if info.cpu_tier:
        table.add_row("cpu tier", info.cpu_tier)
    table.add_row("batch-invariant", "yes" if info.batch_variance is None else f"no: {info.batch_variance}")
    context = f"{info.context_length:,} tokens" if info.context_length else "not stated"
    table.add_row("context length", context)
    template = info.chat_template
    if info.default_system_prompt:
        template += f"; with no system prompt it inserts {preview(info.default_system_prompt, 40)!r}"
    table.add_row("chat template", template)
    table.add_row("reuse modes", info.reuse)
    table.add_row(
        "KV budget",
        f"{info.kv_tokens:,} tokens · {human_bytes(info.kv_bytes)} · blocks of {info.block_size} tokens",
    )
    table.add_row("device", info.device)
    table.add_row("threads", str(info.threads))
    return table


def help_view(view: HelpView) -> RenderableType:
    if view.topic is not None:
        cmd = view.topic
        aliases = f"  (also {', '.join('/' + a for a in cmd.aliases)})" if cmd.aliases else ""
        details = f"\n\n{cmd.details}" if cmd.details else ""
        return Text.assemble((cmd.synopsis, "id"), aliases, "\n", cmd.summary, details)
    table = Table.grid(padding=(0, 2))
    table.add_row(Text("TEXT", style="id"), "Chat: add a user turn, generate the answer")
    for cmd in view.commands:
        table.add_row(Text(cmd.synopsis, style="id"), cmd.summary)
    return table
