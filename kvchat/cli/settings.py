"""The settings as the commands see them: flat `table.key` names for `/set` and completion."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvchat import config

if TYPE_CHECKING:
    from kvchat.config import Settings
    from kvchat.engine.sampling import SamplingParams


def setting_values(settings: Settings) -> dict[str, Any]:
    """Every setting as `{"table.key": value}`."""
    return _flatten(config.settings_as_dict(settings))


def setting_key(key: str) -> str:
    """`key` as `table.key` (a bare key unique across tables is accepted); ConfigError when unknown."""
    return ".".join(config.resolve_key(key))


def with_setting(settings: Settings, key: str, value: str) -> Settings:
    """`settings` with `key` parsed from `value`; ConfigError for an unknown key or a bad value."""
    return config.replace_setting(settings, key, value)


def sampling_params(settings: Settings) -> SamplingParams:
    """The params the next inference uses."""
    return settings.sampling


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
