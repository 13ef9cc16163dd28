"""How the linear kernels want their weights laid out: torch's int4 pack, and kvchat's tiles of 16 rows
(kvchat/native/quantized_linear.cpp, bf16_linear.cpp, fp32_linear.cpp), with the inverses that read them
back."""

from __future__ import annotations

import torch

from kvchat.linears.int4_rounding import GroupScales, NestedScales

GROUP_SIZE = 32  # inputs per int4 scale and zero, as GGUF's Q4_0/Q4_1 blocks, and per kvchat tile-group
TILE_ROWS = 16  # output rows per tile in kvchat's layouts


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """torch's layout for its int4 kernel on the codes' device, from (N, K) codes in 0..15."""
    codes = codes.to(torch.int32)  # (N, K) in 0..15
    if codes.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # (N, K/2) uint8
    # CUDA (untested here): two codes a byte, even index in the high nibble, then the tiled layout.
    pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # (N, K/2)
    inner_k_tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (t * 16) == 0)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)


def tile_int4(codes: torch.Tensor) -> torch.Tensor:
    """kvchat's layout (quantized_linear.cpp): (N/16, K/32, 256) uint8, a tile of 16 rows by a group of 32
    inputs as four 64-byte blocks; block i's byte 4r + j holds row r's code for input 4i + j in its low
    nibble and for input 16 + 4i + j in its high one."""
    rows, inputs = codes.shape
    # (tile, row, group, half, i, j) for input 16 * half + 4i + j, then (tile, group, i, row, j, half)
    split = codes.to(torch.uint8).reshape(rows // TILE_ROWS, TILE_ROWS, inputs // GROUP_SIZE, 2, 4, 4)
    split = split.permute(0, 2, 4, 1, 5, 3)
    packed = split[..., 0] | split[..., 1] << 4  # (tile, group, i, row, j)
    return packed.reshape(rows // TILE_ROWS, inputs // GROUP_SIZE, -1).contiguous()


def tile_params(params: GroupScales | NestedScales) -> torch.Tensor:
    """int4 scales as kvchat's kernel reads them. A bf16 scale and zero a group of G inputs:
    (N/16, K/G, 2, 16) bf16. Nested: (N/16, 64 + K) uint8, per tile the 16 rows' bf16 row scales and
    row lows, then each group's 16 scale codes and 16 low codes."""
    if isinstance(params, GroupScales):
        rows, groups = params.scales.shape
        both = torch.stack([params.scales, params.zeros]).reshape(2, rows // TILE_ROWS, TILE_ROWS, groups)
        return both.permute(1, 3, 0, 2).contiguous()
    rows, groups = params.scale_codes.shape
    tiles = rows // TILE_ROWS
    codes = torch.stack([params.scale_codes, params.low_codes.view(torch.uint8)])  # (2, N, n)
    codes = codes.reshape(2, tiles, TILE_ROWS, groups).permute(1, 3, 0, 2)  # (tile, group, 2, 16)
    heads = torch.stack([params.row_scales, params.row_lows]).reshape(2, tiles, TILE_ROWS)
    heads = heads.permute(1, 0, 2).contiguous().view(torch.uint8)  # (tile, 64)
    return torch.cat([heads.reshape(tiles, -1), codes.reshape(tiles, -1)], -1).contiguous()


def untile_params(tiled: torch.Tensor, groups: int) -> GroupScales | NestedScales:
    """`tile_params` undone, for a layer of `groups` groups of 32 inputs."""
    if tiled.dtype == torch.bfloat16:
        tiles, spans = tiled.shape[:2]
        scales, zeros = tiled.permute(2, 0, 3, 1).reshape(2, tiles * TILE_ROWS, spans)
        return GroupScales(scales, zeros)
    tiles = tiled.shape[0]
    head_bytes = 4 * TILE_ROWS
    heads = tiled[:, :head_bytes].contiguous().view(torch.bfloat16).reshape(tiles, 2, TILE_ROWS)
    row_scales, row_lows = heads.permute(1, 0, 2).reshape(2, tiles * TILE_ROWS)
    codes = tiled[:, head_bytes:].reshape(tiles, groups, 2, TILE_ROWS)
    codes = codes.permute(2, 0, 3, 1).reshape(2, tiles * TILE_ROWS, groups)
    return NestedScales(codes[0], codes[1].contiguous().view(torch.int8), row_scales, row_lows)


def tile_int8(codes: torch.Tensor) -> torch.Tensor:
    """kvchat's layout (quantized_linear.cpp): (N/16, K/32, 512) uint8, a tile of 16 rows by a group of
    32 inputs as eight 64-byte blocks; block j's byte 4r + i holds row r's code for input 4j + i, plus
    128."""
    rows, inputs = codes.shape
    shifted = (codes.to(torch.int16) + 128).to(torch.uint8)
    # (tile, row, group, j, i) for input 4j + i, then (tile, group, j, row, i)
    split = shifted.reshape(rows // TILE_ROWS, TILE_ROWS, inputs // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4)
    return split.reshape(rows // TILE_ROWS, inputs // GROUP_SIZE, -1).contiguous()


def untile_int8(tiled: torch.Tensor) -> torch.Tensor:
    """The codes in kvchat's layout as (N, K) int16: `tile_int8` undone."""
    tiles, groups, _ = tiled.shape
    blocks = tiled.reshape(tiles, groups, 8, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)  # (tile, row, group, j, i)
    return blocks.reshape(tiles * TILE_ROWS, groups * GROUP_SIZE).to(torch.int16) - 128


def untile_int4(packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """The weight in kvchat's layout, (N, K) in fp32: `tile_int4` and `tile_params` undone."""
    tiles, groups, _ = packed.shape
    blocks = packed.reshape(tiles, groups, 4, TILE_ROWS, 4)  # (tile, group, i, row, j)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)  # (tile, group, i, row, j, half)
    codes = codes.permute(0, 3, 1, 5, 2, 4).reshape(tiles * TILE_ROWS, groups * GROUP_SIZE)
    scales, lows = untile_params(params, groups).values()  # (N, spans): a scale and low per span
    group_size = groups * GROUP_SIZE // scales.shape[1]
    return codes.float() * scales.repeat_interleave(group_size, 1) + lows.repeat_interleave(group_size, 1)


def tile_bf16(weight: torch.Tensor) -> torch.Tensor:
    """kvchat's layout (bf16_linear.cpp): (N/16, K/2, 32) bf16, a tile of 16 rows as K/2 64-byte
    operands; operand p holds row r's inputs 2p and 2p + 1 at 2r and 2r + 1."""
    rows, inputs = weight.shape
    pairs = weight.to(torch.bfloat16).reshape(rows // TILE_ROWS, TILE_ROWS, inputs // 2, 2)
    return pairs.permute(0, 2, 1, 3).reshape(rows // TILE_ROWS, inputs // 2, 2 * TILE_ROWS).contiguous()


def untile_bf16(tiled: torch.Tensor) -> torch.Tensor:
    """The (N, K) weight in kvchat's layout: `tile_bf16` undone."""
    tiles, pairs, _ = tiled.shape
    operands = tiled.reshape(tiles, pairs, TILE_ROWS, 2).permute(0, 2, 1, 3)  # (tile, row, pair, 2)
    return operands.reshape(tiles * TILE_ROWS, 2 * pairs)


def tile_fp32(weight: torch.Tensor) -> torch.Tensor:
    """kvchat's layout (fp32_linear.cpp): (N/16, K, 16) fp32, a tile of 16 rows as K 64-byte operands;
    operand k holds the 16 rows' weights for input k."""
    rows, inputs = weight.shape
    tiles = weight.to(torch.float32).reshape(rows // TILE_ROWS, TILE_ROWS, inputs)
    return tiles.permute(0, 2, 1).contiguous()


def untile_fp32(tiled: torch.Tensor) -> torch.Tensor:
    """The (N, K) weight in kvchat's layout: `tile_fp32` undone."""
    tiles, inputs, _ = tiled.shape
    return tiled.permute(0, 2, 1).reshape(tiles * TILE_ROWS, inputs)
