"""Opening a session: settings in, a ready ContextManager out."""

from __future__ import annotations

import dataclasses

import torch

from kvchat.chunks.compose import RepairPolicy
from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import RepairStrategy, ReuseMode
from kvchat.config import ReuseSettings, Settings
from kvchat.engine.engine import Engine
from kvchat.engine.speculate import Speculation
from kvchat.errors import ConfigError, DraftModelError
from kvchat.models.device import available_memory_bytes
from kvchat.models.loader import LoadedModel, load_model
from kvchat.models.progress import ProgressCallback


def open_session(settings: Settings, progress: ProgressCallback | None = None) -> ContextManager:
    """Load the model the settings name and build the paged cache and context manager over it."""
    loaded = load_model(settings.model, progress)
    engine = make_engine(loaded, settings)
    draft_engine = None
    if settings.model.draft_model:
        draft_settings = dataclasses.replace(settings.model, model=settings.model.draft_model)
        draft = load_model(draft_settings, progress)
        check_draft_vocabulary(loaded, draft)
        draft_engine = make_engine(draft, settings)
    return ContextManager(
        engine,
        ChatFormat(loaded.tokenizer),
        loaded.tokenizer,
        loaded.eos_token_ids,
        model_id=loaded.model_id,
        fingerprint=loaded.fingerprint,
        mode=ReuseMode(settings.reuse.mode),
        repair=repair_policy(settings.reuse),
        speculation=Speculation(settings.decode.speculate, settings.decode.draft_max, draft_engine),
    )


def make_engine(loaded: LoadedModel, settings: Settings) -> Engine:
    check_kv_memory(settings.cache.kv_memory_mb, next(loaded.model.parameters()).device)
    return Engine(
        loaded.model,
        kv_memory_bytes=settings.cache.kv_memory_mb << 20,
        block_size=settings.cache.block_size,
        prefill_chunk=settings.cache.prefill_chunk,
    )


def check_kv_memory(kv_memory_mb: int, device: torch.device) -> None:
    """Refuse a KV budget the machine cannot hold: the pool would grow until the kernel killed kvchat."""
    available = available_memory_bytes(device)
    if kv_memory_mb << 20 > available:
        where = "GPU memory" if device.type == "cuda" else "memory"
        raise ConfigError(
            f"--kv-memory {kv_memory_mb} MiB is more than the {available >> 20} MiB of {where} "
            "available now; lower it"
        )


def check_draft_vocabulary(main: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model whose token ids mean other text than the main model's."""
    if main.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise DraftModelError(
            f"draft model {draft.model_id} has another vocabulary than {main.model_id} "
            f"({len(draft.tokenizer)} vs {len(main.tokenizer)} tokens); pick one that shares its tokenizer"
        )


def repair_policy(reuse: ReuseSettings) -> RepairPolicy:
    return RepairPolicy(
        reuse.repair_share,
        reuse.repair_min_tokens,
        RepairStrategy(reuse.repair_strategy),
        taper=reuse.repair_taper,
    )
