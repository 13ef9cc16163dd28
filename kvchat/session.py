"""Opening a session: settings in, a ready ContextManager out."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from kvchat.chunks.compose import RepairPolicy
from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat, read_template
from kvchat.chunks.types import RepairStrategy, ReuseMode
from kvchat.config import CacheSettings, DecodeSettings, ReuseSettings, Settings
from kvchat.engine.engine import Engine, kv_shape
from kvchat.engine.paged_attention import KVPool
from kvchat.engine.speculate import Speculation
from kvchat.errors import ConfigError, DraftModelError
from kvchat.models.device import available_memory_bytes
from kvchat.models.loader import LoadedModel, PreparedModel, load_model, no_template_note, prepare_model
from kvchat.models.progress import ProgressCallback, tell


def open_session(settings: Settings, progress: ProgressCallback | None = None) -> ContextManager:
    """Load the model the settings name and build the paged cache and context manager over it. The
    chat template is settled first, from the tokenizer alone, before the weights load."""
    prepared = prepare_model(settings.model, progress)
    chat_format = make_chat_format(prepared, settings.model.chat_template, progress)
    loaded = load_model(settings.model, progress, prepared)
    engine = make_engine(loaded, settings)
    draft_engine = None
    if settings.model.draft_model:
        draft_settings = dataclasses.replace(settings.model, model=settings.model.draft_model)
        draft = load_model(draft_settings, progress)
        check_draft_vocabulary(loaded, draft)
        draft_engine = make_engine(draft, settings)
    ctx = ContextManager(
        engine,
        chat_format,
        loaded.tokenizer,
        loaded.eos_token_ids,
        model_id=loaded.model_id,
        fingerprint=loaded.fingerprint,
        speculation=make_speculation(settings.decode, draft_engine),
    )
    apply_live_settings(ctx, settings)
    return ctx


def make_chat_format(
    prepared: PreparedModel, spec: str | None, progress: ProgressCallback | None = None
) -> ChatFormat:
    """The chat template `spec` names (a built-in name or a Jinja file), else the model's own, or
    generic ChatML where it has none; what it costs reuse is told once."""
    template, source = read_template(spec) if spec else (None, None)
    chat_format = ChatFormat(prepared.tokenizer, template, source)
    if chat_format.uses_fallback_template and not prepared.told_no_template:
        tell(progress, no_template_note(prepared.source.model_id))
    if chat_format.reuse_note:
        tell(progress, f"{prepared.source.model_id}: {chat_format.reuse_note}")
    return chat_format


class LiveSettable(Protocol):
    """What the live settings set on a context manager (the real one or the CLI tests' fake)."""

    mode: ReuseMode
    repair: RepairPolicy
    speculation: Speculation


def apply_live_settings(ctx: LiveSettable, settings: Settings) -> None:
    """Give the context manager what the live settings (reuse.*, decode.*) make of it; the sampling
    and ui settings are read from the settings where they are used."""
    mode = ReuseMode(settings.reuse.mode)
    reason = getattr(ctx, "move_refusal", None)
    if mode is not ReuseMode.EXACT and reason is not None:
        raise ConfigError(
            f"reuse.mode {mode} is not available for this model: {reason}. Exact reuse is: /mode exact "
            "(or --reuse exact)"
        )
    ctx.mode = mode
    ctx.repair = repair_policy(settings.reuse)
    ctx.speculation = make_speculation(settings.decode, ctx.speculation.draft_engine)


def make_engine(loaded: LoadedModel, settings: Settings) -> Engine:
    cache = settings.cache
    budget = kv_memory_bytes(loaded, cache)
    asked = (
        f"--kv-memory {cache.kv_memory_mb} MiB" if cache.ctx_size is None else f"--ctx-size {cache.ctx_size}"
    )
    check_kv_memory(budget, asked, next(loaded.model.parameters()).device)
    return Engine(
        loaded.model,
        kv_memory_bytes=budget,
        block_size=settings.cache.block_size,
        prefill_chunk=settings.cache.prefill_chunk,
        batch_invariant=settings.model.batch_invariant,
    )


def kv_memory_bytes(loaded: LoadedModel, cache: CacheSettings) -> int:
    """The KV budget: `ctx_size` tokens in whole blocks when set, else `kv_memory_mb` MiB."""
    if cache.ctx_size is None:
        return cache.kv_memory_mb << 20
    num_layers, num_kv_heads, head_dim = kv_shape(loaded.model.config)
    per_block = KVPool.bytes_per_block(num_layers, cache.block_size, num_kv_heads, head_dim, loaded.dtype)
    return -(-cache.ctx_size // cache.block_size) * per_block


def check_kv_memory(num_bytes: int, asked: str, device: torch.device) -> None:
    """Refuse a KV budget (`asked`, as the user gave it) the machine cannot hold: the pool would grow
    until the kernel killed kvchat."""
    available = available_memory_bytes(device)
    if num_bytes > available:
        where = "GPU memory" if device.type == "cuda" else "memory"
        raise ConfigError(
            f"{asked} needs {num_bytes >> 20} MiB of KV cache, more than the {available >> 20} MiB of "
            f"{where} available now; lower it"
        )


def check_draft_vocabulary(main: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model whose token ids mean other text than the main model's."""
    if main.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise DraftModelError(
            f"draft model {draft.model_id} has another vocabulary than {main.model_id} "
            f"({len(draft.tokenizer)} vs {len(main.tokenizer)} tokens); pick one that shares its tokenizer"
        )


def make_speculation(decode: DecodeSettings, draft_engine: Engine | None) -> Speculation:
    return Speculation(decode.speculate, decode.draft_max, draft_engine)


def repair_policy(reuse: ReuseSettings) -> RepairPolicy:
    return RepairPolicy(
        reuse.repair_share,
        reuse.repair_min_tokens,
        RepairStrategy(reuse.repair_strategy),
        taper=reuse.repair_taper,
    )
