"""Quantized layers kept on disk: read back, they are the layers quantize_model made, and any change to
what decides them (the weights, the mode, the dtype, the code) makes a kept file a miss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvchat.config import ModelSettings
from kvchat.models import quantized_cache
from kvchat.models.loader import load_model
from kvchat.models.quantize import quantize_model
from tests.support.models_on_disk import Notes, saved_tiny_qwen2
from tests.support.tiny_models import make_tiny_model

IDS = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))  # (1, T)


def logits(model: nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=IDS).logits  # (1, T, V)


@pytest.mark.parametrize("mode", ["int8", "int4", "int4-g128"])
def test_kept_layers_read_back_are_the_quantized_ones(mode: str) -> None:
    quantized = make_tiny_model("qwen2", dtype=torch.bfloat16)  # qwen2: q/k/v carry a bias
    path = quantized_cache.cache_path(quantized, mode)  # before quantizing: the key reads the weights
    report = quantize_model(quantized, mode)
    quantized_cache.save(quantized, report, path)
    fresh = make_tiny_model("qwen2", dtype=torch.bfloat16)
    assert quantized_cache.cache_path(fresh, mode) == path
    assert quantized_cache.load(fresh, path, mode) == report and report.num_replaced == 15
    expected, got = dict(quantized.named_buffers()), dict(fresh.named_buffers())
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert [repr(m) for m in fresh.modules()] == [repr(m) for m in quantized.modules()]
    assert torch.equal(logits(fresh), logits(quantized))


def test_the_key_follows_the_weights_the_mode_the_dtype_and_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    path = quantized_cache.cache_path(make_tiny_model("llama", dtype=torch.bfloat16), "int4")
    assert quantized_cache.cache_path(make_tiny_model("llama", dtype=torch.bfloat16), "int4") == path
    assert quantized_cache.cache_path(make_tiny_model("llama", dtype=torch.bfloat16), "int8") != path
    assert quantized_cache.cache_path(make_tiny_model("llama"), "int4") != path  # fp32
    assert quantized_cache.cache_path(make_tiny_model("llama", dtype=torch.bfloat16, seed=1), "int4") != path
    touched = make_tiny_model("llama", dtype=torch.bfloat16)
    with torch.no_grad():
        touched.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    assert quantized_cache.cache_path(touched, "int4") != path
    monkeypatch.setattr(quantized_cache, "_code_version", lambda: "another kvchat")
    assert quantized_cache.cache_path(make_tiny_model("llama", dtype=torch.bfloat16), "int4") != path


def kept(mode: str = "int4") -> Path:
    """The file a tiny Llama quantized in `mode` is kept in."""
    model = make_tiny_model("llama", dtype=torch.bfloat16)
    path = quantized_cache.cache_path(model, mode)
    quantized_cache.save(model, quantize_model(model, mode), path)
    return path


def test_a_damaged_file_or_one_of_another_shape_or_code_is_removed_and_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = kept()
    layers = path / quantized_cache.LAYERS
    whole = layers.read_bytes()
    layers.write_bytes(whole[: len(whole) // 2])
    model, told = make_tiny_model("llama", dtype=torch.bfloat16), Notes()
    assert quantized_cache.load(model, path, "int4", told) is None
    assert not any(type(m).__name__.startswith("Int") for m in model.modules())  # untouched
    assert not path.exists() and len(told.notes) == 1 and "bytes where" in told.notes[0]
    path = kept()
    other = make_tiny_model("llama", dtype=torch.bfloat16)
    other.lm_head = nn.Linear(64, 256, bias=False, dtype=torch.bfloat16)  # the kept one has 512 rows
    assert quantized_cache.load(other, path, "int4", told) is None
    assert "lm_head does not fit" in told.notes[-1] and not path.exists()
    path = kept()
    monkeypatch.setattr(quantized_cache, "_code_version", lambda: "another kvchat")
    assert quantized_cache.load(make_tiny_model("llama", dtype=torch.bfloat16), path, "int4", told) is None
    assert "another version of kvchat" in told.notes[-1]


def test_a_failed_write_leaves_no_file_and_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quantized_cache, "save_file", full_disk)
    model, told = make_tiny_model("llama", dtype=torch.bfloat16), Notes()
    path = quantized_cache.cache_path(model, "int4")
    assert not quantized_cache.save(model, quantize_model(model, "int4"), path, told)
    assert not path.exists() and list(path.parent.iterdir()) == []
    expected = f"cannot keep the int4 weights in {path.parent} (No space left on device)"
    assert told.notes == [f"{expected}; quantizing again next start"]


def test_the_second_start_reads_the_kept_layers(tmp_path) -> None:
    folder = saved_tiny_qwen2(tmp_path)
    settings = ModelSettings(model=str(folder), dtype="bf16", device="cpu", threads=1, quantize="int4")
    stages: list[list[str]] = []
    for _ in range(2):
        stages.append([])
        loaded = load_model(settings, progress=lambda d, done, total: stages[-1].append(d))
        stages[-1].append(loaded)  # type: ignore[arg-type]
    (*first, quantized), (*second, again) = stages
    assert "quantizing to int4" in first and "keeping the int4 weights for the next start" in first
    assert "quantizing to int4" not in second
    assert "reading the int4 weights kept from an earlier start" in second
    assert again.quantization == quantized.quantization and again.fingerprint == quantized.fingerprint
    assert torch.equal(logits(again.model), logits(quantized.model))


@pytest.mark.slow  # three quantized starts
def test_quant_cache_off_neither_reads_nor_writes(tmp_path) -> None:
    folder = saved_tiny_qwen2(tmp_path)
    kept = quantized_cache.folder()

    def stages(keep: bool) -> list[str]:
        settings = ModelSettings(
            model=str(folder), dtype="bf16", device="cpu", threads=1, quantize="int4", quant_cache=keep
        )
        seen: list[str] = []
        load_model(settings, progress=lambda d, done, total: seen.append(d))
        return seen

    off = stages(False)
    assert "quantizing to int4" in off and not any("kept" in s or "keeping" in s for s in off)
    assert not kept.exists() or list(kept.iterdir()) == []
    assert "keeping the int4 weights for the next start" in stages(True)
    assert len(list(kept.iterdir())) == 1
    again = stages(False)  # a kept file there is not read either
    assert "quantizing to int4" in again and not any("kept" in s for s in again)


def test_a_file_where_the_folder_should_be_is_told_and_the_start_goes_on(tmp_path) -> None:
    quantized_cache.folder().write_text("in the way")
    folder, told = saved_tiny_qwen2(tmp_path), Notes()
    settings = ModelSettings(model=str(folder), dtype="bf16", device="cpu", threads=1, quantize="int4")
    loaded = load_model(settings, progress=told)
    assert loaded.quantization is not None and loaded.quantization.mode == "int4"
    assert len(told.notes) == 1 and told.notes[0].startswith("cannot keep the int4 weights in ")
    assert quantized_cache.folder().read_text() == "in the way"
