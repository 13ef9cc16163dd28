// The neon tier's arithmetic (kvchat/native/neon_linear.h) against a float64 reference on the same
// tiles, and each row's outputs the same bits alone and among 4 rows. A standalone program, without
// torch: tests/test_cpu_tiers.py builds it with aarch64-linux-gnu-g++ and runs it under qemu-aarch64.
// Prints one line per check; exits 1 where one fails.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "neon_linear.h"

using namespace kvchat_neon;

namespace {

uint32_t state = 12345;
float uniform() {  // in [-1, 1)
  state = state * 1664525u + 1013904223u;
  return static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
}
int code(int levels) { return static_cast<int>((uniform() + 1.0f) * 0.5f * levels) % levels; }
uint16_t bf16(float f) { return float_to_bf16(f); }

int failures = 0;
void check(const char* what, bool ok, double err) {
  std::printf("%s %s (largest error %.3g)\n", ok ? "ok" : "FAILED", what, err);
  failures += ok ? 0 : 1;
}

constexpr int64_t kTiles = 3, kInputs = 128, kGroups = kInputs / kGroup, kWidth = kTiles * kRows, kNumRows = 5;

// out[r][n] by `tile(batch, t, first_row, out)`: 4 rows then 1, and each row alone
template <typename Tile>
void run(Tile&& tile, std::vector<float>& together, std::vector<float>& alone) {
  together.assign(kNumRows * kWidth, 0.0f), alone.assign(kNumRows * kWidth, 0.0f);
  for (int64_t t = 0; t < kTiles; ++t) {
    tile(std::integral_constant<int, 4>{}, t, 0, together.data() + t * kRows);
    tile(std::integral_constant<int, 1>{}, t, 4, together.data() + 4 * kWidth + t * kRows);
    for (int64_t r = 0; r < kNumRows; ++r) tile(std::integral_constant<int, 1>{}, t, r, alone.data() + r * kWidth + t * kRows);
  }
}

double largest_error(const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& size) {
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]) / (size[i] + 1e-30));
  return worst;
}

void check_fp32(const std::vector<float>& W, const std::vector<float>& x) {
  std::vector<float> tiles(kWidth * kInputs);
  for (int64_t n = 0; n < kWidth; ++n)
    for (int64_t k = 0; k < kInputs; ++k) tiles[((n / kRows) * kInputs + k) * kRows + n % kRows] = W[n * kInputs + k];
  std::vector<float> together, alone;
  run([&](auto b, int64_t t, int64_t r, float* out) {
    fp32_tile<decltype(b)::value>(tiles.data() + t * kInputs * kRows, kInputs, x.data() + r * kInputs, nullptr, nullptr, out, kWidth);
  }, together, alone);
  std::vector<double> want(together.size()), size(together.size());
  for (int64_t r = 0; r < kNumRows; ++r)
    for (int64_t n = 0; n < kWidth; ++n)
      for (int64_t k = 0; k < kInputs; ++k) {
        want[r * kWidth + n] += double(W[n * kInputs + k]) * x[r * kInputs + k];
        size[r * kWidth + n] += std::fabs(double(W[n * kInputs + k]) * x[r * kInputs + k]);
      }
  const double err = largest_error(together, want, size);
  check("fp32 against float64", err < 1e-6, err);
  check("fp32 a row alone and among others", together == alone, 0.0);
}

void check_bf16(const std::vector<float>& W, const std::vector<float>& x) {
  std::vector<uint16_t> tiles(kWidth * kInputs);
  std::vector<float> Wb(W.size()), xb(x.size());
  for (size_t i = 0; i < W.size(); ++i) Wb[i] = bf16_to_float(bf16(W[i]));
  for (size_t i = 0; i < x.size(); ++i) xb[i] = bf16_to_float(bf16(x[i]));
  for (int64_t n = 0; n < kWidth; ++n)
    for (int64_t k = 0; k < kInputs; ++k)
      tiles[((n / kRows) * (kInputs / 2) + k / 2) * kPair + 2 * (n % kRows) + k % 2] = bf16(W[n * kInputs + k]);
  std::vector<uint16_t> t16(kNumRows * kWidth), a16(kNumRows * kWidth);
  for (int64_t t = 0; t < kTiles; ++t) {
    const uint16_t* w = tiles.data() + t * (kInputs / 2) * kPair;
    bf16_tile<4>(w, kInputs / 2, xb.data(), nullptr, nullptr, t16.data() + t * kRows, kWidth);
    bf16_tile<1>(w, kInputs / 2, xb.data() + 4 * kInputs, nullptr, nullptr, t16.data() + 4 * kWidth + t * kRows, kWidth);
    for (int64_t r = 0; r < kNumRows; ++r)
      bf16_tile<1>(w, kInputs / 2, xb.data() + r * kInputs, nullptr, nullptr, a16.data() + r * kWidth + t * kRows, kWidth);
  }
  double worst = 0.0;
  for (int64_t r = 0; r < kNumRows; ++r)
    for (int64_t n = 0; n < kWidth; ++n) {
      double sum = 0.0;
      for (int64_t k = 0; k < kInputs; ++k) sum += double(Wb[n * kInputs + k]) * xb[r * kInputs + k];
      const double got = bf16_to_float(t16[r * kWidth + n]);
      worst = std::max(worst, std::fabs(got - sum) / std::max(std::fabs(sum), 1e-3));
    }
  check("bf16 against float64 rounded to bf16", worst <= 1.0 / 128, worst);
  check("bf16 a row alone and among others", t16 == a16, 0.0);
}

// x as the quantized kernels see it: per group, scale * value / 256
std::vector<double> dequantized_input(const std::vector<float>& x, std::vector<int16_t>& values, std::vector<float>& scales,
                                      std::vector<float>& sums, std::vector<int32_t>& value_sums) {
  values.resize(x.size()), scales.resize(kNumRows * kGroups), sums.resize(scales.size()), value_sums.resize(scales.size());
  quantize_rows(x.data(), kNumRows * kGroups, values.data(), scales.data(), sums.data(), value_sums.data());
  std::vector<double> xq(x.size());
  for (size_t i = 0; i < x.size(); ++i) xq[i] = double(scales[i / kGroup]) * values[i] / 256.0;
  return xq;
}

void check_int8(const std::vector<float>& x) {
  std::vector<int16_t> values; std::vector<float> scales, sums; std::vector<int32_t> value_sums;
  const std::vector<double> xq = dequantized_input(x, values, scales, sums, value_sums);
  std::vector<uint8_t> codes(kTiles * kGroups * kByteCodes);
  std::vector<int> u(kWidth * kInputs);
  std::vector<uint16_t> row_scales(kWidth);
  for (auto& s : row_scales) s = bf16(0.01f + 0.01f * std::fabs(uniform()));
  for (int64_t n = 0; n < kWidth; ++n)
    for (int64_t k = 0; k < kInputs; ++k) {
      u[n * kInputs + k] = code(256);
      const int64_t g = k / kGroup, j = (k % kGroup) / 4, i = k % 4;
      codes[((n / kRows) * kGroups + g) * kByteCodes + 64 * j + 4 * (n % kRows) + i] = uint8_t(u[n * kInputs + k]);
    }
  std::vector<float> together, alone;
  run([&](auto b, int64_t t, int64_t r, float* out) {
    const Rows rows{values.data() + r * kInputs, scales.data() + r * kGroups, sums.data() + r * kGroups,
                    value_sums.data() + r * kGroups, kGroups};
    int8_tile<decltype(b)::value>(codes.data() + t * kGroups * kByteCodes, row_scales.data() + t * kRows, rows, out, kWidth);
  }, together, alone);
  std::vector<double> want(together.size()), size(together.size());
  for (int64_t r = 0; r < kNumRows; ++r)
    for (int64_t n = 0; n < kWidth; ++n)
      for (int64_t k = 0; k < kInputs; ++k) {
        const double w = (u[n * kInputs + k] - 128) * double(bf16_to_float(row_scales[n]));
        want[r * kWidth + n] += w * xq[r * kInputs + k];
        size[r * kWidth + n] += std::fabs(w * xq[r * kInputs + k]);
      }
  const double err = largest_error(together, want, size);
  check("int8 against float64", err < 1e-5, err);
  check("int8 a row alone and among others", together == alone, 0.0);
}

void check_int4(const std::vector<float>& x, bool nested, int64_t span) {
  std::vector<int16_t> values; std::vector<float> scales, sums; std::vector<int32_t> value_sums;
  const std::vector<double> xq = dequantized_input(x, values, scales, sums, value_sums);
  const int64_t spans = kGroups / span;
  const int64_t tile_bytes = nested ? kNestedHead + kGroups * kNestedGroup : spans * 2 * kRows * 2;
  std::vector<uint8_t> codes(kTiles * kGroups * kCodeBytes), params(kTiles * tile_bytes);
  std::vector<int> c(kWidth * kInputs);
  std::vector<double> scale_of(kWidth * kGroups), low_of(kWidth * kGroups);  // per row and group
  for (int64_t t = 0; t < kTiles; ++t) {
    uint8_t* p = params.data() + t * tile_bytes;
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t n = t * kRows + r;
      if (nested) {
        const uint16_t row_scale = bf16(0.001f * (1.5f + uniform())), row_low = bf16(0.01f * (1.5f + uniform()));
        std::memcpy(p + 2 * r, &row_scale, 2), std::memcpy(p + 2 * kRows + 2 * r, &row_low, 2);
        for (int64_t g = 0; g < kGroups; ++g) {
          const uint8_t sc = uint8_t(code(256));
          const int8_t lo = int8_t(code(256) - 128);
          p[kNestedHead + g * kNestedGroup + r] = sc, p[kNestedHead + g * kNestedGroup + kRows + r] = uint8_t(lo);
          scale_of[n * kGroups + g] = sc * double(bf16_to_float(row_scale));
          low_of[n * kGroups + g] = lo * double(bf16_to_float(row_low));
        }
      } else {
        for (int64_t s = 0; s < spans; ++s) {
          const uint16_t sc = bf16(0.01f * (1.5f + uniform())), zero = bf16(0.05f * uniform());
          uint16_t* ps = reinterpret_cast<uint16_t*>(p) + s * 2 * kRows;
          ps[r] = sc, ps[kRows + r] = zero;
          for (int64_t g = s * span; g < (s + 1) * span; ++g) {
            scale_of[n * kGroups + g] = bf16_to_float(sc);
            low_of[n * kGroups + g] = double(bf16_to_float(zero)) - 8.0 * bf16_to_float(sc);
          }
        }
      }
    }
  }
  for (int64_t n = 0; n < kWidth; ++n)
    for (int64_t k = 0; k < kInputs; ++k) {
      c[n * kInputs + k] = code(16);
      const int64_t g = k / kGroup, within = k % kGroup, high = within / 16, i = (within % 16) / 4, j = within % 4;
      uint8_t& byte = codes[((n / kRows) * kGroups + g) * kCodeBytes + 64 * i + 4 * (n % kRows) + j];
      byte = uint8_t(byte | (c[n * kInputs + k] << (4 * high)));
    }
  std::vector<float> together, alone;
  run([&](auto b, int64_t t, int64_t r, float* out) {
    const Rows rows{values.data() + r * kInputs, scales.data() + r * kGroups, sums.data() + r * kGroups,
                    value_sums.data() + r * kGroups, kGroups};
    int4_tile<decltype(b)::value>(codes.data() + t * kGroups * kCodeBytes, params.data() + t * tile_bytes, nested, spans,
                                  rows, out, kWidth);
  }, together, alone);
  std::vector<double> want(together.size()), size(together.size());
  for (int64_t r = 0; r < kNumRows; ++r)
    for (int64_t n = 0; n < kWidth; ++n)
      for (int64_t k = 0; k < kInputs; ++k) {
        const int64_t g = k / kGroup;
        const double part = c[n * kInputs + k] * scale_of[n * kGroups + g] * xq[r * kInputs + k] +
                            low_of[n * kGroups + g] * x[r * kInputs + k];
        want[r * kWidth + n] += part;
        size[r * kWidth + n] += std::fabs(c[n * kInputs + k] * scale_of[n * kGroups + g] * xq[r * kInputs + k]) +
                                std::fabs(low_of[n * kGroups + g] * x[r * kInputs + k]);
      }
  const double err = largest_error(together, want, size);
  char name[64];
  std::snprintf(name, sizeof name, "int4 (%s) against float64", nested ? "nested" : span == 1 ? "g32" : "g64");
  check(name, err < 1e-5, err);
  std::snprintf(name, sizeof name, "int4 (%s) a row alone and among others", nested ? "nested" : span == 1 ? "g32" : "g64");
  check(name, together == alone, 0.0);
}

}  // namespace

int main() {
  std::vector<float> W(kWidth * kInputs), x(kNumRows * kInputs);
  for (auto& w : W) w = uniform() * 0.1f;
  for (auto& v : x) v = uniform();
  check_fp32(W, x);
  check_bf16(W, x);
  check_int8(x);
  check_int4(x, false, 1);
  check_int4(x, false, 2);
  check_int4(x, true, 1);
  return failures == 0 ? 0 : 1;
}
