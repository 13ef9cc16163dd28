// The fp32 linear layer, registered for CPU as kvchat::fp32_linear (built by kernels.py) where the CPU
// has AVX-512; elsewhere fp32 layers run torch's own product (MKL's).
//
// Each output is summed in one order whatever the number of rows (a chain of fused multiply-adds over
// each 64 inputs, the parts added in turn): a row's outputs are the same bits alone (decode) and among
// others (a prefill chunk, speculation's drafts). MKL's one-row and many-row products sum in different
// orders, so a token's logits depended on how many tokens were computed with it.
//
// The weight (written by linears/weight_layout.py) is in tiles of 16 output rows, each a run of 64-byte
// operands: operand k holds input k's weight for the tile's 16 rows. Each operand is multiplied by the
// input broadcast and added to the tile's 16 partial sums; the bias is added at the end, then, where a residual is
// given, the output to it: `residual + linear(x)` in fp32. One input row streams 8 tiles at once, every
// line prefetched into L2 16 lines ahead, at the machine's read bandwidth; several rows go through the
// tiles 4 by 4, each operand loaded once for 4 rows, so a prefill is bound by the multiply-adds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tiled_layout.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kRows = 16;      // output rows a tile, one operand of 16 floats
constexpr int64_t kSpan = 8;       // tiles one input row streams at once
constexpr int64_t kRowAhead = 16;  // operands ahead one streaming row prefetches into L2
constexpr int64_t kRowsAhead = 8;  // and several rows, into L1
constexpr int kBlockRows = 4;      // input rows a pass over a few tiles
constexpr int kBlockTiles = 4;     // tiles a pass of several rows
constexpr int64_t kRowGroup = 64;  // input rows that take the tiles in turn
// inputs a partial sum chains over before it joins the total: the error of one chain over all of a
// 1,536-input row, ~2x MKL's, took SmolLM2's logits ~1.3e-4 from transformers' where MKL's were 6e-5
constexpr int64_t kPart = 64;

// A tile's 16 sums plus the bias, then plus the residual where given.
inline void finish(__m512 sum, const float* bias, const float* residual, float* out) {
  __m512 value = _mm512_add_ps(sum, bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps());
  if (residual) value = _mm512_add_ps(_mm512_loadu_ps(residual), value);
  _mm512_storeu_ps(out, value);
}

// B input rows (x, `inputs` apart) against T consecutive tiles of `inputs` operands: out[b * out_stride
// + r] for r < 16 T. Every (row, tile) sum is the same two-level chain whatever B and T: a chain of
// multiply-adds over each kPart inputs in order, each part's sum then added to the total in order.
template <int B, int T>
void block(const float* w, int64_t inputs, const float* x, const float* bias, const float* residual, float* out,
           int64_t out_stride, int64_t ahead) {
  alignas(64) float totals[B][T][kRows] = {};
  for (int64_t first = 0; first < inputs; first += kPart) {
    const int64_t end = std::min(inputs, first + kPart);
    __m512 acc[B][T];
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) acc[b][t] = _mm512_setzero_ps();
    for (int64_t k = first; k < end; ++k) {
      __m512 v[T];
      for (int t = 0; t < T; ++t) {
        const float* line = w + (t * inputs + k) * kRows;
        _mm_prefetch(reinterpret_cast<const char*>(line + ahead * kRows), B == 1 ? _MM_HINT_T1 : _MM_HINT_T0);
        v[t] = _mm512_loadu_ps(line);
      }
      for (int b = 0; b < B; ++b) {
        const __m512 input = _mm512_set1_ps(x[b * inputs + k]);
        for (int t = 0; t < T; ++t) acc[b][t] = _mm512_fmadd_ps(v[t], input, acc[b][t]);
      }
    }
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t) _mm512_store_ps(totals[b][t], _mm512_add_ps(_mm512_load_ps(totals[b][t]), acc[b][t]));
  }
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      finish(_mm512_load_ps(totals[b][t]), bias ? bias + t * kRows : nullptr,
             residual ? residual + b * out_stride + t * kRows : nullptr, out + b * out_stride + t * kRows);
}

// B rows against tiles begin..end-1, T at a time, then the rest one at a time.
template <int B, int T>
void rows_by(const float* w, int64_t inputs, const float* x, const float* bias, const float* residual, float* out,
             int64_t width, int64_t begin, int64_t end, int64_t ahead) {
  int64_t t = begin;
  const auto at = [&](int64_t tile) { return w + tile * inputs * kRows; };
  const auto bias_at = [&](int64_t tile) { return bias ? bias + tile * kRows : nullptr; };
  const auto residual_at = [&](int64_t tile) { return residual ? residual + tile * kRows : nullptr; };
  for (; t + T <= end; t += T)
    block<B, T>(at(t), inputs, x, bias_at(t), residual_at(t), out + t * kRows, width, ahead);
  for (; t < end; ++t) block<B, 1>(at(t), inputs, x, bias_at(t), residual_at(t), out + t * kRows, width, ahead);
}

// Every input row against tiles begin..end-1: one row streams them; more go kRowGroup rows at a time
// (kept in L2), each group through the tiles kBlockTiles at a time, 4 rows by 4 tiles a pass (the tiles
// read from cache after the group's first 4 rows).
void all_rows(int64_t rows, const float* w, int64_t inputs, const float* x, const float* bias,
              const float* residual, float* out, int64_t width, int64_t begin, int64_t end) {
  if (rows == 1) return rows_by<1, kSpan>(w, inputs, x, bias, residual, out, width, begin, end, kRowAhead);
  for (int64_t group = 0; group < rows; group += kRowGroup)
  for (int64_t t = begin; t < end; t += kBlockTiles) {
    const int64_t stop = std::min(t + kBlockTiles, end);
    for (int64_t r = group; r < std::min(rows, group + kRowGroup); r += kBlockRows) {
      const float* xr = x + r * inputs;
      const float* rr = residual ? residual + r * width : nullptr;
      float* to = out + r * width;
      switch (std::min<int64_t>(kBlockRows, rows - r)) {
        case 4: rows_by<4, kBlockTiles>(w, inputs, xr, bias, rr, to, width, t, stop, kRowsAhead); break;
        case 3: rows_by<3, kBlockTiles>(w, inputs, xr, bias, rr, to, width, t, stop, kRowsAhead); break;
        case 2: rows_by<2, kBlockTiles>(w, inputs, xr, bias, rr, to, width, t, stop, kRowsAhead); break;
        default: rows_by<1, kBlockTiles>(w, inputs, xr, bias, rr, to, width, t, stop, kRowsAhead); break;
      }
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
  const int64_t grain = rows == 1 ? kSpan : kBlockTiles;
  at::parallel_for(0, tiles.size(0), grain,
                   [&](int64_t begin, int64_t end) { all_rows(rows, w, inputs, in, b, res, o, width, begin, end); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("fp32_linear(Tensor x, Tensor tiles, Tensor? bias, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) { m.impl("fp32_linear", &fp32_linear); }

#endif
