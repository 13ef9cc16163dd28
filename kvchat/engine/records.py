"""Records the engine streams that the CLI handles too; plain data, so importing them loads no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillProgress:
    """A prompt longer than one prefill piece reports each piece before the first token."""

    done: int  # prompt tokens computed so far by this prefill
    total: int  # prompt tokens this prefill computes
