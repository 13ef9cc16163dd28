"""Models on disk for tests: a tiny saved model folder as `kvchat --model` loads one, GGUF conversions
faked and counted, and a progress callback that keeps the notes it is told."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.models import gguf
from tests.support.hf_tokenizers import load_smollm2_tokenizer
from tests.support.tiny_models import make_tiny_model


def saved_tiny_qwen2(tmp_path: Path) -> Path:
    """A tiny Qwen2 model folder with SmolLM2's tokenizer, as kvchat --model loads one."""
    tokenizer = load_smollm2_tokenizer()
    folder = tmp_path / "tiny-qwen2"
    make_tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def fake_conversion(monkeypatch: pytest.MonkeyPatch, conversions: list[Path]) -> None:
    """Conversions that write a small file of each required name, and are counted."""

    def fake_save(
        model: object, tokenizer: object, out_dir: Path, name: str, progress: object = None
    ) -> None:
        conversions.append(out_dir)
        for required in gguf.REQUIRED_FILES:
            (out_dir / required).write_text(f"{required} of {name}")

    monkeypatch.setattr(gguf, "read_gguf", lambda path, progress=None: (None, None))
    monkeypatch.setattr(gguf, "save_converted", fake_save)


class Notes:
    """A progress callback that keeps the notes it is told."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def __call__(self, description: str, completed: float, total: float | None) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)
