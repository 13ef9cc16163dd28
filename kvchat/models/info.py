"""What `/info` tells about the model a session runs: read off the loaded model, its tokenizer and the
KV pool's size. Plain data: the CLI renders it. torch is imported where a model is read, so that the
CLI can name the record without loading torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Markers of the common chat template families, checked in order against the template's text.
_TEMPLATE_FAMILIES = (
    ("<|im_start|>", "ChatML"),
    ("<|start_header_id|>", "Llama 3"),
    ("[INST]", "Llama 2 / Mistral"),
    ("<start_of_turn>", "Gemma"),
    ("<|start_of_role|>", "Granite"),
    ("<|user|>", "Phi / Zephyr"),
)


@dataclass(frozen=True)
class ModelInfo:
    """The model of a session. `source` and `quantization` are filled by whoever knows the settings
    it was started with (the shell); the rest comes from the loaded objects."""

    model_id: str
    family: str  # the config's model_type, e.g. "llama", "qwen2"
    architecture: str  # e.g. "LlamaForCausalLM"
    num_parameters: int
    dtype: str  # bf16, fp32, fp16
    context_length: int | None  # the most positions the model was trained for
    chat_template: str  # its family (ChatML, ...) or "none: a plain fallback"
    default_system_prompt: str | None  # what the template inserts when no system prompt is set
    kv_tokens: int  # the KV budget: blocks times block size
    kv_bytes: int
    block_size: int
    device: str
    threads: int
    source: str = ""  # where the weights came from: "packaged GGUF at ...", "local folder ...", ...
    quantization: str = "none"
    decode: str = "module forward"  # how single tokens decode: lean step, module forward
    reuse: str = "exact, reposition, repair"  # the reuse modes the model runs, and why not the others
    kernels: str = ""  # kvchat's C++ kernels: built, or why not and what to install
    cpu_tier: str = ""  # the tier of kernels in use (portable, avx2, avx512, neon), and why that one
    # why a token's logits may depend on what is computed with it; None: batch-invariant
    batch_variance: str | None = "not known"


def model_info(
    model: Any,
    chat_template: str | None,
    default_system_prompt: str | None,
    *,
    model_id: str,
    num_blocks: int,
    block_size: int,
    bytes_per_block: int,
) -> ModelInfo:
    """Describe a loaded transformers model with the KV pool built over it."""
    import torch

    from kvchat.models.device import DTYPE_NAMES
    from kvchat.native import kernels, tiers

    param = next(model.parameters())
    config = model.config
    return ModelInfo(
        model_id=model_id,
        family=str(getattr(config, "model_type", "") or "unknown"),
        architecture=", ".join(getattr(config, "architectures", None) or [type(model).__name__]),
        num_parameters=num_weights(model),
        dtype=DTYPE_NAMES.get(param.dtype, str(param.dtype).removeprefix("torch.")),
        context_length=getattr(config, "max_position_embeddings", None),
        chat_template=template_family(chat_template),
        default_system_prompt=default_system_prompt,
        kv_tokens=num_blocks * block_size,
        kv_bytes=num_blocks * bytes_per_block,
        block_size=block_size,
        device=str(param.device),
        threads=torch.get_num_threads(),
        quantization=describe_quantization(model),
        kernels=kernels.status() if param.device.type == "cpu" else f"for CPUs, not used on {param.device}",
        cpu_tier=tiers.describe() if param.device.type == "cpu" else "",
    )


def describe_quantization(model: Any) -> str:
    """How the linear weights are stored and whose kernels run them: "none", "none (bf16 on kvchat's
    kernel)", "none (fp32 on kvchat's kernel)", "int4 (kvchat's kernels)", "int4-g128 (kvchat's
    kernels)", "int8 (torch's kernels)", ...
    (an int4 model's int8 output layer counts as int4's), and "the output layer rescored" where it is a
    RescoredHead."""
    import torch

    from kvchat.linears.bf16_linears import PackedLinear, TiledLinear, UpcastLinear
    from kvchat.linears.quantized_linears import Int4Linear, Int8Linear
    from kvchat.linears.rescored_head import RescoredHead

    layers = [m for m in model.modules() if isinstance(m, Int4Linear | Int8Linear)]
    if not layers:
        modules = list(model.modules())
        tiled = [m for m in modules if isinstance(m, TiledLinear)]
        if tiled and tiled[0].tiles.dtype != torch.bfloat16:
            return "none (fp32 on kvchat's kernel)"
        bf16_kinds = {"kvchat": TiledLinear, "oneDNN": PackedLinear, "torch": UpcastLinear}
        found = [name for name, kind in bf16_kinds.items() if any(isinstance(m, kind) for m in modules)]
        if not found:
            return "none"
        return f"none (bf16 on {' and '.join(found)}'s kernel{'s' if len(found) > 1 else ''})"
    groups = {m.group_size for m in layers if isinstance(m, Int4Linear)}
    mode = ("int4" if groups == {32} else f"int4-g{max(groups)}") if groups else "int8"
    owners = " and ".join(sorted({m.kernel for m in layers}))
    rescored = any(isinstance(m, RescoredHead) for m in model.modules())
    return f"{mode} ({owners}'s kernels{', the output layer rescored' if rescored else ''})"


def num_weights(model: Any) -> int:
    """The model's weights, counting a packed or quantized linear layer (whose weight is no parameter)
    as the in x out weights it stands for, and a tied output layer once."""
    from torch import nn

    total = sum(p.numel() for p in model.parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    outputs = (output, getattr(output, "coarse", None))  # a RescoredHead's int4 layer is the output layer
    for module in model.modules():
        if isinstance(getattr(module, "weight", None), nn.Parameter) or not hasattr(module, "out_features"):
            continue
        if not (tied and any(module is o for o in outputs)):
            total += module.in_features * module.out_features
    return total


def template_family(template: str | None) -> str:
    """A chat template's family by its markers, or what stands in for a missing one."""
    if not template:
        return "none (kvchat's plain fallback)"
    family = family_of(template)
    return "the tokenizer's own" if family == "own format" else f"{family} (the tokenizer's own)"


def family_of(template: str) -> str:
    """A chat template's family by its markers ("own format" when none is known)."""
    return next((family for marker, family in _TEMPLATE_FAMILIES if marker in template), "own format")
