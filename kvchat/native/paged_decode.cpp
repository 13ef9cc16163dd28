// Attention over the paged K/V pool that reads each past key and value once, in place, by slot,
// registered for CPU (built by kvchat/native/kernels.py):
//   kvchat::paged_attention         new tokens whose K/V the pool holds (the lean step);
//   kvchat::paged_attention_rows    the same, returned in the layout the output projection takes.
//
// fp32 arithmetic throughout: scores of the grouped query heads against the keys, a softmax, and the
// values mixed by it. Gathering a layer's K/V first (1.5 MB each for SmolLM2 at 4,096 positions) and
// multiplying the copy read everything twice; here each row is read once, where it lies in the pool.
//
// A query row's result is the same bits whatever rows come with it (one decoded token, speculation's
// drafts, a prefill chunk whose own K/V are written to the pool first): each score is one dot product
// in a fixed order, the softmax runs over exactly the positions the row sees, with kvchat's own e^x, and
// the values are mixed in position order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// GCC/Clang vector extensions: a vector of 16 floats, one zmm register, with AVX-512; of 8 otherwise,
// one ymm with AVX2 (two xmm with SSE2, two q with NEON), so a tier of 16 vector registers holds a key
// row and the query's where 16 lanes would take two or four each and spill.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float floatv __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t halfv __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t wordv __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t maskv __attribute__((vector_size(kLanes * sizeof(int32_t))));

// The lanes of a then b (0-15 a's, 16-31 b's) in the order given: Clang's builtin, or GCC's, which
// GCC has had since 4.7 (its __builtin_shufflevector only since 12).
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, maskv{__VA_ARGS__})
#endif

constexpr int64_t kTile = 32;  // positions per pass over the query heads: their rows stay in L1

inline floatv load(const float* p) {
  floatv v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline floatv load(const c10::BFloat16* p) {
  halfv h;
  std::memcpy(&h, p, sizeof h);
  wordv w = __builtin_convertvector(h, wordv) << 16;  // bf16 is fp32's upper half
  floatv v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline void store(float* p, floatv v) { std::memcpy(p, &v, sizeof v); }

// A bf16 row is read 32 values at a time as 16 words: each word's low half (shifted up) is an even
// element, its high half an odd one, as fp32 -- two bit operations, where widening 16 values at a
// time takes a lane shuffle. So with bf16 rows of a head size that is a multiple of 32, the scaled
// query and the mixed values are kept in that order: each 32 floats as their 16 even elements, then
// the 16 odd ones (`split_pairs`, `join_pairs`).
template <typename T, int C>
constexpr bool kPaired = std::is_same_v<T, c10::BFloat16> && C > 0 && C % 2 == 0;

template <typename T, int C>
inline void load_row(const T* row, floatv (&out)[C]) {
  if constexpr (kPaired<T, C>) {
    for (int m = 0; m < C / 2; ++m) {
      wordv w;
      std::memcpy(&w, row + m * 2 * kLanes, sizeof w);
      wordv even = w << 16, odd = w & 0xFFFF0000u;
      std::memcpy(&out[2 * m], &even, sizeof even);
      std::memcpy(&out[2 * m + 1], &odd, sizeof odd);
    }
  } else {
    for (int c = 0; c < C; ++c) out[c] = load(row + c * kLanes);
  }
}

// each 32 floats of x (n of them) as evens then odds, and back
inline void split_pairs(float* x, int64_t n) {
  float pairs[2 * kLanes];
  for (int64_t at = 0; at < n; at += 2 * kLanes) {
    for (int j = 0; j < kLanes; ++j) pairs[j] = x[at + 2 * j], pairs[kLanes + j] = x[at + 2 * j + 1];
    std::memcpy(x + at, pairs, sizeof pairs);
  }
}

inline void join_pairs(float* x, int64_t n) {
  float pairs[2 * kLanes];
  for (int64_t at = 0; at < n; at += 2 * kLanes) {
    for (int j = 0; j < kLanes; ++j) pairs[2 * j] = x[at + j], pairs[2 * j + 1] = x[at + kLanes + j];
    std::memcpy(x + at, pairs, sizeof pairs);
  }
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
inline float sum(floatv v) {
  // a tree of lane shuffles: 4 adds, where a lane-by-lane sum takes 15 dependent ones
  v += SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// The lane sums of 16 vectors as one vector, sum(v[t]) in lane t: four rounds of pairing, each adding
// the halves of two vectors laid side by side (15 adds for 16 sums, where one sum at a time takes 4).
inline floatv lane_sums(floatv* v) {
  for (int i = 0; i < 8; ++i)
    v[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    v[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUFFLE(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    v[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUFFLE(v[2 * i], v[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  floatv sums = SHUFFLE(v[0], v[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                SHUFFLE(v[0], v[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // the rounds leave position t in the lane of t's bits reversed
  return SHUFFLE(sums, sums, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#else
inline float sum(floatv v) {
  v += SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

// The lane sums of 8 vectors as one vector, as above in three rounds.
inline floatv lane_sums(floatv* v) {
  for (int i = 0; i < 4; ++i)
    v[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    v[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           SHUFFLE(v[2 * i], v[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  floatv sums = SHUFFLE(v[0], v[1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(v[0], v[1], 1, 9, 3, 11, 5, 13, 7, 15);
  return SHUFFLE(sums, sums, 0, 4, 2, 6, 1, 5, 3, 7);
}
#endif

// A row is C vectors (head_dim = C * kLanes); NG query heads at a time, held in registers.

template <typename T, int C, int NG>
void scores_group(const float* q, const T* const* rows, int64_t count, float* scores, int64_t stride) {
  floatv qv[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load(q + (g * C + c) * kLanes);
  floatv acc[NG][kLanes];
  int64_t t = 0;
  for (; t + kLanes <= count; t += kLanes) {
    for (int i = 0; i < kLanes; ++i) {
      floatv k[C];
      load_row<T, C>(rows[t + i], k);
      for (int g = 0; g < NG; ++g) acc[g][i] = floatv{};
      for (int c = 0; c < C; ++c)
        for (int g = 0; g < NG; ++g) acc[g][i] += qv[g][c] * k[c];
    }
    for (int g = 0; g < NG; ++g) store(scores + g * stride + t, lane_sums(acc[g]));
  }
  for (; t < count; ++t) {
    floatv k[C], one[NG] = {};
    load_row<T, C>(rows[t], k);
    for (int c = 0; c < C; ++c)
      for (int g = 0; g < NG; ++g) one[g] += qv[g][c] * k[c];
    for (int g = 0; g < NG; ++g) scores[g * stride + t] = sum(one[g]);
  }
}

template <typename T, int C, int NG>
void mix_group(const float* probs, int64_t stride, const T* const* rows, int64_t count, float* out,
               int64_t head_floats) {
  floatv acc[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = load(out + g * head_floats + c * kLanes);
  for (int64_t t = 0; t < count; ++t) {
    floatv v[C];
    load_row<T, C>(rows[t], v);
    for (int g = 0; g < NG; ++g) {
      const float p = probs[g * stride + t];
      for (int c = 0; c < C; ++c) acc[g][c] += p * v[c];
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) store(out + g * head_floats + c * kLanes, acc[g][c]);
}

// Query heads a pass takes, as many as the vector registers hold beside a row of C vectors: 32 zmm
// with AVX-512, 16 registers otherwise.
constexpr int heads_at_once(int C) {
  if (kLanes == 16) return C <= 4 ? 4 : C <= 8 ? 2 : 1;
  return C <= 2 ? 4 : C <= 4 ? 2 : 1;
}

// Every query head of a KV head, NG at a time (as many as registers hold), then the rest.
template <typename T, int C>
void scores_rows(const float* q, int64_t G, const T* const* rows, int64_t count, float* scores, int64_t stride) {
  constexpr int NG = heads_at_once(C);
  int64_t g = 0;
  for (; g + NG <= G; g += NG) scores_group<T, C, NG>(q + g * C * kLanes, rows, count, scores + g * stride, stride);
  switch (G - g) {
    case 3: scores_group<T, C, 3>(q + g * C * kLanes, rows, count, scores + g * stride, stride); break;
    case 2: scores_group<T, C, 2>(q + g * C * kLanes, rows, count, scores + g * stride, stride); break;
    case 1: scores_group<T, C, 1>(q + g * C * kLanes, rows, count, scores + g * stride, stride); break;
    default: break;
  }
}

// Vectors of a value row one pass of mix_rows takes: with AVX2, 8 (its sums and the row's values fill
// the 16 registers: heads of 128 mixed 1.07-1.12x faster in parts); with AVX-512 the whole row fits
// its 32 registers; with SSE2 (the portable tier) parts were measured slower, so the whole row too.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kMixVectors = 8;
#else
constexpr int kMixVectors = 64;
#endif

template <typename T, int C>
void mix_rows(const float* probs, int64_t stride, int64_t G, const T* const* rows, int64_t count, float* out) {
  // on AVX2, rows of more than 8 vectors in parts of 8, each part's sums held in registers over every
  // position (16 sums and a row of 16 vectors spilled); each value is still summed over the positions
  // in order, so the parts change no bit
  constexpr int P = C > kMixVectors ? kMixVectors : C;
  constexpr int NG = heads_at_once(P);
  const T* part_rows[kTile];
  for (int part = 0; part < C / P; ++part) {
    const T* const* at = rows;
    if constexpr (P < C) {
      for (int64_t t = 0; t < count; ++t) part_rows[t] = rows[t] + part * P * kLanes;
      at = part_rows;
    }
    float* o = out + part * P * kLanes;
    constexpr int64_t head = C * kLanes;  // floats between two heads' outputs
    int64_t g = 0;
    for (; g + NG <= G; g += NG) mix_group<T, P, NG>(probs + g * stride, stride, at, count, o + g * head, head);
    switch (G - g) {
      case 3: mix_group<T, P, 3>(probs + g * stride, stride, at, count, o + g * head, head); break;
      case 2: mix_group<T, P, 2>(probs + g * stride, stride, at, count, o + g * head, head); break;
      case 1: mix_group<T, P, 1>(probs + g * stride, stride, at, count, o + g * head, head); break;
      default: break;
    }
  }
}

// Head sizes without a vector path (see `by_head_size`), element by element.
template <typename T>
void scores_any(const float* q, int64_t G, int64_t D, const T* const* rows, int64_t count, float* scores,
                int64_t stride) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t g = 0; g < G; ++g) {
      float total = 0.f;
      for (int64_t d = 0; d < D; ++d) total += q[g * D + d] * to_float(rows[t][d]);
      scores[g * stride + t] = total;
    }
}

template <typename T>
void mix_any(const float* probs, int64_t stride, int64_t G, int64_t D, const T* const* rows, int64_t count,
             float* out) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += probs[g * stride + t] * to_float(rows[t][d]);
}

// One KV head's rows: position t at its slot in the pool.
template <typename T>
struct HeadRows {
  const T* head;
  int64_t row_stride;
  const int64_t* slots;

  const T* row(int64_t t) const { return head + slots[t] * row_stride; }
};

// Calls f with the vectors a row of D values takes, as a std::integral_constant, or with 0 where D
// has no vector path (the rows then go element by element).
template <typename F>
void by_head_size(int64_t D, F&& f) {
  switch (D % kLanes ? 0 : D / kLanes) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    default: f(std::integral_constant<int, 0>{});
  }
}

// Calls f(C, t0, rows, count) for each tile of a KV head's rows of positions first..end-1, C the head
// size's vectors a row (by_head_size; 0: no vector path).
template <typename T, typename F>
void each_tile(int64_t D, const HeadRows<T>& heads, int64_t first, int64_t end, F&& f) {
  by_head_size(D, [&](auto vectors) {
    const T* rows[kTile];
    for (int64_t t0 = first; t0 < end; t0 += kTile) {
      const int64_t count = std::min(kTile, end - t0);
      for (int64_t i = 0; i < count; ++i) rows[i] = heads.row(t0 + i);
      f(vectors, t0, rows, count);
    }
  });
}

// One KV head: scores (R, stride) of the query rows q (R, D), already scaled, against positions
// 0..end-1.
template <typename T>
void head_scores(const float* q, int64_t R, int64_t D, const HeadRows<T>& heads, int64_t end, float* scores,
                 int64_t stride) {
  each_tile(D, heads, 0, end, [&](auto vectors, int64_t t0, const T* const* rows, int64_t count) {
    constexpr int C = decltype(vectors)::value;
    if constexpr (C > 0) scores_rows<T, C>(q, R, rows, count, scores + t0, stride);
    else scores_any<T>(q, R, D, rows, count, scores + t0, stride);
  });
}

// One KV head: out (R, D) plus probs (R, stride) times the value rows, over positions first..end-1,
// position by position.
template <typename T>
void head_mix(const float* probs, int64_t stride, int64_t R, int64_t D, const HeadRows<T>& heads, int64_t first,
              int64_t end, float* out) {
  each_tile(D, heads, first, end, [&](auto vectors, int64_t t0, const T* const* rows, int64_t count) {
    constexpr int C = decltype(vectors)::value;
    if constexpr (C > 0) mix_rows<T, C>(probs + t0, stride, R, rows, count, out);
    else mix_any<T>(probs + t0, stride, R, D, rows, count, out);
  });
}

// e^x of 16 lanes: 2^n e^r, n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e^r by Cephes'
// polynomial for expf (within ~1 ulp); x clamped to where the result is a normal float.
inline floatv exp_lanes(floatv x) {
  const floatv low = floatv{} - 87.3365f, high = floatv{} + 88.3762f;
  x = x < low ? low : x;
  x = x > high ? high : x;
  const floatv magic = floatv{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const floatv n = (x * 1.44269504f + magic) - magic;
  const floatv r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  floatv y = floatv{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const maskv bits = (__builtin_convertvector(n, maskv) + 127) << 23;
  floatv scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

}  // namespace

namespace kvchat_math {

// e^x of n floats, each computed alike wherever it lies (the last lanes padded): what attention's
// softmax and the MLP's silu (decode_layer.cpp) take, so a value's result never depends on its row's
// length or neighbours, as torch's ops' scalar tails and vector bodies may.
void exp_floats(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, exp_lanes(load(x + i)));
  if (i < n) {
    float lanes[kLanes] = {};
    std::copy(x + i, x + n, lanes);
    store(lanes, exp_lanes(load(lanes)));
    std::copy(lanes, lanes + (n - i), out + i);
  }
}

}  // namespace kvchat_math

namespace {

// The softmax of a row's first `seen` scores, in place: its largest subtracted, e^s lane by lane, the
// sum 16 lanes at a time in position order (the last lanes padded with zeros), its lanes added in one
// tree (`sum`), and each times 1/sum. The same scores give the same bits whatever the row's length
// beyond `seen`.
void normalize(float* s, int64_t seen) {
  const float lowest = -std::numeric_limits<float>::infinity();
  floatv tops = floatv{} + lowest;
  int64_t t = 0;
  for (; t + kLanes <= seen; t += kLanes) tops = load(s + t) > tops ? load(s + t) : tops;
  float top = lowest;
  for (int l = 0; l < kLanes; ++l) top = std::max(top, tops[l]);
  for (; t < seen; ++t) top = std::max(top, s[t]);
  floatv lanes{};
  for (t = 0; t + kLanes <= seen; t += kLanes) {
    const floatv e = exp_lanes(load(s + t) - top);
    store(s + t, e);
    lanes += e;
  }
  if (t < seen) {
    float rest[kLanes];
    std::fill(rest, rest + kLanes, top);
    std::copy(s + t, s + seen, rest);
    maskv index;
    for (int l = 0; l < kLanes; ++l) index[l] = l;
    const floatv e = index < static_cast<int32_t>(seen - t) ? exp_lanes(load(rest) - top) : floatv{};
    store(rest, e);
    std::copy(rest, rest + (seen - t), s + t);
    lanes += e;
  }
  const float inverse = 1.f / sum(lanes);
  for (t = 0; t < seen; ++t) s[t] *= inverse;
}

constexpr int64_t kBlockTokens = 16;  // new tokens whose query rows attend together

// The attention of new tokens first..first+count-1 of `num_new` (the last num_new of `length`
// positions, each seeing the positions up to its own) over one KV head: q, out (G num_new, D), row
// g num_new + i the query head g of the KV head's group for new token i. Their rows are scored
// together over every position the last of them sees; each row's softmax runs over the positions it
// sees, and the values are mixed in position order, the positions all of them see first, then each
// token's own last ones. So a row's result is the same bits whatever tokens come with it.
template <typename T>
void attend_tokens(const float* q, int64_t num_new, int64_t G, int64_t D, int64_t first, int64_t count,
                   const HeadRows<T>& keys, const HeadRows<T>& values, int64_t length, float* out) {
  const int64_t R = G * count, before = length - num_new;  // block row j G + g: head g of token first + j
  const int64_t seen_all = before + first + 1, seen_last = before + first + count;
  std::vector<float> rows(2 * R * D, 0.f);
  float *block_q = rows.data(), *block_out = rows.data() + R * D;
  for (int64_t j = 0; j < count; ++j)
    for (int64_t g = 0; g < G; ++g)
      std::copy_n(q + (g * num_new + first + j) * D, D, block_q + (j * G + g) * D);
  std::unique_ptr<float[]> scores(new float[R * seen_last]);
  head_scores(block_q, R, D, keys, seen_last, scores.get(), seen_last);
  for (int64_t j = 0; j < count; ++j)
    for (int64_t g = 0; g < G; ++g) normalize(scores.get() + (j * G + g) * seen_last, seen_all + j);
  head_mix(scores.get(), seen_last, R, D, values, 0, seen_all, block_out);
  for (int64_t j = 1; j < count; ++j)
    head_mix(scores.get() + j * G * seen_last, seen_last, G, D, values, seen_all, seen_all + j, block_out + j * G * D);
  for (int64_t j = 0; j < count; ++j)
    for (int64_t g = 0; g < G; ++g)
      std::copy_n(block_out + (j * G + g) * D, D, out + (g * num_new + first + j) * D);
}

// The attention of the scaled query rows q (Hk, G num_new, D) of `num_new` new tokens over one layer
// of the pool at `slots`: out (Hk, G num_new, D). The KV heads and blocks of kBlockTokens tokens are
// split between threads.
template <typename T>
void attend(at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t layer, const at::Tensor& slots,
            int64_t num_new, at::Tensor& out) {
  const int64_t Hk = q.size(0), R = q.size(1), D = q.size(2), G = R / num_new, length = slots.size(0);
  const int64_t layer_stride = keys.stride(0), head_stride = keys.stride(1), row_stride = keys.stride(2);
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const auto rows_of = [&](const at::Tensor& pool, int64_t h) {
    return HeadRows<T>{pool.const_data_ptr<T>() + layer * layer_stride + h * head_stride, row_stride, slot};
  };
  bool paired = false;  // as load_row reads the rows
  by_head_size(D, [&](auto vectors) { paired = kPaired<T, decltype(vectors)::value>; });
  if (paired) split_pairs(q.mutable_data_ptr<float>(), q.numel());
  const int64_t blocks = (num_new + kBlockTokens - 1) / kBlockTokens;
  at::parallel_for(0, Hk * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, first = item % blocks * kBlockTokens;
      attend_tokens<T>(q.const_data_ptr<float>() + h * R * D, num_new, G, D, first,
                       std::min(kBlockTokens, num_new - first), rows_of(keys, h), rows_of(values, h), length,
                       out.mutable_data_ptr<float>() + h * R * D);
    }
  });
  if (paired) join_pairs(out.mutable_data_ptr<float>(), out.numel());
}

// Checks the operands; returns the query scaled in fp32 (a new tensor, which attend may reorder) and
// the slots, contiguous.
std::pair<at::Tensor, at::Tensor> prepare(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                          int64_t layer, const at::Tensor& slots, double scale) {
  TORCH_CHECK(query.dim() == 3, "query (Hk, R, D)");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.strides() == values.strides(),
              "pool keys and values (L, Hk, S, D) alike");
  TORCH_CHECK(keys.stride(3) == 1, "pool rows must be contiguous");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              "pool of float32 or bfloat16");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "slots (T,) int64");
  TORCH_CHECK(query.size(0) == keys.size(1) && query.size(2) == keys.size(3), "query and pool heads differ");
  TORCH_CHECK(layer >= 0 && layer < keys.size(0), "no such layer");
  const at::Tensor index = slots.contiguous();
  const int64_t* slot = index.const_data_ptr<int64_t>();
  const auto [lowest, highest] = std::minmax_element(slot, slot + index.numel());
  TORCH_CHECK(index.numel() == 0 || (*lowest >= 0 && *highest < keys.size(2)), "a slot outside the pool");
  at::Tensor q = at::empty(query.sizes(), query.options().dtype(at::kFloat));
  const bool bf16 = query.scalar_type() == at::kBFloat16;
  const at::Tensor given = bf16 ? query.contiguous() : query.to(at::kFloat).contiguous();
  float* scaled = q.mutable_data_ptr<float>();
  const auto scale_from = [&](const auto* x) {
    for (int64_t i = 0; i < q.numel(); ++i) scaled[i] = to_float(x[i]) * static_cast<float>(scale);
  };
  if (bf16) scale_from(given.const_data_ptr<c10::BFloat16>());
  else scale_from(given.const_data_ptr<float>());
  return {q, index};
}

template <typename... Args>
void attend_as_pool(const at::Tensor& keys, Args&&... args) {
  if (keys.scalar_type() == at::kFloat) attend<float>(std::forward<Args>(args)...);
  else attend<c10::BFloat16>(std::forward<Args>(args)...);
}

// num_new tokens whose K/V the pool holds, at the last num_new of `slots` (T,): query (Hk, G * num_new,
// D), row g * num_new + i the query head g of the KV head's group for new token i, which sees positions
// 0..T-num_new+i. Returns fp32 (Hk, G * num_new, D).
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, int64_t layer,
                           const at::Tensor& slots, int64_t num_new, double scale) {
  TORCH_CHECK(num_new >= 1 && query.dim() == 3 && query.size(1) % num_new == 0 && slots.size(0) >= num_new,
              "num_new tokens: a multiple of query rows, at most the positions");
  auto [q, index] = prepare(query, keys, values, layer, slots, scale);
  at::Tensor out = at::empty(q.sizes(), q.options());
  attend_as_pool(keys, q, keys, values, layer, index, num_new, out);
  return out;
}

// As paged_attention, returned as the new tokens' rows (num_new, Hq D) in the query's dtype: the
// layout the attention's output projection takes.
at::Tensor paged_attention_rows(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                int64_t layer, const at::Tensor& slots, int64_t num_new, double scale) {
  const at::Tensor out = paged_attention(query, keys, values, layer, slots, num_new, scale);  // (Hk, G q, D)
  const int64_t heads = query.size(0) * query.size(1) / num_new, D = query.size(2);
  return out.view({heads, num_new, D}).transpose(0, 1).reshape({num_new, heads * D}).to(query.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("paged_attention(Tensor query, Tensor keys, Tensor values, int layer, Tensor slots, int num_new, "
        "float scale) -> Tensor");
  m.def("paged_attention_rows(Tensor query, Tensor keys, Tensor values, int layer, Tensor slots, int num_new, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_rows", &paged_attention_rows);
}
