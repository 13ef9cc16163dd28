"""Token ids to text, one token at a time, without ever emitting half a character.

A byte-level BPE token can hold part of a UTF-8 character, so `decode([token])` alone gives "\ufffd".
Each stream decodes a short window instead: the ids it emitted last (context) plus the ids not yet
emitted, and releases the new suffix once it no longer ends in "\ufffd". The context makes decoders that
treat the start of a text specially (SentencePiece drops the first space) agree with a full decode.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer."""

    def decode(self, token_ids: list[int]) -> str: ...


class _IncrementalDecoder:
    """One id stream; the window stays a few tokens long, so each token costs O(1)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._window_ids: list[int] = []  # context ids, then the ids held back
        self._num_context = 0
        self._context_text = ""

    def add(self, token_id: int) -> str:
        self._window_ids.append(token_id)
        text = self._tokenizer.decode(self._window_ids)
        if text.endswith(REPLACEMENT_CHAR):
            # Maybe the start of a character whose other bytes are still to come.
            return ""
        delta = text[len(self._context_text) :]
        self._window_ids = self._window_ids[self._num_context :]
        self._num_context = len(self._window_ids)
        self._context_text = self._tokenizer.decode(self._window_ids)
        return delta

    def finish(self) -> str:
        if len(self._window_ids) == self._num_context:
            return ""
        delta = self._tokenizer.decode(self._window_ids)[len(self._context_text) :]
        self._window_ids, self._num_context, self._context_text = [], 0, ""
        return delta


class StreamDetokenizer:
    """Text of a stream of generated token ids, split into answer and thinking, released as it is final.

    All answer deltas joined equal `tokenizer.decode(answer_ids)` and all thinking deltas joined equal
    `tokenizer.decode(thinking_ids)`, with `split_think` of the ids less `skip_ids`. `think_ids` is the
    (start, end) pair of marker ids (Qwen3: 151667, 151668); markers and `skip_ids` produce no text.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        think_ids: tuple[int, int] | None = None,
        skip_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.think_ids = think_ids
        self.skip_ids = skip_ids
        # One decoder per channel: a marker between two halves of a character does not break it.
        self._answer = _IncrementalDecoder(tokenizer)
        self._thinking = _IncrementalDecoder(tokenizer)
        self._in_think = False

    def add(self, token_id: int) -> tuple[str, str]:
        """Feed one id; return the (answer, thinking) text it made final, often empty."""
        if token_id in self.skip_ids:
            return "", ""
        if self.think_ids is not None and token_id in self.think_ids:
            self._in_think = token_id == self.think_ids[0]
            return "", ""
        if self._in_think:
            return "", self._thinking.add(token_id)
        return self._answer.add(token_id), ""

    def finish(self) -> tuple[str, str]:
        """Release what is held back (a dangling partial character becomes "\ufffd")."""
        return self._answer.finish(), self._thinking.finish()


def split_think(token_ids: list[int], think_ids: tuple[int, int] | None) -> tuple[list[int], list[int], bool]:
    """Split ids into (answer_ids, thinking_ids, had_think), dropping the marker ids.

    A span opened by the start id runs to the end id or, unclosed, to the end of the ids. A stray end id
    is dropped. had_think is True when any marker was present.
    """
    if think_ids is None:
        return list(token_ids), [], False
    start_id, end_id = think_ids
    answer_ids: list[int] = []
    thinking_ids: list[int] = []
    in_think = had_think = False
    for token_id in token_ids:
        if token_id == start_id or token_id == end_id:
            in_think = token_id == start_id
            had_think = True
        elif in_think:
            thinking_ids.append(token_id)
        else:
            answer_ids.append(token_id)
    return answer_ids, thinking_ids, had_think
