"""Fault injection for the tests that interrupt an operation anywhere: one counter over many methods."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import pytest


class FaultCounter:
    """Counts calls into the methods it wraps and raises `fault` at call number `at`."""

    def __init__(self, at: int, fault: type[BaseException]) -> None:
        self.at, self.fault, self.num_calls = at, fault, 0

    def wrap(self, method):
        def faulty(*args, **kwargs):
            self.num_calls += 1
            if self.num_calls == self.at:
                raise self.fault("injected")
            return method(*args, **kwargs)

        return faulty


@contextmanager
def fault_at(
    targets: Iterable[tuple[object, str]], at: int, fault: type[BaseException]
) -> Iterator[FaultCounter]:
    """Raise `fault` at the `at`-th call into any of the (owner, method name) `targets`, undone on exit."""
    counter = FaultCounter(at, fault)
    with pytest.MonkeyPatch.context() as mp:
        for owner, name in targets:
            mp.setattr(owner, name, counter.wrap(getattr(owner, name)))
        yield counter
