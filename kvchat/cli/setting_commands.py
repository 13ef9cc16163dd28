"""/set and /mode: the settings of a running session. The shell offers them with its own
commands (kvchat.cli.commands.COMMAND_MODULES)."""

from __future__ import annotations

from kvchat.cli.results import Notice, SettingsView
from kvchat.cli.settings import one_setting, restart_hint, set_help, setting_info, setting_values, shown_value
from kvchat.cli.slash_commands import ArgKind, ShellState, command
from kvchat.config import replace_setting


@command(
    "set",
    "Change a setting, show one, or list them all",
    usage="[KEY [VALUE]]",
    arg=ArgKind.SETTING,
    details=set_help(),
)
def set_setting(shell: ShellState, arg: str) -> SettingsView | Notice:
    if not arg:
        return SettingsView(setting_values(shell.settings), shell.ctx.resolved_settings())
    typed_key, _, value = arg.partition(" ")
    if not value.strip():
        return one_setting(shell.settings, typed_key, shell.ctx.resolved_settings())
    info = setting_info(typed_key)
    settings = replace_setting(shell.settings, info.key, value.strip())
    new_value = setting_values(settings)[info.key]
    if info.spec.live:
        from kvchat.session import apply_live_settings  # torch: imported once a model runs

        apply_live_settings(shell.ctx, settings)
    shell.settings = settings
    # Settings that are not live are read once, when kvchat starts.
    later = "" if info.spec.live else f" ({restart_hint(info, new_value, shell.config_file)})"
    return Notice(f"{info.key} = {shown_value(new_value)}{later}", {"key": info.key, "value": new_value})


@command(
    "mode",
    "Show or choose how cached chunks are reused",
    usage="[exact|reposition|repair]",
    arg=ArgKind.MODE,
)
def mode(shell: ShellState, arg: str) -> Notice:
    """How a cached chunk is reused when what comes before it changed:
      exact       recompute from the first token whose prefix differs (same result as a full recompute)
      reposition  move its KV to the new positions (keys re-rotated): fastest, approximate
      repair      reposition, then recompute reuse.repair_share of the moved tokens: each moved
                  chunk's first ones (reuse.repair_strategy prefix) or those whose KV deviates
                  most on the first layers (deviation): closer, costs more
    Without an argument, shows the mode in use. /verify measures what a mode costs.
    """
    if arg:
        set_setting(shell, f"reuse.mode {arg}")  # the context manager holds it; /set checks and applies it
    return Notice(f"reuse mode: {shell.ctx.mode}", {"mode": str(shell.ctx.mode)})
