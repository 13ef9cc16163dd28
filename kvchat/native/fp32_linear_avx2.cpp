// The fp32 linear layer for the avx2 tier (kernels.py builds it with -mavx2 -mfma), registered as
// kvchat::fp32_linear: fp32_linear.cpp's arithmetic on 8-float registers, on the same tiles
// (linears/weight_layout.py: tiles (N/16, K, 16), operand k holding input k's weight for the tile's 16
// rows).
//
// Each output is the same chain as fp32_linear.cpp's: fused multiply-adds over each 64 inputs in
// order, each part's sum then added to the total in order, whatever the number of rows; so a row's
// outputs are the same bits alone (decode) and among others, and the same bits as the avx512 tier's.
// One input row streams 4 tiles at once (8 sums: AVX2 has 16 registers), every line prefetched 16
// lines ahead into L2; several rows take each tile 4 at a time, each operand loaded once for 4 rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tiled_layout.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kRows = 16;      // output rows a tile: two registers of 8 floats
constexpr int64_t kSpan = 4;       // tiles one input row streams at once
constexpr int64_t kRowAhead = 16;  // operands ahead one streaming row prefetches into L2
constexpr int64_t kRowsAhead = 8;  // and several rows, into L1
constexpr int kBlockRows = 4;      // input rows a pass over a tile
constexpr int64_t kPart = 64;      // inputs a partial sum chains over (fp32_linear.cpp's)

// A tile's 16 sums (two halves) plus the bias, then plus the residual where given.
inline void finish(const __m256 (&sum)[2], const float* bias, const float* residual, float* out) {
  for (int h = 0; h < 2; ++h) {
    __m256 value = _mm256_add_ps(sum[h], bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps());
    if (residual) value = _mm256_add_ps(_mm256_loadu_ps(residual + 8 * h), value);
    _mm256_storeu_ps(out + 8 * h, value);
  }
}

// B input rows (x, `inputs` apart) against T consecutive tiles: out[b * out_stride + r] for r < 16 T,
// each (row, tile) sum the same two-level chain whatever B and T.
template <int B, int T>
void block(const float* w, int64_t inputs, const float* x, const float* bias, const float* residual, float* out,
           int64_t out_stride, int64_t ahead) {
  alignas(32) float totals[B][T][kRows] = {};
  for (int64_t first = 0; first < inputs; first += kPart) {
    const int64_t end = std::min(inputs, first + kPart);
    __m256 acc[B][T][2];
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) acc[b][t][0] = acc[b][t][1] = _mm256_setzero_ps();
    for (int64_t k = first; k < end; ++k) {
      __m256 v[T][2];
      for (int t = 0; t < T; ++t) {
        const float* line = w + (t * inputs + k) * kRows;
        _mm_prefetch(reinterpret_cast<const char*>(line + ahead * kRows), B == 1 ? _MM_HINT_T1 : _MM_HINT_T0);
        v[t][0] = _mm256_loadu_ps(line);
        v[t][1] = _mm256_loadu_ps(line + 8);
      }
      for (int b = 0; b < B; ++b) {
        const __m256 input = _mm256_broadcast_ss(x + b * inputs + k);
        for (int t = 0; t < T; ++t)
          for (int h = 0; h < 2; ++h) acc[b][t][h] = _mm256_fmadd_ps(v[t][h], input, acc[b][t][h]);
      }
    }
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < 2; ++h)
          _mm256_store_ps(totals[b][t] + 8 * h, _mm256_add_ps(_mm256_load_ps(totals[b][t] + 8 * h), acc[b][t][h]));
  }
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const __m256 sum[2] = {_mm256_load_ps(totals[b][t]), _mm256_load_ps(totals[b][t] + 8)};
      finish(sum, bias ? bias + t * kRows : nullptr, residual ? residual + b * out_stride + t * kRows : nullptr,
             out + b * out_stride + t * kRows);
    }
}

// Every input row against tiles begin..end-1: one row streams them kSpan at a time; more take each
// tile 4 rows at a time.
void all_rows(int64_t rows, const float* w, int64_t inputs, const float* x, const float* bias,
              const float* residual, float* out, int64_t width, int64_t begin, int64_t end) {
  const auto at = [&](int64_t tile) { return w + tile * inputs * kRows; };
  const auto bias_at = [&](int64_t tile) { return bias ? bias + tile * kRows : nullptr; };
  if (rows == 1) {
    int64_t t = begin;
    const auto residual_at = [&](int64_t tile) { return residual ? residual + tile * kRows : nullptr; };
    for (; t + kSpan <= end; t += kSpan)
      block<1, kSpan>(at(t), inputs, x, bias_at(t), residual_at(t), out + t * kRows, width, kRowAhead);
    for (; t < end; ++t) block<1, 1>(at(t), inputs, x, bias_at(t), residual_at(t), out + t * kRows, width, kRowAhead);
    return;
  }
  for (int64_t t = begin; t < end; ++t)
    for (int64_t r = 0; r < rows; r += kBlockRows) {
      const float* xr = x + r * inputs;
      const float* rr = residual ? residual + r * width + t * kRows : nullptr;
      float* to = out + r * width + t * kRows;
      switch (std::min<int64_t>(kBlockRows, rows - r)) {
        case 4: block<4, 1>(at(t), inputs, xr, bias_at(t), rr, to, width, kRowsAhead); break;
        case 3: block<3, 1>(at(t), inputs, xr, bias_at(t), rr, to, width, kRowsAhead); break;
        case 2: block<2, 1>(at(t), inputs, xr, bias_at(t), rr, to, width, kRowsAhead); break;
        default: block<1, 1>(at(t), inputs, xr, bias_at(t), rr, to, width, kRowsAhead); break;
      }
    }
}

// x (M, K) fp32, tiles (N/16, K, 16) fp32, bias (N,), residual (M, N): (M, N) fp32.
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
  at::parallel_for(0, tiles.size(0), rows == 1 ? kSpan : 1,
                   [&](int64_t begin, int64_t end) { all_rows(rows, w, inputs, in, b, res, o, width, begin, end); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("fp32_linear(Tensor x, Tensor tiles, Tensor? bias, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) { m.impl("fp32_linear", &fp32_linear); }

#endif
