"""Every setting, declared once: name and type (the dataclass field), default, valid values, help,
whether it applies live, and its command-line flag.

The TOML defaults check, the flags, `/set`, completion, validation and the sampler's own checks all
read these declarations. Plain Python (no torch), so `kvchat --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass

from kvchat.engine.records import SamplingParams
from kvchat.settings_spec import Range, SettingInfo, Spec, setting


@dataclass(frozen=True)
class ModelSettings:
    """Which model to run, and where."""

    model: str = setting(
        "smollm2-135m",
        "An alias from configs/models.toml, a Hugging Face id (org/name), a local model folder, or a "
        ".gguf file.",
        flag="--model",
        pattern=r"(?s).*\S.*",
        pattern_help="must not be empty",
    )
    dtype: str = setting(
        "auto",
        "Weights dtype: auto (bf16 where the CPU/GPU runs it natively, else fp32), bf16, fp32 or fp16; "
        "bfloat16, float32 and float16 are accepted too.",
        flag="--dtype",
        choices=("auto", "bf16", "fp32", "fp16"),
        aliases={"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "half": "fp16", "float": "fp32"},
    )
    device: str = setting(
        "auto",
        "auto (cuda when available, else cpu), cpu, cuda or cuda:N.",
        flag="--device",
        pattern=r"auto|cpu|cuda(:\d+)?",
        pattern_help="must be auto, cpu, cuda or cuda:N",
    )
    threads: int = setting(
        0,
        "CPU threads for torch.",
        flag="--threads",
        range=Range(0, 1024),
        note="0 picks automatically",
        detail="0 means all physical cores but one, at least 1. More than the CPUs kvchat may run on is "
        "refused.",
    )
    quantize: str = setting(
        "none",
        "Weight-only quantization of the linear layers: none, int8 (a scale per output channel), int4 "
        "(a scale and zero per 32 inputs, nested as 8-bit codes) or int4-g128 (per 128: fewer bytes, "
        "faster, a little less exact); the output layer int8, or under int4 where tied to the embedding, "
        "int4 with its highest logits computed again from the embedding. int4 keeps a GGUF's Q4_0/Q4_1 "
        "values.",
        flag="--quantize",
        choices=("none", "int8", "int4", "int4-g128"),
    )
    quant_cache: bool = setting(
        True,
        "Keep the layers --quantize makes anew on disk, read back at the next start with the same "
        "weights and mode (a 3B model quantizes in ~90 s, reads back in under a second); off: quantize "
        "at every start, nothing read or written.",
        flag="--quant-cache",
        detail="In quantized/ of the cache folder (~/.cache/kvchat or $KVCHAT_CACHE_DIR), one file per "
        "model and mode (1.9 GB for a 3B model in int4); deleting it is safe.",
    )
    batch_invariant: bool = setting(
        True,
        "Compute each token's logits to the same bits however it is batched: alone, in a prefill chunk, "
        "among speculation's drafts or after a cached prefix, so that exact reuse, /retry, /load and "
        "speculation give a fresh run's answer. Off: a prompt's chunks of more than 16 tokens take the "
        "module forward, and several rows may take AMX's tiles where the CPU has them: faster there, "
        "rounded per batch.",
        flag="--invariant",
        detail="Holds for Llama, Qwen2 and Qwen3 on CPU with kvchat's kernels (bf16, fp32, int8, int4); "
        "/info says whether it holds for the model in use, and if not, why.",
    )
    chat_template: str | None = setting(
        None,
        "The chat template: chatml (a generic one) or a Jinja file. Unset: the model's own, or ChatML "
        "for a model that has none (kvchat says so at start).",
        flag="--chat-template",
        detail="/info names the template in use.",
        example="chatml",
        pattern=r"(?s).*\S.*",
        pattern_help="must not be empty",
    )
    draft_model: str | None = setting(
        None,
        "A small model sharing the tokenizer that drafts tokens for decode.speculate = draft.",
        flag="--draft-model",
        detail="For example smollm2-135m for SmolLM2-360M/1.7B, Qwen2.5-0.5B for Qwen2.5-3B. Unset: none.",
        example="smollm2-135m",
        pattern=r"(?s).*\S.*",
        pattern_help="must not be empty",
    )


@dataclass(frozen=True)
class CacheSettings:
    """The paged KV cache's size and the prefill step."""

    kv_memory_mb: int = setting(
        512,
        "Memory for the paged KV cache, in MiB.",
        flag="--kv-memory",
        range=Range(1),
        detail="The number of blocks follows from the model's KV size per token.",
    )
    ctx_size: int | None = setting(
        None,
        "Size of the paged KV cache in tokens, instead of --kv-memory MiB; rounded up to whole blocks.",
        flag="--ctx-size",
        range=Range(1),
        example=8192,
    )
    block_size: int = setting(
        16,
        "Tokens per KV block.",
        flag="--block-size",
        range=Range(1, 1024),
        detail="Reuse and eviction work in whole blocks.",
    )
    prefill_chunk: int = setting(
        512,
        "Most tokens sent through the model in one prefill forward pass.",
        range=Range(1, 8192),
        detail="Its attention scores take memory in proportion to it times the context's length.",
    )


# The [sampling] table is the engine's own record; its fields are declared as settings here.
SAMPLING_SPECS: dict[str, Spec] = {
    "temperature": Spec(
        "Sampling temperature.",
        live=True,
        flag="--temperature",
        range=Range(0),
        note="0 is greedy",
        detail="Higher values make the output more random.",
    ),
    "top_k": Spec(
        "Keep only the k most likely tokens.", live=True, flag="--top-k", range=Range(0), note="0 is off"
    ),
    "top_p": Spec(
        "Keep the most likely tokens whose probabilities add up to top_p.",
        live=True,
        flag="--top-p",
        range=Range(0, 1, low_open=True),
        note="1 is off",
    ),
    "min_p": Spec(
        "Drop tokens less likely than min_p times the most likely one.",
        live=True,
        flag="--min-p",
        range=Range(0, 1, high_open=True),
        note="0 is off",
    ),
    "repetition_penalty": Spec(
        "Divide the logits of tokens already seen (prompt included, once per distinct token).",
        live=True,
        flag="--repetition-penalty",
        range=Range(0, low_open=True),
        note="1 is off",
    ),
    "max_tokens": Spec("Most tokens generated per answer.", live=True, flag="--max-tokens", range=Range(1)),
    "seed": Spec(
        "Random seed for sampling; unset, a fresh seed each run.",
        live=True,
        flag="--seed",
        range=Range(0, 2**64 - 1),  # what torch.Generator.manual_seed takes
        example=0,
    ),
    "stop": Spec(
        "Strings that end an answer (`none` clears them).",
        live=True,
        detail="The model's own end-of-turn tokens always do (unless ignore_eos).",
    ),
    "ignore_eos": Spec(
        "Run every answer to max_tokens: end-of-turn tokens are never picked and stop strings do not end it.",
        live=True,
        flag="--ignore-eos",
        detail="For measuring: an answer of exactly max_tokens tokens, whatever the model would say.",
    ),
}


@dataclass(frozen=True)
class ReuseSettings:
    """How cached chunks are reused at a position other than where they were computed."""

    mode: str = setting(
        "exact",
        "How cached chunks are reused: exact, reposition or repair.",
        live=True,
        flag="--reuse",
        detail="exact: only where it was computed; reposition: re-rotate its keys to the new positions; "
        "repair: re-rotate, then recompute some of the moved tokens, as repair_strategy picks, so they "
        "attend to what now comes before them.",
        choices=("exact", "reposition", "repair"),
    )
    repair_share: float = setting(
        0.15, "Share of the repositioned tokens recomputed in repair mode.", live=True, range=Range(0, 1)
    )
    repair_min_tokens: int = setting(
        4,
        "Fewest tokens recomputed per moved chunk in repair mode (its first ones).",
        live=True,
        range=Range(0),
    )
    repair_strategy: str = setting(
        "deviation",
        "Which moved tokens repair recomputes: prefix (each chunk's first ones) or deviation (those whose KV "
        "deviates most, CacheBlend-style).",
        detail="Deviation compares the moved KV with a forward in the new context on the first layers.",
        live=True,
        flag="--repair-strategy",
        choices=("prefix", "deviation"),
    )
    repair_taper: float = setting(
        0.0,
        "Deviation repair: 0 selects the tokens to recompute once; t > 0 narrows the selection after "
        "every layer, from repair_share ** (1 - t) of the moved tokens down to repair_share ** (1 + t).",
        live=True,
        range=Range(0, 1, high_open=True),
    )
    verify_tokens: int = setting(
        16, "Tokens /verify compares against a full recompute.", live=True, range=Range(1)
    )


@dataclass(frozen=True)
class DecodeSettings:
    """Speculative decoding: tokens drafted, then checked by one forward."""

    speculate: str = setting(
        "prompt-lookup",
        "Speculative decoding: off, prompt-lookup or draft.",
        live=True,
        flag="--speculate",
        detail="prompt-lookup drafts by copying what followed the last few tokens elsewhere in the context "
        "(quotes, rewrites, code edits); draft drafts with model.draft_model. Drafts are checked in one "
        "forward; sampled output has the same distribution, and drafting pauses while it does not pay "
        "(free writing ran 0.98-1.01x with it, copying 1.5-3x; README). A greedy answer is the one "
        "without drafts, to the bit where the engine is batch-invariant (/info).",
        choices=("off", "prompt-lookup", "draft"),
    )
    draft_max: int = setting(
        8,
        "Most tokens drafted per step.",
        live=True,
        flag="--draft-max",
        range=Range(1, 64),
        detail="The number adapts to how many get accepted.",
    )


@dataclass(frozen=True)
class UiSettings:
    """How the REPL shows things."""

    color: bool = setting(True, "Colors and styles; --no-color prints no escape codes.", flag="--color")
    json: bool = setting(False, "Print one JSON object per command instead of text.", flag="--json")
    debug: bool = setting(False, "Show an error's full traceback instead of one line.", flag="--debug")
    history_file: str = setting("~/.local/share/kvchat/history", "Where the REPL keeps its input history.")
    show_thinking: bool = setting(
        True,
        "Show a reasoning model's <think> text.",
        live=True,
        detail="It stays in the KV cache either way.",
    )


@dataclass(frozen=True)
class Settings:
    """Every setting, one field per TOML table."""

    model: ModelSettings = ModelSettings()
    cache: CacheSettings = CacheSettings()
    sampling: SamplingParams = SamplingParams()
    reuse: ReuseSettings = ReuseSettings()
    decode: DecodeSettings = DecodeSettings()
    ui: UiSettings = UiSettings()


TABLES: dict[str, type] = typing.get_type_hints(Settings)
# Settings that existed once, by `table.key`, with why they went: a config that still sets one is told so.
REMOVED: dict[str, str] = {
    "model.compile": "the compiled decode step was no faster than the default one; delete the line",
}
EXTERNAL_SPECS: dict[type, dict[str, Spec]] = {SamplingParams: SAMPLING_SPECS}  # tables declared elsewhere


@functools.cache
def all_settings() -> dict[str, SettingInfo]:
    """Every setting by `table.key`, in declaration order."""
    out: dict[str, SettingInfo] = {}
    for table, cls in TABLES.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("spec") or EXTERNAL_SPECS[cls][f.name]
            info = SettingInfo(table, f.name, hints[f.name], f.default, spec)
            out[info.key] = info
    return out
