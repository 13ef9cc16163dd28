"""Opening a session: settings in, a ready ContextManager out."""

from __future__ import annotations

from kvchat.chunks.compose import RepairPolicy
from kvchat.chunks.context import ContextManager
from kvchat.chunks.template import ChatFormat
from kvchat.chunks.types import RepairStrategy, ReuseMode
from kvchat.config import ReuseSettings, Settings
from kvchat.engine.engine import Engine
from kvchat.models.loader import load_model
from kvchat.models.progress import ProgressCallback


def open_session(settings: Settings, progress: ProgressCallback | None = None) -> ContextManager:
    """Load the model the settings name and build the paged cache and context manager over it."""
    loaded = load_model(settings.model, progress)
    engine = Engine(
        loaded.model,
        kv_memory_bytes=settings.cache.kv_memory_mb << 20,
        block_size=settings.cache.block_size,
        prefill_chunk=settings.cache.prefill_chunk,
    )
    return ContextManager(
        engine,
        ChatFormat(loaded.tokenizer),
        loaded.tokenizer,
        loaded.eos_token_ids,
        model_id=loaded.model_id,
        fingerprint=loaded.fingerprint,
        mode=ReuseMode(settings.reuse.mode),
        repair=repair_policy(settings.reuse),
    )


def repair_policy(reuse: ReuseSettings) -> RepairPolicy:
    return RepairPolicy(reuse.repair_share, reuse.repair_min_tokens, RepairStrategy(reuse.repair_strategy))
