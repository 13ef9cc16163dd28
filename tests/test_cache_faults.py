"""Fault injection into what kvchat keeps on disk: random damage to a kept quantized-layers file and to a
converted model (bit flips, truncation, NaN scales, edited specs: some sealed again, so that only the
schema and the finiteness checks stand between them and the model), each followed by a start that
must answer exactly as a start without the cache does, and say in one line that it rebuilt."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvchat import cache_files
from kvchat.config import ModelSettings
from kvchat.models import gguf, quantized_cache
from kvchat.models.loader import LoadedModel, load_model
from tests.support.hf_tokenizers import load_smollm2_tokenizer
from tests.support.models_on_disk import Notes
from tests.support.tiny_models import make_tiny_model

IDS = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(0))  # (1, T)


def logits_of(loaded: LoadedModel) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(input_ids=IDS).logits  # (1, T, V)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (q/k/v carry a bias) with SmolLM2's tokenizer, as kvchat --model loads one."""
    tokenizer = load_smollm2_tokenizer()
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_model("qwen2", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def int4_start(folder: Path, keep: bool = True, progress: Notes | None = None) -> LoadedModel:
    settings = ModelSettings(
        model=str(folder), dtype="bf16", device="cpu", threads=1, quantize="int4", quant_cache=keep
    )
    return load_model(settings, progress)


# -- the damage ---------------------------------------------------------------------------------


def flip(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"bit flip at {at}"


def truncate(path: Path, rng: random.Random) -> str:
    size = rng.randrange(path.stat().st_size)
    path.write_bytes(path.read_bytes()[:size])
    return f"truncated to {size}"


def rewrite_layers(path: Path, change) -> None:
    """Rewrite a kept layers file through `change(metadata, tensors)` and seal it again: only the
    checks behind the seal can refuse it."""
    with safe_open(str(path), framework="pt") as file:
        metadata = dict(file.metadata())
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (not a dict)
    change(metadata, tensors)
    save_file(tensors, str(path), metadata=metadata)
    cache_files.seal(path.parent)


def nan_scales(path: Path, rng: random.Random) -> str:
    def change(metadata: dict, tensors: dict) -> None:
        name = rng.choice(sorted(k for k, t in tensors.items() if t.is_floating_point()))
        tensors[name] = tensors[name].clone().view(-1)
        tensors[name][rng.randrange(tensors[name].numel())] = float("nan")
        tensors[name] = tensors[name].view(tensors[name].shape)

    rewrite_layers(path, change)
    return "NaN written into a bf16 tensor"


SPEC_EDITS = {
    "fewer rows": lambda layers, report: next(iter(layers.values())).update(out_features=16),
    "a wrong kernel": lambda layers, report: next(iter(layers.values())).update(kernel="fast"),
    "num_exact many": lambda layers, report: layers["lm_head"].update(num_exact="many"),
    "num_exact -5": lambda layers, report: layers["lm_head"].update(num_exact=-5),
    "a float group size": lambda layers, report: next(iter(layers.values())).update(group_size=32.0),
    "a layer missing": lambda layers, report: layers.pop(next(iter(layers))),
    "an int8 report": lambda layers, report: report.update(mode="int8"),
    "a layer's class": lambda layers, report: next(iter(layers.values())).update({"class": "Int8Linear"}),
}


def edit_spec(path: Path, rng: random.Random) -> str:
    name = rng.choice(sorted(SPEC_EDITS))

    def change(metadata: dict, tensors: dict) -> None:
        layers, report = json.loads(metadata["layers"]), json.loads(metadata["report"])
        SPEC_EDITS[name](layers, report)
        metadata["layers"], metadata["report"] = json.dumps(layers), json.dumps(report)

    rewrite_layers(path, change)
    return f"spec edit: {name}"


def layers_as_list(path: Path, rng: random.Random) -> str:
    rewrite_layers(path, lambda metadata, tensors: metadata.update(layers=json.dumps([1, 2])))
    return "layers as a list"


QUANTIZED_DAMAGE = (flip, truncate, nan_scales, edit_spec, layers_as_list)


def damage_kept_layers(seed: int, tiny_folder: Path, expected: torch.Tensor) -> str:
    rng = random.Random(seed)
    (kept,) = quantized_cache.folder().iterdir()
    what = rng.choice(QUANTIZED_DAMAGE)(kept / quantized_cache.LAYERS, rng)
    told = Notes()
    again = int4_start(tiny_folder, progress=told)
    assert torch.equal(logits_of(again), expected), what
    assert len(told.notes) == 1 and "were damaged" in told.notes[0], (what, told.notes)
    assert cache_files.check_seal(kept, (quantized_cache.LAYERS,)) is None, what  # kept anew, whole
    return what


@pytest.fixture(scope="module")
def int4_kept(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.Tensor, Path]:
    """The int4 answer of a start without the cache, and the cache a start then wrote (answering the
    same), once for the module."""
    kept = tmp_path_factory.mktemp("quantized")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantized_cache, "folder", lambda: kept)
        expected = logits_of(int4_start(tiny_folder, keep=False))
        assert torch.equal(logits_of(int4_start(tiny_folder)), expected)
    return expected, kept


@pytest.fixture
def int4_reference(int4_kept: tuple[torch.Tensor, Path]) -> torch.Tensor:
    """The int4 answer of a start without the cache, with that cache in this test's own folder."""
    expected, kept = int4_kept
    shutil.copytree(kept, quantized_cache.folder())
    return expected


def seeds(num_seeds: int, num_fast: int = 2) -> list:
    """Seeds 0..num_seeds-1, the first `num_fast` in the fast lane and the rest in the full suite."""
    return [
        pytest.param(seed, marks=[] if seed < num_fast else [pytest.mark.slow]) for seed in range(num_seeds)
    ]


@pytest.mark.parametrize("seed", seeds(6))
def test_damaged_kept_layers_answer_as_without_the_cache(seed, tiny_folder, int4_reference) -> None:
    damage_kept_layers(seed, tiny_folder, int4_reference)


@pytest.mark.slow
def test_many_damaged_kept_layers_answer_as_without_the_cache(tiny_folder, int4_reference) -> None:
    kinds = [damage_kept_layers(seed, tiny_folder, int4_reference).split(":")[0] for seed in range(100, 160)]
    assert len(kinds) == 60 and {k.split(" at ")[0] for k in kinds} >= {"bit flip", "spec edit"}


# -- converted models ---------------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A .gguf whose conversion is the tiny Llama with SmolLM2's tokenizer: the dequantizing is
    faked, what is written, sealed, checked and loaded is real."""
    tokenizer = load_smollm2_tokenizer()

    def read_gguf(path: Path, progress: object = None):
        return make_tiny_model("llama", vocab_size=len(tokenizer)), tokenizer

    monkeypatch.setattr(gguf, "read_gguf", read_gguf)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(64))
    return path


def edit_config(path: Path, rng: random.Random) -> str:
    config = json.loads(path.read_text())
    config["rms_norm_eps"] = rng.choice([1e-3, 0.5])
    path.write_text(json.dumps(config))
    return "config edit"


CONVERTED_DAMAGE = {
    "model.safetensors": (flip, truncate),
    "config.json": (flip, truncate, edit_config),
    "tokenizer.json": (flip, truncate),
    "generation_config.json": (flip, truncate),
    cache_files.SEAL: (flip, truncate),
}


def fp32_start(path: Path, progress: Notes | None = None) -> LoadedModel:
    return load_model(ModelSettings(model=str(path), dtype="fp32", device="cpu", threads=1), progress)


@pytest.mark.parametrize("seed", seeds(8))
def test_a_damaged_conversion_is_converted_again_and_answers_the_same(seed: int, tiny_gguf: Path) -> None:
    expected = logits_of(fp32_start(tiny_gguf))
    rng = random.Random(seed)
    folder = gguf.converted_gguf_dir(tiny_gguf)
    name = rng.choice(sorted(CONVERTED_DAMAGE))
    what = rng.choice(CONVERTED_DAMAGE[name])(folder / name, rng)
    told = Notes()
    again = fp32_start(tiny_gguf, told)
    assert torch.equal(logits_of(again), expected), (name, what)
    # what is told of the cache (a GGUF without a chat template is told so too, as it converts again)
    notes = [note for note in told.notes if "no chat template" not in note]
    if name != cache_files.SEAL:  # a seal still read the same (a stamp's bit, say) needs no rebuild
        assert len(notes) == 1 and "converting tiny.gguf again" in notes[0], (name, what)
    assert len(notes) <= 1 and gguf.is_converted(folder)
