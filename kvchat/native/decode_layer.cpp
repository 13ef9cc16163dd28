// The small steps of a decoder layer between its matrix products, one op each, registered for CPU
// (built by kernels.py) for the lean decode step (engine/decode_step.py):
//   kvchat::rms_norm    the families' RMSNorm;
//   kvchat::rope_write  a fused projection's queries and keys rotated (after Qwen3's per-head norms),
//                       the keys and values written to the pool, the queries returned grouped by the
//                       KV head they read, as kvchat::paged_attention takes them;
//   kvchat::silu_mul    the MLP's silu(gate) * up of a fused gate/up projection;
//   kvchat::decoder_layers  every decoder layer of a model whose linears kvchat's kernels (or torch's
//                       plain one) run: the ops above and the kernels', called from here in turn
//                       (found by name: the CPU tier's linear library registers them, kernels.py).
//
// Each is the module's arithmetic in the module's dtype, with its roundings: in bf16 every product
// and sum the module rounds to bf16 is rounded here too. Where torch ran 4 to 25 small ops a step,
// each paying ~2-10 us of dispatch for a few hundred values, one op now does the work.
//
// Each row is computed alone, the same way whatever rows come with it: with kernels that keep to the
// same order for any number of rows (kvchat's linears, attention over the pool), every layer gives a
// token the same bits alone (decode), among speculation's drafts or in a prefill chunk of any length.
// So the MLP's e^x is kvchat's own (kvchat_math::exp_floats, paged_decode.cpp): torch's silu computes
// a tensor's last values (its scalar tail) with another exp than the rest.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

// fp32 products and sums stay separate roundings, as torch's separate ops round them
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

// x rounded to the dtype T, as a float (bf16: to nearest even, as torch rounds)
template <typename T>
inline float rounded(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename T>
inline float value(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// The families' RMSNorm of one row of n: in fp32, x / sqrt(mean(x^2) + eps), cast to T, times the
// weight in T.
template <typename T>
void norm_row(const T* x, const T* weight, int64_t n, float eps, T* out) {
  constexpr int kParts = 16;  // partial sums the compiler keeps in one vector
  float parts[kParts] = {};
  int64_t i = 0;
  for (; i + kParts <= n; i += kParts)
    for (int j = 0; j < kParts; ++j) parts[j] += value(x, i + j) * value(x, i + j);
  float total = 0.f;
  for (; i < n; ++i) total += value(x, i) * value(x, i);
  for (int j = 0; j < kParts; ++j) total += parts[j];
  const float inverse = 1.f / std::sqrt(total / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k)
    out[k] = static_cast<T>(value(weight, k) * rounded<T>(value(x, k) * inverse));
}

// x (..., n) of T, weight (n,) of T.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x and weight of one dtype, float32 or bfloat16");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "rms_norm: weight (n,) for x (..., n)");
  const at::Tensor rows = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(rows);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    for (int64_t r = 0; r < rows.numel() / n; ++r)
      norm_row<scalar_t>(rows.const_data_ptr<scalar_t>() + r * n, w.const_data_ptr<scalar_t>(), n,
                         static_cast<float>(eps), out.mutable_data_ptr<scalar_t>() + r * n);
  });
  return out;
}

// One head of D rotated in place: x * cos + rotate_half(x) * sin, rotate_half(x) * sin taken as the
// halves swapped times the signed sin (its first half negated), each product and the sum rounded to T.
template <typename T>
void rotate(T* x, const T* cos, const T* signed_sin, int64_t D) {
  float turned[512];
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) turned[d] = value(x, d < half ? d + half : d - half);
  for (int64_t d = 0; d < D; ++d) {
    const float straight = rounded<T>(value(x, d) * value(cos, d));
    const float swapped = rounded<T>(turned[d] * value(signed_sin, d));
    x[d] = static_cast<T>(straight + swapped);
  }
}

// qkv (q, (Hq + 2 Hk) D): each new token's projected queries, keys and values. cos, signed_sin (q, D).
// keys, values (L, Hk, S, D): the pool, written at `slots` (q,) in `layer`. Returns the rotated
// queries (Hk, G q, D), row g q + i the query head h G + g of token i.
template <typename T>
at::Tensor rope_write_as(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                         const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, float eps,
                         at::Tensor& keys, at::Tensor& values, int64_t layer, const at::Tensor& slots,
                         int64_t num_heads) {
  const int64_t q = qkv.size(0), Hk = keys.size(1), D = keys.size(3), G = num_heads / Hk;
  at::Tensor query = at::empty({Hk, G * q, D}, qkv.options());
  T* queries = query.mutable_data_ptr<T>();
  T* pool_keys = keys.mutable_data_ptr<T>() + layer * keys.stride(0);
  T* pool_values = values.mutable_data_ptr<T>() + layer * values.stride(0);
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const T* q_weight = q_norm ? q_norm->const_data_ptr<T>() : nullptr;
  const T* k_weight = k_norm ? k_norm->const_data_ptr<T>() : nullptr;
  for (int64_t i = 0; i < q; ++i) {
    const T* row = qkv.const_data_ptr<T>() + i * qkv.size(1);
    const T* c = cos.const_data_ptr<T>() + i * D;
    const T* s = signed_sin.const_data_ptr<T>() + i * D;
    for (int64_t h = 0; h < num_heads; ++h) {
      T* to = queries + ((h / G) * G * q + (h % G) * q + i) * D;
      if (q_weight) norm_row<T>(row + h * D, q_weight, D, eps, to);
      else std::copy(row + h * D, row + (h + 1) * D, to);
      rotate<T>(to, c, s, D);
    }
    for (int64_t h = 0; h < Hk; ++h) {
      T* key = pool_keys + h * keys.stride(1) + slot[i] * keys.stride(2);
      const T* projected = row + (num_heads + h) * D;
      if (k_weight) norm_row<T>(projected, k_weight, D, eps, key);
      else std::copy(projected, projected + D, key);
      rotate<T>(key, c, s, D);
      const T* value_row = row + (num_heads + Hk + h) * D;
      std::copy(value_row, value_row + D, pool_values + h * values.stride(1) + slot[i] * values.stride(2));
    }
  }
  return query;
}

at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                      const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
                      at::Tensor& keys, at::Tensor& values, int64_t layer, const at::Tensor& slots,
                      int64_t num_heads) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rope_write: float32 or bfloat16");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.stride(3) == 1 && values.stride(3) == 1,
              "rope_write: pool keys and values (L, Hk, S, D) alike, rows contiguous");
  TORCH_CHECK(keys.scalar_type() == dtype && values.scalar_type() == dtype, "rope_write: a pool of qkv's dtype");
  const int64_t q = qkv.size(0), Hk = keys.size(1), D = keys.size(3);
  TORCH_CHECK(layer >= 0 && layer < keys.size(0), "rope_write: no such layer");
  TORCH_CHECK(D % 2 == 0 && D <= 512 && num_heads % Hk == 0, "rope_write: heads of an even size up to 512");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (num_heads + 2 * Hk) * D,
              "rope_write: qkv (q, (Hq + 2 Hk) D), contiguous");
  for (const at::Tensor* t : {&cos, &signed_sin})
    TORCH_CHECK(t->scalar_type() == dtype && t->is_contiguous() && t->numel() == q * D, "rope_write: cos, sin (q, D)");
  for (const auto* norm : {&q_norm, &k_norm})
    TORCH_CHECK(!norm->has_value() || ((*norm)->scalar_type() == dtype && (*norm)->numel() == D &&
                                       (*norm)->is_contiguous()),
                "rope_write: norm weights (D,) of qkv's dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == q && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "rope_write: slots (q,) int64");
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < q; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < keys.size(2), "rope_write: a slot outside the pool");
  if (dtype == at::kFloat)
    return rope_write_as<float>(qkv, cos, signed_sin, q_norm, k_norm, eps, keys, values, layer, slots, num_heads);
  return rope_write_as<c10::BFloat16>(qkv, cos, signed_sin, q_norm, k_norm, eps, keys, values, layer, slots,
                                      num_heads);
}

}  // namespace

namespace kvchat_math {
void exp_floats(const float* x, float* out, int64_t n);  // paged_decode.cpp
}  // namespace kvchat_math

namespace {

// silu(gate) * up of one row of n: gate / (1 + e^-gate) in fp32, rounded to T, times up, rounded to T,
// as the module's silu and product round them.
template <typename T>
void silu_mul_row(const T* gate, const T* up, int64_t n, T* out) {
  constexpr int64_t kChunk = 256;
  float exps[kChunk];
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t count = std::min(kChunk, n - at);
    for (int64_t i = 0; i < count; ++i) exps[i] = -value(gate, at + i);
    kvchat_math::exp_floats(exps, exps, count);
    for (int64_t i = 0; i < count; ++i)
      out[at + i] = static_cast<T>(rounded<T>(value(gate, at + i) / (1.f + exps[i])) * value(up, at + i));
  }
}

// gate, up (rows, I), each row contiguous: silu(gate) * up (rows, I).
at::Tensor silu_times(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() &&
                  gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_mul: gate and up (rows, I) alike, rows contiguous");
  const int64_t rows = gate.size(0), width = gate.size(1);
  at::Tensor out = at::empty({rows, width}, gate.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate.scalar_type(), "silu_mul", [&] {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        silu_mul_row<scalar_t>(gate.const_data_ptr<scalar_t>() + r * gate.stride(0),
                               up.const_data_ptr<scalar_t>() + r * up.stride(0), width,
                               out.mutable_data_ptr<scalar_t>() + r * width);
    });
  });
  return out;
}

// gate_up (..., 2 I): silu(gate) * up (..., I), as silu_mul_row computes it.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t width = gate_up.size(-1) / 2;
  TORCH_CHECK(gate_up.size(-1) == 2 * width, "silu_mul: gate_up (..., 2 I)");
  const at::Tensor rows = gate_up.reshape({-1, 2 * width});
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  return silu_times(rows.narrow(1, 0, width), rows.narrow(1, width, width)).view(shape);
}

// kvchat's ops of the other files, as the dispatcher finds them (the linear kernels are registered
// only on CPUs with the instructions they need: decoder_layers is given a kernel's weights only where
// it is).
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Optional = std::optional<at::Tensor>;

using TiledSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&, const Optional&);

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& tiles, const Optional& bias, const Optional& residual) {
  static const auto linear = op<TiledSignature>("kvchat::bf16_linear");
  return linear.call(x, tiles, bias, residual);
}

at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& tiles, const Optional& bias, const Optional& residual) {
  static const auto linear = op<TiledSignature>("kvchat::fp32_linear");
  return linear.call(x, tiles, bias, residual);
}

at::Tensor quantized_linear(bool int4, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& params) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
  if (int4) {
    static const auto linear = op<Signature>("kvchat::int4_linear");
    return linear.call(x, codes, params);
  }
  static const auto linear = op<Signature>("kvchat::int8_linear");
  return linear.call(x, codes, params);
}

at::Tensor attention_rows(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, int64_t layer,
                          const at::Tensor& slots, int64_t num_new, double scale) {
  static const auto attention =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, int64_t,
                    double)>("kvchat::paged_attention_rows");
  return attention.call(query, keys, values, layer, slots, num_new, scale);
}

// A linear layer as decoder_layers is given it, weights (a, b) and a bias, by its kind:
//   bf16 tiles (N/16, K/2, 32), b None: kvchat::bf16_linear, the residual added inside;
//   fp32 tiles (N/16, K, 16), b None: kvchat::fp32_linear, the residual added inside;
//   uint8 codes with bf16 params (N/16, K/32, 2, 16) or nested ones (N/16, 64 + K):
//   kvchat::int4_linear;
//   uint8 codes with bf16 scales (N,): kvchat::int8_linear;
//   a plain weight (N, K) of x's dtype, b None: at::linear.
// The quantized kernels' fp32 output gets the bias, then x's dtype, as linears/quantized_linears.py does.
// Returns residual + linear(x) where a residual is given, each rounded to x's dtype.
at::Tensor project(const at::Tensor& x, const at::Tensor& a, const Optional& b, const Optional& bias,
                   const Optional& residual = std::nullopt) {
  if (a.scalar_type() == at::kBFloat16 && a.dim() == 3) return bf16_linear(x, a, bias, residual);
  if (a.scalar_type() == at::kFloat && a.dim() == 3) return fp32_linear(x, a, bias, residual);
  at::Tensor out;
  if (a.scalar_type() == at::kByte) {
    TORCH_CHECK(b.has_value(), "decoder_layers: quantized codes without their scales");
    out = quantized_linear(b->dim() > 1, x, a, *b);
    if (bias.has_value()) out = out + *bias;
    out = out.to(x.scalar_type());
  } else {
    out = at::linear(x, a, bias);
  }
  return residual.has_value() ? *residual + out : out;
}

// What decoder_layers takes for each layer, in this order: the norms' weights, then the seven
// projections' (a, b, bias) as `project` takes them. Where query, key and value are one fused
// projection (gate and up), it comes in the query's (gate's) place and the key's and value's (up's)
// are None.
constexpr int64_t kNorms = 4, kProjections = 7, kPerLayer = kNorms + 3 * kProjections;
enum Norm { kInputNorm, kPostNorm, kQNorm, kKNorm };
enum Projection { kQuery, kKey, kValue, kOut, kGate, kUp, kDown };

// hidden (q, d), the new tokens' embeddings, float32 or bfloat16; parts, kPerLayer a layer. Each
// layer's K/V goes to the pool at write_slots (q,); attention reads positions at read_slots (T,).
// Returns the hidden states after the last layer, (q, d): the layers of the families (Llama, Qwen2,
// Qwen3) with silu MLPs, as the lean step's loop computes them.
at::Tensor decoder_layers(const at::Tensor& hidden, const c10::List<Optional>& parts, double eps, const at::Tensor& cos,
                          const at::Tensor& signed_sin, at::Tensor& keys, at::Tensor& values,
                          const at::Tensor& write_slots, const at::Tensor& read_slots, int64_t num_heads,
                          double scale) {
  TORCH_CHECK(hidden.dim() == 2, "decoder_layers: hidden (q, d)");
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == keys.size(0) * kPerLayer, "decoder_layers: ", kPerLayer,
              " parts a layer of the pool");
  const int64_t num_new = hidden.size(0);
  at::Tensor h = hidden.contiguous();
  for (int64_t layer = 0; layer < keys.size(0); ++layer) {
    const int64_t first = layer * kPerLayer;
    const auto norm = [&](Norm which) -> Optional { return parts.get(first + which); };
    const auto weight = [&](Projection which, int i) -> Optional { return parts.get(first + kNorms + 3 * which + i); };
    const auto needed = [&](Optional given) {
      TORCH_CHECK(given.has_value(), "decoder_layers: layer ", layer, " lacks a part");
      return *given;
    };
    const auto linear = [&](const at::Tensor& x, Projection which, const Optional& residual = std::nullopt) {
      return project(x, needed(weight(which, 0)), weight(which, 1), weight(which, 2), residual);
    };
    at::Tensor x = rms_norm(h, needed(norm(kInputNorm)), eps);
    at::Tensor qkv = linear(x, kQuery);
    if (weight(kKey, 0).has_value()) qkv = at::cat({qkv, linear(x, kKey), linear(x, kValue)}, 1);
    const at::Tensor query =
        rope_write(qkv, cos, signed_sin, norm(kQNorm), norm(kKNorm), eps, keys, values, layer, write_slots, num_heads);
    h = linear(attention_rows(query, keys, values, layer, read_slots, num_new, scale), kOut, h);
    x = rms_norm(h, needed(norm(kPostNorm)), eps);
    const at::Tensor gated =
        weight(kUp, 0).has_value() ? silu_times(linear(x, kGate), linear(x, kUp)) : silu_mul(linear(x, kGate));
    h = linear(gated, kDown, h);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvchat, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "rope_write(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor? q_norm, Tensor? k_norm, float eps, "
      "Tensor(a!) keys, Tensor(b!) values, int layer, Tensor slots, int num_heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "decoder_layers(Tensor hidden, Tensor?[] parts, float eps, Tensor cos, Tensor signed_sin, Tensor(a!) keys, "
      "Tensor(b!) values, Tensor write_slots, Tensor read_slots, int num_heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvchat, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_write", &rope_write);
  m.impl("silu_mul", &silu_mul);
  m.impl("decoder_layers", &decoder_layers);
}
