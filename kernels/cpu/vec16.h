// A 16-float vector for the hot loops of the CPU kernels, in gcc's generic vector type, so that
// one source serves every clone of KVPRESS_VECTOR_CLONES (vector_clones.h): one register under
// AVX-512, two under AVX2, four in the baseline. Include it only in kernel .cpp files, inside
// their anonymous namespace's reach; the helpers are always inlined into the clone that uses them.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__GNUC__) && !defined(__clang__)
// The helpers pass 64-byte vectors by value; they are always inlined, so the ABI note gcc gives for
// the baseline (no AVX-512) never applies.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace kvpress::kernels::vec16 {

#if defined(__GNUC__)
#define KVPRESS_VEC_INLINE inline __attribute__((always_inline))
#else
#define KVPRESS_VEC_INLINE inline
#endif

constexpr int64_t kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float Half __attribute__((vector_size(kLanes / 2 * sizeof(float))));
typedef float Quarter __attribute__((vector_size(kLanes / 4 * sizeof(float))));

KVPRESS_VEC_INLINE Vec load(const float* p) {  // unaligned
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
KVPRESS_VEC_INLINE void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
KVPRESS_VEC_INLINE Vec broadcast(float x) { return Vec{} + x; }

// Sum of the 16 lanes by halving (a fixed order, so the result does not depend on the clone).
KVPRESS_VEC_INLINE float lane_sum(Vec v) {
  const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// a . b over n floats: two vector accumulators (so consecutive FMAs do not wait on each other),
// then a scalar tail.
KVPRESS_VEC_INLINE float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  Vec s0{}, s1{};
  int64_t d = 0;
  for (; d + 2 * kLanes <= n; d += 2 * kLanes) {
    s0 += load(a + d) * load(b + d);
    s1 += load(a + d + kLanes) * load(b + d + kLanes);
  }
  if (d + kLanes <= n) {
    s0 += load(a + d) * load(b + d);
    d += kLanes;
  }
  float total = lane_sum(s0 + s1);
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

}  // namespace kvpress::kernels::vec16
