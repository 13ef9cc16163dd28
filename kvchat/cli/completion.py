"""Tab completion from the command registry and the session's live state."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document

from kvchat.chunks.types import ReuseMode
from kvchat.cli.commands import Shell
from kvchat.cli.settings import setting_info, setting_values, shown_value
from kvchat.cli.slash_commands import PREFIX, ArgKind
from kvchat.cli.views import preview
from kvchat.errors import KvchatError
from kvchat.settings_schema import all_settings


class ShellCompleter(Completer):
    """Completes command names (with their help as meta), then each command's kind of argument."""

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self._paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterator[Completion]:
        text = document.text_before_cursor
        if not text.startswith(PREFIX) or "\n" in text:
            return
        name, space, arg = text[len(PREFIX) :].partition(" ")
        if not space:
            yield from self._command_names(name)
            return
        try:
            kind = self.shell.commands.get(name).arg
        except KvchatError:
            return
        if kind is ArgKind.PATH or (kind is ArgKind.TEXT_OR_FILE and arg.startswith("@")):
            yield from self._path(arg.removeprefix("@"), complete_event)
        elif kind is ArgKind.SETTING and arg.count(" ") == 1:
            key, _, value = arg.partition(" ")
            yield from _matching(_setting_choices(key), value)
        elif " " not in arg:
            yield from _matching(self._candidates(kind), arg)

    def _command_names(self, typed: str) -> Iterator[Completion]:
        for cmd in self.shell.commands:
            for name in (cmd.name, *cmd.aliases):
                if name.startswith(typed):
                    yield Completion(PREFIX + name, -len(typed) - len(PREFIX), display_meta=cmd.summary)

    def _candidates(self, kind: ArgKind) -> list[tuple[str, str]]:
        ctx = self.shell.ctx
        if kind is ArgKind.OUTPUT:
            return [(str(o.output_number), preview(o.text, 40)) for o in ctx.outputs()]
        if kind is ArgKind.CHUNK:
            chunks = ctx.chunks()
            by_number = [(str(c.number), f"{c.role}: {preview(c.text, 36)}") for c in chunks]
            return by_number + [(c.chunk_id, f"#{c.number} {c.role}") for c in chunks]
        if kind is ArgKind.SETTING:
            values = setting_values(self.shell.settings)
            return [
                (key, f"{shown_value(values[key])} · {info.spec.help}")
                for key, info in all_settings().items()
            ]
        if kind is ArgKind.MODE:
            return [(mode.value, "") for mode in ReuseMode]
        if kind is ArgKind.COMMAND:
            return [(cmd.name, cmd.summary) for cmd in self.shell.commands]
        return []

    def _path(self, typed: str, event: CompleteEvent) -> Iterable[Completion]:
        return self._paths.get_completions(Document(typed, len(typed)), event)


def _setting_choices(key: str) -> list[tuple[str, str]]:
    """The values a setting takes, where they are few: its choices, or true and false."""
    try:
        info = setting_info(key)
    except KvchatError:
        return []
    if info.value_type is bool:
        return [("true", ""), ("false", "")]
    return [(choice, "") for choice in info.spec.choices]


def _matching(candidates: list[tuple[str, str]], typed: str) -> Iterator[Completion]:
    for value, meta in candidates:
        if value.startswith(typed):
            yield Completion(value, -len(typed), display_meta=meta or None)
