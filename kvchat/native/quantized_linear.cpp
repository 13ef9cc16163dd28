// Weight-only int4 and int8 linear layers, registered for CPU as kvchat::int4_linear and
// kvchat::int8_linear (built by kernels.py) where the CPU has AVX-512 VNNI; elsewhere kvchat runs
// torch's own kernels.
//
// Both round their input to int8 per group of 32 with one scale (its largest magnitude / 127), as
// llama.cpp does for its quantized dot products, and then what that rounding leaves to int8 again at
// 1/256 of the scale: two integer products a group, x to within 1/65,000 of the group's largest value,
// where one int8 rounding alone took SmolLM2's KL against its own weights from 0.004 to 0.034. A
// decode token's linears then read each weight byte once, at the machine's read bandwidth, where
// torch's kernels widen every weight to floats and run at about half that; with more rows of input
// (speculation's drafts, prefill) each tile is read once per 4 rows, from cache, and 16 rows or more
// of a bf16 model run on AMX where the CPU has it (amx_linear, below). The output is fp32.
//
// The weights (written by linears/quantized_linears.py) are in tiles of 16 rows by groups of 32 inputs, laid out as
// vpdpbusd operands: 16 rows by 4 inputs in 64 bytes, against 4 inputs broadcast.
// int4: a tile-group is 256 bytes of codes, four 64-byte blocks: block i's byte 4r + j holds row r's
//   code for input 4i + j in its low nibble and for input 16 + 4i + j in its high one; in a second
//   tensor, 16 bf16 scales then 16 bf16 zeros for each span of 1, 2 or 4 groups (int4 groups of 32,
//   64 or 128 inputs). The weight is (code - 8) * scale + zero, and each span's exact input sum
//   carries the zeros:
//   out[r] = sum over spans of  scale * sum over its groups of dx / 256 * sum(code * (256 xq + xr))
//                               + (zero - 8 scale) * sum(x).
//   Or nested (4.5 bits a weight where the above is 5): each tile's params in one run of bytes, its
//   head (16 bf16 row scales, 16 bf16 row lows), then per group 16 uint8 scale codes and 16 int8 low
//   codes. A group's scale is its code times its row's scale, its low (the value of code 0) its code
//   times the row's low; the weight is code * scale + low.
// int8: a tile-group is 512 bytes, eight 64-byte blocks: block j's byte 4r + i holds row r's code for
//   input 4j + i, plus 128 (vpdpbusd multiplies unsigned bytes by signed ones); one bf16 scale per row.
//   out[r] = scale * sum over groups of  dx / 256 * (sum(u * (256 xq + xr)) - 128 * sum(256 xq + xr)).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "quantized_layout.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define KVCHAT_AMX 1
namespace kvchat_tier {
bool batch_invariant();  // bf16_linear.cpp
}  // namespace kvchat_tier

// bf16_linear.cpp's AMX tile work, which this file's prefill path shares
namespace kvchat_amx {
bool permitted();
void configure_tiles();
at::Tensor whole_blocks(const at::Tensor& x);
void blocks(int I, int J, const uint16_t* x, int64_t inputs, const uint16_t* w, int64_t pairs, int64_t first,
            int64_t end, float* sums);
}  // namespace kvchat_amx
#endif

namespace {

constexpr int64_t kRows = 16;                      // output rows a tile
constexpr int64_t kGroup = 32;                     // inputs per scale and zero
constexpr int64_t kCodeBytes = kRows * kGroup / 2;  // an int4 tile-group's codes
constexpr int64_t kNestedHead = 2 * kRows * 2;     // a nested tile's bf16 row scales and lows
constexpr int64_t kNestedGroup = 2 * kRows;         // and each group's scale and low codes
constexpr int64_t kByteCodes = kRows * kGroup;      // an int8 tile-group's codes
constexpr int64_t kBatch = 4;                      // input rows a pass over a tile
// groups ahead to prefetch the codes of into L1, for several input rows (past the end: prefetches never
// fault)
constexpr int64_t kAhead = 8;
constexpr int64_t kInt4Streams = 8;  // int4 tiles one input row streams at once
constexpr int64_t kInt4StreamAhead = 4;  // groups ahead each stream prefetches into L1, its params too
constexpr int64_t kInt8Streams = 4;  // int8 tiles one input row streams at once, where a row has at least
constexpr int64_t kStreamGroups = 64;  // these groups (shorter ones decode faster a tile at a time)
constexpr int64_t kByteAhead = 2;  // int8 groups ahead a streaming row prefetches (4 or more: 20% slower)

// The input's rows quantized per group: int8 codes and their residues' codes (M, K); per group a
// scale, the exact sum, and sum(256 code + residue) for int8's offset. x = scale * (code + residue /
// 256), to within scale / 512.
struct QuantizedInput {
  at::Tensor codes, residues, scales, sums, code_sums;
};

// Raw pointers to the rows of a QuantizedInput from `first` on, as a tile reads them.
struct InputRows {
  const int8_t *codes, *residues;
  const float *scales, *sums;
  const int32_t* code_sums;
  int64_t inputs, groups;

  InputRows(const QuantizedInput& x, int64_t first)
      : inputs(x.codes.size(1)), groups(x.scales.size(1)) {
    codes = x.codes.data_ptr<int8_t>() + first * inputs;
    residues = x.residues.data_ptr<int8_t>() + first * inputs;
    scales = x.scales.data_ptr<float>() + first * groups;
    sums = x.sums.data_ptr<float>() + first * groups;
    code_sums = x.code_sums.data_ptr<int32_t>() + first * groups;
  }

  // sum(weight code * (256 xq + xr)) of row b over group g, for 16 output rows: of int8 blocks
  // (group_dot), of int4_blocks' (int4_group_dot)
  __m512i dot(const __m512i (&v)[8], int b, int64_t g) const;
  __m512i int4_dot(const __m512i (&v)[8], int b, int64_t g) const;
};

inline __m512 widen_bf16(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// 16 values from p as fp32: bf16 widened, or fp32 as they are
inline __m512 load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_floats(const at::BFloat16* p) { return widen_bf16(reinterpret_cast<const uint16_t*>(p)); }

// x rounded to the nearest integer, ties to even, as std::nearbyint
inline __m512 nearest(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// One group of 32 inputs: its codes and residues' codes, and its scale, sum and sum(256 code + residue).
template <typename T>
inline void quantize_group(const T* in, int8_t* codes, int8_t* residues, float* scale, float* sum,
                           int32_t* code_sum) {
  const __m512 values[2] = {load_floats(in), load_floats(in + 16)};
  const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(values[0]), _mm512_abs_ps(values[1])));
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(values[0], values[1]));
  *scale = largest / 127.0f;
  const __m512 inverse = _mm512_set1_ps(*scale > 0.0f ? 1.0f / *scale : 0.0f);
  __m512i combined = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512 scaled = _mm512_mul_ps(values[h], inverse);
    const __m512 code = nearest(scaled);
    // within +-128, at most 127 kept
    const __m512 residue = _mm512_min_ps(nearest(_mm512_mul_ps(_mm512_sub_ps(scaled, code), _mm512_set1_ps(256.0f))),
                                         _mm512_set1_ps(127.0f));
    const __m512i code_int = _mm512_cvtps_epi32(code), residue_int = _mm512_cvtps_epi32(residue);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * h), _mm512_cvtepi32_epi8(code_int));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(residues + 16 * h), _mm512_cvtepi32_epi8(residue_int));
    combined = _mm512_add_epi32(combined, _mm512_add_epi32(_mm512_slli_epi32(code_int, 8), residue_int));
  }
  *code_sum = _mm512_reduce_add_epi32(combined);
}

QuantizedInput quantize_input(const at::Tensor& x) {
  const int64_t rows = x.size(0), inputs = x.size(1), groups = inputs / kGroup;
  const at::Tensor values = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  const auto bytes = x.options().dtype(at::kChar), floats = x.options().dtype(at::kFloat);
  QuantizedInput q{at::empty({rows, inputs}, bytes), at::empty({rows, inputs}, bytes),
                   at::empty({rows, groups}, floats), at::empty({rows, groups}, floats),
                   at::empty({rows, groups}, x.options().dtype(at::kInt))};
  int8_t* codes = q.codes.data_ptr<int8_t>();
  int8_t* residues = q.residues.data_ptr<int8_t>();
  float* scales = q.scales.data_ptr<float>();
  float* sums = q.sums.data_ptr<float>();
  int32_t* code_sums = q.code_sums.data_ptr<int32_t>();
  const auto each_group = [&](const auto* in) {
    for (int64_t g = 0; g < rows * groups; ++g)
      quantize_group(in + g * kGroup, codes + g * kGroup, residues + g * kGroup, scales + g, sums + g,
                     code_sums + g);
  };
  if (values.scalar_type() == at::kBFloat16)
    each_group(values.data_ptr<at::BFloat16>());
  else
    each_group(values.data_ptr<float>());
  return q;
}

// Four input bytes in every 32-bit lane, broadcast from memory: through a general register, as
// _mm512_set1_epi32 compiles, each costs one more vector instruction.
inline __m512i broadcast_four(const int8_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

// sum(code * (256 xq + xr)) over one group for 16 rows: eight blocks of 16 rows by 4 inputs.
inline __m512i group_dot(const __m512i (&v)[8], const int8_t* coarse, const int8_t* fine) {
  // four chains of vpdpbusd, not two: each waits on its own last result
  __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  __m512i rest[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int j = 0; j < 8; ++j) {
    dot[j % 2] = _mm512_dpbusd_epi32(dot[j % 2], v[j], broadcast_four(coarse + 4 * j));
    rest[j % 2] = _mm512_dpbusd_epi32(rest[j % 2], v[j], broadcast_four(fine + 4 * j));
  }
  const __m512i coarse_sum = _mm512_add_epi32(dot[0], dot[1]);
  return _mm512_add_epi32(_mm512_slli_epi32(coarse_sum, 8), _mm512_add_epi32(rest[0], rest[1]));
}

__m512i InputRows::dot(const __m512i (&v)[8], int b, int64_t g) const {
  return group_dot(v, codes + b * inputs + g * kGroup, residues + b * inputs + g * kGroup);
}

// One int4 tile-group's codes as eight blocks for int4_group_dot: the low nibbles, then the high ones
// masked in place (16 times their codes), the lines `ahead` groups on prefetched into L1.
inline void int4_blocks(const uint8_t* c, int64_t ahead, __m512i (&v)[8]) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int i = 0; i < 4; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(c + ahead * kCodeBytes + 64 * i), _MM_HINT_T0);
    const __m512i raw = _mm512_loadu_si512(c + 64 * i);
    v[i] = _mm512_and_si512(raw, low);
    v[i + 4] = _mm512_and_si512(raw, high);
  }
}

// group_dot for int4_blocks' blocks: the high blocks' products come 16 times too large and are shifted
// back exactly once summed (each sum stays below 2^27), which spares shifting every block's codes down.
inline __m512i int4_group_dot(const __m512i (&v)[8], const int8_t* coarse, const int8_t* fine) {
  __m512i dot_low = _mm512_setzero_si512(), dot_high = _mm512_setzero_si512();
  __m512i rest_low = _mm512_setzero_si512(), rest_high = _mm512_setzero_si512();
  for (int i = 0; i < 4; ++i) {
    dot_low = _mm512_dpbusd_epi32(dot_low, v[i], broadcast_four(coarse + 4 * i));
    rest_low = _mm512_dpbusd_epi32(rest_low, v[i], broadcast_four(fine + 4 * i));
    dot_high = _mm512_dpbusd_epi32(dot_high, v[i + 4], broadcast_four(coarse + 16 + 4 * i));
    rest_high = _mm512_dpbusd_epi32(rest_high, v[i + 4], broadcast_four(fine + 16 + 4 * i));
  }
  const __m512i lows = _mm512_add_epi32(_mm512_slli_epi32(dot_low, 8), rest_low);
  const __m512i highs = _mm512_add_epi32(_mm512_slli_epi32(dot_high, 8), rest_high);
  return _mm512_add_epi32(lows, _mm512_srai_epi32(highs, 4));
}

__m512i InputRows::int4_dot(const __m512i (&v)[8], int b, int64_t g) const {
  return int4_group_dot(v, codes + b * inputs + g * kGroup, residues + b * inputs + g * kGroup);
}

// One span of an int4 tile: its 16 scales, and its zeros less 8 scales (weight = code * scale + offset).
struct SpanParams {
  __m512 scale, offset;

  explicit SpanParams(const uint16_t* param)
      : scale(widen_bf16(param)), offset(_mm512_fmadd_ps(_mm512_set1_ps(-8.0f), scale, widen_bf16(param + kRows))) {}

  // a nested group's codes (16 scale codes, 16 low codes) times its rows' scales and lows
  SpanParams(const uint8_t* group, __m512 row_scale, __m512 row_low) {
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));
    const __m128i lows = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + kRows));
    scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scales)), row_scale);
    offset = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lows)), row_low);
  }

  // acc plus the span's dot products (already at their input scales) times the scales, and the offsets
  // times the span's exact input sum
  __m512 add(__m512 acc, __m512 dots, float sum) const {
    return _mm512_fmadd_ps(offset, _mm512_set1_ps(sum), _mm512_fmadd_ps(dots, scale, acc));
  }
};

// Where an int4 layer's params are, by tile and span, from its first tile on: bf16 scales and zeros
// per span, or nested ones (spans of one group).
struct PlainParams {
  static constexpr bool kNested = false;
  const uint16_t* p;
  int64_t spans;  // a tile's

  PlainParams from(int64_t tile) const { return {p + tile * spans * 2 * kRows, spans}; }
  SpanParams at(int64_t tile, int64_t span) const { return SpanParams(p + (tile * spans + span) * 2 * kRows); }
  void prefetch(int64_t tile, int64_t span) const {
    _mm_prefetch(reinterpret_cast<const char*>(p + (tile * spans + span) * 2 * kRows), _MM_HINT_T0);
  }
};

struct NestedParams {
  static constexpr bool kNested = true;
  const uint8_t* p;
  int64_t groups;  // a tile's

  const uint8_t* tile_head(int64_t tile) const { return p + tile * (kNestedHead + groups * kNestedGroup); }
  const uint8_t* group_codes(int64_t tile, int64_t group) const {
    return tile_head(tile) + kNestedHead + group * kNestedGroup;
  }
  NestedParams from(int64_t tile) const { return {tile_head(tile), groups}; }
  // the tile's 16 row scales and 16 row lows, in fp32
  __m512 row_scales(int64_t tile) const { return widen_bf16(reinterpret_cast<const uint16_t*>(tile_head(tile))); }
  __m512 row_lows(int64_t tile) const {
    return widen_bf16(reinterpret_cast<const uint16_t*>(tile_head(tile)) + kRows);
  }
  SpanParams at(int64_t tile, int64_t group) const {
    return SpanParams(group_codes(tile, group), row_scales(tile), row_lows(tile));
  }
  void prefetch(int64_t tile, int64_t group) const {
    if (group == 0) _mm_prefetch(reinterpret_cast<const char*>(tile_head(tile)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(group_codes(tile, group)), _MM_HINT_T0);
  }
};

// Nested params a row at a time: each group's dot products times its scale codes, and its input sum
// times its low codes, summed over the row, then times the rows' scales and lows once (two products a
// group fewer than each group's scale and low made whole).
struct RowSums {
  __m512 scaled = _mm512_setzero_ps(), lowered = _mm512_setzero_ps();

  void add(const uint8_t* group, __m512 dots, float sum) {
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));
    const __m128i lows = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + kRows));
    scaled = _mm512_fmadd_ps(dots, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scales)), scaled);
    lowered = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lows)), _mm512_set1_ps(sum), lowered);
  }
  // the sums times the rows' scales and lows
  __m512 finish(__m512 row_scales, __m512 row_lows) const {
    return _mm512_fmadd_ps(lowered, row_lows, _mm512_mul_ps(scaled, row_scales));
  }
};

// B input rows against one int4 tile of 16 output rows: out[b * out_stride + r]. Each scale and zero
// serves S consecutive groups of 32 inputs (a group of 32 S): their dot products are summed in fp32,
// each at its input scale, then multiplied by the weight's scale once.
template <int B, int S, typename Params>
void int4_tile(const uint8_t* codes, const Params& params, int64_t groups, const QuantizedInput& x,
               int64_t first_row, float* out, int64_t out_stride) {
  const InputRows rows(x, first_row);
  __m512 acc[B];
  for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
  RowSums nested[Params::kNested ? B : 1];
  for (int64_t span = 0; span < groups / S; ++span) {
    __m512 dots[B];
    float sums[B];
    for (int s = 0; s < S; ++s) {
      const int64_t g = span * S + s;
      __m512i v[8];
      int4_blocks(codes + g * kCodeBytes, kAhead, v);
      for (int b = 0; b < B; ++b) {
        // |sum(code * (256 xq + xr))| <= 32 * 15 * (256 * 127 + 128) < 2^24: exact in int32 and fp32
        const __m512 dot = _mm512_cvtepi32_ps(rows.int4_dot(v, b, g));
        const __m512 step = _mm512_set1_ps(rows.scales[b * groups + g] / 256.0f);
        dots[b] = s == 0 ? _mm512_mul_ps(dot, step) : _mm512_fmadd_ps(dot, step, dots[b]);
        sums[b] = s == 0 ? rows.sums[b * groups + g] : sums[b] + rows.sums[b * groups + g];
      }
    }
    if constexpr (Params::kNested) {
      for (int b = 0; b < B; ++b) nested[b].add(params.group_codes(0, span), dots[b], sums[b]);
    } else {
      const SpanParams param = params.at(0, span);
      for (int b = 0; b < B; ++b) acc[b] = param.add(acc[b], dots[b], sums[b]);
    }
  }
  if constexpr (Params::kNested)
    for (int b = 0; b < B; ++b) acc[b] = nested[b].finish(params.row_scales(0), params.row_lows(0));
  for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + b * out_stride, acc[b]);
}

// One input row against T consecutive int4 tiles at once (int4_tile's sums in its order), each
// tile's codes and params prefetched into L1 a few groups ahead, and near the row's end the next
// tiles' first groups (SmolLM2's rows are 18 and 48 groups long). On a 2.1 GHz Xeon, one thread,
// eight tiles at once read Qwen2.5-3B's and SmolLM2's int4 weights at 0.97-1.0x the pace of the bf16
// kernel's streams, where one tile at a time (prefetched 32 groups ahead into L2) read at 0.89x;
// int4-g128's at 0.92x (0.85x). Into L2 instead: 2-4% slower; 2 or 4 tiles at once: 3-15% slower;
// 16: 5%. Nested params with factors per 8 groups: 1.05-1.09x kernel only against bf16 params, at 8%
// fewer bytes; factors per row take 2.3% fewer bytes a 3B token again. The high nibbles masked in place
// (int4_group_dot) and nested params summed before their factors, ~10% fewer instructions: 1.01-1.02x
// kernel only (the variants in rotated order, 15 rounds), so the loop is not bound by its instructions
// alone.
template <int T, int S, typename Params>
void int4_row_tiles(const uint8_t* codes, const Params& params, int64_t groups, const QuantizedInput& x,
                    float* out) {
  const InputRows rows(x, 0);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t spans = groups / S, span_ahead = kInt4StreamAhead / S;
  RowSums nested[Params::kNested ? T : 1];
  for (int64_t span = 0; span < spans; ++span) {
    __m512 dots[T];
    float sum = 0.0f;
    for (int s = 0; s < S; ++s) {
      const int64_t g = span * S + s;
      const __m512 step = _mm512_set1_ps(rows.scales[g] / 256.0f);
      sum += rows.sums[g];
      // near the row's end, the start of the tile this stream takes next (T tiles on)
      const int64_t ahead = g + kInt4StreamAhead < groups ? kInt4StreamAhead : kInt4StreamAhead + (T - 1) * groups;
      for (int t = 0; t < T; ++t) {
        __m512i v[8];
        int4_blocks(codes + (t * groups + g) * kCodeBytes, ahead, v);
        const __m512 dot = _mm512_cvtepi32_ps(rows.int4_dot(v, 0, g));
        dots[t] = s == 0 ? _mm512_mul_ps(dot, step) : _mm512_fmadd_ps(dot, step, dots[t]);
      }
    }
    // near the row's end, the next tile's (T tiles on)
    const bool within = span + span_ahead < spans;
    const int64_t next_span = within ? span + span_ahead : span + span_ahead - spans, next_tile = within ? 0 : T;
    for (int t = 0; t < T; ++t) {
      params.prefetch(t + next_tile, next_span);
      if constexpr (Params::kNested) {
        nested[t].add(params.group_codes(t, span), dots[t], sum);
      } else {
        acc[t] = params.at(t, span).add(acc[t], dots[t], sum);
      }
    }
  }
  if constexpr (Params::kNested)
    for (int t = 0; t < T; ++t) acc[t] = nested[t].finish(params.row_scales(t), params.row_lows(t));
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + t * kRows, acc[t]);
}

// B input rows against one int8 tile of 16 output rows: out[b * out_stride + r].
template <int B>
void int8_tile(const uint8_t* codes, const uint16_t* row_scales, int64_t groups, const QuantizedInput& x,
               int64_t first_row, float* out, int64_t out_stride) {
  const InputRows rows(x, first_row);
  __m512 acc[B];
  for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i v[8];
    for (int j = 0; j < 8; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + (g + kAhead) * kByteCodes + 64 * j), _MM_HINT_T0);
      v[j] = _mm512_loadu_si512(codes + g * kByteCodes + 64 * j);
    }
    for (int b = 0; b < B; ++b) {
      // |sum(w * (256 xq + xr))| <= 32 * 128 * (256 * 127 + 128) < 2^31, exact in int32
      const __m512i offset = _mm512_set1_epi32(128 * rows.code_sums[b * groups + g]);
      const __m512i dot = _mm512_sub_epi32(rows.dot(v, b, g), offset);
      const __m512 step = _mm512_set1_ps(rows.scales[b * groups + g] / 256.0f);
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), step, acc[b]);
    }
  }
  const __m512 scale = widen_bf16(row_scales);
  for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + b * out_stride, _mm512_mul_ps(acc[b], scale));
}

// One input row against T consecutive int8 tiles at once, their codes prefetched into L2 two groups
// ahead: on the AMD EPYC, Qwen2.5-3B's shapes (64 and 344 groups a row) at 23-25 GB/s where one tile
// at a time (8 groups ahead into L1) read 17-20; 4 or 8 groups ahead read no faster than one tile. On
// SmolLM2's short rows (18 and 48 groups) it decoded 10-20% slower: each tile's first lines come
// unprefetched. On the Xeon, into L1 read the 3B shapes 4% faster kernel only, but decoded them at
// 1.00x (one process taking turns). out[r], r < 16 T.
template <int T>
void int8_row_tiles(const uint8_t* codes, const uint16_t* row_scales, int64_t groups, const QuantizedInput& x,
                    float* out) {
  const InputRows rows(x, 0);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i offset = _mm512_set1_epi32(128 * rows.code_sums[g]);
    const __m512 step = _mm512_set1_ps(rows.scales[g] / 256.0f);
    for (int t = 0; t < T; ++t) {
      const uint8_t* c = codes + (t * groups + g) * kByteCodes;
      __m512i v[8];
      for (int j = 0; j < 8; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kByteAhead * kByteCodes + 64 * j), _MM_HINT_T1);
        v[j] = _mm512_loadu_si512(c + 64 * j);
      }
      const __m512i dot = _mm512_sub_epi32(rows.dot(v, 0, g), offset);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), step, acc[t]);
    }
  }
  for (int t = 0; t < T; ++t)
    _mm512_storeu_ps(out + t * kRows, _mm512_mul_ps(acc[t], widen_bf16(row_scales + t * kRows)));
}

// One input row against every tile, Streams at a time (then 4, 2, 1): row_tiles(n, t, q, out) computes
// tiles t..t+n-1. int8 streams 4 tiles where a row has kStreamGroups; int4 streams 8, on every row. On
// the AMD EPYC, an earlier int4 streaming (into L2) decoded Qwen2.5-3B's shapes no faster and SmolLM2's
// 15-18% slower; the streams into L1 have been measured on the Xeon only. On the AMD, one int4 tile at
// a time read ~23 GB/s where bf16's streams read ~29: its integer work, ~40 GB/s alone from L1,
// overlapped the memory's only in part (scripts/README.md).
template <int64_t Streams, typename RowTiles>
at::Tensor by_streams(const at::Tensor& x, int64_t tiles, RowTiles&& row_tiles) {
  const QuantizedInput q = quantize_input(x);
  at::Tensor out = at::empty({1, tiles * kRows}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tiles, Streams, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end;) {
      const int64_t left = end - t, n = left >= Streams ? Streams : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      if (n == Streams) row_tiles(std::integral_constant<int, Streams>{}, t, q, o + t * kRows);
      else if (n == 4) row_tiles(std::integral_constant<int, 4>{}, t, q, o + t * kRows);
      else if (n == 2) row_tiles(std::integral_constant<int, 2>{}, t, q, o + t * kRows);
      else row_tiles(std::integral_constant<int, 1>{}, t, q, o + t * kRows);
      t += n;
    }
  });
  return out;
}

// Each tile of 16 output rows against the input's rows, 4 at a time, the tiles split between threads.
template <typename Tile>
at::Tensor by_tiles(const at::Tensor& x, int64_t tiles, Tile&& tile) {
  const int64_t rows = x.size(0), width = tiles * kRows;
  const QuantizedInput q = quantize_input(x);
  at::Tensor out = at::empty({rows, width}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < rows; b += kBatch) {
        float* to = o + b * width + t * kRows;
        switch (std::min(kBatch, rows - b)) {
          case 4: tile(std::integral_constant<int, 4>{}, t, q, b, to, width); break;
          case 3: tile(std::integral_constant<int, 3>{}, t, q, b, to, width); break;
          case 2: tile(std::integral_constant<int, 2>{}, t, q, b, to, width); break;
          default: tile(std::integral_constant<int, 1>{}, t, q, b, to, width); break;
        }
      }
    }
  });
  return out;
}

#ifdef KVCHAT_AMX
// Many rows of bf16 input (a bf16 model's prefill) on AMX, where the CPU has it: each tile's codes are
// widened to bf16 (the int4 codes 0..15, the int8 codes less 128: exact in bf16) into bf16_linear.cpp's
// operand layout, once a call, and the tile unit multiplies the input by them as they are, in fp32
// sums; the scales come after, per span of groups (int4; its zeros by the span's exact input sums)
// or per row (int8). The input is not rounded at all, where the integer path rounds it to within
// 1/65,000 of each group's largest value. On a 2.1 GHz Xeon, one thread, 64 to 512 rows: int4 230-330
// GFLOP/s where the integer path ran 100-180, int4-g128 330-530 (110-160), int8 300-550 (110-180);
// 16 rows 1.1-2.2x; fewer rows stay on the integer path, which reads the weights once for them.
constexpr int64_t kAmxFrom = 16;  // input rows from which AMX serves (fewer: the integer path)

// One 64-byte block of 16 rows by 4 codes (byte 4r + i: row r's code i), less `offset`, as two bf16
// operands: each row's codes 0 and 1 (first), then 2 and 3 (second).
inline void block_operands(__m512i codes, int offset, uint16_t* first, uint16_t* second) {
  alignas(64) static const int32_t kEven[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static const int32_t kOdd[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i less = _mm512_set1_epi32(offset);
  const auto widen = [&](__m128i bytes) {
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), less));
  };
  // rows 0-7 and 8-15, each row's four codes as bf16 in order
  const __m512i low = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(widen(_mm512_extracti32x4_epi32(codes, 1)),
                                                                    widen(_mm512_extracti32x4_epi32(codes, 0))));
  const __m512i high = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(widen(_mm512_extracti32x4_epi32(codes, 3)),
                                                                     widen(_mm512_extracti32x4_epi32(codes, 2))));
  _mm512_storeu_si512(first, _mm512_permutex2var_epi32(low, _mm512_load_si512(kEven), high));
  _mm512_storeu_si512(second, _mm512_permutex2var_epi32(low, _mm512_load_si512(kOdd), high));
}

// Tile t's codes as bf16 operands (groups * 16 of them, 32 values each), int4 or int8.
void int4_operands(const uint8_t* codes, int64_t groups, uint16_t* ops) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* o = ops + g * 16 * 32;
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = _mm512_loadu_si512(codes + g * kCodeBytes + 64 * i);
      block_operands(_mm512_and_si512(raw, nibble), 0, o + (2 * i) * 32, o + (2 * i + 1) * 32);
      block_operands(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble), 0, o + (8 + 2 * i) * 32,
                     o + (9 + 2 * i) * 32);
    }
  }
}

void int8_operands(const uint8_t* codes, int64_t groups, uint16_t* ops) {
  for (int64_t g = 0; g < groups; ++g)
    for (int j = 0; j < 8; ++j)
      block_operands(_mm512_loadu_si512(codes + g * kByteCodes + 64 * j), 128, ops + (g * 16 + 2 * j) * 32,
                     ops + (g * 16 + 2 * j + 1) * 32);
}

// x (M, K) bf16 against every tile: out (M, N) fp32. `operands(t, ops)` widens tile t's codes;
// `finish(t, span, sums, x_sums, spans, acc)` adds a span's 16x16 sums of tile t into acc (16 rows by
// 16 outputs), given the 16 rows' exact input sums per span (x_sums[r * spans + span], where
// `with_sums`, else null); `spans` a row.
template <typename Operands, typename Finish>
at::Tensor amx_linear(const at::Tensor& x, int64_t tiles, int64_t spans, bool with_sums, Operands&& operands,
                      Finish&& finish) {
  const int64_t rows = x.size(0), inputs = x.size(1), pairs = inputs / 2, span_pairs = pairs / spans;
  const at::Tensor input = kvchat_amx::whole_blocks(x);
  const int64_t padded_rows = input.size(0), width = tiles * kRows;
  at::Tensor input_sums;
  if (with_sums) input_sums = input.to(at::kFloat).view({padded_rows, spans, inputs / spans}).sum(-1).contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(input.data_ptr<at::BFloat16>());
  const float* xs = with_sums ? input_sums.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, width}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    kvchat_amx::configure_tiles();
    std::vector<uint16_t> ops(2 * pairs * 32);
    alignas(64) float sums[4 * 256], acc[4 * 256];
    for (int64_t t = 2 * begin; t < std::min(2 * end, tiles); t += 2) {
      const int J = std::min<int64_t>(2, tiles - t);
      for (int j = 0; j < J; ++j) operands(t + j, ops.data() + j * pairs * 32);
      for (int64_t block = 0; block < padded_rows / 16; block += 2) {
        const int I = std::min<int64_t>(2, padded_rows / 16 - block);
        std::fill(acc, acc + 4 * 256, 0.0f);
        for (int64_t span = 0; span < spans; ++span) {
          kvchat_amx::blocks(I, J, xp + block * 16 * inputs, inputs, ops.data(), pairs, span * span_pairs,
                             (span + 1) * span_pairs, sums);
          for (int i = 0; i < I; ++i)
            for (int j = 0; j < J; ++j)
              finish(t + j, span, sums + (i * J + j) * 256, xs ? xs + (block + i) * 16 * spans : nullptr, spans,
                     acc + (i * J + j) * 256);
        }
        for (int i = 0; i < I; ++i)
          for (int j = 0; j < J; ++j)
            for (int64_t r = 0; r < 16 && (block + i) * 16 + r < rows; ++r)
              _mm512_storeu_ps(o + ((block + i) * 16 + r) * width + (t + j) * kRows,
                               _mm512_load_ps(acc + (i * J + j) * 256 + r * 16));
      }
    }
    _tile_release();
  });
  return out;
}

bool amx_serves(const at::Tensor& x) {
  return x.size(0) >= kAmxFrom && x.scalar_type() == at::kBFloat16 && !kvchat_tier::batch_invariant() &&
         kvchat_amx::permitted();
}
#endif

template <int S, typename Params>
at::Tensor int4_spans(const at::Tensor& x, const at::Tensor& codes, const Params& params) {
  const int64_t groups = codes.size(1);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  if (x.size(0) == 1)
    return by_streams<kInt4Streams>(x, codes.size(0), [&](auto streams, int64_t t, const QuantizedInput& q,
                                                          float* to) {
      int4_row_tiles<decltype(streams)::value, S>(c + t * groups * kCodeBytes, params.from(t), groups, q, to);
    });
  return by_tiles(x, codes.size(0), [&](auto batch, int64_t t, const QuantizedInput& q, int64_t b, float* to,
                                        int64_t width) {
    int4_tile<decltype(batch)::value, S>(c + t * groups * kCodeBytes, params.from(t), groups, q, b, to, width);
  });
}

// The params as int4_spans and the AMX path take them: f(spans a tile, params).
template <typename F>
at::Tensor with_params(const at::Tensor& params, int64_t groups, F&& f) {
  if (params.dim() == 2) return f(groups, NestedParams{params.data_ptr<uint8_t>(), groups});
  return f(params.size(1), PlainParams{reinterpret_cast<const uint16_t*>(params.data_ptr<at::BFloat16>()),
                                       params.size(1)});
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params) {
  const int64_t span = kvchat_layout::check_int4(x, codes, params), groups = codes.size(1);
  return with_params(params, groups, [&](int64_t spans, const auto& ps) {
#ifdef KVCHAT_AMX
    if (amx_serves(x)) {
      const uint8_t* c = codes.data_ptr<uint8_t>();
      return amx_linear(
          x, codes.size(0), spans, true,
          [&](int64_t t, uint16_t* ops) { int4_operands(c + t * groups * kCodeBytes, groups, ops); },
          [&](int64_t t, int64_t s, const float* sums, const float* x_sums, int64_t row_spans, float* acc) {
            const SpanParams param = ps.at(t, s);
            for (int r = 0; r < 16; ++r) {
              const __m512 sum = _mm512_load_ps(sums + 16 * r);
              _mm512_store_ps(acc + 16 * r, param.add(_mm512_load_ps(acc + 16 * r), sum, x_sums[r * row_spans + s]));
            }
          });
    }
#endif
    if constexpr (std::decay_t<decltype(ps)>::kNested) return int4_spans<1>(x, codes, ps);
    switch (span) {
      case 4: return int4_spans<4>(x, codes, ps);
      case 2: return int4_spans<2>(x, codes, ps);
      default: return int4_spans<1>(x, codes, ps);
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  kvchat_layout::check_int8(x, codes, scales);
  const int64_t tiles = codes.size(0), groups = codes.size(1);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
#ifdef KVCHAT_AMX
  if (amx_serves(x))
    return amx_linear(
        x, tiles, 1, false, [&](int64_t t, uint16_t* ops) { int8_operands(c + t * groups * kByteCodes, groups, ops); },
        [&](int64_t t, int64_t, const float* sums, const float*, int64_t, float* acc) {
          const __m512 scale = widen_bf16(s + t * kRows);  // weight = (code - 128) * scale
          for (int r = 0; r < 16; ++r)
            _mm512_store_ps(acc + 16 * r,
                            _mm512_fmadd_ps(_mm512_load_ps(sums + 16 * r), scale, _mm512_load_ps(acc + 16 * r)));
        });
#endif
  if (x.size(0) == 1 && groups >= kStreamGroups)
    return by_streams<kInt8Streams>(x, tiles, [&](auto streams, int64_t t, const QuantizedInput& q, float* to) {
      int8_row_tiles<decltype(streams)::value>(c + t * groups * kByteCodes, s + t * kRows, groups, q, to);
    });
  return by_tiles(x, tiles, [&](auto batch, int64_t t, const QuantizedInput& q, int64_t b, float* to,
                                int64_t width) {
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
