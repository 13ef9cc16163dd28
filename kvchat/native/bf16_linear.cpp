// The bf16 linear layer, registered for CPU as kvchat::bf16_linear (built by kernels.py) where the CPU
// has AVX-512 BF16; elsewhere kvchat runs oneDNN's packed kernel (engine/decode_step.py).
//
// A decode token's linears read every weight once, and nothing else: their pace is the machine's read
// bandwidth. torch's bf16 F.linear reads a one-row product's weights at 5-11 GB/s here, and oneDNN's
// on a packed weight at 6-17 GB/s; this kernel streams them at 20-28 GB/s (one thread, SmolLM2 and
// Qwen2.5-3B shapes), as fast as inductor's generated GEMV, and as fast as oneDNN's GEMM at 512 rows.
//
// The weight (written by models/weight_layout.py) is in tiles of 16 rows, each a run of 64-byte
// vdpbf16ps operands: operand p holds inputs 2p and 2p + 1 of the tile's 16 rows (row r's pair in
// bytes 4r..4r+3). Each operand is multiplied by the input's pair broadcast: the products are exact,
// summed in fp32 (four chains an input row), the bias added, and the sum rounded to bf16 once, as
// oneDNN's kernel does. With more input rows each tile is read once per 4 rows, from cache.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

constexpr int64_t kRows = 16;    // output rows a tile
constexpr int64_t kPair = 32;    // bf16 values an operand: 16 rows by 2 inputs
constexpr int kChains = 4;       // operands a step, each with its own sum
constexpr int64_t kBatch = 4;    // input rows a pass over a tile
constexpr int64_t kAhead = 8;    // operands ahead to prefetch (past the end: prefetches never fault)

inline __m512bh broadcast_pair(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

inline __m512bh operand(const uint16_t* w) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(w)); }

// B input rows (x, stride `inputs`) against one tile of `pairs` operands: out[b * out_stride + r], bf16.
template <int B>
void tile(const uint16_t* w, int64_t pairs, const uint16_t* x, int64_t inputs, const float* bias,
          uint16_t* out, int64_t out_stride) {
  __m512 acc[B][kChains];
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < kChains; ++c) acc[b][c] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + kChains <= pairs; p += kChains) {
    __m512bh v[kChains];
    for (int c = 0; c < kChains; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (p + c + kAhead) * kPair), _MM_HINT_T0);
      v[c] = operand(w + (p + c) * kPair);
    }
    for (int b = 0; b < B; ++b)
      for (int c = 0; c < kChains; ++c)
        acc[b][c] = _mm512_dpbf16_ps(acc[b][c], v[c], broadcast_pair(x + b * inputs + 2 * (p + c)));
  }
  for (; p < pairs; ++p) {
    const __m512bh v = operand(w + p * kPair);
    for (int b = 0; b < B; ++b) acc[b][0] = _mm512_dpbf16_ps(acc[b][0], v, broadcast_pair(x + b * inputs + 2 * p));
  }
  const __m512 offset = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int b = 0; b < B; ++b) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[b][0], acc[b][1]), _mm512_add_ps(acc[b][2], acc[b][3]));
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(sum, offset));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * out_stride), reinterpret_cast<__m256i>(rounded));
  }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && tiles.dim() == 3 && tiles.size(2) == kPair,
              "bf16_linear: x (M, K), tiles (N/16, K/2, 32)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && tiles.scalar_type() == at::kBFloat16,
              "bf16_linear: bf16 input and weights");
  TORCH_CHECK(tiles.is_contiguous(), "bf16_linear: contiguous weights");
  const int64_t rows = x.size(0), inputs = x.size(1), pairs = tiles.size(1), width = tiles.size(0) * kRows;
  TORCH_CHECK(inputs == 2 * pairs, "bf16_linear: x has ", inputs, " inputs, the weights ", 2 * pairs);
  at::Tensor offsets;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == width, "bf16_linear: bias (N,)");
    offsets = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty({rows, width}, x.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  const uint16_t* in = reinterpret_cast<const uint16_t*>(input.data_ptr<at::BFloat16>());
  const float* b = bias.has_value() ? offsets.data_ptr<float>() : nullptr;
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* wt = w + t * pairs * kPair;
      const float* bt = b ? b + t * kRows : nullptr;
      for (int64_t r = 0; r < rows; r += kBatch) {
        const uint16_t* xr = in + r * inputs;
        uint16_t* to = o + r * width + t * kRows;
        switch (std::min(kBatch, rows - r)) {
          case 4: tile<4>(wt, pairs, xr, inputs, bt, to, width); break;
          case 3: tile<3>(wt, pairs, xr, inputs, bt, to, width); break;
          case 2: tile<2>(wt, pairs, xr, inputs, bt, to, width); break;
          default: tile<1>(wt, pairs, xr, inputs, bt, to, width); break;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) { m.def("bf16_linear(Tensor x, Tensor tiles, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvchat, CPU, m) { m.impl("bf16_linear", &bf16_linear); }

#endif
