"""What kvchat shows while it starts: a bar for each stage of loading the model and, beside it, one for
the kernel build running meanwhile (on a terminal); one line each for the slow first-start steps and for
each note about a cache (in scripts and `-p`, on stderr)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

# How kvchat's slow first-start steps are described (not imported: that would import torch).
CONVERTING = "converting"  # kvchat.models.gguf.CONVERTING
BUILDING = "building kvchat's kernels"  # kvchat.native.build.BUILDING


class StartProgress:
    """The progress callback of a start, with notes (kvchat.models.progress.Notes). The kernel build
    reports from a thread of its own, in parallel with the model's stages: each has a line."""

    def __init__(self, console: Console, bar: Progress | None) -> None:
        self.console, self.bar = console, bar
        self._lock = threading.Lock()
        self._tasks: dict[str, tuple[str, TaskID]] = {}  # line ("build" or "load") -> description, task
        self._told: set[str] = set()

    def __call__(self, description: str, completed: float, total: float | None) -> None:
        with self._lock:
            if self.bar is None:
                self._tell_once(description, total)
            else:
                self._update(self.bar, description, completed, total)

    def note(self, message: str) -> None:
        """One line about a cache: rebuilt, or not kept."""
        with self._lock:
            line = Text(f"kvchat: {message}", style="warning")
            if self.bar is not None:
                self.bar.console.print(line)
            else:
                self.console.print(line, soft_wrap=True)

    def _update(self, bar: Progress, description: str, completed: float, total: float | None) -> None:
        line = "build" if description.startswith(BUILDING) else "load"
        shown = self._tasks.get(line)
        if shown is None or (line == "load" and shown[0] != description):
            if shown is not None:
                bar.remove_task(shown[1])
            shown = (description, bar.add_task(description, total=total))
            self._tasks[line] = shown
        bar.update(shown[1], description=description, completed=completed, total=total)

    def _tell_once(self, description: str, total: float | None) -> None:
        """Without a terminal, only the slow steps of a first start are told, once each."""
        head = description.partition(":")[0]
        if head.startswith(CONVERTING) and head not in self._told:
            self._told.add(head)
            self._line(f"{head}, into the cache; later starts skip this")
        elif head.startswith(BUILDING) and total and BUILDING not in self._told:
            self._told.add(BUILDING)
            files = f"{int(total)} file{'s' if total != 1 else ''}"
            self._line(
                f"{BUILDING} for this CPU ({files}, once) while the model loads; later starts skip this"
            )

    def _line(self, text: str) -> None:
        self.console.print(Text(f"kvchat: {text}", style="muted"), soft_wrap=True)


@contextmanager
def start_progress(console: Console) -> Iterator[StartProgress]:
    """Bars on a terminal (gone when the start is done), lines elsewhere."""
    if not console.is_terminal:
        yield StartProgress(console, None)
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(show_speed=False),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        yield StartProgress(console, bar)
