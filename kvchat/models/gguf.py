"""GGUF files converted once to safetensors and cached, so a second start loads in seconds.

transformers dequantizes every tensor of a GGUF at each load (~20 s for 135M, ~74 s for 0.5B); the
converted folder loads like any local model. A file's conversion is keyed by its content (content_key,
a SHA-256 of the whole file, hashed once and remembered by the file's stamp), so a copy or a renamed
file is not converted again, and an edited or replaced one is. A conversion is a sealed folder
(kvchat/cache_files.py): one that is damaged is converted again, said in one line; where the cache
cannot be written, the model converted in memory serves this start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvchat import cache_files
from kvchat.cache_files import cache_dir
from kvchat.errors import ModelLoadError
from kvchat.models.progress import ProgressCallback, quiet_transformers, report, tell

CONVERTING = "converting"  # how a conversion's progress descriptions start
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
DIGESTS_FILE = "gguf-digests.json"  # in the cache folder: each GGUF's SHA-256 by its stamp
_MAX_DIGESTS = 64
# End-of-turn and end-of-text tokens of ChatML models (SmolLM2, Qwen): stop on whichever the vocabulary has.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


@dataclass(frozen=True)
class Conversion:
    """A GGUF as a transformers model: its cached folder, or where the cache could not be written,
    the model (fp32) and tokenizer converted in memory for this start."""

    folder: Path | None
    model: PreTrainedModel | None = None
    tokenizer: PreTrainedTokenizerBase | None = None


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Where the conversion of `gguf_path` is cached (it may not exist yet)."""
    return cache_dir() / "models" / f"gguf-{content_key(gguf_path)}"


def content_key(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256. A copy or a new name keeps the key, any edit
    gets another. The whole file is read once; its digest is kept in the cache folder by the file's
    stamp (kvchat/cache_files.py), so later starts read none of it."""
    resolved, stamp = str(path.resolve()), cache_files.stamp_of(path)
    digests = _read_digests()
    entry = digests.get(resolved)
    if entry is not None and entry["stamp"] == stamp:
        return entry["sha256"][:16]
    digest = cache_files.sha256_of(path)
    digests.pop(resolved, None)
    digests[resolved] = {"stamp": stamp, "sha256": digest}
    kept = dict(list(digests.items())[-_MAX_DIGESTS:])
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        cache_files.write_atomically(cache_dir() / DIGESTS_FILE, json.dumps(kept).encode())
    except OSError:
        pass  # a read-only cache: hashed again next time
    return digest[:16]


def _read_digests() -> dict[str, dict]:
    """The remembered digests; a damaged file counts as none (they are hashed again)."""
    try:
        table = json.loads((cache_dir() / DIGESTS_FILE).read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {
        path: entry
        for path, entry in table.items()
        if isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and len(entry["sha256"]) == 64
        and isinstance(entry.get("stamp"), list)
    }


def is_converted(folder: Path) -> bool:
    """True when `folder` holds a complete conversion, whole as it was written."""
    return check_converted(folder) is None


def check_converted(folder: Path) -> str | None:
    """Why `folder` holds no usable conversion, or None."""
    if not folder.is_dir():
        return "it is not there"
    return cache_files.check_seal(folder, REQUIRED_FILES)


def ensure_gguf_converted(gguf_path: Path, progress: ProgressCallback | None = None) -> Conversion:
    """The cached conversion of a user's GGUF file, converting it first if needed."""
    return convert_once(gguf_path, converted_gguf_dir(gguf_path), progress)


def convert_once(gguf_path: Path, target: Path, progress: ProgressCallback | None = None) -> Conversion:
    """Convert `gguf_path` into `target` unless a whole conversion is there. A damaged one is removed
    and converted again; where `target` cannot be written, the conversion in memory is returned."""
    cache_files.sweep(target.parent)  # what interrupted writes left, whoever they were
    problem = check_converted(target)
    if problem is None:
        return Conversion(target)
    if target.exists():
        tell(
            progress,
            f"the converted model in {target} is damaged ({problem}); converting {gguf_path.name} again",
        )
        cache_files.remove(target)
    try:
        model, tokenizer = read_gguf(gguf_path, progress)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not convert {gguf_path}: {exc}") from exc
    staging = cache_files.part_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        save_converted(model, tokenizer, staging, gguf_path.name, progress)
        cache_files.publish(staging, target)  # readers never see a half-written folder
    except (OSError, SafetensorError) as exc:
        tell(
            progress,
            f"cannot keep the converted model in {target.parent} ({_reason(exc)}); {gguf_path.name} is "
            "converted again at every start until it can",
        )
        return Conversion(None, model, tokenizer)
    finally:
        cache_files.remove(staging)
    return Conversion(target)


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0] or type(exc).__name__


def read_gguf(
    gguf_path: Path, progress: ProgressCallback | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize a GGUF into a transformers model (fp32) and its tokenizer, generation config fixed."""
    # Each stage is named: reading the tokenizer and the metadata takes most of the time, uncounted.
    description = f"{CONVERTING} {gguf_path.name} (once)"
    report(progress, f"{description}: tokenizer", 0, None)
    with quiet_transformers(progress, f"{description}: tensors"):
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        report(progress, f"{description}: metadata", 0, None)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _fix_generation_config(model, tokenizer)
    # The GGUF tokenizer claims an unbounded length; the model's real limit is its RoPE range.
    tokenizer.model_max_length = model.config.max_position_embeddings
    # The weights are plain tensors now; drop the GGUF quantizer so save_pretrained accepts them.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's __setattr__ typing
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def save_converted(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    name: str,
    progress: ProgressCallback | None = None,
) -> None:
    """Write a converted model and its tokenizer into `out_dir`."""
    report(progress, f"{CONVERTING} {name} (once): saving", 0, None)
    with quiet_transformers():
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)


def _fix_generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Stop on `<|im_end|>` (ends a chat turn) and `<|endoftext|>` (ends a document) where the
    vocabulary has them, besides the ids the file names."""
    vocab = tokenizer.get_vocab()
    stop_ids = [vocab[token] for token in _STOP_TOKENS if token in vocab]
    if not stop_ids:
        return
    named = model.generation_config.eos_token_id
    named_ids = [named] if isinstance(named, int) else list(named or [])
    model.generation_config.eos_token_id = stop_ids + [i for i in named_ids if i not in stop_ids]
    model.generation_config.pad_token_id = stop_ids[0]
