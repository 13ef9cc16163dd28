"""A GGUF's Q4_0 and Q4_1 weights as int4 layers, their 4-bit codes taken as the file holds them.

A Q4_1 block of 32 weights is `d * q + m` with q in 0..15: the int4 kernel's `(q - 8) * scale + zero`
with scale d and zero m + 8d. Q4_0 is `d * (q - 8)`: zero 0. The codes are kept exactly; d and the
zero are rounded once to bf16, the kernel's format (an error of at most 1/64 of a quantization step
on a typical block, where dequantizing to bf16 rounds every weight instead).
Q8_0 has no exact int4 or per-channel int8 form (one scale per 32 inputs), so it is not kept: such
layers are quantized from their dequantized weights like any other.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from kvchat import cache_files
from kvchat.errors import ModelLoadError
from kvchat.linears.int4_rounding import GroupScales
from kvchat.linears.quantized_linears import GROUP_SIZE, Int4Linear

# Bytes of one 32-weight block: fp16 d [, fp16 m], then 16 bytes of two codes each.
_BLOCK_BYTES = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}
# Architectures whose GGUF tensors transformers reads row for row (llama's q/k rows are permuted back).
_ARCHITECTURES = {"llama", "qwen2", "qwen3"}
# A file layer whose values stray further than this from the converted weights is mapped wrongly.
_MAX_RELATIVE_ERROR = 0.05


class GGUFInt4Layers:
    """Makes an Int4Linear from the file's own blocks for each linear stored as Q4_0/Q4_1.

    Called with a transformers module name and the dense layer converted from the same file; answers
    None for layers the file stores otherwise. Block 0's layers are checked against the dense ones."""

    def __init__(
        self,
        path: Path,
        index_file: Path | None,
        num_heads: int,
        num_kv_heads: int,
        num_layers: int,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.index = read_tensor_index(path, index_file, notify)
        self.architecture = self.index.architecture
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.architecture), None)
        self.names = gguf.get_tensor_name_map(arch, num_layers) if arch is not None else None

    def __call__(self, name: str, linear: nn.Linear) -> Int4Linear | None:
        if self.names is None or self.architecture not in _ARCHITECTURES:
            return None
        base = self.names.get_name(name)
        entry = self.index.tensors.get(f"{base}.weight") if base else None
        if base is None or entry is None or entry.tensor_type not in _BLOCK_BYTES:
            return None
        data = np.memmap(self.path, np.uint8, "r", entry.offset, (entry.num_rows, entry.row_bytes))
        codes, scales, offsets = read_int4_blocks(data, entry.tensor_type)  # (N, K), (N, K/G) x2
        zeros = offsets + 8 * scales  # d * q + m = (q - 8) * d + (m + 8d)
        if codes.shape != tuple(linear.weight.shape):
            return None
        if self.architecture == "llama" and base.endswith(("attn_q", "attn_k")):
            heads = self.num_heads if base.endswith("attn_q") else self.num_kv_heads
            codes, scales, zeros = (unpermute_rows(a, heads) for a in (codes, scales, zeros))
        if base.startswith("blk.0."):
            self._check(name, codes, scales, zeros, linear)
        device = linear.weight.device
        codes_t, scales_t, zeros_t = (torch.from_numpy(a).to(device) for a in (codes, scales, zeros))
        return Int4Linear(codes_t, GroupScales(scales_t, zeros_t), linear.bias)

    def _check(
        self, name: str, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, linear: nn.Linear
    ) -> None:
        values = dequantize_int4(codes, scales, zeros)  # (N, K)
        dense = linear.weight.detach().float().cpu().numpy()
        error = np.abs(values - dense).mean() / max(float(np.abs(dense).mean()), 1e-12)
        if error > _MAX_RELATIVE_ERROR:
            raise ModelLoadError(
                f"{self.path.name}: the 4-bit values of {name} do not match its converted weights "
                f"(relative error {error:.3f}); load it with --quantize none or int8"
            )


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's rows lie in a GGUF file."""

    tensor_type: gguf.GGMLQuantizationType
    offset: int
    num_rows: int
    row_bytes: int


@dataclass(frozen=True)
class TensorIndex:
    """A GGUF's architecture and tensor table: all that reading its blocks takes."""

    architecture: str
    file_size: int
    tensors: dict[str, TensorEntry]


def read_tensor_index(
    path: Path, index_file: Path | None, notify: Callable[[str], None] | None = None
) -> TensorIndex:
    """The tensor table of `path`, kept in `index_file` (None: not kept): GGUFReader parses the whole
    vocabulary (~10 s for SmolLM2's), so the file is read once. A kept table is checked (its own
    SHA-256, every tensor inside the file) before use; a damaged one is read again and rewritten."""
    size = path.stat().st_size
    if index_file is not None and index_file.exists():
        try:
            return _read_index(index_file, size)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if notify is not None:
                notify(
                    f"the tensor table kept in {index_file} was damaged ({exc}); reading {path.name} again"
                )
    reader = gguf.GGUFReader(path)
    tensors = {
        t.name: TensorEntry(
            t.tensor_type, t.data_offset, int(t.data.shape[0]), int(t.data.nbytes // t.data.shape[0])
        )
        for t in reader.tensors
    }
    index = TensorIndex(str(reader.fields["general.architecture"].contents()), size, tensors)
    if index_file is not None:
        try:
            _write_index(index, index_file)
        except OSError:
            pass  # a read-only cache: parse the file again next time rather than fail the load
    return index


def _read_index(index_file: Path, size: int) -> TensorIndex:
    """A kept tensor table, whole and fitting a GGUF of `size` bytes; ValueError (or KeyError,
    TypeError) where it is not."""
    saved = json.loads(index_file.read_bytes())
    body = saved["body"]
    if saved["sha256"] != _digest(body):
        raise ValueError("its SHA-256 differs")
    if body["file_size"] != size:
        raise ValueError(f"made for a file of {body['file_size']} bytes")
    entries = {}
    for name, (kind, offset, num_rows, row_bytes) in body["tensors"].items():
        if not all(isinstance(v, int) and v >= 0 for v in (offset, num_rows, row_bytes)):
            raise ValueError(f"{name} has a bad place")
        if offset + num_rows * row_bytes > size:
            raise ValueError(f"{name} ends past the file")
        entries[name] = TensorEntry(gguf.GGMLQuantizationType(kind), offset, num_rows, row_bytes)
    if not isinstance(body["architecture"], str):
        raise TypeError("the architecture is not a name")
    return TensorIndex(body["architecture"], size, entries)


def _write_index(index: TensorIndex, index_file: Path) -> None:
    table = {n: [int(e.tensor_type), e.offset, e.num_rows, e.row_bytes] for n, e in index.tensors.items()}
    body = {"architecture": index.architecture, "file_size": index.file_size, "tensors": table}
    # Written beside and renamed: another kvchat never reads half a file.
    cache_files.write_atomically(index_file, json.dumps({"body": body, "sha256": _digest(body)}).encode())


def _digest(body: object) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_int4_blocks(
    data: np.ndarray, tensor_type: gguf.GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1 rows as the file holds them: codes (N, K) in 0..15, and fp32 scales and offsets
    (N, K/32) with weight = scale * code + offset (Q4_1: d and m; Q4_0: d and -8d)."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, _BLOCK_BYTES[tensor_type])  # (N, K/G, bytes)
    d = _fp16(blocks[..., 0:2])
    if tensor_type == gguf.GGMLQuantizationType.Q4_1:
        offsets, packed = _fp16(blocks[..., 2:4]), blocks[..., 4:]
    else:
        offsets, packed = -8 * d, blocks[..., 2:]
    # Byte j holds weight j of the block in its low nibble and weight j + 16 in its high one.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # (N, K/G, G)
    return codes.reshape(rows, -1), d, offsets


def dequantize_int4(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """What the int4 kernel multiplies by, in fp32, with scale and zero rounded to bf16: (N, K)."""
    scale = torch.from_numpy(scales).to(torch.bfloat16).float().numpy()[..., None]  # (N, K/G, 1)
    zero = torch.from_numpy(zeros).to(torch.bfloat16).float().numpy()[..., None]
    groups = codes.reshape(codes.shape[0], -1, GROUP_SIZE).astype(np.float32)
    return ((groups - 8) * scale + zero).reshape(codes.shape)


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows for its RoPE layout, as transformers' GGUF reader does."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _fp16(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)
