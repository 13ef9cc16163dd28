// The neon tier's linear arithmetic (Arm64 NEON), without torch: linear_neon.cpp registers it as
// kvchat's ops, and tests/native/neon_check.cpp checks it against a float64 reference under qemu-user.
//
// Each function is one tile of 16 output rows against B input rows, on the tiles the other tiers read
// (linears/weight_layout.py, linears/quantized_linears.py), with their orders of sums: fp32 chains fused
// multiply-adds over each 64 inputs; bf16 adds each pair's odd product, then its even one, to one chain
// and rounds the sum (plus the bias) to bf16 once; int8 and int4 sum each group's integer products
// exactly in int32 (the input as 256 code + residue in int16, quantize_rows), then scale them in fp32.
// A row's sums never depend on B: its outputs are the same bits alone and among others.
#pragma once

#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvchat_neon {

constexpr int64_t kRows = 16;                       // output rows a tile: four registers of 4 floats
constexpr int64_t kPart = 64;                       // inputs an fp32 partial sum chains over
constexpr int64_t kPair = 32;                       // bf16 values an operand: 16 rows by 2 inputs
constexpr int64_t kGroup = 32;                      // inputs per scale
constexpr int64_t kCodeBytes = kRows * kGroup / 2;  // an int4 tile-group's codes
constexpr int64_t kByteCodes = kRows * kGroup;      // an int8 tile-group's codes
constexpr int64_t kNestedHead = 2 * kRows * 2;      // a nested tile's bf16 row scales and lows
constexpr int64_t kNestedGroup = 2 * kRows;         // and each group's scale and low codes

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// to nearest, ties to even; a NaN stays a NaN
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return static_cast<uint16_t>((bits | 0x400000u) >> 16);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline float32x4_t widen4(const uint16_t* p) {  // 4 bf16 values as fp32
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

// B input rows (x, `inputs` apart) against one fp32 tile (operand k: input k's weight for 16 rows):
// out[b * out_stride + r] = sum + bias[r], plus residual[b * out_stride + r] where given.
template <int B>
void fp32_tile(const float* w, int64_t inputs, const float* x, const float* bias, const float* residual, float* out,
               int64_t out_stride) {
  float32x4_t total[B][4];
  for (int b = 0; b < B; ++b)
    for (int q = 0; q < 4; ++q) total[b][q] = vdupq_n_f32(0.0f);
  for (int64_t first = 0; first < inputs; first += kPart) {
    float32x4_t acc[B][4];
    for (int b = 0; b < B; ++b)
      for (int q = 0; q < 4; ++q) acc[b][q] = vdupq_n_f32(0.0f);
    for (int64_t k = first; k < std::min(inputs, first + kPart); ++k) {
      float32x4_t v[4];
      for (int q = 0; q < 4; ++q) v[q] = vld1q_f32(w + k * kRows + 4 * q);
      for (int b = 0; b < B; ++b)
        for (int q = 0; q < 4; ++q) acc[b][q] = vfmaq_n_f32(acc[b][q], v[q], x[b * inputs + k]);
    }
    for (int b = 0; b < B; ++b)
      for (int q = 0; q < 4; ++q) total[b][q] = vaddq_f32(total[b][q], acc[b][q]);
  }
  for (int b = 0; b < B; ++b)
    for (int q = 0; q < 4; ++q) {
      float32x4_t value = vaddq_f32(total[b][q], bias ? vld1q_f32(bias + 4 * q) : vdupq_n_f32(0.0f));
      if (residual) value = vaddq_f32(vld1q_f32(residual + b * out_stride + 4 * q), value);
      vst1q_f32(out + b * out_stride + 4 * q, value);
    }
}

// B input rows (as fp32, 2 `pairs` apart) against one bf16 tile (operand p: inputs 2p and 2p + 1 of
// 16 rows, row r's pair at 2r): out bf16, the sum plus bias rounded once, then plus the residual and
// rounded again where given.
template <int B>
void bf16_tile(const uint16_t* w, int64_t pairs, const float* x, const float* bias, const uint16_t* residual,
               uint16_t* out, int64_t out_stride) {
  const uint32x4_t high_half = vdupq_n_u32(0xFFFF0000u);
  float32x4_t acc[B][4];
  for (int b = 0; b < B; ++b)
    for (int q = 0; q < 4; ++q) acc[b][q] = vdupq_n_f32(0.0f);
  for (int64_t p = 0; p < pairs; ++p) {
    float32x4_t even[4], odd[4];
    for (int q = 0; q < 4; ++q) {
      const uint32x4_t raw = vreinterpretq_u32_u16(vld1q_u16(w + p * kPair + 8 * q));
      even[q] = vreinterpretq_f32_u32(vshlq_n_u32(raw, 16));
      odd[q] = vreinterpretq_f32_u32(vandq_u32(raw, high_half));
    }
    for (int b = 0; b < B; ++b) {
      const float x_even = x[b * 2 * pairs + 2 * p], x_odd = x[b * 2 * pairs + 2 * p + 1];
      for (int q = 0; q < 4; ++q) acc[b][q] = vfmaq_n_f32(vfmaq_n_f32(acc[b][q], odd[q], x_odd), even[q], x_even);
    }
  }
  for (int b = 0; b < B; ++b) {
    alignas(16) float sums[kRows];
    for (int q = 0; q < 4; ++q) vst1q_f32(sums + 4 * q, acc[b][q]);
    for (int64_t r = 0; r < kRows; ++r) {
      uint16_t rounded = float_to_bf16(sums[r] + (bias ? bias[r] : 0.0f));
      if (residual) rounded = float_to_bf16(bf16_to_float(rounded) + bf16_to_float(residual[b * out_stride + r]));
      out[b * out_stride + r] = rounded;
    }
  }
}

// Rows of x quantized per group of 32: values[i] = 256 code + residue (x = scale * value / 256, to
// within scale / 512), and per group its scale, exact sum and sum of values.
inline void quantize_rows(const float* x, int64_t num_groups, int16_t* values, float* scales, float* sums,
                          int32_t* value_sums) {
  for (int64_t g = 0; g < num_groups; ++g) {
    const float* group = x + g * kGroup;
    float largest = 0.0f, sum = 0.0f;
    for (int64_t i = 0; i < kGroup; ++i) {
      largest = std::max(largest, std::fabs(group[i]));
      sum += group[i];
    }
    const float scale = largest / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    int32_t total = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float scaled = group[i] * inverse, code = std::nearbyint(scaled);
      const float residue = std::min(std::nearbyint((scaled - code) * 256.0f), 127.0f);
      const int32_t value = 256 * static_cast<int32_t>(code) + static_cast<int32_t>(residue);
      values[g * kGroup + i] = static_cast<int16_t>(value);
      total += value;
    }
    scales[g] = scale, sums[g] = sum, value_sums[g] = total;
  }
}

// A quantized input's rows from one on, as a tile reads them.
struct Rows {
  const int16_t* values;
  const float *scales, *sums;
  const int32_t* value_sums;
  int64_t groups;
};

// 16 rows' sums (four lanes each) reduced to four registers of 4 rows.
inline void reduce_rows(const int32x4_t (&acc)[kRows], int32x4_t (&out)[4]) {
  for (int q = 0; q < 4; ++q)
    out[q] = vpaddq_s32(vpaddq_s32(acc[4 * q], acc[4 * q + 1]), vpaddq_s32(acc[4 * q + 2], acc[4 * q + 3]));
}

// sum(code * value) over one int8 group for 16 rows (block j's byte 4r + i: row r's code for input
// 4j + i), exact in int32.
inline void int8_group(const uint8_t* c, const int16_t* x, int32x4_t (&out)[4]) {
  int32x4_t acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = vdupq_n_s32(0);
  for (int j = 0; j < 8; ++j) {
    const int16x4_t xs = vld1_s16(x + 4 * j);
    for (int q = 0; q < 4; ++q) {
      const uint8x16_t raw = vld1q_u8(c + 64 * j + 16 * q);  // rows 4q..4q+3
      const int16x8_t low = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(raw)));
      const int16x8_t high = vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(raw)));
      acc[4 * q] = vmlal_s16(acc[4 * q], vget_low_s16(low), xs);
      acc[4 * q + 1] = vmlal_s16(acc[4 * q + 1], vget_high_s16(low), xs);
      acc[4 * q + 2] = vmlal_s16(acc[4 * q + 2], vget_low_s16(high), xs);
      acc[4 * q + 3] = vmlal_s16(acc[4 * q + 3], vget_high_s16(high), xs);
    }
  }
  reduce_rows(acc, out);
}

// The same over one int4 group (block i's byte 4r + j: row r's code for input 4i + j in its low
// nibble, for 16 + 4i + j in its high one).
inline void int4_group(const uint8_t* c, const int16_t* x, int32x4_t (&out)[4]) {
  int32x4_t acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = vdupq_n_s32(0);
  const uint16x8_t nibble = vdupq_n_u16(0x0F);
  for (int i = 0; i < 4; ++i) {
    const int16x4_t lows = vld1_s16(x + 4 * i), highs = vld1_s16(x + 16 + 4 * i);
    for (int q = 0; q < 4; ++q) {
      const uint8x16_t raw = vld1q_u8(c + 64 * i + 16 * q);
      for (int h = 0; h < 2; ++h) {  // rows 4q + 2h and 4q + 2h + 1
        const uint16x8_t wide = vmovl_u8(h == 0 ? vget_low_u8(raw) : vget_high_u8(raw));
        const int16x8_t low = vreinterpretq_s16_u16(vandq_u16(wide, nibble));
        const int16x8_t high = vreinterpretq_s16_u16(vshrq_n_u16(wide, 4));
        int32x4_t& first = acc[4 * q + 2 * h];
        int32x4_t& second = acc[4 * q + 2 * h + 1];
        first = vmlal_s16(vmlal_s16(first, vget_low_s16(low), lows), vget_low_s16(high), highs);
        second = vmlal_s16(vmlal_s16(second, vget_high_s16(low), lows), vget_high_s16(high), highs);
      }
    }
  }
  reduce_rows(acc, out);
}

// B input rows against one int8 tile: out[b * out_stride + r] = scale[r] * sum over groups of
// dx / 256 * (sum(u * value) - 128 * sum(value)).
template <int B>
void int8_tile(const uint8_t* codes, const uint16_t* row_scales, const Rows& x, float* out, int64_t out_stride) {
  const int64_t groups = x.groups, inputs = groups * kGroup;
  float32x4_t acc[B][4];
  for (int b = 0; b < B; ++b)
    for (int q = 0; q < 4; ++q) acc[b][q] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < groups; ++g)
    for (int b = 0; b < B; ++b) {
      int32x4_t dot[4];
      int8_group(codes + g * kByteCodes, x.values + b * inputs + g * kGroup, dot);
      const int32x4_t offset = vdupq_n_s32(128 * x.value_sums[b * groups + g]);
      const float step = x.scales[b * groups + g] / 256.0f;
      for (int q = 0; q < 4; ++q) acc[b][q] = vfmaq_n_f32(acc[b][q], vcvtq_f32_s32(vsubq_s32(dot[q], offset)), step);
    }
  for (int b = 0; b < B; ++b)
    for (int q = 0; q < 4; ++q) vst1q_f32(out + b * out_stride + 4 * q, vmulq_f32(acc[b][q], widen4(row_scales + 4 * q)));
}

// B input rows against one int4 tile, its params bf16 scales and zeros per span of S groups (`spans`
// a tile), or nested (a head of bf16 row scales and lows, then per group 16 uint8 scale codes and 16
// int8 low codes): as quantized_linear.cpp's int4_tile.
template <int B>
void int4_tile(const uint8_t* codes, const uint8_t* params, bool nested, int64_t spans, const Rows& x, float* out,
               int64_t out_stride) {
  const int64_t groups = x.groups, inputs = groups * kGroup, S = groups / spans;
  float32x4_t acc[B][4], low_acc[B][4];
  for (int b = 0; b < B; ++b)
    for (int q = 0; q < 4; ++q) acc[b][q] = low_acc[b][q] = vdupq_n_f32(0.0f);
  for (int64_t span = 0; span < spans; ++span) {
    float32x4_t dots[B][4];
    float sum[B];
    for (int64_t s = 0; s < S; ++s) {
      const int64_t g = span * S + s;
      for (int b = 0; b < B; ++b) {
        int32x4_t dot[4];
        int4_group(codes + g * kCodeBytes, x.values + b * inputs + g * kGroup, dot);
        const float step = x.scales[b * groups + g] / 256.0f;
        for (int q = 0; q < 4; ++q) {
          const float32x4_t d = vcvtq_f32_s32(dot[q]);
          dots[b][q] = s == 0 ? vmulq_n_f32(d, step) : vfmaq_n_f32(dots[b][q], d, step);
        }
        sum[b] = s == 0 ? x.sums[b * groups + g] : sum[b] + x.sums[b * groups + g];
      }
    }
    for (int q = 0; q < 4; ++q) {
      float32x4_t scale, offset;
      if (nested) {
        const uint8_t* group = params + kNestedHead + span * kNestedGroup;
        const uint16x8_t scales = vmovl_u8(vld1_u8(group + 8 * (q / 2)));
        scale = vcvtq_f32_u32(vmovl_u16(q % 2 ? vget_high_u16(scales) : vget_low_u16(scales)));
        const int16x8_t lows = vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(group + kRows + 8 * (q / 2))));
        offset = vcvtq_f32_s32(vmovl_s16(q % 2 ? vget_high_s16(lows) : vget_low_s16(lows)));
      } else {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(params) + span * 2 * kRows;
        scale = widen4(p + 4 * q);
        offset = vfmaq_f32(widen4(p + kRows + 4 * q), vdupq_n_f32(-8.0f), scale);
      }
      for (int b = 0; b < B; ++b) {
        acc[b][q] = vfmaq_f32(acc[b][q], dots[b][q], scale);
        if (nested) low_acc[b][q] = vfmaq_n_f32(low_acc[b][q], offset, sum[b]);
        else acc[b][q] = vfmaq_n_f32(acc[b][q], offset, sum[b]);
      }
    }
  }
  const uint16_t* head = reinterpret_cast<const uint16_t*>(params);
  for (int b = 0; b < B; ++b)
    for (int q = 0; q < 4; ++q) {
      float32x4_t value = acc[b][q];
      if (nested) value = vfmaq_f32(vmulq_f32(value, widen4(head + 4 * q)), low_acc[b][q], widen4(head + kRows + 4 * q));
      vst1q_f32(out + b * out_stride + 4 * q, value);
    }
}

}  // namespace kvchat_neon
