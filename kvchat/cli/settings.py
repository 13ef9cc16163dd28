"""The settings as the commands see them: flat `table.key` names for `/set` and completion."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat import config
from kvchat.cli.results import Notice
from kvchat.settings_schema import all_settings
from kvchat.settings_spec import SettingInfo

if TYPE_CHECKING:
    from kvchat.config import Settings


def setting_values(settings: Settings) -> dict[str, Any]:
    """Every setting as `{"table.key": value}`."""
    nested = config.settings_as_dict(settings)
    return {f"{table}.{key}": value for table, values in nested.items() for key, value in values.items()}


def setting_info(key: str) -> SettingInfo:
    """The declaration of `key` (`table.key`, or a bare key unique across tables); ConfigError if unknown."""
    return all_settings()[".".join(config.resolve_key(key))]


def shown_value(value: Any, resolved: str | None = None) -> str:
    """A value as TOML writes it, with what it resolved to when that says more: `"auto" (bf16)`."""
    text = config.format_value(value)
    return f"{text} ({resolved})" if resolved is not None and resolved not in (str(value), text) else text


def set_help() -> str:
    """`/help set`: which settings apply at once, read off the schema."""
    return (
        "Without arguments, lists every setting; with KEY alone, shows that one. KEY is table.key "
        "(sampling.temperature) or a key unique across tables (temperature).\n"
        f"These apply at once: {', '.join(_grouped_keys(live=True))}.\n"
        f"These apply when kvchat starts again: {', '.join(_grouped_keys(live=False))}; "
        "/set says which flag or config file line makes the change stick.\n"
        "Defaults are in configs/default.toml, overridden by your config file and the command-line flags."
    )


def _grouped_keys(live: bool) -> list[str]:
    """The keys that are (or are not) live, a table written `table.*` when all of it is."""
    tables: dict[str, list[SettingInfo]] = {}
    for info in all_settings().values():
        tables.setdefault(info.table, []).append(info)
    keys: list[str] = []
    for table, infos in tables.items():
        chosen = [i.key for i in infos if i.spec.live == live]
        keys += [f"{table}.*"] if len(chosen) == len(infos) else chosen
    return keys


def restart_hint(info: SettingInfo, value: Any, config_file: Path) -> str:
    """How to keep a setting that applies at the next start: its flag, or its line in the config file."""
    line = f"{info.name} = {config.format_value(value)} under [{info.table}] in {_home_relative(config_file)}"
    if info.spec.flag is None:
        return f"takes effect when kvchat starts again: put {line}"
    if info.value_type is bool:
        flag = info.spec.flag if value else f"--no-{info.spec.flag[2:]}"
    else:
        flag = f"{info.spec.flag} {value}"
    return f"takes effect when kvchat starts again: start it with {flag}, or put {line}"


def user_config_file(explicit: Path | None) -> Path:
    """The config file in use (--config, $KVCHAT_CONFIG, the XDG one), or where the XDG one would go."""
    if explicit is not None:
        return explicit
    found = config.find_user_file()
    if found is not None:
        return found
    return Path(os.environ.get("XDG_CONFIG_HOME") or "~/.config").expanduser() / "kvchat" / "config.toml"


def _home_relative(path: Path) -> str:
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) else str(path)


def one_setting(settings: Settings, key: str, resolved: dict[str, str]) -> Notice:
    """`/set KEY`: one setting's value (and what `auto` resolved to); JSON `key` and `value`."""
    info = setting_info(key)
    value = setting_values(settings)[info.key]
    data: dict[str, Any] = {"key": info.key, "value": value}
    if info.key in resolved:
        data["resolved"] = resolved[info.key]
    return Notice(f"{info.key} = {shown_value(value, resolved.get(info.key))}", data)
