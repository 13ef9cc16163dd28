// The bf16 linear layer for the avx2 tier (kernels.py builds it with -mavx2 -mfma), registered as
// kvchat::bf16_linear, on bf16_linear.cpp's tiles (linears/weight_layout.py: tiles (N/16, K/2, 32),
// operand p holding inputs 2p and 2p + 1 of the tile's 16 rows, row r's pair in bytes 4r..4r+3).
//
// Without vdpbf16ps, each operand's pairs are split into fp32 (a bf16 value is fp32's upper half: the
// odd input masked in place, the even one shifted up) and multiplied by the input's pair in two fused
// multiply-adds, odd first, as vdpbf16ps adds them: a product of two bf16 values is exact in fp32, so
// each step rounds once, as there. The sum, plus the bias, is rounded to bf16 once (to nearest, ties to
// even); given a residual, the rounded output is added to it and rounded again.
//
// Every (row, tile) sum is one chain over the operands in order, whatever the number of rows: a row's
// outputs are the same bits alone and among others. One input row streams 6 tiles at once (12 sums),
// every line prefetched 16 lines ahead into L2: SmolLM2 decoded 1.09x faster than with 4 tiles (Zen 4
// forced to avx2, bench_tiers.py), 5 tiles within noise of 6. Several rows take each tile 4 at a time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tiled_layout.h"
#include "unrolled.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kRows = 16;      // output rows a tile
constexpr int64_t kPair = 32;      // bf16 values an operand: 16 rows by 2 inputs
constexpr int64_t kSpan = 6;       // tiles one input row streams at once
constexpr int64_t kRowAhead = 16;  // operands ahead one streaming row prefetches into L2
constexpr int64_t kRowsAhead = 8;  // and several rows, into L1
constexpr int kBlockRows = 4;      // input rows a pass over a tile

// 8 floats rounded to bf16, to nearest, ties to even (a NaN stays a NaN), as vcvtneps2bf16.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
  const __m256i high = _mm256_srli_epi32(rounded, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

inline __m256 widen(const uint16_t* p) {  // 8 bf16 values as fp32
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

// A tile's 16 sums plus their bias, rounded to bf16, then plus the residual and rounded again.
__attribute__((always_inline)) inline void finish(__m256 low, __m256 high, const float* bias,
                                                  const uint16_t* residual, uint16_t* out) {
  for (int h = 0; h < 2; ++h) {
    const __m256 offset = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
    __m128i rounded = to_bf16(_mm256_add_ps(h ? high : low, offset));
    if (residual) {
      const __m256 value = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(rounded), 16));
      rounded = to_bf16(_mm256_add_ps(value, widen(residual + 8 * h)));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * h), rounded);
  }
}

// B input rows (x as fp32, `inputs` apart) against T consecutive tiles of `pairs` operands:
// out[b * out_stride + r] for r < 16 T.
template <int B, int T>
void block(const uint16_t* w, int64_t pairs, const float* x, const float* bias, const uint16_t* residual,
           uint16_t* out, int64_t out_stride, int64_t ahead) {
  using kvchat_unrolled::unrolled;
  const int64_t inputs = 2 * pairs;
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[B * T * 2];  // row b, tile t, half h at (b T + t) 2 + h
  unrolled<B * T * 2>([&](auto i) __attribute__((always_inline)) { acc[i] = _mm256_setzero_ps(); });
  for (int64_t p = 0; p < pairs; ++p) {
    __m256 x_even[B], x_odd[B];
    unrolled<B>([&](auto b) __attribute__((always_inline)) {
      x_even[b] = _mm256_broadcast_ss(x + b * inputs + 2 * p);
      x_odd[b] = _mm256_broadcast_ss(x + b * inputs + 2 * p + 1);
    });
    // each line loaded, split and summed before the next: the sums, the inputs and one line's halves
    // fit the 16 ymm registers
    unrolled<T>([&](auto t) __attribute__((always_inline)) {
      const uint16_t* line = w + (t * pairs + p) * kPair;
      _mm_prefetch(reinterpret_cast<const char*>(line + ahead * kPair), B == 1 ? _MM_HINT_T1 : _MM_HINT_T0);
      unrolled<2>([&](auto h) __attribute__((always_inline)) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 16 * h));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high_half));
        unrolled<B>([&](auto b) __attribute__((always_inline)) {
          __m256& sum = acc[(b * T + t) * 2 + h];
          sum = _mm256_fmadd_ps(even, x_even[b], _mm256_fmadd_ps(odd, x_odd[b], sum));
        });
      });
    });
  }
  unrolled<B>([&](auto b) __attribute__((always_inline)) {
    unrolled<T>([&](auto t) __attribute__((always_inline)) {
      finish(acc[(b * T + t) * 2], acc[(b * T + t) * 2 + 1], bias ? bias + t * kRows : nullptr,
             residual ? residual + b * out_stride + t * kRows : nullptr, out + b * out_stride + t * kRows);
    });
  });
}

// Every input row against tiles begin..end-1: one row streams them kSpan at a time; more take each
// tile 4 rows at a time.
void all_rows(int64_t rows, const uint16_t* w, int64_t pairs, const float* x, const float* bias,
              const uint16_t* residual, uint16_t* out, int64_t width, int64_t begin, int64_t end) {
  const auto at = [&](int64_t tile) { return w + tile * pairs * kPair; };
  const auto bias_at = [&](int64_t tile) { return bias ? bias + tile * kRows : nullptr; };
  if (rows == 1) {
    const auto residual_at = [&](int64_t tile) { return residual ? residual + tile * kRows : nullptr; };
    int64_t t = begin;
    for (; t + kSpan <= end; t += kSpan)
      block<1, kSpan>(at(t), pairs, x, bias_at(t), residual_at(t), out + t * kRows, width, kRowAhead);
    for (; t < end; ++t) block<1, 1>(at(t), pairs, x, bias_at(t), residual_at(t), out + t * kRows, width, kRowAhead);
    return;
  }
  for (int64_t t = begin; t < end; ++t)
    for (int64_t r = 0; r < rows; r += kBlockRows) {
      const float* xr = x + r * 2 * pairs;
      const uint16_t* rr = residual ? residual + r * width + t * kRows : nullptr;
      uint16_t* to = out + r * width + t * kRows;
      switch (std::min<int64_t>(kBlockRows, rows - r)) {
        case 4: block<4, 1>(at(t), pairs, xr, bias_at(t), rr, to, width, kRowsAhead); break;
        case 3: block<3, 1>(at(t), pairs, xr, bias_at(t), rr, to, width, kRowsAhead); break;
        case 2: block<2, 1>(at(t), pairs, xr, bias_at(t), rr, to, width, kRowsAhead); break;
        default: block<1, 1>(at(t), pairs, xr, bias_at(t), rr, to, width, kRowsAhead); break;
      }
    }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  kvchat_layout::check_bf16_tiles(x, tiles);
  const int64_t rows = x.size(0), inputs = x.size(1), pairs = tiles.size(1), width = tiles.size(0) * kRows;
  const auto [offsets, added] = kvchat_layout::extras("bf16_linear", bias, residual, rows, width, at::kBFloat16);
  const at::Tensor input = x.to(at::kFloat).contiguous();  // exact: bf16 is fp32's upper half
  at::Tensor out = at::empty({rows, width}, x.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(tiles.const_data_ptr<at::BFloat16>());
  const float* in = input.const_data_ptr<float>();
  const float* b = offsets.defined() ? offsets.const_data_ptr<float>() : nullptr;
  const uint16_t* res = added.defined() ? reinterpret_cast<const uint16_t*>(added.const_data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* o = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles.size(0), rows == 1 ? kSpan : 1,
                   [&](int64_t begin, int64_t end) { all_rows(rows, w, pairs, in, b, res, o, width, begin, end); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("bf16_linear(Tensor x, Tensor tiles, Tensor? bias, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) { m.impl("bf16_linear", &bf16_linear); }

#endif
