"""ChatFormat: concatenated segment ids equal the tokenizer's own chat-template rendering."""

from __future__ import annotations

from typing import Any

import pytest

from kvchat.chunks.template import CHATML_TEMPLATE, ChatFormat
from kvchat.errors import ChunkError
from tests.hf_tokenizers import (
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
    ids: list[int] = []
    if messages[0]["role"] != "system":
        # What the template inserts on its own, made an explicit segment.
        prompt = fmt.default_system_prompt
        ids += fmt.start_ids if prompt is None else fmt.segment_ids("system", prompt)
    for m in messages:
        ids += fmt.segment_ids(m["role"], m["content"])
    return ids + list(fmt.generation_prompt_ids)


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
    name, _, fmt = case
    assert fmt.default_system_prompt == DEFAULT_SYSTEM_PROMPTS[name]
    assert fmt.start_ids == ()
    assert not fmt.uses_fallback_template


def test_end_of_turn_is_im_end(case: tuple) -> None:
    _, tokenizer, fmt = case
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fmt.end_of_turn_id == im_end
    assert fmt.assistant_close_ids[0] == im_end


@pytest.mark.parametrize("content", ["The capital of France is Paris.", "Line one.\nLine two: 世界 🌍"])
def test_assistant_segment_from_generated_ids(case: tuple, content: str) -> None:
    _, tokenizer, fmt = case
    content_ids = tokenizer.encode(content, add_special_tokens=False)
    reused = [*fmt.generation_prompt_ids, *content_ids, *fmt.assistant_close_ids]  # an output's ids
    assert reused == fmt.segment_ids("assistant", content)
    messages = [msg("system", "S."), msg("user", "Q?"), msg("assistant", content), msg("user", "More?")]
    composed = fmt.segment_ids("system", "S.") + fmt.segment_ids("user", "Q?") + reused
    composed += [*fmt.segment_ids("user", "More?"), *fmt.generation_prompt_ids]
    assert composed == render_ids(tokenizer, messages)


def test_think_ids(qwen3_tokenizer: Any, smollm2_tokenizer: Any) -> None:  # noqa: F811
    assert ChatFormat(qwen3_tokenizer).think_ids == (151667, 151668)
    assert ChatFormat(smollm2_tokenizer).think_ids is None


def test_qwen3_history_assistant_loses_its_reasoning(qwen3_tokenizer: Any) -> None:  # noqa: F811
    fmt = ChatFormat(qwen3_tokenizer)
    thought = "<think>\nLet me count.\n</think>\n\nFour."
    assert fmt.segment_ids("assistant", thought) == fmt.segment_ids("assistant", "Four.")
    messages = [msg("system", "S."), msg("user", "2+2?"), msg("assistant", thought), msg("user", "Sure?")]
    assert compose_ids(fmt, messages) == render_ids(qwen3_tokenizer, messages)


def test_qwen3_final_assistant_turn_cannot_match(qwen3_tokenizer: Any) -> None:  # noqa: F811
    # An assistant turn after the last user message gets an empty think block from the template,
    # so a conversation ending in an assistant turn is not the plain concatenation of segments.
    fmt = ChatFormat(qwen3_tokenizer)
    messages = [msg("system", "S."), msg("user", "2+2?"), msg("assistant", "Four.")]
    rendered = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nFour.<|im_end|>" in rendered
    assert compose_ids(fmt, messages) != render_ids(qwen3_tokenizer, messages)


def test_fallback_chatml_without_a_template(qwen3_tokenizer: Any) -> None:  # noqa: F811
    fmt = ChatFormat(TemplateOverride(qwen3_tokenizer, None))
    assert fmt.uses_fallback_template
    assert fmt.default_system_prompt is None
    assert fmt.end_of_turn_id == qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = CONVERSATIONS["multi_turn"]
    expected = render_ids(qwen3_tokenizer, messages, chat_template=CHATML_TEMPLATE)
    assert compose_ids(fmt, messages) == expected


def test_bos_written_by_the_template_goes_to_the_first_segment(qwen3_tokenizer: Any) -> None:  # noqa: F811
    tokenizer = TemplateOverride(qwen3_tokenizer, BOS_CHATML_TEMPLATE)
    fmt = ChatFormat(tokenizer)
    bos = qwen3_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert fmt.default_system_prompt is None
    assert fmt.start_ids == (bos,)
    assert fmt.segment_ids("system", "S.")[0] == bos
    assert fmt.segment_ids("user", "U.")[0] != bos
    for messages in CONVERSATIONS.values():
        assert compose_ids(fmt, messages) == render_ids(tokenizer, messages)


@pytest.mark.parametrize(
    "template",
    [
        # The number of messages leads the text: no segment is independent of the others.
        "{{ messages | length }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}",
        # Gemma-style refusal of system messages.
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('No system role') }}{% endif %}",
    ],
)
def test_unsplittable_template_is_refused(qwen3_tokenizer: Any, template: str) -> None:  # noqa: F811
    with pytest.raises(ChunkError):
        ChatFormat(TemplateOverride(qwen3_tokenizer, template))


def test_unknown_role_is_refused(qwen3_tokenizer: Any) -> None:  # noqa: F811
    with pytest.raises(ChunkError):
        ChatFormat(qwen3_tokenizer).segment_ids("context", "text")
