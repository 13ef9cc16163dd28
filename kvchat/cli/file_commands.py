"""/save and /load: the session to and from a state file. The shell offers them with its own
commands (kvchat.cli.commands.COMMAND_MODULES)."""

from __future__ import annotations

from kvchat.cli import cache_commands
from kvchat.cli.results import Notice
from kvchat.cli.slash_commands import ArgKind, ShellState, command
from kvchat.errors import CommandError
from kvchat.paths import user_path


@command("save", "Save chunks, outputs and their KV to FILE", usage="FILE", arg=ArgKind.PATH)
def save(shell: ShellState, arg: str) -> Notice:
    """Writes every chunk and retained output with its KV, and the context, to one safetensors file
    (atomically: a failed save leaves the old file). The file records the model and KV layout.
    """
    path = user_path(arg)
    with cache_commands.cancellable("save", f"; {path} is as it was"):
        num_chunks = shell.ctx.save(path)
    return Notice(f"saved {num_chunks} chunks to {path}", {"path": str(path), "num_chunks": num_chunks})


@command("load", "Load chunks, outputs and their KV from FILE", usage="FILE", arg=ArgKind.PATH)
def load(shell: ShellState, arg: str) -> Notice:
    """Replaces the session's chunks, outputs, context and KV with those saved in FILE. A file made
    for another model, dtype or block size, or a damaged one, is refused and the session is kept
    (the first fault is named); so is a load stopped with Ctrl-C.
    """
    path = user_path(arg)
    if path.is_dir():
        raise CommandError(f"{path} is a directory, not a state file")
    if not path.exists():
        raise CommandError(f"no such file: {path}")
    with cache_commands.cancellable("load", "; the session is as it was"):
        num_chunks = shell.ctx.load(path)
    return Notice(f"loaded {num_chunks} chunks from {path}", {"path": str(path), "num_chunks": num_chunks})
