"""The settings as the commands see them: flat `table.key` names for `/set` and completion."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvchat import config
from kvchat.settings_schema import SettingInfo, all_settings

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
