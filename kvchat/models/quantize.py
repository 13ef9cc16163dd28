"""Weight-only quantization of a model's linear layers: each nn.Linear replaced by an int8 or int4 layer
(linears/quantized_linears.py), or taken from a GGUF's own 4-bit values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kvchat.errors import ModelLoadError
from kvchat.linears.quantized_linears import INT4_GROUP_SIZES, Int4Linear, Int8Linear
from kvchat.linears.rescored_head import RescoredHead

# The int4 modes' inputs per scale and zero: 32 as GGUF's Q4_0/Q4_1 (5 bits a weight), or 128 (4.25).
INT4_GROUPS = {"int4": 32, "int4-g128": 128}
# The modes quantize_model runs (the model.quantize setting offers these; tests/test_quantize.py holds
# the two together).
QUANTIZE_MODES = ("none", "int8", *INT4_GROUPS)
# The output layer's formats: a mode's, or "rescored" (RescoredHead: the int4 mode's layer, its highest
# logits computed again from the embedding it is tied to).
HEAD_MODES = (*QUANTIZE_MODES, "rescored")
# The aten ops each mode runs on each device type (torch >= 2.6 has the CPU int4 ones).
KERNELS = {
    ("int8", "cpu"): ("_weight_int8pack_mm",),
    ("int8", "cuda"): (),  # cuBLAS on the codes widened to bf16 (Int8Linear.forward)
    ("int4", "cpu"): ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"),
    ("int4", "cuda"): ("_convert_weight_to_int4pack", "_weight_int4pack_mm"),
}

# A linear's name and module in, its quantized replacement out (or None: quantize it from its weight).
LayerSource = Callable[[str, nn.Linear], nn.Module | None]


@dataclass
class QuantizeReport:
    """What quantize_model did: layer names by outcome."""

    mode: str
    quantized: list[str] = field(default_factory=list)
    kept_from_file: list[str] = field(default_factory=list)  # values taken as they are from a GGUF
    nested: list[str] = field(default_factory=list)  # int4 layers whose scales are nested
    rescored: list[str] = field(default_factory=list)  # output layers run as a RescoredHead
    refused: list[str] = field(default_factory=list)  # shapes the kernel cannot take: left as they were

    @property
    def num_replaced(self) -> int:
        return len(self.quantized) + len(self.kept_from_file)


def quantize_model(
    model: nn.Module,
    mode: str,
    head_mode: str | None = None,
    from_file: LayerSource | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> QuantizeReport:
    """Replace the model's nn.Linear layers by int8 or int4 ones in place (the embedding stays), int4
    in groups of 32 inputs, or of 128 for "int4-g128" (of 64 or 32 where 128 does not divide a layer's
    inputs, as SmolLM2's 576).

    The output layer is quantized as `head_mode` says. By default, under the int4 modes, an output
    layer tied to the embedding is "rescored" (a RescoredHead in the mode's groups), and any other is
    int8: plain int4 costs 50x the KL of all other layers together on SmolLM2 (docs/quantization.md,
    scripts/bench_quant.py quality).
    `from_file` may supply a ready layer for a name under "int4" (a GGUF's own 4-bit values, in
    groups of 32); the others are quantized from their weights. Layers of shapes the kernel cannot
    take stay as they are, listed in the report. `progress(done, total)` hears of each layer."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")
    if head_mode is not None and head_mode not in HEAD_MODES:
        raise ValueError(f"the output layer's mode must be one of {', '.join(HEAD_MODES)}, got {head_mode!r}")
    report = QuantizeReport(mode)
    if mode == "none":
        return report
    head = _output_layer(model)
    tied = _is_tied(model, head)
    if head_mode is None:
        head_mode = "rescored" if mode in INT4_GROUPS and tied else "int8"
    if head_mode == "rescored" and not (mode in INT4_GROUPS and tied):
        raise ValueError("a rescored output layer needs an int4 mode and a layer tied to the embedding")
    device = next(model.parameters()).device
    for layer_mode in {mode, mode if head_mode == "rescored" else head_mode} - {"none"}:
        require_kernels(layer_mode, device)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    head_name = next((n for n in names if model.get_submodule(n) is head), None)
    del head
    # Names, not modules: each dense layer is freed once replaced, so the peak stays near the model.
    for done, name in enumerate(names):
        if progress is not None:
            progress(done, len(names))
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        layer_mode = mode if name != head_name else _head_layer_mode(head_mode, mode, linear)
        rescored = name == head_name and head_mode == "rescored" and layer_mode == mode
        if layer_mode == "none":
            continue
        try:
            from_gguf = from_file if layer_mode == "int4" else None  # its groups are of 32
            replacement = from_gguf(name, linear) if from_gguf is not None else None
            outcome = report.kept_from_file if replacement is not None else report.quantized
            if replacement is None:
                replacement = (
                    Int8Linear.from_linear(linear)
                    if layer_mode == "int8"
                    else Int4Linear.from_linear(
                        linear, group_size=_group_for(linear, INT4_GROUPS[layer_mode])
                    )
                )
        except ValueError:  # a shape the kernel cannot take
            report.refused.append(name)
            continue
        outcome.append(name)
        if getattr(replacement, "nested", False):
            report.nested.append(name)
        if rescored:
            replacement = RescoredHead(replacement, linear.weight)
            report.rescored.append(name)
        _set_submodule(model, name, replacement)
    if progress is not None:
        progress(len(names), len(names))
    return report


def _group_for(linear: nn.Linear, largest: int) -> int:
    """The largest int4 group of at most `largest` inputs that divides the layer's (else `largest`)."""
    fits = [g for g in INT4_GROUP_SIZES if g <= largest and linear.in_features % g == 0]
    return max(fits, default=largest)


def require_kernels(mode: str, device: torch.device) -> None:
    """Raise ModelLoadError when this torch lacks the kernels `mode` needs on `device`."""
    names = KERNELS.get(("int4" if mode in INT4_GROUPS else mode, device.type))
    if names is None:
        raise ModelLoadError(f"--quantize {mode} runs on cpu or cuda, not {device.type}")
    missing = [name for name in names if not hasattr(torch.ops.aten, name)]
    if missing:
        raise ModelLoadError(
            f"--quantize {mode} needs torch's {', '.join(missing)} (torch >= 2.6); this is torch "
            f"{torch.__version__}"
        )


def _output_layer(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _head_layer_mode(head_mode: str, mode: str, linear: nn.Linear) -> str:
    """The mode the output layer's own weight takes: a rescored one's is the int4 mode's, or int8 where
    int4 cannot take its rows (not a multiple of 16)."""
    if head_mode != "rescored":
        return head_mode
    return mode if linear.out_features % 16 == 0 else "int8"


def _is_tied(model: nn.Module, head: nn.Module | None) -> bool:
    """Whether the output layer's weight is the input embedding's (the same tensor)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    return weight is not None and weight is getattr(embedding, "weight", None)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
