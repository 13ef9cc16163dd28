// The int4 and int8 linear layers for the avx2 tier (kernels.py builds it with -mavx2 -mfma),
// registered as kvchat::int4_linear and kvchat::int8_linear, on quantized_linear.cpp's tiles and with
// its arithmetic: the input rounded per group of 32 to int8 codes (scale: the largest magnitude / 127)
// and what that leaves to int8 again at 1/256 of the scale, the weights' integer products summed
// exactly per group, then scaled in fp32 in the same order (see quantized_linear.cpp for the layouts).
//
// Without vpdpbusd, each input's two codes make one int16 (256 code + residue, within +-32,640) and each
// weight code is widened to int16: vpmaddwd multiplies them and adds pairs exactly in int32, so a
// group's integer sum is the one quantized_linear.cpp computes. Every row is computed alone, in one
// order whatever the number of rows: one row takes each tile in turn, its codes prefetched a few groups
// ahead; several rows take each tile 4 at a time, the codes read once for them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "quantized_layout.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRows = 16;                       // output rows a tile
constexpr int64_t kGroup = 32;                      // inputs per scale
constexpr int64_t kCodeBytes = kRows * kGroup / 2;  // an int4 tile-group's codes
constexpr int64_t kByteCodes = kRows * kGroup;      // an int8 tile-group's codes
constexpr int64_t kNestedHead = 2 * kRows * 2;      // a nested tile's bf16 row scales and lows
constexpr int64_t kNestedGroup = 2 * kRows;         // and each group's scale and low codes
constexpr int64_t kBatch = 4;                       // input rows a pass over a tile
constexpr int64_t kAheadBytes = 2048;               // how far ahead a tile's codes are prefetched

// The input's rows quantized per group: 256 code + residue as int16 (M, K); per group its scale, its
// exact sum, and the sum of its int16 values (int8's offset).
struct QuantizedInput {
  at::Tensor values, scales, sums, value_sums;
};

QuantizedInput quantize_input(const at::Tensor& x) {
  const int64_t rows = x.size(0), inputs = x.size(1), groups = inputs / kGroup;
  const at::Tensor in = x.to(at::kFloat).contiguous();
  QuantizedInput q{at::empty({rows, inputs}, x.options().dtype(at::kShort)),
                   at::empty({rows, groups}, x.options().dtype(at::kFloat)),
                   at::empty({rows, groups}, x.options().dtype(at::kFloat)),
                   at::empty({rows, groups}, x.options().dtype(at::kInt))};
  const float* v = in.const_data_ptr<float>();
  int16_t* values = q.values.mutable_data_ptr<int16_t>();
  float* scales = q.scales.mutable_data_ptr<float>();
  float* sums = q.sums.mutable_data_ptr<float>();
  int32_t* value_sums = q.value_sums.mutable_data_ptr<int32_t>();
  for (int64_t g = 0; g < rows * groups; ++g) {
    const float* group = v + g * kGroup;
    float largest = 0.0f, sum = 0.0f;
    for (int64_t i = 0; i < kGroup; ++i) {
      largest = std::max(largest, std::fabs(group[i]));
      sum += group[i];
    }
    const float scale = largest / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    int32_t total = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float scaled = group[i] * inverse, code = std::nearbyint(scaled);
      const float residue = std::min(std::nearbyint((scaled - code) * 256.0f), 127.0f);  // within +-128
      const int32_t value = 256 * static_cast<int32_t>(code) + static_cast<int32_t>(residue);
      values[g * kGroup + i] = static_cast<int16_t>(value);
      total += value;
    }
    scales[g] = scale, sums[g] = sum, value_sums[g] = total;
  }
  return q;
}

inline __m256i four_inputs(const int16_t* x) {  // 4 int16 values repeated over the register
  int64_t four;
  std::memcpy(&four, x, sizeof four);
  return _mm256_set1_epi64x(four);
}

inline __m256i widen_codes(const uint8_t* p) {  // 16 bytes as int16
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Four sums of rows 4q..4q+3 (two int32 each) as two registers of rows 0-7 and 8-15.
inline void combine(const __m256i (&acc)[4], __m256i (&out)[2]) {
  for (int h = 0; h < 2; ++h)
    out[h] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[2 * h], acc[2 * h + 1]), 0xD8);
}

// sum(code * (256 xq + xr)) over one int8 group for 16 rows: block j's byte 4r + i is row r's code
// for input 4j + i; |sum| <= 32 * 255 * 32,640 < 2^31.
inline void int8_group(const uint8_t* c, const int16_t* x, __m256i (&out)[2]) {
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int j = 0; j < 8; ++j) {
    const __m256i xs = four_inputs(x + 4 * j);
    for (int q = 0; q < 4; ++q) acc[q] = _mm256_add_epi32(acc[q], _mm256_madd_epi16(widen_codes(c + 64 * j + 16 * q), xs));
  }
  combine(acc, out);
}

// The same over one int4 group: block i's byte 4r + j holds row r's code for input 4i + j in its low
// nibble and for 16 + 4i + j in its high one.
inline void int4_group(const uint8_t* c, const int16_t* x, __m256i (&out)[2]) {
  const __m256i nibble = _mm256_set1_epi16(0x0F);
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int i = 0; i < 4; ++i) {
    const __m256i low = four_inputs(x + 4 * i), high = four_inputs(x + 16 + 4 * i);
    for (int q = 0; q < 4; ++q) {
      const __m256i raw = widen_codes(c + 64 * i + 16 * q);
      const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(raw, nibble), low),
                                           _mm256_madd_epi16(_mm256_srli_epi16(raw, 4), high));
      acc[q] = _mm256_add_epi32(acc[q], dot);
    }
  }
  combine(acc, out);
}

inline __m256 widen_bf16(const uint16_t* p) {  // 8 bf16 values as fp32
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

inline __m256 bytes_as_floats(const uint8_t* p, bool is_signed) {  // 8 bytes as fp32
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

// Where an int4 tile's params are: bf16 scales and zeros per span (of S groups), or nested ones.
struct Params {
  const uint8_t* p;
  bool nested;
  int64_t spans;  // a tile's

  int64_t tile_bytes() const { return nested ? kNestedHead + spans * kNestedGroup : spans * 2 * kRows * 2; }
};

// B input rows against one int4 tile: out[b * out_stride + r]. As quantized_linear.cpp's int4_tile: a
// span's dot products at their input scales summed in fp32, then times the span's scales, plus its
// offsets (zero - 8 scale) times the span's exact input sum; nested params summed over the row with
// their codes, then times the rows' scales and lows once.
template <int B>
void int4_tile(const uint8_t* codes, const uint8_t* params, const Params& kind, int64_t groups,
               const QuantizedInput& x, int64_t first_row, float* out, int64_t out_stride) {
  const int64_t inputs = groups * kGroup, S = groups / kind.spans;
  const int16_t* xv = x.values.const_data_ptr<int16_t>() + first_row * inputs;
  const float* scales = x.scales.const_data_ptr<float>() + first_row * groups;
  const float* sums = x.sums.const_data_ptr<float>() + first_row * groups;
  __m256 acc[B][2], low_acc[B][2];
  for (int b = 0; b < B; ++b) acc[b][0] = acc[b][1] = low_acc[b][0] = low_acc[b][1] = _mm256_setzero_ps();
  for (int64_t span = 0; span < kind.spans; ++span) {
    __m256 dots[B][2];
    float sum[B];
    for (int64_t s = 0; s < S; ++s) {
      const int64_t g = span * S + s;
      _mm_prefetch(reinterpret_cast<const char*>(codes + g * kCodeBytes + kAheadBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(codes + g * kCodeBytes + kAheadBytes + 128), _MM_HINT_T0);
      for (int b = 0; b < B; ++b) {
        __m256i dot[2];
        int4_group(codes + g * kCodeBytes, xv + b * inputs + g * kGroup, dot);
        const __m256 step = _mm256_set1_ps(scales[b * groups + g] / 256.0f);
        for (int h = 0; h < 2; ++h) {
          const __m256 d = _mm256_cvtepi32_ps(dot[h]);
          dots[b][h] = s == 0 ? _mm256_mul_ps(d, step) : _mm256_fmadd_ps(d, step, dots[b][h]);
        }
        sum[b] = s == 0 ? sums[b * groups + g] : sum[b] + sums[b * groups + g];
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, offset;
      if (kind.nested) {
        const uint8_t* group = params + kNestedHead + span * kNestedGroup;
        scale = bytes_as_floats(group + 8 * h, false), offset = bytes_as_floats(group + kRows + 8 * h, true);
      } else {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(params) + span * 2 * kRows;
        scale = widen_bf16(p + 8 * h);
        offset = _mm256_fmadd_ps(_mm256_set1_ps(-8.0f), scale, widen_bf16(p + kRows + 8 * h));
      }
      for (int b = 0; b < B; ++b) {
        acc[b][h] = _mm256_fmadd_ps(dots[b][h], scale, acc[b][h]);
        if (kind.nested) low_acc[b][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(sum[b]), low_acc[b][h]);
        else acc[b][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(sum[b]), acc[b][h]);
      }
    }
  }
  const uint16_t* head = reinterpret_cast<const uint16_t*>(params);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < 2; ++h) {
      __m256 value = acc[b][h];
      if (kind.nested)
        value = _mm256_fmadd_ps(low_acc[b][h], widen_bf16(head + kRows + 8 * h), _mm256_mul_ps(value, widen_bf16(head + 8 * h)));
      _mm256_storeu_ps(out + b * out_stride + 8 * h, value);
    }
}

// B input rows against one int8 tile: out[b * out_stride + r] = scale * sum over groups of
// dx / 256 * (sum(u * (256 xq + xr)) - 128 * sum(256 xq + xr)).
template <int B>
void int8_tile(const uint8_t* codes, const uint16_t* row_scales, int64_t groups, const QuantizedInput& x,
               int64_t first_row, float* out, int64_t out_stride) {
  const int64_t inputs = groups * kGroup;
  const int16_t* xv = x.values.const_data_ptr<int16_t>() + first_row * inputs;
  const float* scales = x.scales.const_data_ptr<float>() + first_row * groups;
  const int32_t* value_sums = x.value_sums.const_data_ptr<int32_t>() + first_row * groups;
  __m256 acc[B][2];
  for (int b = 0; b < B; ++b) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t line = 0; line < kByteCodes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(codes + g * kByteCodes + kAheadBytes + line), _MM_HINT_T0);
    for (int b = 0; b < B; ++b) {
      __m256i dot[2];
      int8_group(codes + g * kByteCodes, xv + b * inputs + g * kGroup, dot);
      const __m256i offset = _mm256_set1_epi32(128 * value_sums[b * groups + g]);
      const __m256 step = _mm256_set1_ps(scales[b * groups + g] / 256.0f);
      for (int h = 0; h < 2; ++h)
        acc[b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot[h], offset)), step, acc[b][h]);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(out + b * out_stride + 8 * h, _mm256_mul_ps(acc[b][h], widen_bf16(row_scales + 8 * h)));
}

// Each tile against the input's rows, 4 at a time, the tiles split between threads:
// tile(batch, t, q, first_row, out, width).
template <typename Tile>
at::Tensor by_tiles(const at::Tensor& x, int64_t tiles, Tile&& tile) {
  const int64_t rows = x.size(0), width = tiles * kRows;
  const QuantizedInput q = quantize_input(x);
  at::Tensor out = at::empty({rows, width}, x.options().dtype(at::kFloat));
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < rows; b += kBatch) {
        float* to = o + b * width + t * kRows;
        switch (std::min(kBatch, rows - b)) {
          case 4: tile(std::integral_constant<int, 4>{}, t, q, b, to, width); break;
          case 3: tile(std::integral_constant<int, 3>{}, t, q, b, to, width); break;
          case 2: tile(std::integral_constant<int, 2>{}, t, q, b, to, width); break;
          default: tile(std::integral_constant<int, 1>{}, t, q, b, to, width); break;
        }
      }
  });
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params) {
  kvchat_layout::check_int4(x, codes, params);
  const int64_t tiles = codes.size(0), groups = codes.size(1);
  const bool nested = params.dim() == 2;
  const int64_t spans = nested ? groups : params.size(1);
  const Params kind{static_cast<const uint8_t*>(params.const_data_ptr()), nested, spans};
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  return by_tiles(x, tiles, [&](auto batch, int64_t t, const QuantizedInput& q, int64_t b, float* to, int64_t width) {
    int4_tile<decltype(batch)::value>(c + t * groups * kCodeBytes, kind.p + t * kind.tile_bytes(), kind, groups, q, b,
                                      to, width);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  kvchat_layout::check_int8(x, codes, scales);
  const int64_t tiles = codes.size(0), groups = codes.size(1);
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::BFloat16>());
  return by_tiles(x, tiles, [&](auto batch, int64_t t, const QuantizedInput& q, int64_t b, float* to, int64_t width) {
    int8_tile<decltype(batch)::value>(c + t * groups * kByteCodes, s + t * kRows, groups, q, b, to, width);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor params) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}

#endif
