"""A GGUF's Q4_0/Q4_1 weights kept as int4 layers: exact codes, llama's q/k row order, refusals."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from kvchat.errors import ModelLoadError
from kvchat.linears.quantized_linears import Int4Linear
from kvchat.models import gguf_quant
from kvchat.models.gguf_quant import GGUFInt4Layers, read_int4_blocks, unpermute_rows
from kvchat.models.quantize import quantize_model
from tests.support.tiny_models import make_tiny_model

QType = gguf.GGMLQuantizationType
Q4_0, Q4_1, Q8_0 = QType.Q4_0, QType.Q4_1, QType.Q8_0
NUM_HEADS, NUM_KV_HEADS = 4, 2  # the tiny models'
# The tiny llama's layer 0 as stored in the test file: GGUF name, transformers name, type.
STORED = (
    ("blk.0.attn_q", "model.layers.0.self_attn.q_proj", Q4_1),
    ("blk.0.attn_k", "model.layers.0.self_attn.k_proj", Q4_1),
    ("blk.0.attn_v", "model.layers.0.self_attn.v_proj", Q4_0),
    ("blk.0.attn_output", "model.layers.0.self_attn.o_proj", Q4_1),
    ("blk.0.ffn_gate", "model.layers.0.mlp.gate_proj", Q4_1),
    ("blk.0.ffn_up", "model.layers.0.mlp.up_proj", Q8_0),
    ("blk.0.ffn_down", "model.layers.0.mlp.down_proj", Q4_0),
)


def permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: q/k rows reordered for its RoPE layout."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def heads_of(gguf_name: str) -> int | None:
    return {"blk.0.attn_q": NUM_HEADS, "blk.0.attn_k": NUM_KV_HEADS}.get(gguf_name)


def write_gguf_and_convert(path: Path, kind: str = "llama") -> torch.nn.Module:
    """Write a tiny model's layer 0 into a GGUF as llama.cpp would; return the model as transformers
    converts that file: every stored weight dequantized, a llama's q/k rows put back in its order."""
    model = make_tiny_model(kind, num_layers=1)
    writer = gguf.GGUFWriter(path, kind)
    processor = LlamaTensorProcessor({"num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS})
    for gguf_name, hf_name, qtype in STORED:
        linear = model.get_submodule(hf_name)
        weight = linear.weight.detach().numpy()  # (N, K)
        heads = heads_of(gguf_name) if kind == "llama" else None  # llama.cpp permutes llama's only
        raw = gguf.quants.quantize(permute(weight, heads) if heads else weight, qtype)
        writer.add_tensor(f"{gguf_name}.weight", raw, raw_dtype=qtype)
        values = gguf.quants.dequantize(raw, qtype)
        if kind == "llama":
            values = processor.process(values, f"{gguf_name}.weight").weights
        linear.weight.data = torch.from_numpy(np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def file_layers(path: Path) -> GGUFInt4Layers:
    return GGUFInt4Layers(path, path.with_suffix(".json"), NUM_HEADS, NUM_KV_HEADS, num_layers=1)


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1])
def test_blocks_read_back_exactly(qtype: gguf.GGMLQuantizationType) -> None:
    weight = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(weight, qtype)
    codes, scales, offsets = read_int4_blocks(raw, qtype)  # (N, K), (N, K/32) x2
    assert codes.shape == (48, 96) and codes.max() <= 15
    values = scales[..., None] * codes.reshape(48, 3, 32) + offsets[..., None]  # d * q + m, as GGUF
    assert np.array_equal(values.reshape(48, 96), gguf.quants.dequantize(raw, qtype))


def test_unpermute_matches_transformers() -> None:
    rows = np.arange(32 * 3).reshape(32, 3)
    processor = LlamaTensorProcessor({"num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS})
    expected = processor.process(rows, "blk.0.attn_k.weight").weights
    assert np.array_equal(unpermute_rows(rows, NUM_KV_HEADS), expected)
    assert np.array_equal(unpermute_rows(permute(rows, NUM_HEADS), NUM_HEADS), rows)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: rows as stored, biases kept
def test_q4_layers_keep_the_files_values_and_the_rest_are_quantized(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "tiny.gguf"
    converted = write_gguf_and_convert(path, kind)
    dense = {hf_name: converted.get_submodule(hf_name).weight.detach().clone() for _, hf_name, _ in STORED}
    report = quantize_model(converted, "int4", head_mode="none", from_file=file_layers(path))
    kept = [hf_name for _, hf_name, qtype in STORED if qtype in (Q4_0, Q4_1)]
    assert sorted(report.kept_from_file) == sorted(kept)
    assert report.quantized == ["model.layers.0.mlp.up_proj"]  # Q8_0: requantized from its values
    for hf_name in kept:
        layer = converted.get_submodule(hf_name)
        assert isinstance(layer, Int4Linear)
        # The file's values d * q + m, up to bf16's rounding of d and m + 8d and of the output.
        error = (layer.dequantized_weight() - dense[hf_name]).abs().max()
        assert float(error) <= 2**-7 * float(dense[hf_name].abs().max()), hf_name
        has_bias = kind == "qwen2" and hf_name.endswith(("q_proj", "k_proj", "v_proj"))
        assert (layer.bias is not None) == has_bias, hf_name


def test_a_file_that_does_not_match_its_conversion_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    converted = write_gguf_and_convert(path)
    q_proj = converted.get_submodule("model.layers.0.self_attn.q_proj")
    # The converted rows left in llama.cpp's order: the file's values no longer line up with them.
    q_proj.weight.data = torch.from_numpy(permute(q_proj.weight.detach().numpy(), NUM_HEADS))
    with pytest.raises(ModelLoadError, match="q_proj do not match"):
        file_layers(path)("model.layers.0.self_attn.q_proj", q_proj)


def test_the_tensor_index_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tiny.gguf"
    converted = write_gguf_and_convert(path)
    file_layers(path)
    assert path.with_suffix(".json").is_file()

    def no_reader(*args: object) -> None:
        raise AssertionError("parsed the file again")

    monkeypatch.setattr(gguf_quant.gguf, "GGUFReader", no_reader)
    k_proj = converted.get_submodule("model.layers.0.self_attn.k_proj")
    assert isinstance(file_layers(path)("model.layers.0.self_attn.k_proj", k_proj), Int4Linear)


def test_a_read_only_cache_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    converted = write_gguf_and_convert(path)
    k_proj = converted.get_submodule("model.layers.0.self_attn.k_proj")
    layers = GGUFInt4Layers(path, tmp_path / "missing" / "index.json", NUM_HEADS, NUM_KV_HEADS, num_layers=1)
    assert isinstance(layers("model.layers.0.self_attn.k_proj", k_proj), Int4Linear)


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # truncated
        lambda text: text.replace('"file_size": ', '"file_size": 1', 1),  # an edit its digest refuses
        lambda text: "[]",
    ],
)
def test_a_damaged_tensor_table_is_read_again_and_told(tmp_path: Path, damage) -> None:
    path = tmp_path / "tiny.gguf"
    converted = write_gguf_and_convert(path)
    k_proj = converted.get_submodule("model.layers.0.self_attn.k_proj")
    expected = file_layers(path)("model.layers.0.self_attn.k_proj", k_proj)
    index = path.with_suffix(".json")
    index.write_text(damage(index.read_text()))
    told: list[str] = []
    layers = GGUFInt4Layers(path, index, NUM_HEADS, NUM_KV_HEADS, num_layers=1, notify=told.append)
    layer = layers("model.layers.0.self_attn.k_proj", k_proj)
    assert isinstance(layer, Int4Linear) and isinstance(expected, Int4Linear)
    assert torch.equal(layer.packed, expected.packed) and torch.equal(layer.params, expected.params)
    assert len(told) == 1 and told[0].startswith(f"the tensor table kept in {index} was damaged")
    told.clear()
    GGUFInt4Layers(path, index, NUM_HEADS, NUM_KV_HEADS, num_layers=1, notify=told.append)
    assert told == []  # written again whole
