"""The shell: one session's context manager and settings, and the slash commands that act on them.

Handlers check their argument, call the context manager and return a record; they never print.
Bad input raises a KvchatError before anything changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.chunks.types import CacheStats, ChunkDetail, FidelityReport, ReuseMode
from kvchat.cli.registry import ArgKind, Command, CommandRegistry, command, split_command
from kvchat.cli.results import (
    ChunkChange,
    ChunkList,
    HelpView,
    Inference,
    Notice,
    OutputList,
    Quit,
    SettingsView,
)
from kvchat.cli.settings import setting_key, setting_values
from kvchat.config import replace_setting
from kvchat.errors import CommandError
from kvchat.session import repair_policy

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager
    from kvchat.config import Settings

# Settings the session reads as it goes; the others are read once, when kvchat starts.
LIVE_SETTINGS = ("sampling.", "reuse.mode", "reuse.repair_", "reuse.verify_tokens", "ui.show_thinking")


class Shell:
    """What the REPL and the script runner drive: `execute` one line, get a record back."""

    def __init__(self, ctx: ContextManager, settings: Settings) -> None:
        self.ctx = ctx
        self.settings = settings
        self.commands = CommandRegistry(self)

    def execute(self, line: str) -> tuple[str, Any]:
        """Run one line (plain text is a chat turn); returns the command's name and its record."""
        parts = split_command(line)
        if parts is None:
            return "chat", self.chat(line)
        name, arg = parts
        cmd = self.commands.get(name)
        if arg and not cmd.usage:
            raise CommandError(f"{cmd.synopsis} takes no argument")
        if not arg and cmd.needs_argument:
            raise CommandError(f"missing argument: {cmd.synopsis}")
        return cmd.name, cmd.handler(arg)

    def chat(self, text: str) -> Inference:
        if not text.strip():
            raise CommandError("empty message")
        return Inference(self.ctx.chat(text.strip(), self.settings.sampling))

    @command("system", "Set the system prompt", usage="TEXT", arg=ArgKind.TEXT)
    def system(self, arg: str) -> ChunkChange:
        return ChunkChange("system prompt set", self.ctx.set_system(arg))

    @command(
        "context",
        "Add a context chunk: text, or @FILE for a file's text",
        usage="TEXT|@FILE",
        arg=ArgKind.TEXT_OR_FILE,
    )
    def context(self, arg: str) -> ChunkChange:
        text = _read_text(Path(arg[1:]).expanduser()) if arg.startswith("@") else arg
        return ChunkChange("added", self.ctx.add_context(text))

    @command("query", "Set the query that /infer answers", usage="TEXT", arg=ArgKind.TEXT)
    def query(self, arg: str) -> ChunkChange:
        return ChunkChange("query set", self.ctx.set_query(arg))

    @command("infer", "Generate from the current context and query")
    def infer(self, arg: str) -> Inference:
        return Inference(self.ctx.infer(self.settings.sampling))

    @command("output", "List the retained outputs")
    def output(self, arg: str) -> OutputList:
        return OutputList(self.ctx.outputs())

    @command("use-output", "Add retained output N to the context", usage="N", arg=ArgKind.OUTPUT)
    def use_output(self, arg: str) -> ChunkChange:
        return ChunkChange("added output", self.ctx.use_output(_count(arg)))

    @command("delete-output", "Delete retained output N", usage="N", arg=ArgKind.OUTPUT)
    def delete_output(self, arg: str) -> ChunkChange:
        return ChunkChange("deleted output", self.ctx.delete_output(_count(arg)))

    @command("chunks", "List every chunk: role, id, tokens, blocks, references, place")
    def chunks(self, arg: str) -> ChunkList:
        return ChunkList(self.ctx.chunks())

    @command("show", "Show one chunk: text, tokens, positions, blocks", usage="N|ID", arg=ArgKind.CHUNK)
    def show(self, arg: str) -> ChunkDetail:
        return self.ctx.chunk(arg)

    @command("drop", "Remove a chunk from the context", usage="N|ID", arg=ArgKind.CHUNK)
    def drop(self, arg: str) -> ChunkChange:
        return ChunkChange("dropped", self.ctx.drop(arg))

    @command("clear", "Empty the context; chunks and outputs are kept")
    def clear(self, arg: str) -> Notice:
        self.ctx.clear()
        return Notice("context cleared; chunks and outputs kept")

    @command("reset", "Delete every chunk and output; free every block")
    def reset(self, arg: str) -> Notice:
        self.ctx.reset()
        return Notice("everything deleted; every block is free")

    @command("stats", "KV cache blocks, bytes and hit rate")
    def stats(self, arg: str) -> CacheStats:
        return self.ctx.stats()

    @command("set", "Change a setting, or list them all", usage="[KEY VALUE]", arg=ArgKind.SETTING)
    def set(self, arg: str) -> SettingsView | Notice:
        if not arg:
            return SettingsView(setting_values(self.settings))
        typed_key, _, value = arg.partition(" ")
        if not value.strip():
            raise CommandError("missing argument: /set KEY VALUE")
        key = setting_key(typed_key)
        settings = replace_setting(self.settings, key, value.strip())
        new_value = setting_values(settings)[key]
        if key == "reuse.mode":
            self.ctx.mode = ReuseMode(new_value)
        if key.startswith("reuse.repair_"):
            self.ctx.repair = repair_policy(settings.reuse)
        self.settings = settings
        later = "" if key.startswith(LIVE_SETTINGS) else " (takes effect when kvchat starts again)"
        return Notice(f"{key} = {new_value}{later}", {"key": key, "value": new_value})

    @command(
        "mode",
        "Show or choose how cached chunks are reused",
        usage="[exact|reposition|repair]",
        arg=ArgKind.MODE,
    )
    def mode(self, arg: str) -> Notice:
        if arg:
            self.set(f"reuse.mode {arg}")  # one path keeps the setting and the context manager agreeing
        return Notice(f"reuse mode: {self.ctx.mode}", {"mode": str(self.ctx.mode)})

    @command(
        "verify", "Compare the reuse mode with a full recompute over N tokens", usage="[N]", arg=ArgKind.TEXT
    )
    def verify(self, arg: str) -> FidelityReport:
        return self.ctx.verify(_count(arg) if arg else self.settings.reuse.verify_tokens)

    @command("save", "Save chunks, outputs and their KV to FILE", usage="FILE", arg=ArgKind.PATH)
    def save(self, arg: str) -> Notice:
        path = Path(arg).expanduser()
        num_chunks = self.ctx.save(path)
        return Notice(f"saved {num_chunks} chunks to {path}", {"path": str(path), "num_chunks": num_chunks})

    @command("load", "Load chunks, outputs and their KV from FILE", usage="FILE", arg=ArgKind.PATH)
    def load(self, arg: str) -> Notice:
        path = Path(arg).expanduser()
        if not path.is_file():
            raise CommandError(f"no such file: {path}")
        num_chunks = self.ctx.load(path)
        return Notice(
            f"loaded {num_chunks} chunks from {path}", {"path": str(path), "num_chunks": num_chunks}
        )

    @command("help", "List the commands, or explain one", usage="[COMMAND]", arg=ArgKind.COMMAND)
    def help(self, arg: str) -> HelpView:
        topic: Command | None = self.commands.get(arg.removeprefix("/")) if arg else None
        return HelpView(list(self.commands), topic)

    @command("quit", "Leave kvchat", aliases=("exit",))
    def quit(self, arg: str) -> Quit:
        return Quit()


def _count(arg: str) -> int:
    try:
        number = int(arg)
    except ValueError:
        raise CommandError(f"not a number: {arg!r}") from None
    if number < 1:
        raise CommandError(f"must be 1 or more: {arg}")
    return number


def _read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CommandError(f"no such file: {path}") from None
    except UnicodeDecodeError as exc:
        raise CommandError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror}") from None
    if not text.strip():
        raise CommandError(f"{path} is empty")
    return text.rstrip("\n")
