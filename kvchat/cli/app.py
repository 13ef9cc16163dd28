"""The `kvchat` command: parse the options, load settings and the model, then run the REPL or a script.

Exit status: 0 when every command succeeded, 1 when any failed, 2 when kvchat could not start.
"""

from __future__ import annotations

import inspect
import io
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, BinaryIO

import typer
from typer.core import TyperCommand, TyperGroup

from kvchat import __version__
from kvchat.cli.commands import Shell
from kvchat.cli.oneshot import run_prompt
from kvchat.cli.repl import make_prompt_session, run_interactive
from kvchat.cli.script import run_script
from kvchat.cli.ui import UI
from kvchat.config import Settings, load_settings
from kvchat.errors import ConfigError, KvchatError, PathError
from kvchat.models.sources import resolve_model
from kvchat.paths import user_path
from kvchat.settings_schema import all_settings
from kvchat.settings_spec import SettingInfo

if TYPE_CHECKING:
    from kvchat.chunks.context import ContextManager
    from kvchat.models.progress import ProgressCallback

    SessionFactory = Callable[[Settings, ProgressCallback | None], ContextManager]

EXIT_OK, EXIT_FAILED, EXIT_CANNOT_START = 0, 1, 2
HELP_WIDTH = 120  # columns of --help where standard output is no terminal


@dataclass(frozen=True)
class Flag:
    """One option both `kvchat` and `kvchat run` take; `setting` is the setting's flag when it sets one."""

    name: str  # the parameter name typer passes it as
    type: Any
    help: str
    decls: tuple[str, ...]
    setting: str | None = None


def _setting_flag(info: SettingInfo) -> Flag:
    flag = info.spec.flag
    assert flag is not None
    help = info.spec.help
    extra = [str(info.spec.range)] if info.spec.range else []
    extra += [info.spec.note] if info.spec.note else []
    if extra:
        help = f"{help.removesuffix('.')} ({'; '.join(extra)})."
    if info.default is not None:  # typer cannot show it: every flag defaults to None, "not given"
        help = f"{help} Default: {_shown_default(info)}."
    # A switch has its negative too, to undo what a config file turned on.
    decls = (f"{flag}/--no-{flag[2:]}",) if info.value_type is bool else (flag,)
    return Flag(flag[2:].replace("-", "_"), info.value_type, help, decls, flag)


def _shown_default(info: SettingInfo) -> str:
    if info.value_type is bool:
        return "on" if info.default else "off"
    return str(info.default)


FLAGS = (
    *(_setting_flag(info) for info in all_settings().values() if info.spec.flag),
    Flag("system", str, "The system prompt, for the REPL, a script or -p.", ("--system",)),
    Flag("config", str, "A TOML settings file instead of ~/.config/kvchat/config.toml.", ("--config",)),
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
    # A boolean is a switch: an empty metavar keeps typer from showing it as taking a value.
    metavar = "" if flag.type is bool else None
    option = typer.Option(*flag.decls, help=flag.help, show_default=False, metavar=metavar)
    annotation = Annotated[flag.type | None, option]  # type: ignore[name-defined]  # built at run time
    return inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def setting_flags(flags: dict[str, Any]) -> dict[str, object]:
    """The flags that set a setting, as load_settings takes them: `{"--top-p": 0.9}`."""
    return {flag.setting: flags.get(flag.name) for flag in FLAGS if flag.setting}


# Both show --help as the switch it is (typer lists its type, `<bool>`, as if it took a value), and lay
# it out wider than rich's 80 columns where standard output is no terminal.
class _Group(TyperGroup):
    def get_help_option(self, ctx: Any) -> Any:
        return _as_switch(super().get_help_option(ctx))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _help_width():
            super().format_help(ctx, formatter)


class _Command(TyperCommand):
    def get_help_option(self, ctx: Any) -> Any:
        return _as_switch(super().get_help_option(ctx))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _help_width():
            super().format_help(ctx, formatter)


@contextmanager
def _help_width() -> Iterator[None]:
    """Into a pipe or a file rich lays help out 80 columns wide, which cuts long values (a default
    path, the largest seed) short; there it is HELP_WIDTH wide. COLUMNS, when set, still decides."""
    import typer.rich_utils as rich_utils

    before = rich_utils.MAX_WIDTH
    if before is None and not os.environ.get("COLUMNS") and not _is_terminal(sys.stdout):
        rich_utils.MAX_WIDTH = HELP_WIDTH
    try:
        yield
    finally:
        rich_utils.MAX_WIDTH = before


def _as_switch(option: Any) -> Any:
    if option is not None:
        option.metavar = ""
    return option


def make_app(open_session: SessionFactory | None = None) -> typer.Typer:
    """The typer app; `open_session` builds the context manager (kvchat.session's by default)."""
    app = typer.Typer(
        add_completion=False,
        no_args_is_help=False,
        pretty_exceptions_enable=False,
        cls=_Group,
        help="Chat with a local LLM and see and steer what it keeps in its KV cache.",
    )
    factory = open_session or _open_real_session

    @app.callback(invoke_without_command=True)
    @with_flags
    def start(
        ctx: typer.Context,
        version: Annotated[
            bool, typer.Option("--version", help="Print the version and exit.", is_eager=True, metavar="")
        ] = False,
        prompt: Annotated[
            str | None,
            typer.Option(
                "-p",
                "--prompt",
                help="Answer PROMPT once on stdout and exit (0, or 1 on failure).",
                metavar="PROMPT",
            ),
        ] = None,
        flags: dict[str, Any] | None = None,
    ) -> int | None:
        """Start the chat REPL (or read commands from stdin when it is not a terminal)."""
        if version:
            UI(color=False).console.out(f"kvchat {__version__}")
            return EXIT_OK
        if ctx.invoked_subcommand is not None:
            ctx.obj = flags  # `kvchat --model X run FILE`: run's own flags win over these
            return None
        return session_main(flags or {}, None, factory, prompt=prompt)

    @app.command("run", cls=_Command)
    @with_flags
    def run(
        ctx: typer.Context,
        file: Annotated[
            Path,
            typer.Argument(
                help="A file of commands, one per line; # comments, <<< ... >>> blocks. - reads stdin.",
                metavar="FILE",
            ),
        ],
        flags: dict[str, Any] | None = None,
    ) -> int:
        """Run the commands in FILE, then exit."""
        given = {name: value for name, value in (flags or {}).items() if value is not None}
        return session_main({**(ctx.obj or {}), **given}, file, factory)

    return app


def session_main(
    flags: dict[str, Any], script: Path | None, open_session: SessionFactory, prompt: str | None = None
) -> int:
    """Load settings and the model, then answer the prompt, or run the script, the piped stdin or the REPL."""
    # Until the settings are read, the flags alone decide how an error looks.
    ui = UI(
        color=flags.get("color") is not False,
        json_lines=bool(flags.get("json")),
        debug=bool(flags.get("debug")),
    )
    if script is not None and str(script) != "-" and not script.is_file():
        ui.fatal(f"{script}: no such file" if not script.exists() else f"{script} is not a file")
        return EXIT_CANNOT_START
    try:
        config_file = _config_file(flags.get("config"))
        settings = load_settings(config_file, flags=setting_flags(flags))
        ui = UI(color=settings.ui.color, json_lines=settings.ui.json, debug=settings.ui.debug)
        check_model_paths(settings)
        _history_file(settings)  # a path that cannot name a file stops the start, in one line
        with ui.progress() as progress:
            shell = Shell(open_session(settings, progress), settings, config_file)
        shell.notify = ui.note
        if flags.get("system") is not None:
            shell.ctx.set_system(flags["system"])
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
        return run_prompt(shell, ui, prompt) if prompt is not None else _run(shell, ui, script)
    except KeyboardInterrupt:  # Ctrl-C between commands of a script: the rest did not run
        ui.error(None, "interrupted; the commands after it did not run" if prompt is None else "interrupted")
        return EXIT_FAILED


def _run(shell: Shell, ui: UI, script: Path | None) -> int:
    if script is not None and str(script) != "-":
        with script.open("rb") as stream:
            return run_script(shell, ui, stream)
    if script is None and _stdin_is_terminal():
        history = _history_file(shell.settings)
        return run_interactive(shell, ui, make_prompt_session(shell, history, color=shell.settings.ui.color))
    return run_script(shell, ui, _stdin_bytes())


def check_model_paths(settings: Settings) -> None:
    """A model that names nothing kvchat can load (an unknown alias, a path that is not there) is told
    at once, before torch is even imported."""
    for spec in (settings.model.model, settings.model.draft_model):
        if spec:
            resolve_model(spec)


def _open_real_session(settings: Settings, progress: ProgressCallback | None) -> ContextManager:
    # Imported here: it pulls in torch and transformers, which `kvchat --help` does not need.
    from kvchat.session import open_session

    return open_session(settings, progress)


def _config_file(text: str | None) -> Path | None:
    try:
        return user_path(text) if text is not None else None
    except PathError as err:
        raise ConfigError(f"--config: {err}") from None


def _history_file(settings: Settings) -> Path | None:
    history = settings.ui.history_file
    try:
        return user_path(history) if history else None
    except PathError as err:
        raise ConfigError(f"ui.history_file: {err}") from None


def _stdin_is_terminal() -> bool:
    return _is_terminal(sys.stdin)


def _is_terminal(stream: IO[str] | None) -> bool:
    return stream is not None and not stream.closed and stream.isatty()


def _stdin_bytes() -> BinaryIO:
    # CI may run kvchat with stdin closed or absent: that is an empty script, not an error.
    stdin = sys.stdin
    if stdin is None or stdin.closed:
        return io.BytesIO()
    return stdin.buffer


_app = make_app()


def main(args: list[str] | None = None) -> None:
    """The `kvchat` command. A Ctrl-C that comes outside any command (as kvchat exits, say) ends it
    with one line and status 1, not a traceback or a death by SIGINT; once the work is done, Ctrl-C
    is ignored while the process exits (its exit handlers run to the end)."""
    try:
        _app(args)
    except KeyboardInterrupt:
        UI(color=False).fatal("interrupted")
        raise SystemExit(EXIT_FAILED) from None
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
