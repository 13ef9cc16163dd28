"""Quantized weights kept on disk, so that a model is quantized once, not at every start: searching a
3B model's int4 groups takes ~90 s on one thread, reading the result back a few seconds.

A model's quantized layers are saved as one safetensors file under `$KVCHAT_CACHE_DIR/quantized/` (by
default ~/.cache/kvchat/quantized), named by a key of everything that decides them: the weights (pieces
of every linear layer's, as `gguf.content_key` samples a file: a full hash would cost seconds at every
start), the model's config, the mode, the device type, the dtype, which kernels run the layers (their
layouts differ), torch's version, and the code that quantizes and lays out (a hash of its files, so a
new kvchat never reads an older one's layers). A file that cannot be read, or whose layers do not fit
the model, is quantized anew and written again. Deleting the folder is always safe.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from kvchat.models import gguf_quant, int4_rounding, quantize, quantized_linears, rescored_head, weight_layout
from kvchat.models.gguf import cache_dir
from kvchat.models.quantize import QuantizeReport
from kvchat.models.quantized_linears import Int4Linear, Int8Linear, rebuilt
from kvchat.models.rescored_head import RescoredHead
from kvchat.native import kernels

_PIECES, _PIECE = 64, 64  # values sampled from each weight: _PIECES runs of _PIECE


def folder() -> Path:
    """Where quantized layers are kept."""
    return cache_dir() / "quantized"


def cache_path(model: nn.Module, mode: str) -> Path:
    """Where `model` quantized in `mode` is kept (it may not exist yet); call before quantizing."""
    return folder() / f"{_key(model, mode)}.safetensors"


def save(model: nn.Module, report: QuantizeReport, path: Path) -> None:
    """Write the model's quantized layers and the report to `path` (atomically). A failed write (a full
    disk) leaves no file: the next start quantizes again."""
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, object]] = {}
    for name, module in _quantized_layers(model).items():
        layers[name] = _describe(module)
        layer = module.coarse if isinstance(module, RescoredHead) else module
        for buffer_name, buffer in layer.named_buffers(recurse=False):
            tensors[f"{name}.{buffer_name}"] = buffer.detach().cpu().contiguous()
    metadata = {"code": _code_version(), "layers": json.dumps(layers), "report": json.dumps(asdict(report))}
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(partial), metadata=metadata)
        partial.replace(path)
    except OSError:
        partial.unlink(missing_ok=True)


def load(model: nn.Module, path: Path) -> QuantizeReport | None:
    """Put the layers kept at `path` in place of the model's linears and return their report; None (the
    model untouched) where there is no such file or it does not fit the model."""
    if not path.is_file():
        return None
    device = next(model.parameters()).device
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as file:
            metadata = file.metadata() or {}
            if metadata.get("code") != _code_version():
                return None
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (not a dict)
        layers = json.loads(metadata["layers"])
        report = QuantizeReport(**json.loads(metadata["report"]))
        replacements: dict[str, nn.Module] = {
            name: _layer(spec, name, tensors) for name, spec in layers.items()
        }
    except (SafetensorError, OSError, ValueError, KeyError, TypeError):
        return None
    if not all(_fits(model, name, layer) for name, layer in replacements.items()):
        return None
    for name, layer in replacements.items():
        parent_name, _, child = name.rpartition(".")
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)  # _fits said so
        if "num_exact" in layers[name]:  # its exact weight is the model's own, tied to the embedding
            layer = RescoredHead(layer, linear.weight, layers[name]["num_exact"])
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return report


def _quantized_layers(model: nn.Module) -> dict[str, Int4Linear | Int8Linear | RescoredHead]:
    """The quantized layers by the name of the linear each replaced (a RescoredHead's own int4 layer
    is kept with it, under its name)."""
    found: dict[str, Int4Linear | Int8Linear | RescoredHead] = {}
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if isinstance(module, RescoredHead) or (
            isinstance(module, Int4Linear | Int8Linear) and not isinstance(found.get(parent), RescoredHead)
        ):
            found[name] = module
    return found


def _key(model: nn.Module, mode: str) -> str:
    parameter = next(model.parameters())
    config = getattr(model, "config", None)
    setup = {
        "code": _code_version(),
        "mode": mode,
        "device": parameter.device.type,
        "dtype": str(parameter.dtype),
        "torch": torch.__version__,
        "kernels": [kernels.int4_linear() is not None, kernels.int8_linear() is not None]
        if parameter.device.type == "cpu"
        else None,
        "config": config.to_json_string(use_diff=False) if config is not None else None,
    }
    digest = hashlib.sha256(json.dumps(setup, sort_keys=True).encode())
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            digest.update(f"{name}:{tuple(module.weight.shape)}".encode())
            digest.update(_sample(module.weight))
            if module.bias is not None:
                digest.update(_sample(module.bias))
    return digest.hexdigest()[:24]


@functools.cache
def _code_version() -> str:
    """A hash of the code that decides quantized layers and their layouts: any change to it (a new
    rounding, another layout) makes every file kept before it a miss."""
    digest = hashlib.sha256()
    for module in (gguf_quant, int4_rounding, quantize, quantized_linears, rescored_head, weight_layout):
        digest.update(Path(inspect.getfile(module)).read_bytes())
    return digest.hexdigest()[:16]


def _sample(tensor: torch.Tensor) -> bytes:
    """_PIECES runs of _PIECE values spread over the tensor, as bytes."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= _PIECES * _PIECE:
        picked = flat
    else:
        starts = torch.linspace(0, flat.numel() - _PIECE, _PIECES, device=flat.device).long()
        picked = flat[(starts[:, None] + torch.arange(_PIECE, device=flat.device)).reshape(-1)]
    return picked.float().cpu().numpy().tobytes()


def _describe(module: Int4Linear | Int8Linear | RescoredHead) -> dict[str, object]:
    if isinstance(module, RescoredHead):
        return {**_describe(module.coarse), "num_exact": module.num_exact}
    return {"class": type(module).__name__, **{name: getattr(module, name) for name in module.ATTRIBUTES}}


def _layer(spec: dict, name: str, tensors: dict[str, torch.Tensor]) -> Int4Linear | Int8Linear:
    kinds = {kind.__name__: kind for kind in (Int4Linear, Int8Linear)}
    if spec["class"] not in kinds:
        raise ValueError(f"no such layer: {spec['class']}")
    kind = kinds[spec["class"]]
    # a missing buffer is a KeyError (a file that does not fit), but for a bias: a layer without one
    buffers = {b: tensors[f"{name}.{b}"] for b in kind.BUFFERS if b != "bias" or f"{name}.bias" in tensors}
    return rebuilt(kind, spec, buffers)


def _fits(model: nn.Module, name: str, layer: nn.Module) -> bool:
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        return False
    shape = (layer.out_features, layer.in_features)
    return isinstance(linear, nn.Linear) and tuple(linear.weight.shape) == shape
