"""Cutting a chat template's rendering into chunks: pure Python over strings and token ids.

A conversation is a list of parts, one per chunk (a system prompt, a context passage, a query, a user
turn, an answer), each with the role of the message it goes into. The template renders whole messages,
so the parts become messages first (`Layout.messages`): each its own message where the template allows
it, else consecutive user parts share one user message (their texts joined by SEPARATOR), and a system
prompt the template cannot render goes first into the first user message.

The rendering is tokenized whole, as apply_chat_template does, and cut at the parts' boundaries: a part
owns the tokens from the end of the part before it to the end of its own text, and of the template's
text after it what closes its message (its end-of-turn), found by rendering the conversation up to that
message. Before the first part is the template's lead (a BOS, a default system prompt) when there is no
system prompt; after the last, the generation prompt. A token that straddles a cut belongs to the piece
that holds its last character.
"""

from __future__ import annotations

from dataclasses import dataclass

SEPARATOR = "\n\n"  # between the parts that share one message


@dataclass(frozen=True)
class Part:
    """One chunk's text and the role of the message it goes into ("system", "user", "assistant")."""

    role: str
    text: str


@dataclass(frozen=True)
class Rendering:
    """A conversation's token ids as the template renders them (with the generation prompt), cut into
    pieces in the order the template wrote the parts (`order`, part indices; a template may put the
    system prompt late): the lead is token_ids[:bounds[0]], the part at slot k token_ids[bounds[k]:
    bounds[k + 1]], and the generation prompt token_ids[bounds[-1]:]."""

    token_ids: list[int]
    bounds: list[int]
    order: list[int]

    @property
    def lead_ids(self) -> list[int]:
        return self.token_ids[: self.bounds[0]]

    @property
    def tail_ids(self) -> list[int]:
        return self.token_ids[self.bounds[-1] :]

    def part_ids(self, index: int) -> list[int]:
        slot = self.order.index(index)
        return self.token_ids[self.bounds[slot] : self.bounds[slot + 1]]


@dataclass(frozen=True)
class Layout:
    """How parts become messages: `joins_users` puts consecutive user parts in one message,
    `folds_system` puts the system part at the head of the first user message."""

    joins_users: bool = False
    folds_system: bool = False

    def groups(self, roles: list[str]) -> list[tuple[str, list[int]]]:
        """Each message's role and the indices of the parts it holds, in order."""
        groups: list[tuple[str, list[int]]] = []
        for index, role in enumerate(roles):
            message_role = "user" if role == "system" and self.folds_system else role
            if groups and message_role == "user" and groups[-1][0] == "user" and role != "system":
                held = groups[-1][1]
                folded_system = self.folds_system and held == [0] and roles[0] == "system"
                if self.joins_users or folded_system:
                    held.append(index)
                    continue
            groups.append((message_role, [index]))
        return groups

    def messages(self, parts: list[Part], texts: list[str] | None = None) -> list[dict[str, str]]:
        """The messages for `parts` (with `texts` in place of the parts' own, e.g. markers)."""
        texts = [p.text for p in parts] if texts is None else texts
        groups = self.groups([p.role for p in parts])
        return [{"role": role, "content": SEPARATOR.join(texts[i] for i in ids)} for role, ids in groups]


def marker(index: int) -> str:
    """The text that stands for part `index` in a marked rendering: one plain word no template trims."""
    return f"kvchatmark{index}x"


@dataclass(frozen=True)
class Structure:
    """What a marked rendering (each part's text replaced by its marker) tells about a conversation's
    shape, in the order the template wrote the parts: the template's text around them, and where each
    message ends."""

    order: list[int]  # part indices, as the rendering holds them
    glues: list[str]  # before the first part, between parts, after the last (n + 1 of them)
    closer_lengths: list[int]  # characters after a part's text that still belong to it (by slot)
    lead_length: int  # characters of glues[0] before the first message (a BOS, a default system prompt)


def find_markers(text: str, count: int) -> list[tuple[int, int]] | None:
    """Each marker's (start, end) in `text` by part index, or None unless each occurs exactly once."""
    spans = []
    for index in range(count):
        word = marker(index)
        start = text.find(word)
        if start < 0 or text.count(word) != 1:
            return None
        spans.append((start, start + len(word)))
    return spans


def locate(text: str, parts: list[Part], glues: list[str], start: int) -> list[tuple[int, int]]:
    """Each part's (start, end) in the real rendering `text` (`parts` in the order the template writes
    them), walking from `start` along the marked rendering's glues: the part's text as given or
    trimmed, else up to where the next glue begins (a template that rewrites the text, as Qwen3 drops
    an earlier answer's reasoning). A part that cannot be found is empty at the place reached."""
    spans, pos = [], start
    for index, part in enumerate(parts):
        glue, last = glues[index + 1], index == len(parts) - 1
        end = _text_end(text, pos, part.text, glue, last)
        spans.append((pos, max(pos, end)))
        if end >= pos and text.startswith(glue, end):
            pos = end + len(glue)
        else:
            pos = max(pos, end)
    return spans


def _text_end(text: str, pos: int, content: str, glue: str, last: bool) -> int:
    for candidate in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip())):
        end = pos + len(candidate)
        if text.startswith(candidate, pos) and (text[end:] == glue if last else text.startswith(glue, end)):
            return end
    if last:
        return len(text) - len(glue) if text.endswith(glue) and len(text) - len(glue) >= pos else pos
    found = text.find(glue, pos) if glue else -1
    return found if found >= 0 else pos


def char_bounds(spans: list[tuple[int, int]], structure: Structure, text_length: int) -> list[int]:
    """Character cuts: where the first part begins, then where each part ends (n + 1 of them)."""
    first = min(structure.lead_length, spans[0][0]) if spans else 0
    cuts = [first]
    for (_, end), closer in zip(spans, structure.closer_lengths, strict=True):
        cuts.append(min(text_length, max(cuts[-1], end + closer)))
    return cuts


def token_bounds(offsets: list[tuple[int, int]], cuts: list[int]) -> list[int]:
    """Token indices for character cuts: a token belongs to the piece holding its last character."""
    anchors = [end - 1 if end > start else start for start, end in offsets]
    bounds, token = [], 0
    for cut in cuts:
        while token < len(anchors) and anchors[token] < cut:
            token += 1
        bounds.append(token)
    return bounds


def closer_after(glue: str, special_tokens: list[str]) -> int:
    """Where the end-of-turn in `glue` (the text between a message's text and the next one's) ends: after
    the first special token in it and the newlines that follow, or 0 when it holds none."""
    found = [(glue.find(t), t) for t in special_tokens if t and t in glue]
    if not found:
        return 0
    index, token = min(found)
    end = index + len(token)
    while end < len(glue) and glue[end] == "\n":
        end += 1
    return end
