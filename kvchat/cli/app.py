"""The `kvchat` command: parse the options, load settings and the model, then run the REPL or a script.

Exit status: 0 when every command succeeded, 1 when any failed, 2 when kvchat could not start.
"""

from __future__ import annotations

import inspect
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

import typer

from kvchat import __version__
from kvchat.cli.commands import Shell
from kvchat.cli.repl import make_prompt_session, run_interactive
from kvchat.cli.script import run_script
from kvchat.cli.ui import UI
from kvchat.config import load_settings
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager
    from kvchat.config import Settings
    from kvchat.models.progress import ProgressCallback

    SessionFactory = Callable[[Settings, ProgressCallback | None], ContextManager]

EXIT_OK, EXIT_FAILED, EXIT_CANNOT_START = 0, 1, 2


@dataclass(frozen=True)
class Flag:
    """One option both `kvchat` and `kvchat run` take; `key` is the setting (`table.key`) it overrides."""

    name: str
    type: type
    help: str
    key: str | None = None
    decls: tuple[str, ...] = ()  # option names when not just --name


FLAGS = (
    Flag("model", str, "Model: an alias, a hub id (org/name), a local folder or a GGUF file.", "model.model"),
    Flag("dtype", str, "Weights dtype: auto, bf16, fp32 or fp16.", "model.dtype"),
    Flag("device", str, "auto, cpu, cuda or cuda:N.", "model.device"),
    Flag("threads", int, "CPU threads for torch (0: automatic).", "model.threads"),
    Flag("kv_memory", int, "Memory for the paged KV cache, in MiB.", "cache.kv_memory_mb"),
    Flag("block_size", int, "Tokens per KV block.", "cache.block_size"),
    Flag("temperature", float, "Sampling temperature (0: greedy).", "sampling.temperature"),
    Flag("top_k", int, "Top-k sampling (0: off).", "sampling.top_k"),
    Flag("top_p", float, "Top-p sampling (1.0: off).", "sampling.top_p"),
    Flag("repetition_penalty", float, "Repetition penalty (1.0: off).", "sampling.repetition_penalty"),
    Flag("max_tokens", int, "Most tokens one answer may have.", "sampling.max_tokens"),
    Flag("seed", int, "Random seed for sampling.", "sampling.seed"),
    Flag("reuse", str, "How cached chunks are reused: exact, reposition or repair.", "reuse.mode"),
    Flag(
        "repair_strategy",
        str,
        "Which moved tokens repair recomputes: prefix or deviation.",
        "reuse.repair_strategy",
    ),
    Flag("config", Path, "A TOML settings file instead of ~/.config/kvchat/config.toml."),
    Flag("json", bool, "Print one JSON object per command.", "ui.json"),
    Flag(
        "color",
        bool,
        "Colors and styles; --no-color prints no escape codes.",
        "ui.color",
        ("--color/--no-color",),
    ),
    Flag("debug", bool, "Show tracebacks.", "ui.debug"),
)


def with_flags(func: Callable[..., int | None]) -> Callable[..., None]:
    """Give a typer command every flag of FLAGS; `func` gets them in one dict, `flags`, and returns
    the exit status, or None to let a subcommand run. One table, so `kvchat --model X` and
    `kvchat run FILE --model X` cannot drift apart."""
    own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "flags"]

    def command(**kwargs: Any) -> None:
        flags = {flag.name: kwargs.pop(flag.name) for flag in FLAGS}
        status = func(**kwargs, flags=flags)
        if status is not None:
            raise typer.Exit(status)

    command.__name__, command.__doc__ = func.__name__, func.__doc__
    command.__signature__ = inspect.Signature([*own, *map(_flag_parameter, FLAGS)])  # type: ignore[attr-defined]
    return command


def _flag_parameter(flag: Flag) -> inspect.Parameter:
    # Every flag defaults to None, "not given", so only the flags a user typed override the settings.
    decls = flag.decls or ("--" + flag.name.replace("_", "-"),)
    option = typer.Option(*decls, help=flag.help, show_default=False)
    annotation = Annotated[flag.type | None, option]  # type: ignore[name-defined]  # built at run time
    return inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def overrides(flags: dict[str, Any]) -> dict[str, dict[str, object]]:
    """The flags given, as load_settings' override layer: `{"sampling": {"temperature": 0.7}}`."""
    layer: dict[str, dict[str, object]] = {}
    for flag in FLAGS:
        if flag.key and flags.get(flag.name) is not None:
            table, _, name = flag.key.partition(".")
            layer.setdefault(table, {})[name] = flags[flag.name]
    return layer


def make_app(open_session: SessionFactory | None = None) -> typer.Typer:
    """The typer app; `open_session` builds the context manager (kvchat.session's by default)."""
    app = typer.Typer(
        add_completion=False,
        no_args_is_help=False,
        pretty_exceptions_enable=False,
        help="Chat with a local LLM and see and steer what it keeps in its KV cache.",
    )
    factory = open_session or _open_real_session

    @app.callback(invoke_without_command=True)
    @with_flags
    def start(
        ctx: typer.Context,
        version: Annotated[
            bool, typer.Option("--version", help="Print the version and exit.", is_eager=True)
        ] = False,
        flags: dict[str, Any] | None = None,
    ) -> int | None:
        """Start the chat REPL (or read commands from stdin when it is not a terminal)."""
        if version:
            UI(color=False).console.out(f"kvchat {__version__}")
            return EXIT_OK
        if ctx.invoked_subcommand is not None:
            ctx.obj = flags  # `kvchat --model X run FILE`: run's own flags win over these
            return None
        return session_main(flags or {}, None, factory)

    @app.command("run")
    @with_flags
    def run(
        ctx: typer.Context,
        file: Annotated[
            Path,
            typer.Argument(
                help="A file of commands, one per line; # comments, <<< ... >>> blocks.",
                metavar="FILE",
                exists=True,
                dir_okay=False,
            ),
        ],
        flags: dict[str, Any] | None = None,
    ) -> int:
        """Run the commands in FILE, then exit."""
        given = {name: value for name, value in (flags or {}).items() if value is not None}
        return session_main({**(ctx.obj or {}), **given}, file, factory)

    return app


def session_main(flags: dict[str, Any], script: Path | None, open_session: SessionFactory) -> int:
    """Load settings and the model, then run the script, the piped stdin or the REPL."""
    # Until the settings are read, the flags alone decide how an error looks.
    ui = UI(
        color=flags.get("color") is not False,
        json_lines=bool(flags.get("json")),
        debug=bool(flags.get("debug")),
    )
    try:
        settings = load_settings(flags.get("config"), overrides(flags))
        ui = UI(color=settings.ui.color, json_lines=settings.ui.json, debug=settings.ui.debug)
        with ui.progress() as progress:
            shell = Shell(open_session(settings, progress), settings)
    except (KvchatError, OSError) as exc:
        ui.fatal(str(exc))
        return EXIT_CANNOT_START
    except KeyboardInterrupt:
        ui.fatal("interrupted while starting")
        return EXIT_CANNOT_START
    except Exception as exc:  # a bug while loading: still one line (and the traceback with --debug)
        ui.fatal(f"internal error: {type(exc).__name__}: {exc}")
        ui.exception(exc)
        return EXIT_CANNOT_START
    try:
        return _run(shell, ui, script)
    except KeyboardInterrupt:
        return EXIT_FAILED  # Ctrl-C between commands of a script: the rest did not run


def _run(shell: Shell, ui: UI, script: Path | None) -> int:
    if script is not None:
        with script.open("rb") as stream:
            return run_script(shell, ui, stream)
    if _stdin_is_terminal():
        history = _history_file(shell.settings)
        return run_interactive(shell, ui, make_prompt_session(shell, history, color=shell.settings.ui.color))
    return run_script(shell, ui, _stdin_bytes())


def _open_real_session(settings: Settings, progress: ProgressCallback | None) -> ContextManager:
    # Imported here: it pulls in torch and transformers, which `kvchat --help` does not need.
    from kvchat.session import open_session

    return open_session(settings, progress)


def _history_file(settings: Settings) -> Path | None:
    history = settings.ui.history_file
    return Path(history).expanduser() if history else None


def _stdin_is_terminal() -> bool:
    stdin = sys.stdin
    return stdin is not None and not stdin.closed and stdin.isatty()


def _stdin_bytes() -> BinaryIO:
    # CI may run kvchat with stdin closed or absent: that is an empty script, not an error.
    stdin = sys.stdin
    if stdin is None or stdin.closed:
        return io.BytesIO()
    return stdin.buffer


main = make_app()
