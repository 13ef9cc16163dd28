// The int4 and int8 linear layers for the avx2 tier (kernels.py builds it with -mavx2 -mfma),
// registered as kvchat::int4_linear and kvchat::int8_linear, on quantized_linear.cpp's tiles and with
// its arithmetic: the input rounded per group of 32 to int8 codes (scale: the largest magnitude / 127)
// and what that leaves to int8 again at 1/256 of the scale, the weights' integer products summed
// exactly per group, then scaled in fp32 in the same order (see quantized_linear.cpp for the layouts).
//
// Without vpdpbusd, int8: each input's two codes make one int16 (256 code + residue, within +-32,640)
// and each weight code is widened to int16: vpmaddwd multiplies them and adds pairs exactly in int32.
// int4: vpmaddubsw multiplies the weight's nibbles (0..15) by the input's codes and by its residues (int8)
// and adds pairs in int16, where a group's 16 products a row sum exactly (within +-30,720); vpmaddwd
// then takes the codes' sum times 256 and the residues' to int32. Either way a group's integer sum is
// the one quantized_linear.cpp computes. Every row is computed alone, in one order whatever the number
// of rows: one row streams a few tiles at once, their codes prefetched a few groups ahead; several rows
// take each tile 4 at a time, the codes read once for them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "quantized_layout.h"
#include "unrolled.h"

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
constexpr int kInt4Streams = 2;                     // int4 tiles one input row streams at once
constexpr int64_t kAheadBytes = 2048;               // how far ahead a tile's codes are prefetched

// The input's rows quantized per group, each value to a code and what it leaves (the residue), as
// each kernel takes them: int8's as one int16 (256 code + residue) (M, K) with each group's sum of
// them (its offset); int4's as int8 codes and residues apart (M, K) with each group's exact sum. Both
// take each group's scale; the other kernel's tensors stay undefined.
struct QuantizedInput {
  at::Tensor values, value_sums;  // int8's
  at::Tensor codes, residues, sums;  // int4's
  at::Tensor scales;
};

QuantizedInput quantize_input(const at::Tensor& x, bool int4) {
  const int64_t rows = x.size(0), inputs = x.size(1), groups = inputs / kGroup;
  const at::Tensor in = x.to(at::kFloat).contiguous();
  const auto of = [&](int64_t n, at::ScalarType type) { return at::empty({rows, n}, x.options().dtype(type)); };
  QuantizedInput q;
  q.scales = of(groups, at::kFloat);
  if (int4) q.codes = of(inputs, at::kChar), q.residues = of(inputs, at::kChar), q.sums = of(groups, at::kFloat);
  else q.values = of(inputs, at::kShort), q.value_sums = of(groups, at::kInt);
  const float* v = in.const_data_ptr<float>();
  float* scales = q.scales.mutable_data_ptr<float>();
  int8_t* codes = int4 ? q.codes.mutable_data_ptr<int8_t>() : nullptr;
  int8_t* residues = int4 ? q.residues.mutable_data_ptr<int8_t>() : nullptr;
  float* sums = int4 ? q.sums.mutable_data_ptr<float>() : nullptr;
  int16_t* values = int4 ? nullptr : q.values.mutable_data_ptr<int16_t>();
  int32_t* value_sums = int4 ? nullptr : q.value_sums.mutable_data_ptr<int32_t>();
  for (int64_t g = 0; g < rows * groups; ++g) {
    const float* group = v + g * kGroup;
    float largest = 0.0f, sum = 0.0f;
    for (int64_t i = 0; i < kGroup; ++i) {
      largest = std::max(largest, std::fabs(group[i]));
      sum += group[i];
    }
    const float scale = largest / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    int32_t total = 0;
    for (int64_t i = 0, at = g * kGroup; i < kGroup; ++i, ++at) {
      const float scaled = group[i] * inverse, code = std::nearbyint(scaled);
      const float residue = std::min(std::nearbyint((scaled - code) * 256.0f), 127.0f);  // within +-128
      if (int4) {
        codes[at] = static_cast<int8_t>(code), residues[at] = static_cast<int8_t>(residue);
      } else {
        const int32_t value = 256 * static_cast<int32_t>(code) + static_cast<int32_t>(residue);
        values[at] = static_cast<int16_t>(value), total += value;
      }
    }
    scales[g] = scale;
    if (int4) sums[g] = sum;
    else value_sums[g] = total;
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

inline __m256i four_bytes(const int8_t* x) {  // 4 int8 values repeated over the register
  int32_t four;
  std::memcpy(&four, x, sizeof four);
  return _mm256_set1_epi32(four);
}

// The same over one int4 group from the input's int8 codes xq and residues xr: block i's byte 4r + j
// holds row r's code for input 4i + j in its low nibble and for 16 + 4i + j in its high one. Each
// register of codes is rows 0-7 or 8-15 of a block; vpmaddubsw's pairs, 16 a row over the group, sum
// within +-16 * 15 * 128 in int16.
__attribute__((always_inline)) inline void int4_group(const uint8_t* c, const int8_t* xq, const int8_t* xr,
                                                      __m256i (&out)[2]) {
  using kvchat_unrolled::unrolled;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i coarse[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  __m256i fine[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  unrolled<4>([&](auto i) __attribute__((always_inline)) {
    const __m256i q_low = four_bytes(xq + 4 * i), q_high = four_bytes(xq + 16 + 4 * i);
    const __m256i r_low = four_bytes(xr + 4 * i), r_high = four_bytes(xr + 16 + 4 * i);
    unrolled<2>([&](auto h) __attribute__((always_inline)) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * i + 32 * h));
      const __m256i low = _mm256_and_si256(raw, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
      coarse[h] = _mm256_add_epi16(coarse[h], _mm256_add_epi16(_mm256_maddubs_epi16(low, q_low),
                                                               _mm256_maddubs_epi16(high, q_high)));
      fine[h] = _mm256_add_epi16(fine[h], _mm256_add_epi16(_mm256_maddubs_epi16(low, r_low),
                                                           _mm256_maddubs_epi16(high, r_high)));
    });
  });
  unrolled<2>([&](auto h) __attribute__((always_inline)) {
    out[h] = _mm256_add_epi32(_mm256_madd_epi16(coarse[h], _mm256_set1_epi16(256)),
                              _mm256_madd_epi16(fine[h], _mm256_set1_epi16(1)));
  });
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

// B input rows against T consecutive int4 tiles: out[b * out_stride + 16 t + r]. As
// quantized_linear.cpp's int4_tile: a span's dot products at their input scales summed in fp32, then
// times the span's scales, plus its offsets (zero - 8 scale) times the span's exact input sum; nested
// params summed over the row with their codes, then times the rows' scales and lows once. Each tile's
// codes are prefetched kAheadBytes on (one row streams several tiles; several rows take one).
template <int B, int T>
void int4_tiles(const uint8_t* codes, const uint8_t* params, const Params& kind, int64_t groups,
                const QuantizedInput& x, int64_t first_row, float* out, int64_t out_stride) {
  using kvchat_unrolled::unrolled;
  const int64_t inputs = groups * kGroup, S = groups / kind.spans, tile_codes = groups * kCodeBytes;
  const int8_t* xq = x.codes.const_data_ptr<int8_t>() + first_row * inputs;
  const int8_t* xr = x.residues.const_data_ptr<int8_t>() + first_row * inputs;
  const float* scales = x.scales.const_data_ptr<float>() + first_row * groups;
  const float* sums = x.sums.const_data_ptr<float>() + first_row * groups;
  __m256 acc[B][T][2], low_acc[B][T][2];
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      acc[b][t][0] = acc[b][t][1] = low_acc[b][t][0] = low_acc[b][t][1] = _mm256_setzero_ps();
  for (int64_t span = 0; span < kind.spans; ++span) {
    __m256 dots[B][T][2];
    float sum[B];
    for (int64_t s = 0; s < S; ++s) {
      const int64_t g = span * S + s;
      unrolled<B>([&](auto b) __attribute__((always_inline)) {
        const __m256 step = _mm256_set1_ps(scales[b * groups + g] / 256.0f);
        sum[b] = s == 0 ? sums[b * groups + g] : sum[b] + sums[b * groups + g];
        unrolled<T>([&](auto t) __attribute__((always_inline)) {
          const uint8_t* c = codes + t * tile_codes + g * kCodeBytes;
          if (b == 0)
            for (int64_t line = 0; line < kCodeBytes; line += 64)
              _mm_prefetch(reinterpret_cast<const char*>(c + kAheadBytes + line), _MM_HINT_T0);
          __m256i dot[2];
          int4_group(c, xq + b * inputs + g * kGroup, xr + b * inputs + g * kGroup, dot);
          unrolled<2>([&](auto h) __attribute__((always_inline)) {
            const __m256 d = _mm256_cvtepi32_ps(dot[h]);
            dots[b][t][h] = s == 0 ? _mm256_mul_ps(d, step) : _mm256_fmadd_ps(d, step, dots[b][t][h]);
          });
        });
      });
    }
    for (int t = 0; t < T; ++t) {
      const uint8_t* tile = params + t * kind.tile_bytes();
      for (int h = 0; h < 2; ++h) {
        __m256 scale, offset;
        if (kind.nested) {
          const uint8_t* group = tile + kNestedHead + span * kNestedGroup;
          scale = bytes_as_floats(group + 8 * h, false), offset = bytes_as_floats(group + kRows + 8 * h, true);
        } else {
          const uint16_t* p = reinterpret_cast<const uint16_t*>(tile) + span * 2 * kRows;
          scale = widen_bf16(p + 8 * h);
          offset = _mm256_fmadd_ps(_mm256_set1_ps(-8.0f), scale, widen_bf16(p + kRows + 8 * h));
        }
        for (int b = 0; b < B; ++b) {
          acc[b][t][h] = _mm256_fmadd_ps(dots[b][t][h], scale, acc[b][t][h]);
          if (kind.nested) low_acc[b][t][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(sum[b]), low_acc[b][t][h]);
          else acc[b][t][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(sum[b]), acc[b][t][h]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const uint16_t* head = reinterpret_cast<const uint16_t*>(params + t * kind.tile_bytes());
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < 2; ++h) {
        __m256 value = acc[b][t][h];
        if (kind.nested)
          value = _mm256_fmadd_ps(low_acc[b][t][h], widen_bf16(head + kRows + 8 * h),
                                  _mm256_mul_ps(value, widen_bf16(head + 8 * h)));
        _mm256_storeu_ps(out + b * out_stride + t * kRows + 8 * h, value);
      }
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

// Each tile against the input's rows, 4 at a time, the tiles split between threads; one row takes
// Streams tiles at once (then one at a time): tile(rows, tiles, t, q, first_row, out, width) with rows
// and tiles as compile-time constants.
template <int Streams, typename Tile>
at::Tensor by_tiles(const at::Tensor& x, bool int4, int64_t tiles, Tile&& tile) {
  using One = std::integral_constant<int, 1>;
  const int64_t rows = x.size(0), width = tiles * kRows;
  const QuantizedInput q = quantize_input(x, int4);
  at::Tensor out = at::empty({rows, width}, x.options().dtype(at::kFloat));
  float* o = out.mutable_data_ptr<float>();
  at::parallel_for(0, tiles, rows == 1 ? Streams : 1, [&](int64_t begin, int64_t end) {
    int64_t t = begin;
    if (rows == 1)
      for (; t + Streams <= end; t += Streams)
        tile(One{}, std::integral_constant<int, Streams>{}, t, q, 0, o + t * kRows, width);
    for (; t < end; ++t)
      for (int64_t b = 0; b < rows; b += kBatch) {
        float* to = o + b * width + t * kRows;
        switch (std::min(kBatch, rows - b)) {
          case 4: tile(std::integral_constant<int, 4>{}, One{}, t, q, b, to, width); break;
          case 3: tile(std::integral_constant<int, 3>{}, One{}, t, q, b, to, width); break;
          case 2: tile(std::integral_constant<int, 2>{}, One{}, t, q, b, to, width); break;
          default: tile(One{}, One{}, t, q, b, to, width); break;
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
  return by_tiles<kInt4Streams>(
      x, true, tiles, [&](auto rows, auto span, int64_t t, const QuantizedInput& q, int64_t b, float* to, int64_t width) {
        int4_tiles<decltype(rows)::value, decltype(span)::value>(c + t * groups * kCodeBytes,
                                                                 kind.p + t * kind.tile_bytes(), kind, groups, q, b,
                                                                 to, width);
      });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  kvchat_layout::check_int8(x, codes, scales);
  const int64_t tiles = codes.size(0), groups = codes.size(1);
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<at::BFloat16>());
  return by_tiles<1>(x, false, tiles, [&](auto rows, auto, int64_t t, const QuantizedInput& q, int64_t b,
                                          float* to, int64_t width) {
    int8_tile<decltype(rows)::value>(c + t * groups * kByteCodes, s + t * kRows, groups, q, b, to, width);
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
