"""The settings as the commands see them: flat `table.key` names for `/set` and completion."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvchat import config

if TYPE_CHECKING:
    from kvchat.config import Settings


def setting_values(settings: Settings) -> dict[str, Any]:
    """Every setting as `{"table.key": value}`."""
    nested = config.settings_as_dict(settings)
    return {f"{table}.{key}": value for table, values in nested.items() for key, value in values.items()}


def setting_key(key: str) -> str:
    """`key` as `table.key` (a bare key unique across tables is accepted); ConfigError when unknown."""
    return ".".join(config.resolve_key(key))
