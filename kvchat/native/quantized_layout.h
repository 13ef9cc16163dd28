// The int8 and int4 weight layouts every tier's quantized kernels read (kvchat/linears/weight_layout.py
// writes them), checked at each op's boundary here, once for every tier, so that no tier can accept a
// layout another refuses.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kvchat_layout {

constexpr int64_t kRows = 16;                       // output rows a tile
constexpr int64_t kGroup = 32;                      // inputs per scale (and zero)
constexpr int64_t kCodeBytes = kRows * kGroup / 2;  // an int4 tile-group's codes
constexpr int64_t kByteCodes = kRows * kGroup;      // an int8 tile-group's codes
constexpr int64_t kNestedHead = 2 * kRows * 2;      // a nested tile's bf16 row scales and lows
constexpr int64_t kNestedGroup = 2 * kRows;         // and each group's scale and low codes

// x (M, K), codes (N/16, K/32, 256) uint8, params (N/16, K/(32 S), 2, 16) bf16 or nested (N/16, 64 + K)
// uint8. The groups of 32 inputs each scale and zero serves: 1, 2 or 4 (groups of 32, 64 or 128); 1
// where nested.
inline int64_t check_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && (params.dim() == 4 || params.dim() == 2),
              "int4_linear: x (M, K), codes (N/16, K/32, 256), params (N/16, K/(32 S), 2, 16) bf16 or nested "
              "(N/16, 64 + K) uint8");
  TORCH_CHECK(codes.scalar_type() == at::kByte &&
                  params.scalar_type() == (params.dim() == 4 ? at::kBFloat16 : at::kByte),
              "int4_linear: uint8 codes, and bf16 params or uint8 nested ones");
  TORCH_CHECK(codes.is_contiguous() && params.is_contiguous(), "int4_linear: contiguous weights");
  const int64_t tiles = codes.size(0), groups = codes.size(1);
  TORCH_CHECK(codes.size(2) == kCodeBytes && x.size(1) == groups * kGroup, "int4_linear: shapes");
  if (params.dim() == 2) {
    TORCH_CHECK(params.size(0) == tiles && params.size(1) == kNestedHead + groups * kNestedGroup,
                "int4_linear: nested params shape");
    return 1;
  }
  const int64_t spans = params.size(1), span = spans > 0 ? groups / spans : 0;
  TORCH_CHECK(params.size(0) == tiles && spans * span == groups && (span == 1 || span == 2 || span == 4) &&
                  params.size(2) == 2 && params.size(3) == kRows,
              "int4_linear: params shape (groups of 32, 64 or 128 inputs)");
  return span;
}

// x (M, K), codes (N/16, K/32, 512) uint8, scales (N,) bf16.
inline void check_int8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && scales.dim() == 1,
              "int8_linear: x (M, K), codes (N/16, K/32, 512), scales (N,)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kBFloat16,
              "int8_linear: uint8 codes and bf16 scales");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "int8_linear: contiguous weights");
  TORCH_CHECK(codes.size(2) == kByteCodes && x.size(1) == codes.size(1) * kGroup &&
                  scales.size(0) == codes.size(0) * kRows,
              "int8_linear: shapes");
}

}  // namespace kvchat_layout
