"""Typed settings: the packaged default.toml, then a user file, then overrides (CLI flags, `/set`).

What each setting is (type, default, valid values, help) is declared in kvchat.settings_schema; this
module reads, layers, parses and checks values against those declarations.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import tomllib
from collections.abc import Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from kvchat.errors import ConfigError, PathError
from kvchat.paths import user_path
from kvchat.settings_schema import (
    REMOVED,
    TABLES,
    CacheSettings,
    DecodeSettings,
    ModelSettings,
    ReuseSettings,
    SamplingParams,
    Settings,
    UiSettings,
    all_settings,
)
from kvchat.settings_spec import SettingInfo, normalize, problem

__all__ = [
    "TABLES",
    "CacheSettings",
    "DecodeSettings",
    "ModelSettings",
    "ReuseSettings",
    "SamplingParams",
    "Settings",
    "UiSettings",
    "all_keys",
    "format_value",
    "load_settings",
    "replace_setting",
    "resolve_key",
    "settings_as_dict",
]

# Shipped inside the package, so an installed wheel finds them; configs/ at the top holds equal copies.
CONFIGS: Traversable = importlib.resources.files("kvchat") / "configs"
DEFAULT_FILE: Traversable = CONFIGS / "default.toml"

_TRUE_WORDS = ("true", "on", "yes", "1")
_FALSE_WORDS = ("false", "off", "no", "0")

Layer = Mapping[str, Mapping[str, object]]


def load_settings(
    user_file: Path | None = None, overrides: Layer | None = None, flags: Mapping[str, object] | None = None
) -> Settings:
    """Read the defaults, then the user file (explicit, `$KVCHAT_CONFIG`, or ~/.config/kvchat/config.toml),
    then `overrides` (`{"sampling": {"temperature": 0.7}}`), then `flags` (`{"--top-p": 0.9}`, as
    settings_schema names them). None values are ignored; errors name the file and key, or the flag."""
    values: dict[str, dict[str, object]] = {table: {} for table in TABLES}
    _merge(values, read_toml(DEFAULT_FILE), f"{DEFAULT_FILE}: ")
    path = user_file or find_user_file()
    if path is not None:
        _merge(values, read_toml(path), f"{path}: ")
    if overrides:
        _merge(values, overrides, "")
    for flag, raw in (flags or {}).items():
        info = _by_flag()[flag]
        if raw is not None:
            values[info.table][info.name] = _checked(info, raw, f"{flag} {raw}")
    return Settings(**{table: cls(**values[table]) for table, cls in TABLES.items()})


def find_user_file() -> Path | None:
    """`$KVCHAT_CONFIG` if set, else `$XDG_CONFIG_HOME/kvchat/config.toml` (~/.config) if it exists."""
    explicit = os.environ.get("KVCHAT_CONFIG")
    if explicit:
        try:
            return user_path(explicit)
        except PathError as err:
            raise ConfigError(f"$KVCHAT_CONFIG: {err}") from None
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or "~/.config").expanduser()
    path = config_home / "kvchat" / "config.toml"
    return path if path.is_file() else None


def settings_as_dict(settings: Settings) -> dict[str, dict[str, object]]:
    """Every setting as `{table: {key: value}}`, in declaration order."""
    return {table: dataclasses.asdict(getattr(settings, table)) for table in TABLES}


def replace_setting(settings: Settings, key: str, text: str) -> Settings:
    """Return `settings` with `key` (`table.key`, or a key unique across tables) set to `text` parsed."""
    info = all_settings()[".".join(resolve_key(key))]
    value = _checked(info, _parse_text(text, info), f"{info.key} = {text.strip()}")
    section = dataclasses.replace(getattr(settings, info.table), **{info.name: value})
    return dataclasses.replace(settings, **{info.table: section})


def resolve_key(key: str) -> tuple[str, str]:
    """Split `table.key` or find the table of a bare key; ConfigError when unknown or ambiguous."""
    known = all_settings()
    removed = next((name for name in REMOVED if key in (name, name.partition(".")[2])), None)
    if removed is not None:
        raise ConfigError(removed_message(removed))
    if "." in key:
        if key not in known:
            raise ConfigError(f"unknown setting {key!r}; known: {', '.join(known)}")
        return known[key].table, known[key].name
    matches = [info for info in known.values() if info.name == key]
    if not matches:
        raise ConfigError(f"unknown setting {key!r}; known: {', '.join(known)}")
    if len(matches) > 1:
        raise ConfigError(f"setting {key!r} is ambiguous: {', '.join(m.key for m in matches)}")
    return matches[0].table, matches[0].name


def removed_message(key: str) -> str:
    """One line saying that a setting (`table.key`) was removed, and why."""
    return f"{key} was removed: {REMOVED[key]}"


def all_keys() -> list[str]:
    """Every setting as `table.key`."""
    return list(all_settings())


def format_value(value: object) -> str:
    """A value as TOML writes it (`"bf16"`, `true`, `["###"]`); `none` for an unset one."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    return str(value)


def read_toml(path: Traversable | Path) -> dict[str, Any]:
    try:
        # utf-8-sig: a byte-order mark, as some editors write one, is no error
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _merge(values: dict[str, dict[str, object]], layer: Layer, where: str) -> None:
    for table, entries in layer.items():
        if table not in TABLES:
            raise ConfigError(f"{where}unknown table [{table}]; known: {', '.join(TABLES)}")
        if not isinstance(entries, Mapping):
            raise ConfigError(f"{where}[{table}] must be a table")
        for name, raw in entries.items():
            info = all_settings().get(f"{table}.{name}")
            if f"{table}.{name}" in REMOVED:
                raise ConfigError(f"{where}{removed_message(f'{table}.{name}')}")
            if info is None:
                known = ", ".join(i.name for i in all_settings().values() if i.table == table)
                raise ConfigError(f"{where}unknown key {name!r} in [{table}]; known: {known}")
            if raw is not None:
                values[table][name] = _checked(info, raw, f"{where}{info.key} = {_shown(raw)}")


def _checked(info: SettingInfo, raw: object, where: str) -> object:
    """`raw` coerced to the setting's type and checked; ConfigError starting with `where` otherwise."""
    value = None if raw is None else normalize(info, _coerce(raw, info.value_type))
    if value is _INVALID:
        raise ConfigError(f"{where} must be {_type_name(info)}")
    reason = problem(info, value)
    if reason is not None:
        raise ConfigError(f"{where} {reason}")
    return value


_INVALID = object()


def _coerce(raw: object, value_type: object) -> object:
    """`raw` as a value of `value_type`, or _INVALID. bool is never taken for an int."""
    if value_type is bool:
        return raw if isinstance(raw, bool) else _INVALID
    if value_type is int:
        return raw if isinstance(raw, int) and not isinstance(raw, bool) else _INVALID
    if value_type is float:
        return float(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else _INVALID
    if value_type is str:
        return raw if isinstance(raw, str) else _INVALID
    if isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw):
        return tuple(raw)
    return _INVALID


def _parse_text(text: str, info: SettingInfo) -> object:
    """Parse what a user typed after `/set KEY`."""
    text = text.strip()
    if info.optional and text.lower() in ("", "none"):
        return None
    value_type = info.value_type
    try:
        if value_type is bool and text.lower() in _TRUE_WORDS + _FALSE_WORDS:
            return text.lower() in _TRUE_WORDS
        if value_type is int:
            return int(text)
        if value_type is float:
            return float(text)
        if value_type is str:
            return tomllib.loads(f"v = {text}")["v"] if text.startswith('"') else text
        if value_type is not bool:  # a list of strings: a TOML array or string, `none` (empty), one word
            if text.startswith(("[", '"')):
                parsed = tomllib.loads(f"v = {text}")["v"]
                return [parsed] if isinstance(parsed, str) else parsed
            return [] if text.lower() == "none" else ([text] if text else [])
    except (ValueError, tomllib.TOMLDecodeError):
        pass
    return text


def _shown(raw: object) -> str:
    return format_value(raw) if isinstance(raw, str | bool | tuple | list) or raw is None else repr(raw)


def _type_name(info: SettingInfo) -> str:
    names: dict[object, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    name = names.get(info.value_type, "a list of strings")
    return f"{name} or none" if info.optional else name


def _by_flag() -> dict[str, SettingInfo]:
    return {info.spec.flag: info for info in all_settings().values() if info.spec.flag}
