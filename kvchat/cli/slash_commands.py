"""Slash commands as data: a decorator marks handlers, a registry collects them per object.

A handler is a method of the shell or a function of a command module taking the shell's state
(`ShellState`) first; the shell names the modules whose commands it offers, and its registry binds
them to it. `/help`, completion and the "did you mean" hint all read the registry, so a command
exists in one place only. The registry belongs to the object it binds (the shell), never to a module.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from kvchat.errors import CommandError

if TYPE_CHECKING:
    from kvchat.chunks.contract import ContextManagerContract
    from kvchat.config import ModelSettings, Settings

PREFIX = "/"
SUGGEST_CUTOFF = 0.75  # difflib similarity: one typo in a short name (/stat, /quti), not /bogus for /blocks
_MARK = "_kvchat_command"


class ArgKind(StrEnum):
    """What a command's argument names, so completion can offer the right things."""

    NONE = "none"
    TEXT = "text"
    TEXT_OR_FILE = "text-or-file"  # text, or @PATH for a file's text
    OUTPUT = "output"  # a retained output number
    CHUNK = "chunk"  # a chunk number or id prefix
    SETTING = "setting"
    MODE = "mode"
    COMMAND = "command"
    PATH = "path"


@dataclass(frozen=True)
class Command:
    """One slash command: its names, its one-line help, the bound handler, and the longer help
    (arguments, defaults, what each number it shows means) that `/help NAME` prints."""

    name: str
    summary: str
    usage: str  # argument synopsis, e.g. "N|ID", "[N]" when optional; empty when the command takes none
    aliases: tuple[str, ...]
    arg: ArgKind
    handler: Callable[[str], Any]
    details: str = ""
    destructive: bool = False  # deletes what cannot be had back: never offered as "did you mean"

    @property
    def needs_argument(self) -> bool:
        return bool(self.usage) and not self.usage.startswith("[")

    @property
    def synopsis(self) -> str:
        return f"{PREFIX}{self.name} {self.usage}".rstrip()


class ShellState(Protocol):
    """What a command module's handler reads and sets of the shell that runs it."""

    ctx: ContextManagerContract  # all the CLI may use of its manager; the cache views ask for the real one
    settings: Settings  # /set replaces it
    started_model: ModelSettings  # what /info describes; /set model.* waits for a restart
    config_file: Path  # where /set says a setting can be kept
    notify: Callable[[str], None] | None  # progress of a long command, one line each
    commands: CommandRegistry


def command(
    name: str,
    summary: str,
    *,
    usage: str = "",
    aliases: tuple[str, ...] = (),
    arg: ArgKind = ArgKind.NONE,
    details: str | None = None,
    destructive: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a method `(self, arg: str) -> record`, or a command module's function `(shell: ShellState,
    arg: str) -> record`, as the handler of `/name`; its docstring is the longer help unless `details`
    (text built from data, such as the settings schema) is given."""

    def mark(func: Callable[..., Any]) -> Callable[..., Any]:
        text = (inspect.getdoc(func) or "") if details is None else details
        cmd = Command(name, summary, usage, aliases, arg, func, text, destructive)
        setattr(func, _MARK, cmd)  # bound per owner later
        return func

    return mark


class CommandRegistry:
    """The commands of one owner object: its class's, then each module's, in the order written."""

    def __init__(self, owner: object, modules: Iterable[ModuleType] = ()) -> None:
        self._commands: dict[str, Command] = {}
        self._names: dict[str, str] = {}  # name or alias -> name
        for attr in _marked_attributes(type(owner)):
            unbound: Command = getattr(getattr(type(owner), attr), _MARK)
            self._add(replace(unbound, handler=getattr(owner, attr)))
        for module in modules:
            for func in _marked_functions(module):
                self._add(replace(getattr(func, _MARK), handler=functools.partial(func, owner)))

    def _add(self, cmd: Command) -> None:
        for name in (cmd.name, *cmd.aliases):
            assert name not in self._names, f"command /{name} registered twice"
            self._names[name] = cmd.name
        self._commands[cmd.name] = cmd

    def __iter__(self) -> Iterator[Command]:
        return iter(self._commands.values())

    def get(self, name: str) -> Command:
        """The command called `name` (or an alias); CommandError with the closest match otherwise."""
        if name in self._names:
            return self._commands[self._names[name]]
        offered = [n for n, cmd_name in self._names.items() if not self._commands[cmd_name].destructive]
        close = difflib.get_close_matches(name, offered, n=1, cutoff=SUGGEST_CUTOFF)
        hint = f"; did you mean {PREFIX}{close[0]}?" if close else f"; {PREFIX}help lists the commands"
        raise CommandError(f"unknown command {PREFIX}{name}{hint}")


def _marked_attributes(cls: type) -> list[str]:
    # Definition order (not alphabetical) so /help reads in the order the commands were written.
    seen: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        for attr, value in vars(klass).items():
            if inspect.isfunction(value) and hasattr(value, _MARK):
                seen[attr] = None
    return list(seen)


def _marked_functions(module: ModuleType) -> list[Callable[..., Any]]:
    # The module's own handlers (not ones it imports), in the order it defines them.
    return [
        value
        for value in vars(module).values()
        if inspect.isfunction(value) and hasattr(value, _MARK) and value.__module__ == module.__name__
    ]


def split_command(line: str) -> tuple[str, str] | None:
    """`"/name rest"` -> `("name", "rest")`; None when the line is not a command (plain chat text).

    The argument starts after the first run of whitespace, newlines included, so a block of text
    joined under a command line becomes its argument.
    """
    match = _COMMAND_RE.fullmatch(line.strip())
    return (match[1], match[2]) if match else None


_COMMAND_RE = re.compile(rf"{re.escape(PREFIX)}(\S*)\s*(.*)", re.DOTALL)


def join_block(head: str, body: list[str]) -> str:
    """A command line and the lines of a block under it, as one command: the block is its argument."""
    text = "\n".join(body).strip("\n")
    return f"{head}\n{text}" if head else text
