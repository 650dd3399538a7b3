// A 16-float vector for the hot loops of the CPU kernels, in gcc's generic vector type, so that
// one source serves every clone of KVPRESS_VECTOR_CLONES (vector_clones.h): one register under
// AVX-512, two under AVX2, four in the baseline. Include it only in kernel .cpp files, inside
// their anonymous namespace's reach; the helpers are always inlined into the clone that uses them.
// The element-wise helpers (load, store, broadcast, the exponential, the lane reductions) also
// take an 8-float vector, Vec8 (their template argument V, 16 floats by default): code compiled
// for AVX2 alone (the register-tile kernels) uses it, since gcc keeps 64-byte vectors that are not
// a machine register in memory and compares them lane by lane.
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
typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));  // one ymm register under AVX2

template <class V>
constexpr int64_t lanes = sizeof(V) / sizeof(float);

template <class V = Vec>
KVPRESS_VEC_INLINE V load(const float* p) {  // unaligned
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class V>
KVPRESS_VEC_INLINE void store(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// Sixteen bfloat16 values (their bits, unaligned) as float32, exactly: a bfloat16 is the upper half
// of the float32 with the same value.
KVPRESS_VEC_INLINE Vec load_bfloat16(const uint16_t* p) {
  typedef uint16_t Bits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t Bits32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Bits16 h;
  std::memcpy(&h, p, sizeof h);
  const Bits32 bits = __builtin_convertvector(h, Bits32) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
// Lane 0 shuffled into every lane: one broadcast instruction in every clone (folded into the FMA
// that uses it under AVX-512). `Vec{} + x` keeps a scalar add (0 + -0 is +0) in every inner loop,
// and `x - Vec{}` becomes sixteen masked inserts in the AVX-512 clone.
template <class V = Vec>
KVPRESS_VEC_INLINE V broadcast(float x) {
  const V first = {x};
  if constexpr (lanes<V> == 16) {
    return __builtin_shufflevector(first, first, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  } else {
    static_assert(lanes<V> == 8);
    return __builtin_shufflevector(first, first, 0, 0, 0, 0, 0, 0, 0, 0);
  }
}

// Largest of the lanes.
template <class V>
KVPRESS_VEC_INLINE float lane_max(V v) {
  float m = v[0];
  for (int64_t i = 1; i < lanes<V>; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// e^x for x <= 0 (softmax's shifted logits), Cephes's single-precision expf: x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 split in two parts so n ln2 is exact), a degree-6 polynomial for e^r, then
// 2^n built in the exponent bits. Within 2 ulp of std::exp; results below the smallest normal
// float (x < -87.3, including -inf) are 0.
template <class V>
KVPRESS_VEC_INLINE V exp_nonpositive(V x) {
  typedef int32_t Ints __attribute__((vector_size(sizeof(V))));
  const Ints underflow = x < broadcast<V>(-87.33654f);
  x = underflow ? broadcast<V>(0.0f) : x;  // any finite value: masked below
  const V t = x * 1.44269504088896341f + 0.5f;
  Ints n = __builtin_convertvector(t, Ints);  // truncation toward 0 ...
  n += (__builtin_convertvector(n, V) > t);   // ... corrected to floor (true is -1)
  const V nf = __builtin_convertvector(n, V);
  const V r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  V p = broadcast<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const Ints scale_bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return underflow ? broadcast<V>(0.0f) : p * scale;
}

// Lane-wise maximum of `start` and the n floats at x (n a multiple of the lanes), for a softmax's
// shift.
template <class V>
KVPRESS_VEC_INLINE V lanes_max(const float* x, int64_t n, V start) {
  for (int64_t j = 0; j < n; j += lanes<V>) {
    const V v = load<V>(x + j);
    start = v > start ? v : start;
  }
  return start;
}

// x[j] <- e^(x[j] - shift) for the n floats at x (n a multiple of the lanes, shift >= every x[j]):
// a softmax's exponentials in place. Returns their lane-wise sums.
template <class V = Vec>
KVPRESS_VEC_INLINE V exp_shifted_in_place(float* x, int64_t n, float shift) {
  const V s = broadcast<V>(shift);
  V sum{};
  for (int64_t j = 0; j < n; j += lanes<V>) {
    const V e = exp_nonpositive(load<V>(x + j) - s);
    store(x + j, e);
    sum += e;
  }
  return sum;
}

// |x| lane by lane: the sign bit cleared (one AND in every ISA).
template <class V>
KVPRESS_VEC_INLINE V abs(V x) {
  typedef int32_t Ints __attribute__((vector_size(sizeof(V))));
  Ints bits;
  std::memcpy(&bits, &x, sizeof x);
  bits &= 0x7fffffff;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// Sum of the lanes by halving (a fixed order, so the result does not depend on the clone).
template <class V>
KVPRESS_VEC_INLINE float lane_sum(V v) {
  if constexpr (lanes<V> == 16) {
    const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
  } else {
    static_assert(lanes<V> == 8);
    const Quarter q = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
  }
}

// a . b over n floats: two vector accumulators (so consecutive FMAs do not wait on each other),
// then a scalar tail.
template <class V = Vec>
KVPRESS_VEC_INLINE float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  constexpr int64_t w = lanes<V>;
  V s0{}, s1{};
  int64_t d = 0;
  for (; d + 2 * w <= n; d += 2 * w) {
    s0 += load<V>(a + d) * load<V>(b + d);
    s1 += load<V>(a + d + w) * load<V>(b + d + w);
  }
  if (d + w <= n) {
    s0 += load<V>(a + d) * load<V>(b + d);
    d += w;
  }
  float total = lane_sum(s0 + s1);
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

// One stage of a transpose of 16 x 16 (Vec) or 8 x 8 (Vec8): with a and b kSpan rows apart, the
// lanes of a whose index has bit kSpan set swap with the lanes of b whose index has it clear.
// Stages 8 (16 lanes only), 4, 2 and 1 transpose.
template <int kSpan>
KVPRESS_VEC_INLINE void swap_blocks(Vec& a, Vec& b) {
  Vec lo, hi;
  if constexpr (kSpan == 8) {
    lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    hi = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  } else if constexpr (kSpan == 4) {
    lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    hi = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  } else if constexpr (kSpan == 2) {
    lo = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    hi = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  } else {
    static_assert(kSpan == 1);
    lo = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    hi = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  a = lo;
  b = hi;
}

template <int kSpan>
KVPRESS_VEC_INLINE void swap_blocks(Vec8& a, Vec8& b) {
  Vec8 lo, hi;
  if constexpr (kSpan == 4) {
    lo = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
    hi = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  } else if constexpr (kSpan == 2) {
    lo = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
    hi = __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  } else {
    static_assert(kSpan == 1);
    lo = __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14);
    hi = __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
  }
  a = lo;
  b = hi;
}

template <int kSpan, class V>
KVPRESS_VEC_INLINE void transpose_stage(V (&t)[lanes<V>]) {
  for (int i = 0; i < lanes<V>; ++i)
    if ((i & kSpan) == 0) swap_blocks<kSpan>(t[i], t[i + kSpan]);
}

// t[i][j] <- t[j][i] in registers (64 two-vector shuffles for 16 x 16, 24 for 8 x 8).
template <class V>
KVPRESS_VEC_INLINE void transpose(V (&t)[lanes<V>]) {
  if constexpr (lanes<V> == 16) transpose_stage<8>(t);
  transpose_stage<4>(t);
  transpose_stage<2>(t);
  transpose_stage<1>(t);
}

}  // namespace kvpress::kernels::vec16
