"""Load a model and its tokenizer from any source, ready for inference."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvchat import cache_files
from kvchat.errors import ModelLoadError
from kvchat.models import quantized_cache
from kvchat.models.device import apply_threads, choose_device, choose_dtype
from kvchat.models.gguf import Conversion, converted_gguf_dir, ensure_gguf_converted, is_converted
from kvchat.models.gguf_quant import GGUFInt4Layers
from kvchat.models.hub_files import first_line, hub_is_cached, load_part
from kvchat.models.packaged import packaged_gguf
from kvchat.models.progress import ProgressCallback, quiet_transformers, report, tell
from kvchat.models.quantize import QuantizeReport, quantize_model
from kvchat.models.sources import ModelSource, resolve_model
from kvchat.native import kernels

__all__ = [
    "LoadedModel",
    "PreparedModel",
    "ModelSource",
    "ProgressCallback",
    "apply_threads",
    "choose_dtype",
    "compute_fingerprint",
    "load_model",
    "resolve_model",
]

# Config entries that change with the machine or the load options, not with the model.
_VOLATILE_CONFIG_KEYS = frozenset({"dtype", "torch_dtype", "transformers_version"})


class ModelChoice(Protocol):
    """What loading reads of the model settings (kvchat.settings_schema.ModelSettings has it all)."""

    @property
    def model(self) -> str: ...  # an alias, a hub id, a local folder or a .gguf file
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def threads(self) -> int: ...
    @property
    def quantize(self) -> str: ...
    @property
    def quant_cache(self) -> bool: ...
    @property
    def chat_template(self) -> str | None: ...


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode on its device, its tokenizer, and what identifies them."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: frozenset[int]
    fingerprint: str
    quantization: QuantizeReport | None = None


@dataclass(frozen=True)
class PreparedModel:
    """A model's source made ready to load (a GGUF converted, the hub's cache checked) and its
    tokenizer, loaded first: the chat template is settled before the weights load."""

    source: ModelSource
    location: str | None  # the folder or hub id the weights load from; None: converted in memory
    local_only: bool
    tokenizer: PreTrainedTokenizerBase
    told_no_template: bool = False  # a GGUF without one: said before its conversion
    conversion: Conversion | None = None  # a GGUF's, made on first use


def prepare_model(settings: ModelChoice, progress: ProgressCallback | None = None) -> PreparedModel:
    """Resolve `settings.model`, start building kvchat's kernels (in a process of their own, while the
    model converts and loads), convert a GGUF on first use, and load the tokenizer."""
    source = resolve_model(settings.model)
    if choose_device(settings.device).type == "cpu":
        kernels.start_build(progress)
    told = False
    if source.kind == "gguf" and not settings.chat_template and _converts_first(Path(source.location)):
        told = not has_chat_template(Path(source.location))
        if told:  # said before the conversion's long minutes
            tell(progress, no_template_note(source.model_id))
    conversion = _conversion(source, progress)
    if conversion is not None:
        return _prepared_conversion(source, conversion, told, progress)
    local_only = True if source.kind == "local" else hub_is_cached(source.location)
    with quiet_transformers():
        tokenizer = load_part(AutoTokenizer, source.location, source, local_only)
    return PreparedModel(source, source.location, local_only, tokenizer, told)


def _prepared_conversion(
    source: ModelSource, conversion: Conversion, told: bool, progress: ProgressCallback | None
) -> PreparedModel:
    """A converted GGUF with its tokenizer: from the cached folder (one whose tokenizer cannot be
    loaded is damaged: converted again, once), or as converted in memory."""
    for attempt in range(2):
        if conversion.folder is None:
            assert conversion.tokenizer is not None
            return PreparedModel(source, None, True, conversion.tokenizer, told, conversion)
        try:
            with quiet_transformers():
                tokenizer = load_part(AutoTokenizer, str(conversion.folder), source, True)
            return PreparedModel(source, str(conversion.folder), True, tokenizer, told, conversion)
        except ModelLoadError as exc:
            if attempt:
                raise
            conversion = _convert_again(source, conversion, exc, progress)
    raise AssertionError("unreachable")


def _convert_again(
    source: ModelSource, conversion: Conversion, problem: Exception, progress: ProgressCallback | None
) -> Conversion:
    """A converted folder that was checked whole yet cannot be loaded is a damaged cache, not a bad
    model: it is removed and converted again."""
    assert conversion.folder is not None
    folder = conversion.folder
    tell(progress, f"the converted model in {folder} cannot be loaded ({problem}); converting it again")
    cache_files.remove(conversion.folder)
    again = _conversion(source, progress)
    assert again is not None
    return again


def no_template_note(model_id: str) -> str:
    return (
        f"{model_id} has no chat template: kvchat uses a generic one (ChatML); "
        "--chat-template NAME|FILE picks another"
    )


def load_model(
    settings: ModelChoice, progress: ProgressCallback | None = None, prepared: PreparedModel | None = None
) -> LoadedModel:
    """Load the model `settings.model` names (prepared by `prepare_model` unless given) in the chosen
    dtype onto the chosen device, set CPU threads."""
    prepared = prepared or prepare_model(settings, progress)
    source, tokenizer = prepared.source, prepared.tokenizer
    device = choose_device(settings.device)
    apply_threads(settings.threads)
    dtype = choose_dtype(settings.dtype, device)
    description = f"loading {source.model_id}"
    report(progress, description, 0, 1)
    with quiet_transformers():
        if prepared.conversion is not None:
            model, prepared = _load_converted(prepared, dtype, progress)
        else:
            assert prepared.location is not None
            model = load_part(
                AutoModelForCausalLM, prepared.location, source, prepared.local_only, dtype=dtype
            )
    try:
        model.to(device)  # type: ignore[arg-type]  # transformers types `to` for a model argument
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        raise ModelLoadError(f"could not move {source.model_id} to {device}: {first_line(exc)}") from exc
    model.eval()
    report(progress, description, 1, 1)  # quantizing, a stage of its own, comes after
    # before quantizing: layers take kvchat's layout
    if device.type == "cpu" and kernels.build_error() is not None:
        note = kernels.failure_note()  # where its kernels are built
        if note is not None:
            tell(progress, note)
    conversion = prepared.conversion
    folder = conversion.folder if conversion is not None else None
    quantization = apply_quantize(model, settings.quantize, source, folder, progress, settings.quant_cache)
    eos_ids = eos_token_ids(model, tokenizer)
    if not eos_ids:
        raise ModelLoadError(f"{source.model_id} names no end-of-sequence token; replies would never end")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=source.model_id,
        dtype=dtype,
        device=device,
        eos_token_ids=eos_ids,
        fingerprint=compute_fingerprint(source.model_id, model.config, quantization_tag(quantization)),
        quantization=quantization,
    )


def _converts_first(gguf_path: Path) -> bool:
    return not is_converted(converted_gguf_dir(gguf_path))


def has_chat_template(gguf_path: Path) -> bool:
    """Whether a GGUF file's metadata carries a chat template (read without loading its tokenizer)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf_path).get_field("tokenizer.chat_template") is not None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not read {gguf_path}: {first_line(exc)}") from exc


def _conversion(source: ModelSource, progress: ProgressCallback | None) -> Conversion | None:
    """The safetensors conversion of a GGUF (the packaged one or a user's), made on first use; a copy
    of the packaged file shares its conversion, keyed by content."""
    if source.kind == "packaged":
        return ensure_gguf_converted(packaged_gguf(), progress)
    if source.kind == "gguf":
        return ensure_gguf_converted(Path(source.location), progress)
    return None


def _load_converted(
    prepared: PreparedModel, dtype: torch.dtype, progress: ProgressCallback | None
) -> tuple[PreTrainedModel, PreparedModel]:
    """The converted model: from its cached folder, or as converted in memory where the cache could
    not be written; a folder that cannot be loaded is converted again, once."""
    conversion = prepared.conversion
    assert conversion is not None
    for attempt in range(2):
        if conversion.folder is None:
            assert conversion.model is not None
            model = conversion.model.to(dtype)  # type: ignore[arg-type]
            return model, replace(prepared, location=None, conversion=conversion)
        try:
            folder = str(conversion.folder)
            model = load_part(AutoModelForCausalLM, folder, prepared.source, True, dtype=dtype)
            return model, replace(prepared, location=str(conversion.folder), conversion=conversion)
        except ModelLoadError as exc:
            if attempt:
                raise
            conversion = _convert_again(prepared.source, conversion, exc, progress)
    raise AssertionError("unreachable")


def apply_quantize(
    model: PreTrainedModel,
    mode: str,
    source: ModelSource,
    converted: Path | None,
    progress: ProgressCallback | None = None,
    keep: bool = True,
) -> QuantizeReport | None:
    """Quantize the linear layers in place, reporting each layer to `progress` ("quantizing to int4",
    ...); int4 keeps a Q4_0/Q4_1 GGUF's own 4-bit values. Where `keep`, layers quantized anew are kept
    on disk, and the next start with the same weights reads them back (models/quantized_cache.py)."""
    if mode == "none":
        return None
    from_file = None
    if mode == "int4" and source.kind in ("packaged", "gguf"):
        path = packaged_gguf() if source.kind == "packaged" else Path(source.location)
        config = model.config
        from_file = GGUFInt4Layers(
            path,
            converted / "gguf-tensors.json" if converted is not None else None,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.num_hidden_layers,
            lambda message: tell(progress, message),
        )
    kept = quantized_cache.cache_path(model, mode) if keep else None
    if kept is not None and kept.exists():
        description = f"reading the {mode} weights kept from an earlier start"
        report(progress, description, 0, 1)
        cached = quantized_cache.load(model, kept, mode, progress)
        report(progress, description, 1, 1)
        if cached is not None:
            return cached
    with torch.no_grad():
        result = quantize_model(
            model,
            mode,
            from_file=from_file,
            progress=lambda done, total: report(progress, f"quantizing to {mode}", done, total),
        )
    if kept is not None and result.quantized:  # some layers were quantized anew: keep them for the next start
        description = f"keeping the {mode} weights for the next start"
        report(progress, description, 0, 1)
        quantized_cache.save(model, result, kept, progress)
        report(progress, description, 1, 1)
    return result


def quantization_tag(report: QuantizeReport | None) -> str:
    """How the weights were quantized, as the fingerprint records it: none, int8, int4, int4+file,
    int4+nested (scales nested: other weights than int4's bf16 scales and zeros), int4+file+nested."""
    if report is None:
        return "none"
    return report.mode + ("+file" if report.kept_from_file else "") + ("+nested" if report.nested else "")


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The union of the tokenizer's and the generation config's end-of-sequence ids."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, model.generation_config.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(token_id) for token_id in value)
    return frozenset(ids)


def compute_fingerprint(model_id: str, config: PretrainedConfig, quantize: str = "none") -> str:
    """A short hash of the model id, architecture config and weight quantization, the same for any
    dtype, device or path: KV computed with quantized weights is refused by an unquantized model."""
    entries = {
        key: value
        for key, value in config.to_dict().items()
        if not key.startswith("_") and key not in _VOLATILE_CONFIG_KEYS
    }
    text = model_id + "\n" + json.dumps(entries, sort_keys=True, default=str)
    if quantize != "none":
        text += f"\nquantize={quantize}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
