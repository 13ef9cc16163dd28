"""What a --model string names: a packaged model, a local folder, a GGUF file or a Hugging Face id."""

from __future__ import annotations

import functools
import importlib.resources
import re
import tomllib
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Literal

from kvchat.errors import ConfigError, ModelLoadError

MODELS_FILE: Traversable = importlib.resources.files("kvchat") / "configs" / "models.toml"
# Hugging Face repo ids: `org/name`, letters, digits, `-`, `_` and `.`.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

SourceKind = Literal["packaged", "local", "gguf", "hub"]


@dataclass(frozen=True)
class Alias:
    """A short model name from configs/models.toml."""

    name: str
    hub_id: str
    packaged: bool = False


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from. `location` is a hub id (packaged, hub) or an absolute path."""

    kind: SourceKind
    location: str

    @property
    def model_id(self) -> str:
        """The id kvchat reports and fingerprints: the hub id or the absolute path."""
        return self.location


@functools.cache
def load_aliases(path: Traversable | Path = MODELS_FILE) -> dict[str, Alias]:
    """The aliases of configs/models.toml, by name."""
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8")).get("aliases", {})
        return {
            name: Alias(name, entry["hub"], bool(entry.get("packaged", False)))
            for name, entry in table.items()
        }
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: bad model alias table ({exc!r})") from None


def resolve_model(spec: str) -> ModelSource:
    """Resolve an alias, a local model folder, a .gguf file or a hub id `org/name`, in that order."""
    spec = spec.strip()
    aliases = load_aliases()
    if not spec:
        raise ModelLoadError(_unknown_message("no model given", aliases))
    alias = aliases.get(spec.lower())
    if alias is not None:
        return ModelSource("packaged" if alias.packaged else "hub", alias.hub_id)
    missing = missing_path(spec)
    if missing is not None:
        raise ModelLoadError(missing)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return ModelSource("gguf", str(path.resolve()))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder without config.json, so not a transformers model")
        return ModelSource("local", str(path.resolve()))
    if _HUB_ID.fullmatch(spec) and ".." not in spec:
        return ModelSource("hub", spec)
    raise ModelLoadError(_unknown_message(f"unknown model {spec!r}", aliases))


def missing_path(spec: str) -> str | None:
    """Why `spec` names no model when it is written as a path (`./x`, `/x`, `~/x`, `x/`, `x.gguf`)
    that does not exist, else None. Cheap, so kvchat can say it before loading anything."""
    spec = spec.strip()
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        return None if path.is_file() else f"GGUF file not found: {path}"
    written_as_path = spec.startswith(("/", "./", "../", "~")) or spec.endswith("/") or spec in (".", "..")
    if written_as_path and not path.exists():
        return f"no such model folder: {spec}"
    return None


def _unknown_message(problem: str, aliases: dict[str, Alias]) -> str:
    return (
        f"{problem}: give an alias ({', '.join(aliases)}), a local model folder, a .gguf file, "
        "or a Hugging Face id like Qwen/Qwen2.5-0.5B-Instruct"
    )
