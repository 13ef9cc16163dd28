"""The KV of a token prefix for the views that run their own forward (/attention): the live
sequence's where it holds the prefix, else an exact one computed and freed again."""

from __future__ import annotations

import torch

from kvchat.engine.block_manager import Sequence
from kvchat.engine.engine import Engine


def read_prefix_kv(
    engine: Engine, live: Sequence | None, token_ids: list[int], end: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """K/V (L, end, H, D) of the first `end` of `token_ids`, and whether it is `live`'s (the KV the last
    inference used, moved KV included); otherwise exact KV, computed and freed again."""
    if live is not None and live.token_ids[: len(token_ids)] == token_ids and live.num_computed >= end:
        return *engine.read_kv(live, 0, end), True
    seq = engine.start(token_ids[: end + 1])
    try:
        if seq.num_computed < end:
            engine.compute(seq, until=end)
        return *engine.read_kv(seq, 0, end), False
    finally:
        engine.free(seq)
