"""ChatFormat: concatenated segment ids equal the tokenizer's own chat-template rendering."""

from __future__ import annotations

from typing import Any

import pytest

from kvchat.chunks.rendering import Part
from kvchat.chunks.template import CHATML_TEMPLATE, ChatFormat
from kvchat.errors import ChunkError
from tests.support.hf_tokenizers import (
    BOS_CHATML_TEMPLATE,
    TemplateOverride,
    load_qwen3_tokenizer,
    load_qwen25_tokenizer,
    load_smollm2_tokenizer,
    qwen3_tokenizer,  # noqa: F401 (pytest fixture)
    smollm2_tokenizer,  # noqa: F401 (pytest fixture)
)

LOADERS = {"smollm2": load_smollm2_tokenizer, "qwen2.5": load_qwen25_tokenizer, "qwen3": load_qwen3_tokenizer}

DEFAULT_SYSTEM_PROMPTS = {
    "smollm2": "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "qwen2.5": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "qwen3": None,
}


def msg(role: str, text: str) -> dict[str, str]:
    return {"role": role, "content": text}


CONVERSATIONS = {
    "system_user": [msg("system", "You are a careful assistant."), msg("user", "What is 2 + 2?")],
    "multi_turn": [
        msg("system", "Answer briefly."),
        msg("user", "Name a prime."),
        msg("assistant", "Seven."),
        msg("user", "Another one?"),
    ],
    "consecutive_users": [
        msg("system", "Use the passages."),
        msg("user", "Passage 1: The Nile is long."),
        msg("user", "Passage 2: The Amazon is wide."),
        msg("user", "Which river is longer?"),
    ],
    "no_system": [msg("user", "Hello!")],
    "no_system_multi_turn": [msg("user", "Hi."), msg("assistant", "Hello."), msg("user", "Bye.")],
    "unicode_newlines": [
        msg("system", "Réponds en français.\nSois bref."),
        msg("user", "Grüße, 世界 🌍\n\nline two\n  indented\ttab"),
        msg("assistant", "Très bien — 好的 ✓\n- a\n- b"),
        msg("user", "ça va ?"),
    ],
    "trailing_whitespace": [
        msg("system", "System ends with a newline\n"),
        msg("user", "ends with spaces   "),
        msg("assistant", "ends with newlines\n\n"),
        msg("user", "  leading and trailing \n"),
    ],
}


def render_ids(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    """The reference: the tokenizer's own rendering, tokenized by apply_chat_template."""
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return encoded["input_ids"]


def compose_ids(fmt: ChatFormat, messages: list[dict[str, str]]) -> list[int]:
    """kvchat's ids for the messages: the rendering's pieces joined in the order the template wrote them."""
    rendering = fmt.render([Part(m["role"], m["content"]) for m in messages])
    pieces = [t for i in rendering.order for t in rendering.part_ids(i)]
    return rendering.lead_ids + pieces + rendering.tail_ids


@pytest.fixture(scope="module", params=list(LOADERS))
def case(request: pytest.FixtureRequest) -> tuple[str, Any, ChatFormat]:
    name = request.param
    tokenizer = LOADERS[name]()
    return name, tokenizer, ChatFormat(tokenizer)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_segments_concatenate_to_the_template_rendering(case: tuple, conversation: str) -> None:
    _, tokenizer, fmt = case
    messages = CONVERSATIONS[conversation]
    assert compose_ids(fmt, messages) == render_ids(tokenizer, messages)


def test_default_system_prompt_is_found_by_rendering(case: tuple) -> None:
    name, tokenizer, fmt = case
    assert fmt.default_system_prompt == DEFAULT_SYSTEM_PROMPTS[name]
    lead = tokenizer.decode(list(fmt.lead_ids))
    assert (DEFAULT_SYSTEM_PROMPTS[name] or "") in lead and (lead == "") == (
        DEFAULT_SYSTEM_PROMPTS[name] is None
    )
    assert not fmt.uses_fallback_template


def test_end_of_turn_is_im_end(case: tuple) -> None:
    _, tokenizer, fmt = case
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fmt.end_of_turn_id == im_end
    assert fmt.assistant_close_ids[0] == im_end


@pytest.mark.parametrize("content", ["The capital of France is Paris.", "Line one.\nLine two: 世界 🌍"])
def test_an_answer_kept_as_generated_is_its_piece_of_the_rendering(case: tuple, content: str) -> None:
    _, tokenizer, fmt = case
    content_ids = tokenizer.encode(content, add_special_tokens=False)
    kept = [*fmt.generation_prompt_ids, *content_ids, *fmt.assistant_close_ids]  # an output's ids
    assert fmt.answer_text(kept, frozenset()) == content
    messages = [msg("system", "S."), msg("user", "Q?"), msg("assistant", content), msg("user", "More?")]
    rendering = fmt.render([Part(m["role"], m["content"]) for m in messages])
    assert rendering.part_ids(2) == kept
    assert compose_ids(fmt, messages) == render_ids(tokenizer, messages)


def test_think_ids(qwen3_tokenizer: Any, smollm2_tokenizer: Any) -> None:  # noqa: F811
    assert ChatFormat(qwen3_tokenizer).think_ids == (151667, 151668)
    assert ChatFormat(smollm2_tokenizer).think_ids is None


def test_qwen3_history_assistant_loses_its_reasoning(qwen3_tokenizer: Any) -> None:  # noqa: F811
    fmt = ChatFormat(qwen3_tokenizer)
    thought = "<think>\nLet me count.\n</think>\n\nFour."
    messages = [msg("system", "S."), msg("user", "2+2?"), msg("assistant", thought), msg("user", "Sure?")]
    plain = [*messages[:2], msg("assistant", "Four."), messages[3]]
    assert compose_ids(fmt, messages) == render_ids(qwen3_tokenizer, messages) == compose_ids(fmt, plain)
    assert fmt.reuse_note is not None and "reasoning" in fmt.reuse_note


def test_qwen3_final_assistant_turn_renders_as_the_template_does(qwen3_tokenizer: Any) -> None:  # noqa: F811
    # An assistant turn after the last user message gets an empty think block from the template.
    fmt = ChatFormat(qwen3_tokenizer)
    messages = [msg("system", "S."), msg("user", "2+2?"), msg("assistant", "Four.")]
    rendered = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nFour.<|im_end|>" in rendered
    assert compose_ids(fmt, messages) == render_ids(qwen3_tokenizer, messages)


def test_fallback_chatml_without_a_template(qwen3_tokenizer: Any) -> None:  # noqa: F811
    fmt = ChatFormat(TemplateOverride(qwen3_tokenizer, None))
    assert fmt.uses_fallback_template and "generic ChatML" in fmt.describe()
    assert fmt.default_system_prompt is None
    assert fmt.end_of_turn_id == qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = CONVERSATIONS["multi_turn"]
    expected = render_ids(qwen3_tokenizer, messages, chat_template=CHATML_TEMPLATE)
    assert compose_ids(fmt, messages) == expected


def test_a_bos_the_template_writes_leads_a_conversation_without_system_prompt(qwen3_tokenizer: Any) -> None:  # noqa: F811
    fmt = ChatFormat(qwen3_tokenizer, BOS_CHATML_TEMPLATE)
    bos = qwen3_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert fmt.default_system_prompt is None
    assert fmt.lead_ids == (bos,)
    with_system = fmt.render([Part("system", "S."), Part("user", "U.")])
    assert with_system.lead_ids == [] and with_system.part_ids(0)[0] == bos
    for messages in CONVERSATIONS.values():
        assert compose_ids(fmt, messages) == render_ids(
            qwen3_tokenizer, messages, chat_template=BOS_CHATML_TEMPLATE
        )


@pytest.mark.parametrize(
    "template",
    [
        # The number of messages leads the text: each probe renders, but no part's text is found once.
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + m['content'] }}{% endfor %}",
        # Renders no message at all.
        "{{ 'nothing' }}",
    ],
)
def test_a_template_that_renders_no_conversation_is_refused(qwen3_tokenizer: Any, template: str) -> None:  # noqa: F811
    with pytest.raises(ChunkError, match="cannot render a conversation"):
        ChatFormat(qwen3_tokenizer, template)


def test_a_template_refusing_system_messages_gets_the_system_prompt_in_the_first_user_turn(
    qwen3_tokenizer: Any,  # noqa: F811
) -> None:
    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('No system role') }}{% endif %}"
        + CHATML_TEMPLATE
    )
    fmt = ChatFormat(qwen3_tokenizer, template)
    assert fmt.layout.folds_system
    parts = [Part("system", "S."), Part("user", "U."), Part("assistant", "A."), Part("user", "V.")]
    assert fmt.messages(parts)[0] == {"role": "user", "content": "S.\n\nU."}
    rendering = fmt.render(parts)
    assert rendering.token_ids == render_ids(qwen3_tokenizer, fmt.messages(parts), chat_template=template)


def test_unknown_role_is_refused(qwen3_tokenizer: Any) -> None:  # noqa: F811
    with pytest.raises(ChunkError):
        ChatFormat(qwen3_tokenizer).render([Part("context", "text")])
