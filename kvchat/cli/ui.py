"""All of kvchat's printing: one themed rich console for results, its twin on stderr for progress bars
and fatal errors (so `--json` on stdout stays pure JSON)."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any, Literal

from rich.console import Console, RenderableType
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.text import Text
from rich.theme import Theme

from kvchat.chunks.blockmap import BlockMap
from kvchat.chunks.reports import AttentionReport, Comparison, FidelityReport
from kvchat.chunks.types import CacheStats, ChunkDetail, InferenceResult
from kvchat.cli import cacheviews, jsonout, views
from kvchat.cli.results import (
    ChunkChange,
    ChunkHeat,
    ChunkList,
    HelpView,
    Notice,
    OutputList,
    Quit,
    SettingsView,
)
from kvchat.cli.softwrap import SoftWrap
from kvchat.cli.start_progress import start_progress
from kvchat.engine.records import GenerationStep, PrefillProgress
from kvchat.models.info import ModelInfo

if TYPE_CHECKING:
    from kvchat.models.progress import ProgressCallback

THEME = Theme(
    {
        "error": "bold red",
        "warning": "yellow",
        "ok": "green",
        "id": "cyan",
        "muted": "dim",
        "thinking": "dim italic",
        "prompt": "bold",
    }
)


class UI:
    """Renders records as text (or as JSON lines with `json_lines`), streams model text as it comes."""

    def __init__(
        self,
        *,
        color: bool = True,
        json_lines: bool = False,
        debug: bool = False,
        file: IO[str] | None = None,
        err_file: IO[str] | None = None,
    ) -> None:
        # color_system=None strips every escape code, styles included, not just colors.
        system: Literal["auto"] | None = "auto" if color else None
        self.console = Console(file=file, theme=THEME, color_system=system, highlight=False)
        self.err_console = Console(
            file=err_file, stderr=err_file is None, theme=THEME, color_system=system, highlight=False
        )
        self.json_lines = json_lines
        self.debug = debug
        self._open_kind: str | None = None  # "text"/"thinking" while a stream of that kind is shown
        self._line_open = False  # the last streamed text did not end its line
        self._wrap: SoftWrap | None = None  # breaks streamed text at spaces, on a terminal
        self._prefill_bar: Progress | None = None
        self._prefill_task = TaskID(0)

    def step(self, event: PrefillProgress | GenerationStep, show_thinking: bool = True) -> None:
        """Print one streamed delta (thinking text dim, or not at all when hidden), or move the
        progress bar of a long prefill."""
        if self.json_lines:
            return
        if isinstance(event, PrefillProgress):
            self._prefill_progress(event)
            return
        self._end_prefill()
        if event.thinking and show_thinking:
            self._stream(event.thinking, "thinking")
        if event.text:
            self._stream(event.text, "text")

    def _stream(self, delta: str, kind: str) -> None:
        if self._open_kind not in (None, kind):
            self._end_stream()  # thinking and answer on their own lines
        if self._open_kind is None and self.console.is_terminal:
            self._wrap = SoftWrap(self.console.width)
        self._open_kind = kind
        self._write_stream(self._wrap.feed(delta) if self._wrap else delta)

    def _write_stream(self, text: str) -> None:
        if text:
            style = "thinking" if self._open_kind == "thinking" else None
            self.console.out(text, end="", style=style, highlight=False)
            self._line_open = not text.endswith("\n")

    def _prefill_progress(self, event: PrefillProgress) -> None:
        if not self.err_console.is_terminal:
            return
        if self._prefill_bar is None:
            columns = (TextColumn("prefill"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"))
            self._prefill_bar = Progress(*columns, console=self.err_console, transient=True)
            self._prefill_bar.start()
            self._prefill_task = self._prefill_bar.add_task("prefill", total=event.total)
        self._prefill_bar.update(self._prefill_task, completed=event.done, total=event.total)

    def _end_prefill(self) -> None:
        if self._prefill_bar is not None:
            self._prefill_bar.stop()
            self._prefill_bar = None

    def _end_stream(self) -> None:
        if self._wrap is not None:
            self._write_stream(self._wrap.flush())
        if self._line_open:
            self.console.out("")
        self._open_kind, self._wrap, self._line_open = None, None, False

    def show(self, cmd: str, record: object, line: int | None = None) -> None:
        """Render the record a command returned."""
        self._end_prefill()
        self._end_stream()
        if self.json_lines:
            self._json(jsonout.result_json(cmd, record, line))
            return
        for renderable in _renderables(record):
            self._print(self.console, renderable)

    def answer_done(self, cmd: str, result: InferenceResult) -> None:
        """End a streamed answer shown alone (`kvchat -p`): a newline, or with --json its JSON object."""
        self._end_prefill()
        self._end_stream()
        if self.json_lines:
            self._json(jsonout.result_json(cmd, result))

    def note(self, message: str) -> None:
        """A muted progress line on a terminal's stderr (nothing in scripts or with --json)."""
        if self.err_console.is_terminal and not self.json_lines:
            self._print(self.err_console, Text(message, style="muted"))

    def warn(self, message: str) -> None:
        """One line on stderr about something that worked, but not quite as asked."""
        self._print(self.err_console, Text(f"kvchat: {message}", style="warning"))

    def error(self, cmd: str | None, message: str, line: int | None = None) -> None:
        """One red line on stderr for a command that failed (answers alone go to stdout); with --json
        its JSON object goes to stdout too, in the stream's order. The session goes on."""
        self._end_stream()
        if self.json_lines:
            self._json(jsonout.error_json(cmd, message, line))
        where = f"line {line}: " if line is not None else ""
        self._print(self.err_console, Text(f"error: {where}{message}", style="error"))

    def _json(self, obj: dict[str, Any]) -> None:
        self.console.out(jsonout.dumps(obj), highlight=False)

    def exception(self, exc: BaseException) -> None:
        """The traceback of an unexpected error, shown only with --debug."""
        if self.debug:
            self.err_console.print(Text("".join(traceback.format_exception(exc)), style="muted"))

    def fatal(self, message: str) -> None:
        """The one line shown when kvchat cannot start."""
        self._print(self.err_console, Text(f"kvchat: {message}", style="error"))

    @staticmethod
    def _print(console: Console, renderable: RenderableType) -> None:
        """On a terminal, rich wraps at spaces. Into a pipe or file a one-line result stays one line
        however long, and no line ends in the spaces rich pads table cells with."""
        if console.is_terminal:
            console.print(renderable)
            return
        with console.capture() as captured:
            console.print(renderable, soft_wrap=isinstance(renderable, Text))
        console.file.write("\n".join(line.rstrip() for line in captured.get().split("\n")))
        console.file.flush()

    def banner(self, model_id: str) -> None:
        if not self.json_lines:
            self.console.print(
                Text.assemble(
                    ("kvchat", "prompt"),
                    f" · {model_id} · /help lists the commands, Ctrl-D quits",
                    style="muted",
                )
            )

    @contextmanager
    def progress(self) -> Iterator[ProgressCallback]:
        """What a start shows on stderr (cli/start_progress.py): bars for the model's stages and the
        kernel build on a terminal; elsewhere one line for each slow first-start step and each note."""
        with start_progress(self.err_console) as progress:
            yield progress


def _renderables(record: object) -> list[RenderableType]:
    match record:
        case InferenceResult():
            table = [views.chunk_reports_table(record.chunks)] if views.needs_chunk_table(record) else []
            return [views.inference_line(record), *table]
        case ChunkChange():
            return [views.chunk_line(record)]
        case ChunkList(chunks=chunks):
            return [views.chunks_table(chunks)]
        case OutputList(outputs=outputs):
            return [views.outputs_table(outputs)]
        case ChunkDetail():
            return [views.detail_view(record)]
        case CacheStats():
            return [views.stats_table(record)]
        case FidelityReport():
            return [views.fidelity_table(record)]
        case SettingsView():
            return [views.settings_table(record)]
        case BlockMap():
            return [cacheviews.BlocksView(record)]
        case AttentionReport():
            return [cacheviews.AttentionView(record)]
        case Comparison():
            return [cacheviews.CompareView(record)]
        case ChunkHeat():
            return [cacheviews.heat_view(record)]
        case HelpView():
            return [views.help_view(record)]
        case ModelInfo():
            return [views.info_table(record)]
        case Notice(text=text):
            return [Text(text, style="ok")]
        case Quit():
            return []
    raise TypeError(f"no view for {type(record).__name__}")
