// unrolled<N>(f): f(0), f(1), ..., f(N - 1), each index a compile-time constant, so arrays of vector
// registers indexed by it stay in registers (a loop over them, not unrolled early enough, keeps them
// in memory and reloads one a step).
#pragma once

#include <type_traits>
#include <utility>

namespace kvchat_unrolled {

template <int N, class F>
__attribute__((always_inline)) inline void unrolled(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) __attribute__((always_inline)) {
    (f(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

}  // namespace kvchat_unrolled
