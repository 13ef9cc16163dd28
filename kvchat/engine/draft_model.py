"""Drafting with a small model that shares the main model's tokenizer, over its own paged cache."""

from __future__ import annotations

from kvchat.engine.block_manager import Sequence
from kvchat.engine.engine import Engine
from kvchat.errors import CacheFullError


class DraftModel:
    """Proposes the draft model's greedy continuation. Its sequence follows the main one: it starts by
    sharing whatever prefix the draft engine holds (a reused context is not recomputed), and each call
    drops the drafts the main model rejected and computes only the tokens it has not seen."""

    def __init__(self, engine: Engine, vocab_size: int):
        self.engine = engine
        self.vocab_size = vocab_size  # drafts stay ids the main model has
        self.seq: Sequence | None = None
        self.num_followed = 0  # leading tokens known to agree with the main sequence

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        try:
            seq = self._follow(token_ids)
            drafts: list[int] = []
            for _ in range(max_tokens):
                logits = self.engine.compute(seq)  # (V,)
                drafts.append(int(logits[: self.vocab_size].argmax()))
                self.engine.extend(seq, drafts[-1:])
            return drafts
        except CacheFullError:
            self.close()  # the draft cache is full: the answer goes on undrafted
            return []

    def _follow(self, token_ids: list[int]) -> Sequence:
        if self.seq is None:
            self.seq = self.engine.start(token_ids)
            self.num_followed = len(token_ids)
            return self.seq
        seq, common = self.seq, self.num_followed
        limit = min(seq.num_tokens, len(token_ids))
        while common < limit and seq.token_ids[common] == token_ids[common]:
            common += 1
        common = min(common, len(token_ids) - 1)  # the last token's logits are needed, so it is computed
        self.engine.truncate(seq, common)
        self.engine.extend(seq, token_ids[common:])
        self.num_followed = len(token_ids)
        return seq

    def close(self) -> None:
        if self.seq is not None:
            self.engine.free(self.seq)  # its KV stays cached for the next answer's prefix
            self.seq = None
