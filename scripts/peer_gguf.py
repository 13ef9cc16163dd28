"""GGUF files of the packaged model in other weight types, for llama.cpp in bench_peer.py.

The packaged file holds Q4_1 matrices (and a Q8_0 embedding); kvchat runs their dequantized values. A
BF16 or Q8_0 file written from those same values gives llama.cpp the same weights kvchat reads, so a
comparison measures the engines, not the weights. Written once next to kvchat's converted model.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from kvchat.models.packaged import cache_dir, packaged_gguf

KEPT_TYPES = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16})


def packaged_as(type_name: str) -> Path:
    """The packaged model as a GGUF file whose matrices are `type_name` (Q4_1: the packaged file)."""
    source = packaged_gguf()
    if type_name == "Q4_1":
        return source
    target = cache_dir() / "bench" / f"{source.stem.rsplit('.', 1)[0]}.{type_name}.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        _rewrite(source, partial, gguf.GGMLQuantizationType[type_name])
        partial.rename(target)
    return target


def weight_bytes(path: Path) -> int:
    """Bytes of all tensors in a GGUF file (what one token's decode reads, the embedding being tied)."""
    return sum(int(tensor.n_bytes) for tensor in gguf.GGUFReader(path).tensors)


def _rewrite(source: Path, target: Path, qtype: gguf.GGMLQuantizationType) -> None:
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.tensor_type in KEPT_TYPES:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # (rows, cols) fp32
        writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
