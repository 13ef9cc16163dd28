"""The records command handlers return beside those of kvchat.chunks.types. The UI renders them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvchat.chunks.types import ChunkDetail, ChunkInfo
from kvchat.cli.slash_commands import Command


@dataclass(frozen=True)
class ChunkChange:
    """One chunk that a command added, replaced or removed."""

    action: str  # past tense, e.g. "added", "dropped"
    chunk: ChunkInfo


@dataclass(frozen=True)
class ChunkList:
    chunks: list[ChunkInfo]


@dataclass(frozen=True)
class OutputList:
    outputs: list[ChunkInfo]


@dataclass(frozen=True)
class Notice:
    """A state change with nothing more to show than one line; `data` goes into --json."""

    text: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SettingsView:
    values: dict[str, Any]  # dotted key -> value
    resolved: dict[str, str] = field(default_factory=dict)  # dotted key -> what it resolved to


@dataclass(frozen=True)
class HelpView:
    commands: list[Command]
    topic: Command | None = None  # `/help NAME`: the one command asked about


@dataclass(frozen=True)
class Quit:
    """Ends the session."""


@dataclass(frozen=True)
class ChunkHeat:
    """`/show N heat`: a chunk's tokens with the share of the last answer's attention each drew."""

    detail: ChunkDetail
    output_number: int
    pieces: list[str]  # each token's text; joined, the chunk's decoded text
    weights: list[float]  # each token's share of the answer's attention (all chunks' sum to 1)
