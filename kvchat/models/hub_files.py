"""Where a model's files come from when they are on the Hugging Face hub: the local cache first, a
download only where the hub answers, never in offline mode, and one message that says what to do
where a model is neither cached nor reachable."""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub
from transformers import AutoTokenizer

from kvchat.errors import KvchatError, ModelLoadError
from kvchat.models.sources import ModelSource

_TRUE_WORDS = ("1", "true", "yes", "on")
MAX_MESSAGE = 400  # characters of a joined message
# the files a tokenizer loads from, one of which a local model folder must hold
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model")


def load_part(loader, location: str, source: ModelSource, local_only: bool, **options: object):
    """The tokenizer or the weights (`loader`'s from_pretrained) from `location`."""
    folder = Path(location)
    no_tokenizer = folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES)
    if loader is AutoTokenizer and no_tokenizer:
        raise ModelLoadError(
            f"could not load {location}: it holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])} or the "
            "like); copy the tokenizer files of the model's release beside its config.json"
        )
    try:
        return loader.from_pretrained(location, local_files_only=local_only, **options)
    except KvchatError:
        raise
    except Exception as exc:
        problem = f"could not load {location}: {first_line(exc)}"
        if source.kind == "hub" and not local_only:
            problem = not_cached_message(location, f"downloading it failed: {problem}")
        raise ModelLoadError(problem) from exc


def hub_is_cached(hub_id: str) -> bool:
    """Whether a hub model loads from the HF cache; else check that it can be downloaded: one quick
    request first, since a download without network retries for ~45 s before failing."""
    cached = huggingface_hub.try_to_load_from_cache(hub_id, "config.json")
    if isinstance(cached, str):
        return True
    if is_offline():
        raise ModelLoadError(not_cached_message(hub_id, "offline mode (HF_HUB_OFFLINE) is on"))
    try:
        huggingface_hub.model_info(hub_id, timeout=10)
    except Exception as exc:
        raise ModelLoadError(
            not_cached_message(hub_id, f"the hub did not answer ({first_line(exc)})")
        ) from exc
    return False


def is_offline() -> bool:
    """True when the Hugging Face hub must not be contacted."""
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return huggingface_hub.constants.HF_HUB_OFFLINE or any(flag.lower() in _TRUE_WORDS for flag in flags)


def not_cached_message(hub_id: str, reason: str) -> str:
    """What to do about a hub model that is not in the cache and cannot be downloaded now."""
    return (
        f"model {hub_id} is not in the Hugging Face cache and {reason}. Download it where there is "
        f"network access (`hf download {hub_id}`, or `huggingface-cli download {hub_id}` with an older "
        "huggingface_hub) and copy the cache over, or pass a local model folder with --model PATH"
    )


def first_line(exc: BaseException) -> str:
    """An exception's message in one line (its type's name where it has none): its first line, or all
    of it joined where the first line ends in a colon (what follows is the message's own list)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if not lines[0].endswith(":"):
        return lines[0]
    joined = " ".join(lines)
    return joined if len(joined) <= MAX_MESSAGE else joined[: MAX_MESSAGE - 3].rstrip() + "..."
