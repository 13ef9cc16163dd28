// The bf16 linear layer, registered for CPU as kvchat::bf16_linear (built by kernels.py) where the CPU
// has AVX-512 BF16; elsewhere kvchat runs oneDNN's packed kernel (linears/bf16_linears.py).
//
// A decode token's linears read every weight once, and nothing else: their pace is the machine's read
// bandwidth. torch's bf16 F.linear reads a one-row product's weights at 5-11 GB/s here, and oneDNN's
// on a packed weight at 6-17 GB/s; this kernel streams a whole SmolLM2 token's weights at 21-24 GB/s
// (one thread), and is as fast as oneDNN's GEMM at 512 rows.
//
// The weight (written by linears/weight_layout.py) is in tiles of 16 rows, each a run of 64-byte
// vdpbf16ps operands: operand p holds inputs 2p and 2p + 1 of the tile's 16 rows (row r's pair in
// bytes 4r..4r+3). Each operand is multiplied by the input's pair broadcast: the products are exact,
// summed in fp32, the bias added, and the sum rounded to bf16 once, as oneDNN's kernel does. Given a
// residual, the rounded output is added to it and rounded again: `residual + linear(x)` in bf16.
//
// One input row streams 8 tiles at once, one sum each, every line prefetched 16 lines ahead into L2:
// 21-23 GB/s over a SmolLM2 token's weights where one tile at a time (four sums, prefetched into L1)
// read 15-17. More input rows go to AMX's tiles where the CPU has them (below); elsewhere 4 at a time
// over one tile (four sums a row), each tile read from memory for the first 4 rows and from cache for
// the rest.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tiled_layout.h"

#include <atomic>

namespace kvchat_tier {

// Whether the linear kernels keep to their batch-invariant paths (no AMX tiles for several rows): on
// unless the engine was started without batch invariance (kvchat::set_batch_invariant).
std::atomic<bool> invariant{true};

bool batch_invariant() { return invariant.load(std::memory_order_relaxed); }

void set_batch_invariant(bool on) { invariant.store(on, std::memory_order_relaxed); }

}  // namespace kvchat_tier

// no tensor to dispatch on: every backend
TORCH_LIBRARY_FRAGMENT(kvchat, m) { m.def("set_batch_invariant(bool on) -> ()", &kvchat_tier::set_batch_invariant); }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVCHAT_AMX 1
#endif

#ifdef KVCHAT_AMX
// What the AMX paths of this file and quantized_linear.cpp share (declared there too).
namespace kvchat_amx {

// Asks Linux once for the tile registers' state (arch_prctl ARCH_REQ_XCOMP_PERM of XTILEDATA);
// without it, AMX instructions fault.
bool permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// tmm0-3 accumulators (input block i, weight tile j: tmm 2i + j), tmm4-5 input blocks, tmm6-7
// weight tiles; each 16 rows of 64 bytes. Each thread configures its own before its tile work. A
// constant in memory: GCC 12 took a configuration built on the stack for dead stores (ldtilecfg's
// builtin does not tell it that it reads them) and loaded zero rows.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};
constexpr TileConfig kTileConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

void configure_tiles() { _tile_loadconfig(&kTileConfig); }

// x (M, K), contiguous, its rows made a whole number of 16-row blocks with zero rows: a tile load
// reads 16 rows.
at::Tensor whole_blocks(const at::Tensor& x) {
  const int64_t rows = x.size(0), padded = (rows + 15) / 16 * 16;
  if (padded == rows) return x.contiguous();
  at::Tensor out = at::zeros({padded, x.size(1)}, x.options());
  out.narrow(0, 0, rows).copy_(x);
  return out;
}

// I blocks of 16 input rows (x, `inputs` apart) against J weight tiles from w (`pairs` operands each),
// over operands first..end-1 (whole tiles of 16): sums[(i J + j) * 256 + 16 r + n], row r of block i
// and output n of tile j.
template <int I, int J>
void block(const uint16_t* x, int64_t inputs, const uint16_t* w, int64_t pairs, int64_t first, int64_t end,
           float* sums) {
  const int64_t stride = inputs * sizeof(uint16_t);
  _tile_zero(0);
  if constexpr (J > 1) _tile_zero(1);
  if constexpr (I > 1) _tile_zero(2);
  if constexpr (I > 1 && J > 1) _tile_zero(3);
  for (int64_t p = first; p < end; p += 16) {
    _tile_loadd(6, w + p * 32, 64);
    if constexpr (J > 1) _tile_loadd(7, w + (pairs + p) * 32, 64);
    _tile_loadd(4, x + 2 * p, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (J > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (I > 1) {
      _tile_loadd(5, x + 16 * inputs + 2 * p, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (J > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kTile = 16 * 16;
  _tile_stored(0, sums, 64);
  if constexpr (J > 1) _tile_stored(1, sums + kTile, 64);
  if constexpr (I > 1) _tile_stored(2, sums + J * kTile, 64);
  if constexpr (I > 1 && J > 1) _tile_stored(3, sums + 3 * kTile, 64);
}

void blocks(int I, int J, const uint16_t* x, int64_t inputs, const uint16_t* w, int64_t pairs, int64_t first,
            int64_t end, float* sums) {
  if (I == 2 && J == 2) block<2, 2>(x, inputs, w, pairs, first, end, sums);
  else if (I == 2) block<2, 1>(x, inputs, w, pairs, first, end, sums);
  else if (J == 2) block<1, 2>(x, inputs, w, pairs, first, end, sums);
  else block<1, 1>(x, inputs, w, pairs, first, end, sums);
}

}  // namespace kvchat_amx
#endif

namespace {

constexpr int64_t kRows = 16;    // output rows a tile
constexpr int64_t kPair = 32;    // bf16 values an operand: 16 rows by 2 inputs
// Several input rows go 8 at a time through 2 tiles (16 sums, each operand loaded once for 8 rows):
// 190-220 GFLOP/s on SmolLM2's shapes at 64-512 rows (one thread), as the earlier loop of 4 rows by
// one tile with four sums a row; 4 rows by 4 tiles ran 0.75x, 16 rows by one tile 0.4x.
constexpr int64_t kBatch = 8;      // input rows a pass over a few tiles
constexpr int kBlockTiles = 2;     // tiles a pass of several input rows
constexpr int64_t kRowGroup = 64;  // input rows that take the tiles in turn
constexpr int64_t kSpan = 8;     // tiles one input row streams at once
// operands (lines) ahead to prefetch, past the end too (prefetches never fault): for one row into L2,
// for more into L1 (into L2 made a 512-row prefill 1.2x slower)
constexpr int64_t kRowAhead = 16, kRowsAhead = 8;

inline __m512bh broadcast_pair(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

inline __m512bh operand(const uint16_t* w) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(w)); }

inline __m512 widen(const uint16_t* x) {  // 16 bf16 values as fp32: bf16 is fp32's upper half
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

inline __m512 bias_of(const float* bias) { return bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps(); }

// A tile's 16 sums plus their bias (or zeros), rounded to bf16, then, where `kResidual`, plus the
// residual, rounded again (a template argument: a branch there, in the loop over several rows, made a
// 512-row prefill 1.25x slower).
template <bool kResidual>
inline void finish(__m512 sum, __m512 bias, const uint16_t* residual, uint16_t* out) {
  __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(sum, bias));
  if constexpr (kResidual)
    rounded = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_cvtpbh_ps(rounded), widen(residual)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(rounded));
}

// One input row x against T consecutive tiles of `pairs` operands: out[r] (r < 16 T), bf16, plus
// residual[r] where given; bias[r] where given.
template <int T>
void row_tiles(const uint16_t* w, int64_t pairs, const uint16_t* x, const float* bias, const uint16_t* residual,
               uint16_t* out) {
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh pair = broadcast_pair(x + 2 * p);
    for (int t = 0; t < T; ++t) {
      const uint16_t* line = w + (t * pairs + p) * kPair;
      _mm_prefetch(reinterpret_cast<const char*>(line + kRowAhead * kPair), _MM_HINT_T1);
      acc[t] = _mm512_dpbf16_ps(acc[t], operand(line), pair);
    }
  }
  for (int t = 0; t < T; ++t) {
    const __m512 offset = bias_of(bias ? bias + t * kRows : nullptr);
    if (residual) finish<true>(acc[t], offset, residual + t * kRows, out + t * kRows);
    else finish<false>(acc[t], offset, nullptr, out + t * kRows);
  }
}

// B input rows (x, `inputs` apart) against T consecutive tiles of `pairs` operands: out[b * out_stride +
// r] for r < 16 T, bf16, plus residual[b * out_stride + r] where `kResidual`. Every (row, tile) sum is one
// chain over the operands in order, as row_tiles runs one row's: a row's outputs are the same bits
// whatever rows come with it.
template <int B, int T, bool kResidual>
void rows_tiles(const uint16_t* w, int64_t pairs, const uint16_t* x, int64_t inputs, const float* bias,
                const uint16_t* residual, uint16_t* out, int64_t out_stride) {
  __m512 acc[B][T];
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) acc[b][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh v[T];
    for (int t = 0; t < T; ++t) {
      const uint16_t* line = w + (t * pairs + p) * kPair;
      _mm_prefetch(reinterpret_cast<const char*>(line + kRowsAhead * kPair), _MM_HINT_T0);
      v[t] = operand(line);
    }
    for (int b = 0; b < B; ++b) {
      const __m512bh pair = broadcast_pair(x + b * inputs + 2 * p);
      for (int t = 0; t < T; ++t) acc[b][t] = _mm512_dpbf16_ps(acc[b][t], v[t], pair);
    }
  }
  // the sums stored first: finishing them in place made GCC keep every sum in memory through the loop
  alignas(64) float sums[B][T][kRows];
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) _mm512_store_ps(sums[b][t], acc[b][t]);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      finish<kResidual>(_mm512_load_ps(sums[b][t]), bias_of(bias ? bias + t * kRows : nullptr),
                        kResidual ? residual + b * out_stride + t * kRows : nullptr, out + b * out_stride + t * kRows);
}

// B (1-4) input rows against tiles begin..end-1, kBlockTiles at a time, then one at a time.
template <int B, bool kResidual>
void rows_by(const uint16_t* w, int64_t pairs, const uint16_t* x, int64_t inputs, const float* bias,
             const uint16_t* residual, uint16_t* out, int64_t width, int64_t begin, int64_t end) {
  const auto at = [&](int64_t t) { return w + t * pairs * kPair; };
  const auto bias_at = [&](int64_t t) { return bias ? bias + t * kRows : nullptr; };
  const auto residual_at = [&](int64_t t) { return kResidual ? residual + t * kRows : nullptr; };
  int64_t t = begin;
  for (; t + kBlockTiles <= end; t += kBlockTiles)
    rows_tiles<B, kBlockTiles, kResidual>(at(t), pairs, x, inputs, bias_at(t), residual_at(t), out + t * kRows, width);
  for (; t < end; ++t)
    rows_tiles<B, 1, kResidual>(at(t), pairs, x, inputs, bias_at(t), residual_at(t), out + t * kRows, width);
}

// `count` (1 to kBatch) input rows against tiles begin..end-1: 8, 4, 2 and 1 at a time.
template <bool kResidual>
void rows_block(int64_t count, const uint16_t* w, int64_t pairs, const uint16_t* x, int64_t inputs, const float* bias,
                const uint16_t* residual, uint16_t* out, int64_t width, int64_t begin, int64_t end) {
  for (int64_t done = 0; done < count;) {
    const int64_t left = count - done;
    const uint16_t* xr = x + done * inputs;
    const uint16_t* rr = kResidual ? residual + done * width : nullptr;
    uint16_t* to = out + done * width;
    if (left >= 8) rows_by<8, kResidual>(w, pairs, xr, inputs, bias, rr, to, width, begin, end);
    else if (left >= 4) rows_by<4, kResidual>(w, pairs, xr, inputs, bias, rr, to, width, begin, end);
    else if (left >= 2) rows_by<2, kResidual>(w, pairs, xr, inputs, bias, rr, to, width, begin, end);
    else rows_by<1, kResidual>(w, pairs, xr, inputs, bias, rr, to, width, begin, end);
    done += left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
  }
}

// Several input rows against tiles begin..end-1: kRowGroup rows at a time (kept in L2), each group
// through the tiles kBlockTiles at a time, 4 rows a pass (the tiles read from cache after the group's
// first 4 rows).
template <bool kResidual>
void many_rows(const uint16_t* w, int64_t pairs, const uint16_t* x, int64_t rows, const float* bias,
               const uint16_t* residual, uint16_t* out, int64_t width, int64_t begin, int64_t end) {
  const int64_t inputs = 2 * pairs;
  for (int64_t group = 0; group < rows; group += kRowGroup) {
    const int64_t group_end = std::min(rows, group + kRowGroup);
    for (int64_t t = begin; t < end; t += kBlockTiles) {
      const int64_t stop = std::min(t + kBlockTiles, end);
      for (int64_t r = group; r < group_end; r += kBatch) {
        const uint16_t* xr = x + r * inputs;
        const uint16_t* rr = kResidual ? residual + r * width : nullptr;
        uint16_t* to = out + r * width;
        rows_block<kResidual>(std::min(kBatch, group_end - r), w, pairs, xr, inputs, bias, rr, to, width, t, stop);
      }
    }
  }
}

// One input row against tiles begin..end-1: kSpan at a time, then the rest in halves.
void row(const uint16_t* w, int64_t pairs, const uint16_t* x, const float* bias, const uint16_t* residual,
         uint16_t* out, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end;) {
    const int64_t n = end - t >= kSpan ? kSpan : end - t >= 4 ? 4 : end - t >= 2 ? 2 : 1;
    const uint16_t* wt = w + t * pairs * kPair;
    const float* bt = bias ? bias + t * kRows : nullptr;
    const uint16_t* rt = residual ? residual + t * kRows : nullptr;
    switch (n) {
      case kSpan: row_tiles<kSpan>(wt, pairs, x, bt, rt, out + t * kRows); break;
      case 4: row_tiles<4>(wt, pairs, x, bt, rt, out + t * kRows); break;
      case 2: row_tiles<2>(wt, pairs, x, bt, rt, out + t * kRows); break;
      default: row_tiles<1>(wt, pairs, x, bt, rt, out + t * kRows); break;
    }
    t += n;
  }
}

#ifdef KVCHAT_AMX
// Several input rows on AMX (Intel's tile unit, where the CPU has it): the tiles' operands are already
// the layout TDPBF16PS takes its second matrix in (16 consecutive operands, 64 bytes each, are one
// 16-pair by 16-row tile), and 16 input rows by 32 inputs, read in place, are its first. A block of
// 32 input rows by 2 tiles (32 outputs) is four fp32 accumulator tiles; every sum is exact products
// added in fp32, then finished as above. On a 2.1 GHz Xeon, one thread, 512 rows: 980-1040 GFLOP/s on
// SmolLM2's shapes and 660 on 2048 -> 11008, where the AVX-512 loop above ran 73-86 (oneDNN's own AMX
// GEMM: 710-960); and 2 to 32 rows cost what one row costs the streaming loop, the weights' read.
constexpr int64_t kAmxRows = 16;   // input rows an AMX tile
constexpr int64_t kAmxPairs = 16;  // operands (input pairs) an AMX tile
// input rows from which AMX serves, the last block padded with zeros: 16 rows cost it what one row
// costs the streaming loop (weight-bound), and 2 already cost the loop above more (one row: as much)
constexpr int64_t kAmxFrom = 2;

// Input rows 0..rows-1 of x (their count rounded up to 16 in x, the rest zeros) against tiles
// begin..end-1, two at a time: out[r * width + n] as the loop above writes it.
void amx_rows(const uint16_t* w, int64_t pairs, const uint16_t* x, int64_t rows, const float* bias,
              const uint16_t* residual, uint16_t* out, int64_t width, int64_t begin, int64_t end) {
  kvchat_amx::configure_tiles();
  alignas(64) float sums[4 * kAmxRows * kRows];
  const int64_t blocks = (rows + kAmxRows - 1) / kAmxRows;
  for (int64_t t = begin; t < end; t += 2) {
    const int J = end - t >= 2 ? 2 : 1;
    const uint16_t* wt = w + t * pairs * kPair;
    for (int64_t block = 0; block < blocks; block += 2) {
      const int I = blocks - block >= 2 ? 2 : 1;
      const uint16_t* xb = x + block * kAmxRows * (2 * pairs);
      kvchat_amx::blocks(I, J, xb, 2 * pairs, wt, pairs, 0, pairs, sums);
      for (int i = 0; i < I; ++i)
        for (int j = 0; j < J; ++j) {
          const int64_t n = (t + j) * kRows;
          const __m512 offset = bias_of(bias ? bias + n : nullptr);
          for (int64_t r = 0; r < kAmxRows; ++r) {
            const int64_t row = (block + i) * kAmxRows + r;
            if (row >= rows) break;
            const __m512 sum = _mm512_load_ps(sums + (i * J + j) * kAmxRows * kRows + r * kRows);
            if (residual) finish<true>(sum, offset, residual + row * width + n, out + row * width + n);
            else finish<false>(sum, offset, nullptr, out + row * width + n);
          }
        }
    }
  }
  _tile_release();
}
#endif

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  kvchat_layout::check_bf16_tiles(x, tiles);
  const int64_t rows = x.size(0), inputs = x.size(1), pairs = tiles.size(1), width = tiles.size(0) * kRows;
  const auto [offsets, added] = kvchat_layout::extras("bf16_linear", bias, residual, rows, width, at::kBFloat16);
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty({rows, width}, x.options());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  const uint16_t* in = reinterpret_cast<const uint16_t*>(input.data_ptr<at::BFloat16>());
  const float* b = bias.has_value() ? offsets.data_ptr<float>() : nullptr;
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint16_t* res = added.defined() ? reinterpret_cast<const uint16_t*>(added.data_ptr<at::BFloat16>()) : nullptr;
  if (rows == 1) {
    at::parallel_for(0, tiles.size(0), kSpan,
                     [&](int64_t begin, int64_t end) { row(w, pairs, in, b, res, o, begin, end); });
    return out;
  }
#ifdef KVCHAT_AMX
  if (rows >= kAmxFrom && pairs % kAmxPairs == 0 && !kvchat_tier::batch_invariant() && kvchat_amx::permitted()) {
    const at::Tensor padded = kvchat_amx::whole_blocks(input);
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(padded.data_ptr<at::BFloat16>());
    at::parallel_for(0, (tiles.size(0) + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      amx_rows(w, pairs, xp, rows, b, res, o, width, 2 * begin, std::min(2 * end, tiles.size(0)));
    });
    return out;
  }
#endif
  at::parallel_for(0, tiles.size(0), kBlockTiles, [&](int64_t begin, int64_t end) {
    if (res) many_rows<true>(w, pairs, in, rows, b, res, o, width, begin, end);
    else many_rows<false>(w, pairs, in, rows, b, res, o, width, begin, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("bf16_linear(Tensor x, Tensor tiles, Tensor? bias, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) { m.impl("bf16_linear", &bf16_linear); }

#endif
