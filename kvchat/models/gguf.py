"""GGUF files converted once to safetensors and cached, so a second start loads in seconds.

transformers dequantizes every tensor of a GGUF at each load (~20 s for 135M, ~74 s for 0.5B); the
converted folder loads like any local model. A file's conversion is keyed by its content (content_key),
so a copy or a renamed file is not converted again, and an edited or replaced one is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvchat.errors import ModelLoadError
from kvchat.models.progress import ProgressCallback, quiet_transformers, report

CONVERTING = "converting"  # how a conversion's progress descriptions start
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
_HEADER_BYTES = 1 << 20
_NUM_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10
# End-of-turn and end-of-text tokens of ChatML models (SmolLM2, Qwen): stop on whichever the vocabulary has.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def cache_dir() -> Path:
    """kvchat's cache folder: `$KVCHAT_CACHE_DIR`, else ~/.cache/kvchat."""
    return Path(os.environ.get("KVCHAT_CACHE_DIR") or "~/.cache/kvchat").expanduser()


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Where the conversion of `gguf_path` is cached (it may not exist yet)."""
    return cache_dir() / "models" / f"gguf-{gguf_path.stem}-{content_key(gguf_path)}"


def content_key(path: Path) -> str:
    """A hash of a file's size and content: its first MiB (header and metadata), its last MiB and
    pieces in between. A copy or a new name keeps the key, an edited file gets another; a full hash
    of a multi-GiB model would cost seconds at every start."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}:".encode())
    offsets = [size * i // _NUM_SAMPLES for i in range(1, _NUM_SAMPLES)]
    with path.open("rb") as file:
        digest.update(file.read(_HEADER_BYTES))
        for offset in offsets:
            file.seek(offset)
            digest.update(file.read(_SAMPLE_BYTES))
        file.seek(max(0, size - _HEADER_BYTES))
        digest.update(file.read(_HEADER_BYTES))
    return digest.hexdigest()[:16]


def is_converted(folder: Path) -> bool:
    """True when `folder` holds a complete conversion."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def ensure_gguf_converted(gguf_path: Path, progress: ProgressCallback | None = None) -> Path:
    """The cached conversion of a user's GGUF file, converting it first if needed."""
    return convert_once(gguf_path, converted_gguf_dir(gguf_path), progress)


def convert_once(gguf_path: Path, target: Path, progress: ProgressCallback | None = None) -> Path:
    """Convert `gguf_path` into `target` unless a complete conversion is there; return `target`."""
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert beside the target and rename: readers never see a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        convert_gguf(gguf_path, staging, progress)
        if target.exists() and not is_converted(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished first; its folder is as good as ours.
            if not is_converted(target):
                raise
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"could not convert {gguf_path} into {target}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, progress: ProgressCallback | None = None) -> None:
    """Dequantize a GGUF into `out_dir` as safetensors plus tokenizer and generation config."""
    # Each stage is named: reading the tokenizer and the metadata takes most of the time, uncounted.
    description = f"{CONVERTING} {gguf_path.name} (once)"
    report(progress, f"{description}: tokenizer", 0, None)
    with quiet_transformers(progress, f"{description}: tensors"):
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        report(progress, f"{description}: metadata", 0, None)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        report(progress, f"{description}: saving", 0, None)
        _fix_generation_config(model, tokenizer)
        # The GGUF tokenizer claims an unbounded length; the model's real limit is its RoPE range.
        tokenizer.model_max_length = model.config.max_position_embeddings
        # The weights are plain tensors now; drop the GGUF quantizer so save_pretrained accepts them.
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's __setattr__ typing
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
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
