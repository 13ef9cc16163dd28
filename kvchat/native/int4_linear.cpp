// Weight-only int4 linear layers, registered for CPU as kvchat::int4_linear (built by kernels.py) where
// the CPU has AVX-512 VNNI; elsewhere kvchat runs torch's own int4 kernel.
//
// Weight layout (written by quantize.py): the rows in tiles of 16, each tile's inputs in groups of 32.
// A tile-group is 256 bytes of 4-bit codes, then in a second tensor 16 bf16 scales and 16 bf16 zeros;
// the weight is (code - 8) * scale + zero. The codes are four 64-byte blocks: block i's byte 4r + j
// holds row r's code for input 4i + j in its low nibble and for input 16 + 4i + j in its high one. So
// each half of a block is one vpdpbusd operand, 16 rows by 4 inputs, against 4 inputs broadcast.
//
// The input is quantized per group of 32 to int8 with one scale (its largest magnitude / 127), as
// llama.cpp does for its 4-bit dot products, and what that rounding leaves to int8 again at 1/256 of
// the scale: two dot products a group, x to within 1/65,000 of the group's largest value, where one
// int8 rounding alone took SmolLM2's KL against its own weights from 0.004 to 0.034. Each group's exact
// sum carries the zeros:
//   out[r] = sum over groups of  scale * dx / 256 * sum(code * (256 xq + xr))  +  (zero - 8 scale) * sum(x).
// A decode token's linears then read each weight byte once, at the machine's read bandwidth, where
// torch's int4 kernel widens every weight to fp32 and runs at about half that; with more rows of input
// (speculation's drafts, prefill) each tile is read once per 4 rows, from cache. The output is fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRows = 16;                      // output rows a tile
constexpr int64_t kGroup = 32;                     // inputs per scale and zero
constexpr int64_t kCodeBytes = kRows * kGroup / 2;  // a tile-group's codes
constexpr int64_t kBatch = 4;                      // input rows a pass over a tile

// The input's rows quantized per group: int8 codes and their residues' codes (M, K), and a scale and
// the exact sum per group. x = scale * (code + residue / 256), to within scale / 512.
struct QuantizedInput {
  at::Tensor codes, residues, scales, sums;
};

QuantizedInput quantize_input(const at::Tensor& x) {
  const int64_t rows = x.size(0), inputs = x.size(1), groups = inputs / kGroup;
  const at::Tensor values = x.to(at::kFloat).contiguous();
  const auto bytes = x.options().dtype(at::kChar), floats = x.options().dtype(at::kFloat);
  QuantizedInput q{at::empty({rows, inputs}, bytes), at::empty({rows, inputs}, bytes),
                   at::empty({rows, groups}, floats), at::empty({rows, groups}, floats)};
  const float* in = values.data_ptr<float>();
  int8_t* codes = q.codes.data_ptr<int8_t>();
  int8_t* residues = q.residues.data_ptr<int8_t>();
  float* scales = q.scales.data_ptr<float>();
  float* sums = q.sums.data_ptr<float>();
  for (int64_t g = 0; g < rows * groups; ++g) {
    const float* v = in + g * kGroup;
    float largest = 0.0f, sum = 0.0f;
    for (int64_t k = 0; k < kGroup; ++k) {
      largest = std::max(largest, std::fabs(v[k]));
      sum += v[k];
    }
    const float scale = largest / 127.0f;
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t k = 0; k < kGroup; ++k) {
      const float code = std::nearbyint(v[k] * inverse);
      const float residue = std::nearbyint((v[k] * inverse - code) * 256.0f);  // within +-128
      codes[g * kGroup + k] = static_cast<int8_t>(code);
      residues[g * kGroup + k] = static_cast<int8_t>(std::min(residue, 127.0f));
    }
    scales[g] = scale;
    sums[g] = sum;
  }
  return q;
}

inline __m512 widen_bf16(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// B input rows against one tile of 16 output rows: out[b * out_stride + r].
template <int B>
void tile(const uint8_t* codes, const uint16_t* params, int64_t groups, const QuantizedInput& x,
          int64_t first_row, float* out, int64_t out_stride) {
  const int64_t inputs = x.codes.size(1);
  const int8_t* xq = x.codes.data_ptr<int8_t>() + first_row * inputs;
  const int8_t* xr = x.residues.data_ptr<int8_t>() + first_row * inputs;
  const float* dx = x.scales.data_ptr<float>() + first_row * groups;
  const float* xs = x.sums.data_ptr<float>() + first_row * groups;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512 minus_eight = _mm512_set1_ps(-8.0f);
  __m512 acc[B];
  for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * kCodeBytes;
    __m512i v[8];
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = _mm512_loadu_si512(c + 64 * i);
      v[i] = _mm512_and_si512(raw, low);
      v[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    const __m512 scale = widen_bf16(params + g * 2 * kRows);
    const __m512 offset = _mm512_fmadd_ps(minus_eight, scale, widen_bf16(params + g * 2 * kRows + kRows));
    for (int b = 0; b < B; ++b) {
      const int8_t* coarse = xq + b * inputs + g * kGroup;
      const int8_t* fine = xr + b * inputs + g * kGroup;
      __m512i dot = _mm512_setzero_si512(), rest = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        int32_t four, four_fine;
        std::memcpy(&four, coarse + 4 * j, sizeof four);
        std::memcpy(&four_fine, fine + 4 * j, sizeof four_fine);
        dot = _mm512_dpbusd_epi32(dot, v[j], _mm512_set1_epi32(four));
        rest = _mm512_dpbusd_epi32(rest, v[j], _mm512_set1_epi32(four_fine));
      }
      // |256 dot + rest| <= 256 * 32 * 15 * 127 + 32 * 15 * 128 < 2^24: exact in int32 and in fp32
      dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), rest);
      const __m512 step = _mm512_mul_ps(scale, _mm512_set1_ps(dx[b * groups + g] / 256.0f));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), step, acc[b]);
      acc[b] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs[b * groups + g]), acc[b]);
    }
  }
  for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + b * out_stride, acc[b]);
}

void check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && params.dim() == 4, "int4_linear: x (M, K), codes "
              "(N/16, K/32, 256), params (N/16, K/32, 2, 16)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && params.scalar_type() == at::kBFloat16,
              "int4_linear: uint8 codes and bf16 params");
  TORCH_CHECK(codes.is_contiguous() && params.is_contiguous(), "int4_linear: contiguous weights");
  const int64_t tiles = codes.size(0), groups = codes.size(1);
  TORCH_CHECK(codes.size(2) == kCodeBytes && x.size(1) == groups * kGroup, "int4_linear: shapes");
  TORCH_CHECK(params.size(0) == tiles && params.size(1) == groups && params.size(2) == 2 &&
                  params.size(3) == kRows,
              "int4_linear: params shape");
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params) {
  check(x, codes, params);
  const int64_t rows = x.size(0), tiles = codes.size(0), groups = codes.size(1);
  const QuantizedInput q = quantize_input(x);
  at::Tensor out = at::empty({rows, tiles * kRows}, x.options().dtype(at::kFloat));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* p = reinterpret_cast<const uint16_t*>(params.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  const int64_t width = tiles * kRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tc = c + t * groups * kCodeBytes;
      const uint16_t* tp = p + t * groups * 2 * kRows;
      for (int64_t b = 0; b < rows; b += kBatch) {
        float* to = o + b * width + t * kRows;
        switch (std::min(kBatch, rows - b)) {
          case 4: tile<4>(tc, tp, groups, q, b, to, width); break;
          case 3: tile<3>(tc, tp, groups, q, b, to, width); break;
          case 2: tile<2>(tc, tp, groups, q, b, to, width); break;
          default: tile<1>(tc, tp, groups, q, b, to, width); break;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) { m.def("int4_linear(Tensor x, Tensor codes, Tensor params) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvchat, CPU, m) { m.impl("int4_linear", &int4_linear); }

#endif
