"""The shell: one session's context manager and settings, and the slash commands that act on them;
and `run_line`, which runs one line through it and shows what it returned (the REPL, scripts and
one-shot runs share it).

Handlers check their argument, call the context manager and return a record; they never print.
Bad input raises a KvchatError before anything changes. The shell's own methods are the commands on
the context; the command modules it names (COMMAND_MODULES) add the cache views, the settings, the
state file and the habits, each taking the shell's state as its first argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.chunks.contract import ContextManagerContract
from kvchat.chunks.types import InferenceResult, InferenceStream
from kvchat.cli import cache_commands, file_commands, habit_commands, setting_commands
from kvchat.cli.arguments import count, file_argument, read_text
from kvchat.cli.results import ChunkChange, ChunkList, Notice, OutputList, Quit
from kvchat.cli.settings import user_config_file
from kvchat.cli.slash_commands import ArgKind, CommandRegistry, command, split_command
from kvchat.engine.records import GenerationStep, PrefillProgress
from kvchat.errors import CommandError, KvchatError

if TYPE_CHECKING:
    from kvchat.cli.ui import UI
    from kvchat.config import Settings

# The modules whose commands the shell offers after its own, in the order /help lists them.
COMMAND_MODULES = (cache_commands, setting_commands, file_commands, habit_commands)


class Shell:
    """What the REPL and the script runner drive: `execute` one line, get a record back."""

    ctx: ContextManagerContract  # all the CLI may use of its manager; the cache views ask for the real one

    def __init__(
        self, ctx: ContextManagerContract, settings: Settings, config_file: Path | None = None
    ) -> None:
        self.ctx = ctx
        self._settings = settings  # its reuse.mode is the one the session started with
        self.started_model = settings.model  # what /info describes; /set model.* waits for a restart
        self.config_file = user_config_file(config_file)  # where /set says a setting can be kept
        self.notify: Callable[[str], None] | None = None  # progress of a long command, one line each
        self.commands = CommandRegistry(self, COMMAND_MODULES)

    @property
    def settings(self) -> Settings:
        """The session's settings. The reuse mode among them is the context manager's (`ctx.mode`),
        its one holder, which /set and /mode change through `apply_live_settings`."""
        reuse = dataclasses.replace(self._settings.reuse, mode=str(self.ctx.mode))
        return dataclasses.replace(self._settings, reuse=reuse)

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self._settings = settings

    def execute(self, line: str, parts: tuple[str, str] | None) -> tuple[str, Any]:
        """Run one line, split by the caller (`split_command(line)`; None: plain text, a chat turn);
        returns the command's name and its record."""
        if parts is None:
            return "chat", self.chat(line)
        name, arg = parts
        cmd = self.commands.get(name)
        if arg and not cmd.usage:
            raise CommandError(f"{cmd.synopsis} takes no argument")
        if not arg and cmd.needs_argument:
            raise CommandError(f"missing argument: {cmd.synopsis}")
        return cmd.name, cmd.handler(arg)

    def chat(self, text: str) -> InferenceStream:
        if not text.strip():
            raise CommandError("empty message")
        return self.ctx.chat(text.strip(), self.settings.sampling)

    @command("system", "Set the system prompt", usage="TEXT", arg=ArgKind.TEXT)
    def system(self, arg: str) -> ChunkChange:
        """The chunk every context starts with. Replaces the system prompt in use; the one it replaces
        stays registered (see /chunks). With none set, the chat template's default system prompt (if it
        has one) stands in and is listed as a chunk.
        """
        return ChunkChange("system prompt set", self.ctx.set_system(arg))

    @command(
        "context",
        "Add a context chunk: text, or @FILE for a file's text",
        usage="TEXT|@FILE",
        arg=ArgKind.TEXT_OR_FILE,
    )
    def context(self, arg: str) -> ChunkChange:
        """A passage the model reads before the conversation and the query. Context chunks are placed
        after the system prompt, in the order added; adding the same text again does nothing.
        @FILE reads a UTF-8 text file of at most 16 MiB (a leading ~ is your home directory).
        """
        text = read_text(file_argument(arg[1:])) if arg.startswith("@") else arg
        return ChunkChange("added", self.ctx.add_context(text))

    @command("query", "Set the query that /infer answers", usage="TEXT", arg=ArgKind.TEXT)
    def query(self, arg: str) -> ChunkChange:
        """The question /infer answers, placed last in the context. Replaces the query in use."""
        return ChunkChange("query set", self.ctx.set_query(arg))

    @command("infer", "Generate from the current context and query")
    def infer(self, arg: str) -> InferenceStream:
        """Generates an answer from the current context (system prompt, context chunks and reused
        outputs, conversation turns, query) and keeps it as a retained output. Sampling follows
        /set sampling.* (max_tokens bounds the answer). Ctrl-C stops it and keeps what was generated.

        The line after the answer:
          reused        prompt tokens whose KV came from the cache unchanged (same tokens, same prefix)
          repositioned  prompt tokens whose cached KV was moved to new positions (reposition, repair modes)
          computed      prompt tokens run through the model
          ttft          seconds to the first answer token, composing the context included
          tok/s         answer tokens per second after the first
          then why it ended (stop: end of turn, stop_string, length: max_tokens reached, cancelled:
          Ctrl-C; the last two are truncated) and the output number.
        A table per chunk (tokens, reused, repositioned, computed) follows when a chunk before the new
        one was not simply reused, that is when the cache missed or moved something.
        """
        return self.ctx.infer(self.settings.sampling)

    @command("output", "List the retained outputs")
    def output(self, arg: str) -> OutputList:
        """Every answer is kept, with its KV pinned, until /delete-output.
        Columns:
          output  its number, for /use-output and /delete-output
          text    its start
          tokens  its tokens, end-of-turn tokens included
          end     why generation ended: stop, stop_string, or length / cancelled (truncated)
          id      its chunk id
        """
        return OutputList(self.ctx.outputs())

    @command("use-output", "Add retained output N to the context", usage="N", arg=ArgKind.OUTPUT)
    def use_output(self, arg: str) -> ChunkChange:
        """Places retained output N in the context after the context chunks, as a passage the next
        inference reads. Its KV is reused as the reuse mode allows. A chat answer is refused: it is in
        the conversation already.
        """
        return ChunkChange("added output", self.ctx.use_output(count(arg)))

    @command("delete-output", "Delete retained output N", usage="N", arg=ArgKind.OUTPUT, destructive=True)
    def delete_output(self, arg: str) -> ChunkChange:
        """Removes retained output N from the context and the chunk list, and releases its pinned KV.
        A chat answer goes with the user turn it answered, so the conversation keeps its pairs."""
        number = count(arg)
        paired = self.ctx.is_chat_answer(number)
        action = "deleted output and the user turn it answered" if paired else "deleted output"
        return ChunkChange(action, self.ctx.delete_output(number))

    @command("chunks", "List every chunk: role, id, tokens, blocks, references, place")
    def chunks(self, arg: str) -> ChunkList:
        """Chunks in the context come first, in their place, then the other registered ones.
        Columns:
          #       the chunk's number (for /show and /drop)
          role    system, context, query, user, or output N
          id      short hash of its role and tokens (a unique prefix works too)
          tokens  its tokens in the chat template
          blocks  blocks of the KV kept for it (0: none kept; the live conversation's blocks,
                  which /blocks also counts, are not its own)
          refs    references on those blocks (sequences and chunks sharing them)
          place   its place in the context, — when not in it
          pin     yes when its blocks are pinned (retained outputs are never evicted)
          text    its start
        """
        in_context_first = sorted(self.ctx.chunks(), key=lambda c: (c.place is None, c.place or 0, c.number))
        return ChunkList(in_context_first)

    @command("drop", "Remove a chunk from the context", usage="N|ID", arg=ArgKind.CHUNK)
    def drop(self, arg: str) -> ChunkChange:
        """Removes a chunk (by number or id) from the context. It stays registered: /chunks lists it,
        /show shows it, and the KV it keeps stays cached.
        """
        return ChunkChange("dropped", self.ctx.drop(arg))

    @command("clear", "Empty the context; chunks and outputs are kept", destructive=True)
    def clear(self, arg: str) -> Notice:
        """Empties the context: no system prompt, passages, turns or query. Chunks, retained outputs and
        cached KV stay, so composing the context again reuses them.
        """
        self.ctx.clear()
        return Notice("context cleared; chunks and outputs kept")

    @command("reset", "Delete every chunk and output; no block stays held", destructive=True)
    def reset(self, arg: str) -> Notice:
        """Deletes every chunk and retained output and releases every KV block; the hit counts of /stats
        start again from zero. Settings are kept. Blocks holding exact KV stay in the prefix cache until
        reused (exact KV depends only on the tokens, so reusing it never changes an answer); /evict
        drops them.
        """
        self.ctx.reset()
        cached = self.ctx.stats().num_cached
        kept = f"{cached} keep exact KV for reuse; /evict drops it"
        return Notice(f"everything deleted; no block is held ({kept})")

    @command("evict", "Drop the cached KV that nothing holds, so the next prompt computes it anew")
    def evict(self, arg: str) -> Notice:
        """Empties the prefix cache: every block that no chunk, output or the live conversation holds
        forgets its KV (the draft model's cache too), so the next inference computes what is not kept,
        as after a fresh start. Held KV stays. After /reset it makes the next answer a cold start.
        """
        num_blocks = self.ctx.evict_cached()
        return Notice(f"{num_blocks} cached blocks dropped", {"num_evicted": num_blocks})


class Status(Enum):
    OK = "ok"
    FAILED = "failed"
    QUIT = "quit"


def run_line(shell: Shell, ui: UI, line: str, lineno: int | None = None) -> Status:
    """Execute `line`, render its record or its error; a failure never ends the session."""
    parts = split_command(line)
    typed_name = parts[0] if parts else "chat"
    try:
        cmd, record = shell.execute(line, parts)
        if isinstance(record, Generator):  # an inference, streamed as it runs
            show_thinking = shell.settings.ui.show_thinking
            record = consume(record, lambda event: ui.step(event, show_thinking))
    except KvchatError as exc:
        ui.error(typed_name, str(exc), lineno)
        return Status.FAILED
    except Exception as exc:  # a bug must not take the session and its cache down with it
        ui.error(typed_name, f"internal error: {type(exc).__name__}: {exc}", lineno)
        ui.exception(exc)
        return Status.FAILED
    ui.show(cmd, record, lineno)
    return Status.QUIT if isinstance(record, Quit) else Status.OK


def consume(
    stream: Iterator[PrefillProgress | GenerationStep | InferenceResult],
    on_step: Callable[[PrefillProgress | GenerationStep], None],
) -> InferenceResult:
    """Drive an inference stream to its InferenceResult, showing each step.

    Ctrl-C while a step is being shown is thrown into the generator, which stops within a token and
    answers with its (cancelled) result; Ctrl-C while it computes is caught by the generator itself,
    which then yields that result next.
    """
    assert isinstance(stream, Generator), "inference streams are generators: Ctrl-C is thrown into them"
    try:
        for item in stream:
            if isinstance(item, InferenceResult):
                return item
            try:
                on_step(item)
            except KeyboardInterrupt:
                return _drain(stream.throw(KeyboardInterrupt()), stream)
    finally:
        stream.close()  # run the generator's finally now, not at garbage collection
    raise KvchatError("the inference ended without a result")


def _drain(
    item: PrefillProgress | GenerationStep | InferenceResult,
    stream: Iterator[PrefillProgress | GenerationStep | InferenceResult],
) -> InferenceResult:
    # After a throw the contract is an immediate result; tolerate stray steps without showing them.
    while not isinstance(item, InferenceResult):
        item = next(stream)
    return item
