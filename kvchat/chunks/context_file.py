"""A ContextManager's session written to a file, and read back and staged for it to swap in (persist
holds the format)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.chunks import persist

if TYPE_CHECKING:
    from kvchat.chunks.chunk import Chunk
    from kvchat.chunks.context import ContextManager
    from kvchat.engine.block_manager import Sequence


def save_session(cm: ContextManager, path: Path) -> int:
    """Write the chunks, the context and their KV to `path`; returns the number of chunks saved."""
    context = persist.Context(cm.system, cm.middle, cm.turns, cm.query)
    chunks = list(cm.registry.chunks.values())
    return persist.save(cm.engine, _layout(cm), chunks, context, cm.live, Path(path))


def stage_session(cm: ContextManager, path: Path) -> tuple[persist.SavedState, Sequence | None, list[Chunk]]:
    """The session saved in `path`, checked whole, with its KV staged beside `cm`'s: the saved session,
    its live sequence and its chunks, for `cm` to swap in (or to `persist.unstage`)."""
    saved = persist.read(cm.engine, _layout(cm), Path(path))
    live, chunks = persist.stage(cm.engine, saved)
    return saved, live, chunks


def _layout(cm: ContextManager) -> dict[str, object]:
    return persist.layout(cm.engine, cm.model_id, cm.fingerprint)
