"""A ContextManager's session written to a file and read back in its place (persist holds the format)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.chunks import persist
from kvchat.interrupts import interrupts_ignored

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager


def save_session(cm: ContextManager, path: Path) -> int:
    """Write the chunks, the context and their KV to `path`; returns the number of chunks saved."""
    context = persist.Context(cm.system, cm.middle, cm.turns, cm.query)
    chunks = list(cm.registry.chunks.values())
    return persist.save(cm.engine, _layout(cm), chunks, context, cm.live, Path(path))


def load_session(cm: ContextManager, path: Path) -> int:
    """Replace the session with the one saved in `path`; returns the number of chunks. The whole file is
    checked and its KV staged beside the session before one swap: a file refused, too big or
    interrupted changes nothing."""
    saved = persist.read(cm.engine, _layout(cm), Path(path))
    live, chunks = persist.stage(cm.engine, saved)
    committed = False
    try:
        with interrupts_ignored():  # the swap is bookkeeping over ints: once begun, it runs to the end
            cm.reset()
            cm.registry.restore(chunks)
            cm.live, committed = live, True
            c = saved.context
            cm.system, cm.middle, cm.turns, cm.query = c.system, c.middle, c.turns, c.query
            if live is not None:
                cm.engine.index(live)
    finally:
        if not committed:
            persist.unstage(cm.engine, live, chunks)
    return len(chunks)


def _layout(cm: ContextManager) -> dict[str, object]:
    return persist.layout(cm.engine, cm.model_id, cm.fingerprint)
