"""The shell: one session's context manager and settings, and the slash commands that act on them.

Handlers check their argument, call the context manager and return a record; they never print.
Bad input raises a KvchatError before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.chunks.blockmap import BlockMap, cache_map
from kvchat.chunks.reports import AttentionReport, Comparison, FidelityReport
from kvchat.chunks.types import CacheStats, ChunkDetail, InferenceStream
from kvchat.cli import cache_commands, file_commands, habit_commands, setting_commands
from kvchat.cli.arguments import count, read_text
from kvchat.cli.results import (
    ChunkChange,
    ChunkHeat,
    ChunkList,
    HelpView,
    Notice,
    OutputList,
    Quit,
)
from kvchat.cli.settings import user_config_file
from kvchat.cli.slash_commands import ArgKind, Command, CommandRegistry, command
from kvchat.errors import CommandError
from kvchat.paths import user_path

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager
    from kvchat.config import Settings


class Shell:
    """What the REPL and the script runner drive: `execute` one line, get a record back."""

    def __init__(self, ctx: ContextManager, settings: Settings, config_file: Path | None = None) -> None:
        self.ctx = ctx
        self.settings = settings
        self.started_model = settings.model  # what /info describes; /set model.* waits for a restart
        self.config_file = user_config_file(config_file)  # where /set says a setting can be kept
        self.notify: Callable[[str], None] | None = None  # progress of a long command, one line each
        self.commands = CommandRegistry(self)

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
        text = read_text(user_path(arg[1:])) if arg.startswith("@") else arg
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

    retry = habit_commands.retry

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

    @command(
        "show",
        "Show one chunk: text, token ids, positions, blocks; with heat, what the last answer attended to",
        usage="N|ID [heat]",
        arg=ArgKind.CHUNK,
    )
    def show(self, arg: str) -> ChunkDetail | ChunkHeat:
        """Everything about one chunk, by number or id: its number, role and id; its tokens and token
        ids (the first 64; --json has all); the positions it takes in the current context; the positions
        its kept KV was computed at (where these differ, reuse must reposition or recompute it); the
        blocks holding that KV and their references; for outputs, the number, the chunks of the context
        it came from and whether thinking was hidden; then the text.
        With `heat`: the chunk's tokens shaded by the share of attention the last answer paid to each,
        and the most attended tokens (the shares sum to the chunk's row of /attention).
        """
        ref, _, option = arg.partition(" ")
        if option.strip() not in ("", "heat"):
            raise CommandError(f"unknown option {option.strip()!r}: /show N|ID [heat]")
        detail = self.ctx.chunk(ref)
        if not option.strip():
            return detail
        return cache_commands.heat(self.ctx, detail)

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
        reused: exact KV depends only on the tokens, so reusing it never changes an answer.
        """
        self.ctx.reset()
        cached = self.ctx.stats().num_cached
        return Notice(f"everything deleted; no block is held ({cached} keep exact KV for reuse)")

    @command("stats", "KV cache blocks, bytes and hit rate")
    def stats(self, arg: str) -> CacheStats:
        """The paged KV cache, whose size --ctx-size (tokens) or --kv-memory (MiB) sets.
        Rows:
          blocks      used (referenced by the live sequence or a chunk), pinned (retained outputs),
                      cached (unreferenced but holding reusable KV, evicted least recently used first),
                      free, and total
          tokens      tokens the used blocks hold room for, and the whole budget in tokens
          block size  tokens per block, and the bytes one block takes
          KV memory   bytes of the used blocks, of the whole budget (--kv-memory)
          hit rate    prompt tokens found in the cache, of those looked up, since start or /reset
        """
        return self.ctx.stats()

    info = habit_commands.info

    @command("blocks", "Map of the KV pool: each block's chunk, sharing, pins, moved KV")
    def blocks(self, arg: str) -> BlockMap:
        """One cell per block of the KV pool, lettered by the chunk whose KV it holds (the legend gives
        each letter's chunk number, role, id and the blocks its tokens are in). Marks: + pinned (a
        retained output), * pinned and shared, = shared (more than one reference), . cached
        (unreferenced, reusable KV, evicted least recently used first), ·· free. A lowercase letter:
        the block holds moved (repositioned, not exact) KV. The letter - : no chunk holds the block
        now (-. is KV an earlier sequence, a deleted output or /verify left cached, still reusable).
        Long runs of equal cells are one line with their block range.
        The legend counts every block holding a chunk's tokens: its own kept KV and the live
        conversation's blocks (a block shared by two chunks counts for both). /chunks counts only
        the blocks kept for the chunk itself, so a query or a user turn, held only by the live
        conversation, shows blocks here and 0 there.
        """
        return cache_map(self.ctx)

    @command(
        "attention",
        "Share of attention the last answer (or output N) paid to each chunk of its context",
        usage="[N]",
        arg=ArgKind.OUTPUT,
    )
    def attention(self, arg: str) -> AttentionReport:
        """Re-reads the last answer (or output N) teacher-forced with attention weights, one extra
        forward over the answer, and shows the share of attention its tokens paid to each chunk of its
        context, averaged over heads and layers, and per layer group (early, middle, late thirds).
        The first 4 tokens (attention sinks) have a row of their own; the shares sum to 1.
        """
        return cache_commands.attention(self.ctx, count(arg) if arg else None)

    @command(
        "compare",
        "Answer the query under each mode (default: exact reposition repair), greedily, side by side",
        usage="[MODE...]",
        arg=ArgKind.MODE,
    )
    def compare(self, arg: str) -> Comparison:
        """Answers the current query once per MODE (exact, reposition, repair; default all three) from
        the same cached chunks, greedily whatever the sampling settings, so differences come from the
        KV alone. Shows each answer with the first differing token marked, its time to first token,
        the prompt tokens it computed and its per-token agreement with the reference (exact if
        compared, else the first mode). Nothing is kept: no output, the live sequence unchanged.
        """
        return cache_commands.compare(self.ctx, arg, self.settings.sampling, self.notify)

    set = setting_commands.set_setting
    mode = setting_commands.mode

    @command(
        "verify", "Compare the reuse mode with a full recompute over N tokens", usage="[N]", arg=ArgKind.TEXT
    )
    def verify(self, arg: str) -> FidelityReport:
        """Runs the current context twice: once composed in the reuse mode, once fully recomputed, and
        compares them. N (default reuse.verify_tokens, 16) is how many answer positions are compared. It
        needs room for a second copy of the context's KV; nothing is kept.
          KL divergence   KL(full || mode) of the next-token distributions, in nats; 0 is identical
          next token      whether both pick the same most likely next token
          top-5 overlap   how many of the 5 most likely next tokens both share
          max logit diff  the largest difference between the two next-token logits
          greedy agrees   leading greedy tokens that agree before the first difference, of N
          top-1 rate      share of the N positions whose most likely token agrees, both fed the full
                          recompute's tokens (so one difference does not spoil the rest)
          tokens          reused, repositioned and computed prompt tokens in the reuse mode
        Fewer than N positions are compared when the full recompute's answer ends sooner.
        """
        return cache_commands.verify(self.ctx, count(arg) if arg else self.settings.reuse.verify_tokens)

    save = file_commands.save
    load = file_commands.load

    @command(
        "help", "List the commands, or explain one", usage="[COMMAND]", arg=ArgKind.COMMAND, aliases=("?",)
    )
    def help(self, arg: str) -> HelpView:
        """Without an argument, lists the commands; with one (with or without its /), explains it."""
        topic: Command | None = self.commands.get(arg.removeprefix("/")) if arg else None
        return HelpView(list(self.commands), topic)

    @command("quit", "Leave kvchat", aliases=("exit", "bye"), destructive=True)
    def quit(self, arg: str) -> Quit:
        """Leaves kvchat (Ctrl-D too). Nothing is saved: use /save first to keep the session."""
        return Quit()
