"""Quantized weights kept on disk, so that a model is quantized once, not at every start: searching a
3B model's int4 groups takes ~90 s on one thread, reading the result back a few seconds.

A model's quantized layers are kept as a sealed folder (kvchat/cache_files.py) under
`$KVCHAT_CACHE_DIR/quantized/` (by default ~/.cache/kvchat/quantized) holding one safetensors file,
named by a key of everything that decides them: the weights (pieces of every linear layer's: a full
hash would cost seconds at every start), the model's config, the mode, the device type, the dtype,
which kernels run the layers (their layouts differ), torch's version, and the code that quantizes and
lays out (a hash of its files, so a new kvchat never reads an older one's layers).

What is read back is untrusted: the seal's SHA-256 of the whole file, then the declared schema of its
metadata and tensors (models/quantized_schema.py), finite scales, and layers that fit the model. A kept
entry that fails any of it is removed, said in one line, and the model quantized anew; one that cannot
be written (a full disk, a blocked folder) is said in one line too, and the start goes on. Deleting the
folder is always safe.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from kvchat import cache_files
from kvchat.linears import int4_rounding, quantized_linears, rescored_head, weight_layout
from kvchat.linears.quantized_linears import Int4Linear, Int8Linear, rebuilt
from kvchat.linears.rescored_head import RescoredHead
from kvchat.models import gguf_quant, quantize
from kvchat.models.gguf import cache_dir
from kvchat.models.progress import ProgressCallback, tell
from kvchat.models.quantize import QuantizeReport
from kvchat.models.quantized_schema import Int4Spec, KeptLayers, KeptLayersError, check_tensors, parse_kept
from kvchat.native import kernels

LAYERS = "layers.safetensors"
_PIECES, _PIECE = 64, 64  # values sampled from each weight: _PIECES runs of _PIECE


def folder() -> Path:
    """Where quantized layers are kept."""
    return cache_dir() / "quantized"


def cache_path(model: nn.Module, mode: str) -> Path:
    """The folder `model` quantized in `mode` is kept in (it may not exist yet); call before quantizing."""
    return folder() / _key(model, mode)


def save(
    model: nn.Module, report: QuantizeReport, path: Path, progress: ProgressCallback | None = None
) -> bool:
    """Keep the model's quantized layers and the report in the folder `path`, whole or not at all;
    whether it was kept. A failed write (a full disk, a blocked folder) is told in one line."""
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, object]] = {}
    for name, module in _quantized_layers(model).items():
        layers[name] = _describe(module)
        layer = module.coarse if isinstance(module, RescoredHead) else module
        for buffer_name, buffer in layer.named_buffers(recurse=False):
            tensors[f"{name}.{buffer_name}"] = buffer.detach().cpu().contiguous()
    metadata = {"code": _code_version(), "layers": json.dumps(layers), "report": json.dumps(asdict(report))}
    staging = cache_files.part_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache_files.sweep(path.parent)
        staging.mkdir()
        save_file(tensors, str(staging / LAYERS), metadata=metadata)
        cache_files.publish(staging, path)
    except (OSError, SafetensorError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc).strip() or type(exc).__name__
        tell(
            progress,
            f"cannot keep the {report.mode} weights in {path.parent} ({reason}); quantizing again next start",
        )
        return False
    finally:
        cache_files.remove(staging)
    return True


def load(
    model: nn.Module, path: Path, mode: str, progress: ProgressCallback | None = None
) -> QuantizeReport | None:
    """Put the layers kept in `path` in place of the model's linears and return their report; None (the
    model untouched) where there are none. Kept layers that fail a check are removed, told in one line."""
    cache_files.sweep(path.parent)  # what interrupted writes left, whoever they were
    if not path.exists():
        return None
    try:
        report, replacements = _read(model, path, mode)
    except KeptLayersError as err:
        tell(progress, f"the {mode} weights kept in {path} were damaged ({err}); quantizing again")
        cache_files.remove(path)
        return None
    for name, layer in replacements.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return report


def _read(model: nn.Module, path: Path, mode: str) -> tuple[QuantizeReport, dict[str, nn.Module]]:
    """The report and the layers kept in `path`, each checked; KeptLayersError names the first fault."""
    problem = cache_files.check_seal(path, (LAYERS,)) if path.is_dir() else "it is not a folder"
    if problem is not None:
        raise KeptLayersError(problem)
    device = next(model.parameters()).device
    try:
        with safe_open(str(path / LAYERS), framework="pt", device=str(device)) as file:
            kept = parse_kept(file.metadata() or {}, mode, _code_version())
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError) as exc:
        raise KeptLayersError(f"unreadable: {exc}") from None
    check_tensors(kept, {key: (str(t.dtype).removeprefix("torch."), t.numel()) for key, t in tensors.items()})
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise KeptLayersError(f"{key} holds values that are not finite")
    replacements = {name: _layer(model, kept, name, tensors) for name in kept.layers}
    report = QuantizeReport(**kept.report.model_dump())
    return report, replacements


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


def _layer(model: nn.Module, kept: KeptLayers, name: str, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The kept layer `name`, checked to stand in for the model's linear of that name."""
    spec = kept.layers[name]
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise KeptLayersError(f"the model has no layer {name}") from None
    if not isinstance(linear, nn.Linear) or tuple(linear.weight.shape) != (
        spec.out_features,
        spec.in_features,
    ):
        raise KeptLayersError(f"{name} does not fit the model's layer of that name")
    if spec.kernel == "kvchat":
        ours = kernels.int4_linear() if isinstance(spec, Int4Spec) else kernels.int8_linear()
        if ours is None or linear.weight.device.type != "cpu":
            raise KeptLayersError(f"{name} runs on kvchat's kernel, which does not run here")
    kind = Int4Linear if isinstance(spec, Int4Spec) else Int8Linear
    buffers = {b: tensors[f"{name}.{b}"] for b in kind.BUFFERS if f"{name}.{b}" in tensors}
    layer = rebuilt(kind, spec.model_dump(exclude={"kind", "num_exact"}), buffers)
    if isinstance(spec, Int4Spec) and spec.num_exact is not None:
        # its exact weight is the model's own, tied to the embedding
        return RescoredHead(layer, linear.weight, spec.num_exact)
    return layer
