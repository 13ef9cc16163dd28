// The second step of a rescored output layer (linears/rescored_head.py), registered for CPU (built by
// kernels.py): kvchat::rescore_top computes again, in place, at least the `num_exact` highest of each
// row of int4 logits from the rows of the exact weight. On Qwen2.5-3B's 151,936 logits torch's ops took
// ~3.4 ms for it (a top-k, the rows gathered into a copy, a batched product); this takes ~1 ms: the
// highest are found by counting the logits into buckets between the row's largest and smallest (~0.2
// ms), and each exact row is read where it lies, the next one prefetched while the current one is summed.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBuckets = 4096;
constexpr int64_t kLine = 64;  // bytes a cache line

// A value's bucket: how far below the largest finite value, in steps of (largest - smallest) /
// (kBuckets - 1), at most the last; 0 for a NaN or anything above the largest. buckets16 computes the same.
inline int32_t bucket(float v, float top, float scale) {
  const float below = (top - v) * scale;
  return below > 0.f ? static_cast<int32_t>(std::min(below, static_cast<float>(kBuckets - 1))) : 0;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512i buckets16(__m512 v, __m512 top, __m512 scale) {
  const __m512 below = _mm512_mul_ps(_mm512_sub_ps(top, v), scale);
  const __mmask16 above_zero = _mm512_cmp_ps_mask(below, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 clamped = _mm512_min_ps(below, _mm512_set1_ps(static_cast<float>(kBuckets - 1)));
  return _mm512_maskz_cvttps_epi32(above_zero, clamped);
}
#endif

// The indices, ascending, of at least `n` of the highest of `values` (V): every value in the buckets
// that hold the n highest (a NaN or +infinity counts among the highest, -infinity among the lowest).
// Three passes: the finite range, the count of each bucket, the indices.
template <typename T>
std::vector<int64_t> highest(const T* values, int64_t V, int64_t n) {
  float top = -INFINITY, bottom = INFINITY;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 tops = _mm512_set1_ps(-INFINITY), bottoms = _mm512_set1_ps(INFINITY);
  for (; i + 16 <= V; i += 16) {
    const __m512 v = load16(values + i);
    const __mmask16 finite = ~_mm512_fpclass_ps_mask(v, 0x99);  // not a NaN, not an infinity
    tops = _mm512_mask_max_ps(tops, finite, tops, v);
    bottoms = _mm512_mask_min_ps(bottoms, finite, bottoms, v);
  }
  top = _mm512_reduce_max_ps(tops);
  bottom = _mm512_reduce_min_ps(bottoms);
#endif
  for (; i < V; ++i) {
    const float v = static_cast<float>(values[i]);
    if (std::isfinite(v)) {
      top = std::max(top, v);
      bottom = std::min(bottom, v);
    }
  }
  const float scale = top > bottom ? static_cast<float>(kBuckets - 1) / (top - bottom) : 0.f;
  std::vector<int64_t> counts(kBuckets, 0);
  i = 0;
#if defined(__AVX512F__)
  const __m512 tops_v = _mm512_set1_ps(top), scales_v = _mm512_set1_ps(scale);
  alignas(64) int32_t at[16];
  for (; i + 16 <= V; i += 16) {
    _mm512_store_si512(at, buckets16(load16(values + i), tops_v, scales_v));
    for (int j = 0; j < 16; ++j) ++counts[at[j]];
  }
#endif
  for (; i < V; ++i) ++counts[bucket(static_cast<float>(values[i]), top, scale)];
  int32_t last = 0;
  int64_t total = counts[0];
  while (total < n && last + 1 < kBuckets) total += counts[++last];
  std::vector<int64_t> found;
  found.reserve(total);
  i = 0;
#if defined(__AVX512F__)
  const __m512i lasts = _mm512_set1_epi32(last);
  for (; i + 16 <= V; i += 16) {
    __mmask16 in = _mm512_cmple_epi32_mask(buckets16(load16(values + i), tops_v, scales_v), lasts);
    for (; in != 0; in &= in - 1) found.push_back(i + __builtin_ctz(in));
  }
#endif
  for (; i < V; ++i)
    if (bucket(static_cast<float>(values[i]), top, scale) <= last) found.push_back(i);
  return found;
}

// row . x over K, in fp32, prefetching `next` (the row summed after this one, or null) a line at a time.
template <typename W>
float dot(const W* row, const float* x, int64_t K, const W* next) {
  constexpr int64_t kPerLine = kLine / sizeof(W);
  int64_t k = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 sums = _mm512_setzero_ps();
  for (; k + kPerLine <= K; k += kPerLine) {
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k), _MM_HINT_T0);
    for (int64_t j = 0; j < kPerLine; j += 16)
      sums = _mm512_fmadd_ps(load16(row + k + j), _mm512_loadu_ps(x + k + j), sums);
  }
  total = _mm512_reduce_add_ps(sums);
#endif
  for (; k < K; ++k) total += static_cast<float>(row[k]) * x[k];
  return total;
}

template <typename L, typename W>
void rescore_rows(at::Tensor& logits, const at::Tensor& weight, const at::Tensor& hidden, int64_t n) {
  const int64_t M = logits.size(0), V = logits.size(1), K = weight.size(1);
  const W* rows = weight.const_data_ptr<W>();
  const at::Tensor x_all = hidden.to(at::kFloat).contiguous();  // (M, K)
  for (int64_t r = 0; r < M; ++r) {
    L* out = logits.mutable_data_ptr<L>() + r * V;
    const float* x = x_all.const_data_ptr<float>() + r * K;
    const std::vector<int64_t> found = highest(out, V, n);
    const int64_t count = static_cast<int64_t>(found.size());
    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const W* next = i + 1 < end ? rows + found[i + 1] * K : nullptr;
        out[found[i]] = static_cast<L>(dot(rows + found[i] * K, x, K, next));
      }
    });
  }
}

// logits (M, V) of fp32 or bf16, written in place; weight (V, K) and hidden (M, K) of one dtype, fp32
// or bf16.
void rescore_top(at::Tensor logits, const at::Tensor& weight, const at::Tensor& hidden, int64_t num_exact) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "rescore_top: logits (M, V), contiguous");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == logits.size(1),
              "rescore_top: weight (V, K), contiguous");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == logits.size(0) && hidden.size(1) == weight.size(1),
              "rescore_top: hidden (M, K)");
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), "rescore_top: weight and hidden of one dtype");
  const auto is_float = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
  };
  TORCH_CHECK(is_float(logits) && is_float(weight), "rescore_top: float32 or bfloat16");
  const bool bf16_logits = logits.scalar_type() == at::kBFloat16;
  if (weight.scalar_type() == at::kBFloat16) {
    bf16_logits ? rescore_rows<at::BFloat16, at::BFloat16>(logits, weight, hidden, num_exact)
                : rescore_rows<float, at::BFloat16>(logits, weight, hidden, num_exact);
  } else {
    bf16_logits ? rescore_rows<at::BFloat16, float>(logits, weight, hidden, num_exact)
                : rescore_rows<float, float>(logits, weight, hidden, num_exact);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("rescore_top(Tensor(a!) logits, Tensor weight, Tensor hidden, int num_exact) -> ()");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) { m.impl("rescore_top", &rescore_top); }
