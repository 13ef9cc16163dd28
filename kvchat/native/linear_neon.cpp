// The neon tier's linear layers (Arm64), registered as kvchat::fp32_linear, bf16_linear, int8_linear
// and int4_linear on the tiles the other tiers read; the arithmetic is neon_linear.h's (torch-free, so
// a standalone program checks it under qemu-user: tests/native/neon_check.cpp). Each tile is taken by
// the input's rows 4 at a time, the tiles split between threads; a row's sums never depend on how many
// rows come with it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tiled_layout.h"

#include "quantized_layout.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <optional>

#include "neon_linear.h"

namespace {

using namespace kvchat_neon;

constexpr int64_t kBatch = 4;  // input rows a pass over a tile

// Each tile against the rows, kBatch at a time: tile(batch, t, first_row).
template <typename Tile>
void by_tiles(int64_t rows, int64_t tiles, Tile&& tile) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < rows; b += kBatch) {
        switch (std::min(kBatch, rows - b)) {
          case 4: tile(std::integral_constant<int, 4>{}, t, b); break;
          case 3: tile(std::integral_constant<int, 3>{}, t, b); break;
          case 2: tile(std::integral_constant<int, 2>{}, t, b); break;
          default: tile(std::integral_constant<int, 1>{}, t, b); break;
        }
      }
  });
}

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  kvchat_layout::check_fp32_tiles(x, tiles);
  const int64_t rows = x.size(0), inputs = x.size(1), width = tiles.size(0) * kRows;
  const auto [offsets, added] = kvchat_layout::extras("fp32_linear", bias, residual, rows, width, at::kFloat);
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* w = tiles.const_data_ptr<float>();
  const float* in = input.const_data_ptr<float>();
  const float* b = offsets.defined() ? offsets.const_data_ptr<float>() : nullptr;
  const float* res = added.defined() ? added.const_data_ptr<float>() : nullptr;
  float* o = out.mutable_data_ptr<float>();
  by_tiles(rows, tiles.size(0), [&](auto batch, int64_t t, int64_t r) {
    fp32_tile<decltype(batch)::value>(w + t * inputs * kRows, inputs, in + r * inputs, b ? b + t * kRows : nullptr,
                                      res ? res + r * width + t * kRows : nullptr, o + r * width + t * kRows, width);
  });
  return out;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  kvchat_layout::check_bf16_tiles(x, tiles);
  const int64_t rows = x.size(0), inputs = x.size(1), pairs = tiles.size(1), width = tiles.size(0) * kRows;
  const auto [offsets, added] = kvchat_layout::extras("bf16_linear", bias, residual, rows, width, at::kBFloat16);
  const at::Tensor input = x.to(at::kFloat).contiguous();  // exact
  at::Tensor out = at::empty({rows, width}, x.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(tiles.const_data_ptr<at::BFloat16>());
  const float* in = input.const_data_ptr<float>();
  const float* b = offsets.defined() ? offsets.const_data_ptr<float>() : nullptr;
  const uint16_t* res = added.defined() ? reinterpret_cast<const uint16_t*>(added.const_data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* o = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
  by_tiles(rows, tiles.size(0), [&](auto batch, int64_t t, int64_t r) {
    bf16_tile<decltype(batch)::value>(w + t * pairs * kPair, pairs, in + r * inputs, b ? b + t * kRows : nullptr,
                                      res ? res + r * width + t * kRows : nullptr, o + r * width + t * kRows, width);
  });
  return out;
}

// x's rows quantized (neon_linear.h's quantize_rows), and the Rows of row `first` on.
struct Quantized {
  at::Tensor values, scales, sums, value_sums;

  explicit Quantized(const at::Tensor& x) {
    const int64_t rows = x.size(0), groups = x.size(1) / kGroup;
    const at::Tensor in = x.to(at::kFloat).contiguous();
    values = at::empty({rows, x.size(1)}, x.options().dtype(at::kShort));
    scales = at::empty({rows, groups}, x.options().dtype(at::kFloat));
    sums = at::empty({rows, groups}, x.options().dtype(at::kFloat));
    value_sums = at::empty({rows, groups}, x.options().dtype(at::kInt));
    quantize_rows(in.const_data_ptr<float>(), rows * groups, values.mutable_data_ptr<int16_t>(),
                  scales.mutable_data_ptr<float>(), sums.mutable_data_ptr<float>(), value_sums.mutable_data_ptr<int32_t>());
  }

  Rows from(int64_t first) const {
    const int64_t groups = scales.size(1);
    return {values.const_data_ptr<int16_t>() + first * groups * kGroup, scales.const_data_ptr<float>() + first * groups,
            sums.const_data_ptr<float>() + first * groups, value_sums.const_data_ptr<int32_t>() + first * groups, groups};
  }
};

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  kvchat_layout::check_int8(x, codes, scales);
  const int64_t tiles = codes.size(0), groups = codes.size(1), rows = x.size(0), width = tiles * kRows;
  const Quantized q(x);
  at::Tensor out = at::empty({rows, width}, x.options().dtype(at::kFloat));
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::BFloat16>());
  float* o = out.mutable_data_ptr<float>();
  by_tiles(rows, tiles, [&](auto batch, int64_t t, int64_t r) {
    int8_tile<decltype(batch)::value>(c + t * groups * kByteCodes, s + t * kRows, q.from(r), o + r * width + t * kRows,
                                      width);
  });
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params) {
  kvchat_layout::check_int4(x, codes, params);
  const int64_t tiles = codes.size(0), groups = codes.size(1), rows = x.size(0), width = tiles * kRows;
  const bool nested = params.dim() == 2;
  const int64_t spans = nested ? groups : params.size(1);
  const int64_t tile_bytes = nested ? kNestedHead + groups * kNestedGroup : spans * 2 * kRows * 2;
  const Quantized q(x);
  at::Tensor out = at::empty({rows, width}, x.options().dtype(at::kFloat));
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const uint8_t* p = static_cast<const uint8_t*>(params.const_data_ptr());
  float* o = out.mutable_data_ptr<float>();
  by_tiles(rows, tiles, [&](auto batch, int64_t t, int64_t r) {
    int4_tile<decltype(batch)::value>(c + t * groups * kCodeBytes, p + t * tile_bytes, nested, spans, q.from(r),
                                      o + r * width + t * kRows, width);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("fp32_linear(Tensor x, Tensor tiles, Tensor? bias, Tensor? residual=None) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor tiles, Tensor? bias, Tensor? residual=None) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor params) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) {
  m.impl("fp32_linear", &fp32_linear);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}

#endif
