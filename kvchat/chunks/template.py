"""Chat-template segments as token ids, so a context is the concatenation of its chunks' ids.

Each chunk is one message. Its ids are found by rendering the tokenizer's own chat template on
short message lists and taking string differences, then tokenizing only that segment's text.
Joined text is never re-tokenized: a boundary can tokenize differently in context.

What the templates we test against do:
- SmolLM2: ChatML; inserts "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
  as a system message when the first message is not a system message.
- Qwen2.5: ChatML; inserts "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
  the same way.
- Qwen3: ChatML, no default system prompt, thinking enabled. Assistant turns before the last user query
  lose their reasoning (everything up to "</think>" is dropped); an assistant turn after the last
  user query (e.g. the final message) gets a "<think>...</think>" block. segment_ids("assistant")
  renders a turn before a later user message, so it has no think block.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from kvchat.errors import ChunkError

ROLES = ("system", "user", "assistant")

# Used when a tokenizer has no chat template; "<|im_start|>" and "<|im_end|>" are plain text
# unless the tokenizer happens to have them as tokens.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Probe texts: plain words, so no template trims or rewrites them.
_PROBE_SYSTEM = "kvchat probe system"
_PROBE_USER = "kvchat probe user"
_MARK = "kvchatmark"


def _message(role: str, text: str) -> dict[str, str]:
    return {"role": role, "content": text}


def _between(text: str, head: str, tail: str) -> str | None:
    """`text` without `head` and `tail`, or None when it does not start and end with them."""
    if len(text) < len(head) + len(tail) or not text.startswith(head) or not text.endswith(tail):
        return None
    return text[len(head) : len(text) - len(tail)]


class ChatFormat:
    """The token ids of each chat message as the tokenizer's chat template renders it.

    `segment_ids` of a system message, then of each later message, then `generation_prompt_ids`
    concatenate to what `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`
    gives (with `default_system_prompt` as an explicit system message when the template inserts
    one). Raises ChunkError when the template cannot be split into such segments.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.uses_fallback_template = not getattr(tokenizer, "chat_template", None)
        # A user or assistant segment is cut out of [system probe, message, user probe]: the
        # trailing user message keeps Qwen3 from treating an assistant probe as the final turn.
        self._head_text = self._render([_message("system", _PROBE_SYSTEM)])
        with_suffix = self._render([_message("system", _PROBE_SYSTEM), _message("user", _PROBE_USER)])
        self._suffix_text = self._require(_between(with_suffix, self._head_text, ""), "a user message")

        asked = self._render(
            [_message("system", _PROBE_SYSTEM), _message("user", _PROBE_USER)], add_generation_prompt=True
        )
        # The ids add_generation_prompt=True appends (e.g. "<|im_start|>assistant\n").
        self.generation_prompt_ids = tuple(
            self._encode(self._require(_between(asked, with_suffix, ""), "the generation prompt"))
        )
        assistant = self._segment_text("assistant", _MARK)
        if assistant.count(_MARK) != 1:
            raise ChunkError("the chat template rewrites assistant messages; cannot find their closing text")
        # The ids that close an assistant turn after its content (e.g. "<|im_end|>\n").
        self.assistant_close_ids = tuple(self._encode(assistant.split(_MARK)[1]))
        # The system text the template inserts when a conversation has none, else None; and the ids it
        # writes before a first message that is not a system message (a BOS), meaningful only when there
        # is no such default (else the context starts with that system segment; empty for ChatML).
        self.default_system_prompt, self.start_ids = self._find_default_system_prompt()
        # (<think>, </think>) ids when the tokenizer has both as single tokens, else None.
        self.think_ids = self._find_think_ids()
        # The token that ends an assistant turn (e.g. <|im_end|>), None if the template has none.
        self.end_of_turn_id = self._find_end_of_turn_id()
        self._check_probe_conversation()

    def segment_ids(self, role: str, text: str) -> list[int]:
        """The ids of one message as the template renders it mid-conversation.

        A "system" message is rendered as the first message (it holds any BOS the template
        writes). "assistant" text goes through the template, so Qwen3 drops a think span in it; an
        answer is kept as the ids it was generated as (generation prompt, answer, close) instead.
        """
        if role not in ROLES:
            raise ChunkError(f"unknown chat role {role!r}: expected one of {', '.join(ROLES)}")
        return self._encode(self._segment_text(role, text))

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        kwargs: dict[str, Any] = {}
        if self.uses_fallback_template:
            kwargs["chat_template"] = CHATML_TEMPLATE
        try:
            return self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except (TemplateError, ValueError, TypeError) as exc:
            roles = ", ".join(m["role"] for m in messages)
            raise ChunkError(f"the chat template cannot render messages [{roles}]: {exc}") from exc

    def _encode(self, text: str) -> list[int]:
        # Special tokens written in the text (<|im_start|>) become their single ids; no BOS is
        # added, as apply_chat_template does: the template writes its BOS itself.
        # verbose=False: no transformers warning about a long text; the caller refuses what cannot fit.
        return list(self._tokenizer.encode(text, add_special_tokens=False, verbose=False))

    @staticmethod
    def _require(text: str | None, what: str) -> str:
        if text is None:
            raise ChunkError(
                f"the chat template cannot be split into per-message segments ({what} changes "
                "the text rendered before it)"
            )
        return text

    def _segment_text(self, role: str, text: str) -> str:
        if role == "system":
            return self._render([_message("system", text)])
        rendered = self._render(
            [_message("system", _PROBE_SYSTEM), _message(role, text), _message("user", _PROBE_USER)]
        )
        return self._require(_between(rendered, self._head_text, self._suffix_text), f"a {role} message")

    def _find_default_system_prompt(self) -> tuple[str | None, tuple[int, ...]]:
        """Render a conversation without a system message and see what precedes its user turn."""
        user_text = self._segment_text("user", _PROBE_USER)
        alone = self._render([_message("user", _PROBE_USER)])
        lead = self._require(_between(alone, "", user_text), "a missing system message")
        if not lead:
            return None, ()
        system_head, _, system_tail = self._segment_text("system", _MARK).partition(_MARK)
        default = _between(lead, system_head, system_tail)
        if default is not None and self._segment_text("system", default) == lead:
            return default, ()
        return None, tuple(self._encode(lead))

    def _find_think_ids(self) -> tuple[int, int] | None:
        open_ids = self._encode("<think>")
        close_ids = self._encode("</think>")
        if len(open_ids) != 1 or len(close_ids) != 1:
            return None
        return open_ids[0], close_ids[0]

    def _find_end_of_turn_id(self) -> int | None:
        if not self.assistant_close_ids:
            return None
        first = self.assistant_close_ids[0]
        # A plain-text closing (fallback ChatML on a tokenizer without <|im_end|>) is no stop token.
        special_ids = set(getattr(self._tokenizer, "added_tokens_decoder", {}))
        special_ids.update(self._tokenizer.all_special_ids)
        return first if first in special_ids else None

    def _check_probe_conversation(self) -> None:
        """Refuse a tokenizer whose segments tokenize differently once joined."""
        messages = [
            _message("system", "You are terse."),
            _message("user", "Hi there."),
            _message("assistant", "Hello!"),
            _message("user", "Bye."),
        ]
        ids = [i for m in messages for i in self.segment_ids(m["role"], m["content"])]
        ids += self.generation_prompt_ids
        if ids != self._encode(self._render(messages, add_generation_prompt=True)):
            raise ChunkError("the tokenizer joins chat-template segments differently than it splits them")
