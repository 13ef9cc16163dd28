"""The fast lane (`-m "not slow"`) loads no real model: a test that is not marked slow is refused the
packaged SmolLM2's weights, read from its GGUF or from its kept conversion, and may not ask for a
fixture that holds them. Tiny random-weight models and real tokenizers stay allowed."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from kvchat.errors import ModelLoadError
from kvchat.models import gguf, packaged

REAL_MODEL_FIXTURES = frozenset({"smollm2"})


class RealModelRefused(BaseException):
    """A test that is not marked slow reached the real model. A BaseException, so that no `except
    Exception` on the way up turns it into a load error the test might expect."""


def packaged_files() -> tuple[Path, Path] | None:
    """The packaged GGUF and the folder its conversion is kept in (None where it is not installed)."""
    try:
        return packaged.packaged_gguf(), packaged.converted_dir()
    except ModelLoadError:
        return None


def refuse_real_model(monkeypatch: pytest.MonkeyPatch, files: tuple[Path, Path] | None) -> None:
    """Make reading the packaged model's weights raise RealModelRefused, for the rest of a test."""
    if files is None:
        return
    packaged_file, converted = files
    read_gguf, convert_once = gguf.read_gguf, gguf.convert_once

    def refused_read(path, *args, **kwargs):
        if Path(path).is_file() and filecmp.cmp(path, packaged_file, shallow=False):
            raise RealModelRefused(f"a fast test read the packaged model's weights ({path}): mark it slow")
        return read_gguf(path, *args, **kwargs)

    def refused_conversion(gguf_path, target, *args, **kwargs):
        if Path(target) == converted:
            raise RealModelRefused(f"a fast test loaded the packaged model ({target}): mark it slow")
        return convert_once(gguf_path, target, *args, **kwargs)

    monkeypatch.setattr(gguf, "read_gguf", refused_read)
    monkeypatch.setattr(gguf, "convert_once", refused_conversion)


def unmarked_real_model_tests(items: list[pytest.Item]) -> list[str]:
    """The tests that ask for a real model's fixture without being marked slow."""
    return [
        item.nodeid
        for item in items
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("slow") is None
    ]
