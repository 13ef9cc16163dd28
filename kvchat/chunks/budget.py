"""A chunk larger than the whole KV budget is refused before all of it is tokenized: a 16 MiB file
took 15 s and 3.9 GB to tokenize, only to be refused after. Its text is tokenized in pieces until the
count is past the budget, so a refusal costs about the budget's worth of tokenizing."""

from __future__ import annotations

from kvchat.errors import CacheFullError

PIECE_CHARS = 1 << 14
_BOUNDARY_TOKENS = 2  # a cut inside a word can cost a token or two more than the whole text has


def refuse_oversized(tokenizer, text: str, capacity: int, what: str) -> None:
    """CacheFullError when `text` surely holds more than `capacity` tokens; nothing otherwise (the
    exact count, after tokenizing, decides the rest)."""
    if len(text.encode()) <= capacity:  # every token holds a byte at least
        return
    count = 0
    for num_pieces, start in enumerate(range(0, len(text), PIECE_CHARS), start=1):
        count += len(tokenizer.encode(text[start : start + PIECE_CHARS], add_special_tokens=False))
        if count - _BOUNDARY_TOKENS * num_pieces >= capacity:
            raise CacheFullError(
                f"{what} chunk of more than {capacity} tokens is larger than the whole KV budget "
                f"({capacity} tokens); raise --kv-memory"
            )
