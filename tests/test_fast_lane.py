"""The fast lane loads no real model: what refuses it is itself tested (this test is not slow)."""

import pytest

from kvchat.config import ModelSettings
from kvchat.models import packaged
from kvchat.models.loader import load_model
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
