// The bf16 and fp32 tiled weight layouts every tier's linear kernels read (kvchat/linears/bf16_linears.py
// writes them), and the bias and residual beside them, checked at each op's boundary here, once for
// every tier.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace kvchat_layout {

constexpr int64_t kTileRows = 16;  // output rows a tile

// x (M, K) fp32, tiles (N/16, K, 16) fp32.
inline void check_fp32_tiles(const at::Tensor& x, const at::Tensor& tiles) {
  TORCH_CHECK(x.dim() == 2 && tiles.dim() == 3 && tiles.size(2) == kTileRows,
              "fp32_linear: x (M, K), tiles (N/16, K, 16)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && tiles.scalar_type() == at::kFloat, "fp32_linear: fp32 input and weights");
  TORCH_CHECK(tiles.is_contiguous(), "fp32_linear: contiguous weights");
  TORCH_CHECK(x.size(1) == tiles.size(1), "fp32_linear: x has ", x.size(1), " inputs, the weights ", tiles.size(1));
}

// x (M, K) bf16, tiles (N/16, K/2, 32) bf16: each tile row a pair of inputs for 16 outputs.
inline void check_bf16_tiles(const at::Tensor& x, const at::Tensor& tiles) {
  TORCH_CHECK(x.dim() == 2 && tiles.dim() == 3 && tiles.size(2) == 2 * kTileRows,
              "bf16_linear: x (M, K), tiles (N/16, K/2, 32)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && tiles.scalar_type() == at::kBFloat16,
              "bf16_linear: bf16 input and weights");
  TORCH_CHECK(tiles.is_contiguous(), "bf16_linear: contiguous weights");
  TORCH_CHECK(x.size(1) == 2 * tiles.size(1), "bf16_linear: x has ", x.size(1), " inputs, the weights ",
              2 * tiles.size(1));
}

// The bias (N,) as fp32 and the residual (M, N) in the input's dtype, contiguous; undefined where absent.
struct Extras {
  at::Tensor offsets, added;
};

inline Extras extras(const char* name, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& residual, int64_t rows, int64_t width, at::ScalarType dtype) {
  Extras out;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == width, name, ": bias (N,)");
    out.offsets = bias->to(at::kFloat).contiguous();
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == at::IntArrayRef({rows, width}) && residual->scalar_type() == dtype, name,
                ": residual (M, N) of the input's dtype");
    out.added = residual->contiguous();
  }
  return out;
}

}  // namespace kvchat_layout
