"""The chat template, as kvchat composes with it: a conversation rendered whole, its ids cut into chunks.

A context is rendered by the model's own template (or the one `--chat-template` names) as one
conversation and tokenized whole, as `apply_chat_template` does, so the prompt ids are exactly what
transformers gives for the same messages whatever the template does (a system prompt folded into the
first user turn, a BOS, trimmed text, an inserted default system prompt, a generation prompt, Qwen3
dropping an earlier answer's reasoning). The ids are then cut at each chunk's text (kvchat.chunks.
rendering): a chunk is a span of the template's own rendering. Joined text is never re-tokenized part by
part: a boundary can tokenize differently in context.

What the template allows is found at start, before the model loads, by rendering probe conversations
with markers in place of the texts: whether consecutive user messages stay apart (else context
passages and the query share one user turn, each its own span), whether it takes a system message
(else the system prompt goes at the head of the first user turn), what it writes before a first user
message (a BOS, a default system prompt), around an answer, and before the answer (the generation
prompt). A template no probe conversation renders is refused then, with the template's own error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from kvchat.chunks.rendering import (
    Layout,
    Part,
    Rendering,
    Structure,
    char_bounds,
    closer_after,
    find_markers,
    locate,
    marker,
    token_bounds,
)
from kvchat.errors import ChunkError
from kvchat.models.info import family_of

ROLES = ("system", "user", "assistant")

# The generic template: ChatML. "<|im_start|>" and "<|im_end|>" are plain text unless the tokenizer
# happens to have them as tokens.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE}
LAYOUTS = (Layout(), Layout(joins_users=True), Layout(joins_users=True, folds_system=True))
# The shapes kvchat composes: system, context passages, query and turns; a first message alone.
_PROBE_SHAPES = (("system", "user", "user", "user", "assistant", "user"), ("user", "assistant", "user"))
_PROBE_ANSWER = "kvchat probe answer"


def read_template(spec: str) -> tuple[str, str]:
    """The Jinja text `--chat-template` names and how to call it: a built-in name or a file."""
    builtin = BUILTIN_TEMPLATES.get(spec.strip().lower())
    if builtin is not None:
        return builtin, f"generic {spec.strip().lower()} (--chat-template)"
    path = Path(spec).expanduser()
    try:
        return path.read_text(encoding="utf-8"), f"{path} (--chat-template)"
    except OSError as exc:
        names = ", ".join(BUILTIN_TEMPLATES)
        raise ChunkError(
            f"--chat-template {spec}: no such built-in ({names}) and no readable file ({exc.strerror})"
        ) from None


class ChatFormat:
    """A tokenizer's chat template as kvchat renders and cuts conversations with it.

    `template` is the Jinja text to use (None: the tokenizer's own, or generic ChatML when it has none)
    and `source` says where it came from. Raises ChunkError when the template renders no conversation
    kvchat composes."""

    def __init__(self, tokenizer: Any, template: str | None = None, source: str | None = None) -> None:
        self._tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.uses_fallback_template = template is None and not own
        self.template: str = template or own or CHATML_TEMPLATE
        self.source = source or ("generic ChatML (the model has none)" if self.uses_fallback_template
                                 else "the model's own")  # fmt: skip
        self._structures: dict[tuple[str, ...], Structure] = {}
        self._specials = sorted(_special_texts(tokenizer), key=len, reverse=True)
        self.layout = self._choose_layout()
        self._user_header = self._header_of_user()
        self.generation_prompt_ids = tuple(self.render([Part("user", "kvchat probe")]).tail_ids)
        self.assistant_close_ids = self._assistant_close_ids()
        # (<think>, </think>) ids when the tokenizer has both as single tokens, else None.
        self.think_ids = self._find_think_ids()
        # The token that ends an assistant turn (e.g. <|im_end|>), None if the template writes none.
        self.end_of_turn_id = self._find_end_of_turn_id()
        # What the template writes before a first user message when there is no system prompt, and the
        # system text it inserts there (Qwen2.5's, SmolLM2's), if that is what it is.
        self.lead_ids = tuple(self.render([Part("user", "kvchat probe")]).lead_ids)
        self.default_system_prompt = self._find_default_system_prompt()
        # What the template costs reuse, said once at start: None when a grown conversation keeps the
        # ids of the one before it.
        self.reuse_note = self._find_reuse_note()

    # -- rendering ---------------------------------------------------------------------------------

    def render(self, parts: list[Part]) -> Rendering:
        """The ids `apply_chat_template` gives for the parts' messages (generation prompt included),
        cut at the parts' boundaries."""
        if not parts:
            raise ChunkError("nothing to render: a conversation needs at least one message")
        for part in parts:
            if part.role not in ROLES:
                raise ChunkError(f"unknown chat role {part.role!r}: expected one of {', '.join(ROLES)}")
        structure = self._structure(tuple(p.role for p in parts))
        text = self._render(self.layout.messages(parts), add_generation_prompt=True)
        in_order = [parts[i] for i in structure.order]
        start = len(structure.glues[0]) if text.startswith(structure.glues[0]) else 0
        spans = locate(text, in_order, structure.glues, start)
        token_ids, offsets = self._encode_with_offsets(text)
        cuts = char_bounds(spans, structure, len(text))
        return Rendering(token_ids, token_bounds(offsets, cuts), list(structure.order))

    def messages(self, parts: list[Part]) -> list[dict[str, str]]:
        """The messages kvchat renders for the parts (what apply_chat_template is given)."""
        return self.layout.messages(parts)

    def answer_text(self, token_ids: list[int], stop_ids: frozenset[int]) -> str:
        """An answer's text for the history, from its kept ids (generation prompt, answer, closing): the
        generated ids decoded as transformers would, the stop token and the closing left out."""
        ids = list(token_ids)
        head, close = list(self.generation_prompt_ids), list(self.assistant_close_ids)
        if head and ids[: len(head)] == head:
            ids = ids[len(head) :]
        if close and ids[-len(close) :] == close:
            ids = ids[: -len(close)]
        while ids and ids[-1] in stop_ids:
            ids.pop()
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def text_ids(self, text: str) -> list[int]:
        """A text's own ids, tokenized alone (what identifies a chunk; its ids in place may differ)."""
        return self._encode(text)

    def describe(self) -> str:
        """The template for /info: its family by its markers, and where it came from."""
        return f"{family_of(self.template)}, {self.source}"

    # -- probing -----------------------------------------------------------------------------------

    def _choose_layout(self) -> Layout:
        errors = []
        for layout in LAYOUTS:
            self.layout = layout
            try:
                for shape in _PROBE_SHAPES:
                    self._structure(shape)
                return layout
            except ChunkError as err:
                errors.append(str(err))
            finally:
                self._structures.clear()
        raise ChunkError(f"the chat template cannot render a conversation kvchat composes: {errors[0]}")

    def _structure(self, roles: tuple[str, ...]) -> Structure:
        known = self._structures.get(roles)
        if known is not None:
            return known
        parts = [Part(role, marker(i)) for i, role in enumerate(roles)]
        messages = self.layout.messages(parts)
        text = self._render(messages, add_generation_prompt=True)
        spans = find_markers(text, len(parts))
        if spans is None:
            shape = ", ".join(m["role"] for m in messages)
            raise ChunkError(f"it drops or repeats a message's text in [{shape}]")
        order = sorted(range(len(parts)), key=lambda i: spans[i][0])
        ends = [spans[i][1] for i in order]
        starts = [spans[i][0] for i in order] + [len(text)]
        glues = [text[: starts[0]]] + [text[ends[k] : starts[k + 1]] for k in range(len(order))]
        closers = self._closers(roles, messages, text, order, ends, starts, glues)
        lead = 0
        if roles[0] != "system" and self._user_header_known and glues[0].endswith(self._user_header):
            lead = len(glues[0]) - len(self._user_header)
        structure = Structure(order, glues, closers, lead)
        self._structures[roles] = structure
        return structure

    def _closers(self, roles, messages, text, order, ends, starts, glues) -> list[int]:
        """By slot: the characters after a part's text that close its message. Rendering the messages up
        to it shows where that message ends; where the template renders that prefix otherwise (a system
        prompt it moves, an end-of-text written after the last message), the end-of-turn token in the
        text after it does."""
        slot_of = {part: slot for slot, part in enumerate(order)}
        closers = [0] * len(order)
        for count, (_, ids) in enumerate(self.layout.groups(list(roles))):
            slot = slot_of[ids[-1]]
            try:
                prefix = self._render(messages[: count + 1], add_generation_prompt=False)
            except ChunkError:
                prefix = ""
            if ends[slot] <= len(prefix) <= starts[slot + 1] and text.startswith(prefix):
                closers[slot] = len(prefix) - ends[slot]
            else:
                closers[slot] = closer_after(glues[slot + 1], self._specials)
        return closers

    @property
    def _user_header_known(self) -> bool:
        return bool(getattr(self, "_user_header", ""))

    def _header_of_user(self) -> str:
        """What opens a user message mid-conversation, e.g. "<|im_start|>user\\n"."""
        structure = self._structure(("user", "assistant", "user"))
        slot = structure.order.index(1)
        glue = structure.glues[slot + 1]
        header = glue[structure.closer_lengths[slot] :]
        self._structures.clear()  # the lead lengths depend on the header
        return header

    def _assistant_close_ids(self) -> tuple[int, ...]:
        """The ids after an answer's text that end its turn (e.g. <|im_end|> and a newline)."""
        parts = [Part("user", "kvchat probe"), Part("assistant", _PROBE_ANSWER), Part("user", "kvchat more")]
        rendering = self.render(parts)
        structure = self._structure(("user", "assistant", "user"))
        text = self._render(self.layout.messages(parts), add_generation_prompt=True)
        slot = structure.order.index(1)
        end = text.find(_PROBE_ANSWER) + len(_PROBE_ANSWER)
        _, offsets = self._encode_with_offsets(text)
        first = token_bounds(offsets, [end])[0]
        return tuple(rendering.token_ids[first : rendering.bounds[slot + 1]])

    def _find_default_system_prompt(self) -> str | None:
        """The system text the template inserts when a conversation has none, else None."""
        if not self.lead_ids or self.layout.folds_system:
            return None
        structure = self._structure(("system", "user"))
        head, closer = structure.glues[0], structure.glues[1][: structure.closer_lengths[0]]
        lead = self._tokenizer.decode(list(self.lead_ids))
        if not (lead.startswith(head) and lead.endswith(closer)) or len(lead) <= len(head) + len(closer):
            return None
        text = lead[len(head) : len(lead) - len(closer)]
        with_it = self.render([Part("system", text), Part("user", "kvchat probe")])
        without = self.render([Part("user", "kvchat probe")])
        return text if with_it.token_ids == without.token_ids else None

    def _find_reuse_note(self) -> str | None:
        """Render a conversation and the same one a turn longer: where the first is no prefix of the
        second, the template moves or rewrites what came before, and each turn recomputes from there."""
        one = [Part("system", "kvchat probe system"), Part("user", "kvchat probe")]
        first = self.render(one)
        kept = first.token_ids[: first.bounds[-1]]  # without the generation prompt
        answer = (
            _PROBE_ANSWER
            if self.think_ids is None
            else f"<think>\nkvchat reasoning\n</think>\n\n{_PROBE_ANSWER}"
        )
        second = self.render([*one, Part("assistant", answer), Part("user", "kvchat more")])
        if second.token_ids[: len(kept)] != kept:
            pairs = zip(kept, second.token_ids, strict=False)
            changed = next((i for i, (a, b) in enumerate(pairs) if a != b), len(second.token_ids))
            slot = max(0, sum(1 for bound in first.bounds[1:-1] if bound <= changed))
            what = "system prompt" if first.order[slot] == 0 else "first message"
            return (
                f"the chat template writes the {what} anew once the conversation grows: each turn "
                "recomputes the conversation from there in exact mode; reposition and repair move what "
                "kept its tokens"
            )
        if self.think_ids is not None and "kvchat reasoning" not in self._tokenizer.decode(second.token_ids):
            return (
                "the chat template drops an answer's reasoning (<think>...</think>) from the history: "
                "each turn recomputes the last answer from its reasoning on"
            )
        return None

    def _find_think_ids(self) -> tuple[int, int] | None:
        open_ids = self._encode("<think>")
        close_ids = self._encode("</think>")
        if len(open_ids) != 1 or len(close_ids) != 1:
            return None
        return open_ids[0], close_ids[0]

    def _find_end_of_turn_id(self) -> int | None:
        # A plain-text closing (generic ChatML on a tokenizer without <|im_end|>) has no stop token.
        special_ids = set(getattr(self._tokenizer, "added_tokens_decoder", {}))
        special_ids.update(self._tokenizer.all_special_ids)
        return next((i for i in self.assistant_close_ids if i in special_ids), None)

    # -- the tokenizer -----------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=self.template,
            )  # fmt: skip
        except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            roles = ", ".join(m["role"] for m in messages)
            raise ChunkError(f"the chat template cannot render messages [{roles}]: {exc}") from exc

    def _encode(self, text: str) -> list[int]:
        # Special tokens written in the text (<|im_start|>) become their single ids; no BOS is added, as
        # apply_chat_template does: the template writes its BOS itself. verbose=False: no transformers
        # warning about a long text; the caller refuses what cannot fit.
        return list(self._tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def _encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` as apply_chat_template tokenizes it, and each one's character span."""
        if getattr(self._tokenizer, "is_fast", False):
            encoded = self._tokenizer(
                text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
            )
            return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
        ids = self._encode(text)
        return ids, _offsets_by_prefixes(self._tokenizer, ids)


def _offsets_by_prefixes(tokenizer: Any, ids: list[int]) -> list[tuple[int, int]]:
    """Character spans from decodes of growing prefixes, for a tokenizer without offsets."""
    spans, done = [], 0
    for i in range(1, len(ids) + 1):
        end = len(tokenizer.decode(ids[:i]))
        spans.append((done, max(done, end)))
        done = max(done, end)
    return spans


def _special_texts(tokenizer: Any) -> set[str]:
    """The text of every special token the tokenizer has (end-of-turn markers among them)."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return texts
