"""Keeping Ctrl-C out of the few steps that must run to the end once started."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_ignored() -> Iterator[None]:
    """Ignore SIGINT while the block runs. For a step that ends an operation already stopping (closing
    a cancelled turn): a second Ctrl-C there would lose the answer and stop nothing sooner. Outside the
    main thread, or under a handler Python did not install, this changes nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
