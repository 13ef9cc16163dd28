"""How model loading reports progress, and tells what it did about its caches, without knowing who
displays either."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import Protocol, TypeVar, runtime_checkable

from transformers import modeling_gguf_pytorch_utils as gguf_utils
from transformers.utils import logging as hf_logging

T = TypeVar("T")


class ProgressCallback(Protocol):
    """Receives progress: `completed` of `total` steps; `total` None when the length is unknown."""

    def __call__(self, description: str, completed: float, total: float | None) -> None: ...


@runtime_checkable
class Notes(Protocol):
    """A progress callback that also takes notes: one line each, about a cache rebuilt or not kept."""

    def note(self, message: str) -> None: ...


def report(
    progress: ProgressCallback | None, description: str, completed: float, total: float | None
) -> None:
    """Call `progress` if there is one."""
    if progress is not None:
        progress(description, completed, total)


def tell(progress: ProgressCallback | None, message: str) -> None:
    """Give `progress` a note (`kvchat: ...` on the screen) where it takes notes."""
    if isinstance(progress, Notes):
        progress.note(message)


@contextmanager
def quiet_transformers(progress: ProgressCallback | None = None, description: str = "") -> Iterator[None]:
    """Hide transformers' own tqdm bars: progress goes through the callback, and the UI owns the terminal.

    A GGUF being dequantized meanwhile reports its tensors, done of total, to `progress` as `description`.
    """
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # The GGUF dequantizer calls tqdm directly over its tensors, ignoring the switch above.
    original_tqdm = getattr(gguf_utils, "tqdm", None)
    if original_tqdm is not None:
        gguf_utils.tqdm = functools.partial(_reporting, progress, description)
    try:
        yield
    finally:
        if original_tqdm is not None:
            gguf_utils.tqdm = original_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _reporting(
    progress: ProgressCallback | None, description: str, items: Iterable[T], *args: object, **kwargs: object
) -> Iterator[T]:
    total = len(items) if isinstance(items, Sized) else None
    for done, item in enumerate(items):
        report(progress, description, done, total)
        yield item
    if total is not None:
        report(progress, description, total, total)
