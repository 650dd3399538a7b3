// This machine's true limits, measured in the run that reports against them (docs/PERFORMANCE.md,
// "How it is measured"), on this process's intra-op threads:
//   fma_flops    the float32 FMA peak: every thread runs independent fused multiply-adds on
//                register-resident accumulators (24 zmm for AVX-512, 12 ymm for AVX2 + FMA; no
//                memory traffic), in the instruction set the library's CPU kernels use
//                (ops::cpu_kernel_isa); "baseline" machines get SSE multiply-adds (two FLOPs each);
//   read_bytes   the read bandwidth: each thread sums its part of a buffer with vector loads;
//   write_bytes  the write bandwidth: each thread fills its part, the faster of plain stores and
//                non-temporal (streaming) ones, which skip the read-for-ownership a cached store
//                pays but also the cache;
//   copy_bytes   the traffic of reading and writing at once (bytes read + bytes written per
//                second): each thread copies the first half of its part into the second, vector
//                loads and the faster of plain and streaming stores.
// The buffer is the size of the data the measured work reads (the layer's K and V, given by the
// caller) and as warm as the benchmarks' inputs, which every timed call reads again: where it fits
// in the last-level cache (300 MiB on some Xeons of our kind, a 64 MiB K at S = 16384) the
// bandwidths are the cache's, elsewhere the memory's. Best of several runs each. A press's floor
// (press_work.h) is the largest of its FLOPs over fma_flops, its bytes read over read_bytes, its
// bytes written over write_bytes and both over copy_bytes (a roofline: the units work at once).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVPRESS_BENCH_X86 1
#endif

namespace kvpress_bench {

struct MachinePeaks {
  double fma_flops = 0;    // FLOP/s
  double read_bytes = 0;   // B/s
  double write_bytes = 0;  // B/s
  double copy_bytes = 0;   // B/s, read + written
  std::string isa;         // the FMA loop's instruction set: avx512, avx2 or baseline
};

namespace peaks_detail {

// Seconds of the fastest of `repeats` calls of fn().
template <typename Fn>
double fastest(Fn&& fn, int repeats) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// Runs body(part) for parts 0..threads-1 at once, one std::thread each: at::parallel_for is a header
// template whose OpenMP path exists only in code compiled with -fopenmp (the library's kernels), so
// here it would run the parts one after another.
template <typename Body>
void on_every_thread(int64_t threads, Body&& body) {
  std::vector<std::thread> pool;
  for (int64_t part = 1; part < threads; ++part) pool.emplace_back([&body, part] { body(part); });
  body(0);
  for (std::thread& t : pool) t.join();
}

#ifdef KVPRESS_BENCH_X86
// acc = acc * a + b on kAcc independent accumulators, `iters` times: 2 * kAcc * lanes FLOPs per
// iteration, all in registers. a < 1 and b small keep the values finite and normal.
template <int kAcc>
__attribute__((target("avx512f"))) float fma_avx512(int64_t iters) {
  __m512 acc[kAcc];
  for (int k = 0; k < kAcc; ++k) acc[k] = _mm512_set1_ps(1.0f + static_cast<float>(k) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 32
    for (int k = 0; k < kAcc; ++k) acc[k] = _mm512_fmadd_ps(acc[k], a, b);
  }
  __m512 sum = acc[0];
  for (int k = 1; k < kAcc; ++k) sum = _mm512_add_ps(sum, acc[k]);
  return _mm512_reduce_add_ps(sum);
}

template <int kAcc>
__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iters) {
  __m256 acc[kAcc];
  for (int k = 0; k < kAcc; ++k) acc[k] = _mm256_set1_ps(1.0f + static_cast<float>(k) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int k = 0; k < kAcc; ++k) acc[k] = _mm256_fmadd_ps(acc[k], a, b);
  }
  __m256 sum = acc[0];
  for (int k = 1; k < kAcc; ++k) sum = _mm256_add_ps(sum, acc[k]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float out = 0;
  for (float x : lanes) out += x;
  return out;
}

template <int kAcc>
float mul_add_sse(int64_t iters) {
  __m128 acc[kAcc];
  for (int k = 0; k < kAcc; ++k) acc[k] = _mm_set1_ps(1.0f + static_cast<float>(k) * 1e-3f);
  const __m128 a = _mm_set1_ps(0.999999f), b = _mm_set1_ps(1e-6f);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int k = 0; k < kAcc; ++k) acc[k] = _mm_add_ps(_mm_mul_ps(acc[k], a), b);
  }
  __m128 sum = acc[0];
  for (int k = 1; k < kAcc; ++k) sum = _mm_add_ps(sum, acc[k]);
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, sum);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// Sums n floats (n a multiple of 64, p 64-byte aligned) with vector loads.
__attribute__((target("avx512f"))) inline float read_avx512(const float* p, int64_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t i = 0; i < n; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_load_ps(p + i));
    s1 = _mm512_add_ps(s1, _mm512_load_ps(p + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_load_ps(p + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

__attribute__((target("avx2"))) inline float read_avx2(const float* p, int64_t n) {
  __m256 s[8];
  for (auto& x : s) x = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 64)
    for (int k = 0; k < 8; ++k) s[k] = _mm256_add_ps(s[k], _mm256_load_ps(p + i + 8 * k));
  __m256 t = s[0];
  for (int k = 1; k < 8; ++k) t = _mm256_add_ps(t, s[k]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, t);
  float out = 0;
  for (float x : lanes) out += x;
  return out;
}

inline float read_sse(const float* p, int64_t n) {
  __m128 s[4];
  for (auto& x : s) x = _mm_setzero_ps();
  for (int64_t i = 0; i < n; i += 16)
    for (int k = 0; k < 4; ++k) s[k] = _mm_add_ps(s[k], _mm_load_ps(p + i + 4 * k));
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_add_ps(_mm_add_ps(s[0], s[1]), _mm_add_ps(s[2], s[3])));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// Fills n floats (n a multiple of 64, p 64-byte aligned) with plain stores ...
__attribute__((target("avx512f"))) inline void store_avx512(float* p, int64_t n, float value) {
  const __m512 v = _mm512_set1_ps(value);
  for (int64_t i = 0; i < n; i += 16) _mm512_store_ps(p + i, v);
}

__attribute__((target("avx"))) inline void store_avx2(float* p, int64_t n, float value) {
  const __m256 v = _mm256_set1_ps(value);
  for (int64_t i = 0; i < n; i += 8) _mm256_store_ps(p + i, v);
}

inline void store_sse(float* p, int64_t n, float value) {
  const __m128 v = _mm_set1_ps(value);
  for (int64_t i = 0; i < n; i += 4) _mm_store_ps(p + i, v);
}

// Copies n floats from src to dst (n a multiple of 64, both 64-byte aligned), plain or streaming stores.
__attribute__((target("avx512f"))) inline void copy_avx512(const float* src, float* dst, int64_t n, bool streaming) {
  if (streaming) {
    for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_load_ps(src + i));
    _mm_sfence();
  } else {
    for (int64_t i = 0; i < n; i += 16) _mm512_store_ps(dst + i, _mm512_load_ps(src + i));
  }
}

__attribute__((target("avx"))) inline void copy_avx2(const float* src, float* dst, int64_t n, bool streaming) {
  if (streaming) {
    for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_load_ps(src + i));
    _mm_sfence();
  } else {
    for (int64_t i = 0; i < n; i += 8) _mm256_store_ps(dst + i, _mm256_load_ps(src + i));
  }
}

inline void copy_sse(const float* src, float* dst, int64_t n, bool streaming) {
  if (streaming) {
    for (int64_t i = 0; i < n; i += 4) _mm_stream_ps(dst + i, _mm_load_ps(src + i));
    _mm_sfence();
  } else {
    for (int64_t i = 0; i < n; i += 4) _mm_store_ps(dst + i, _mm_load_ps(src + i));
  }
}

// ... or with non-temporal stores.
__attribute__((target("avx512f"))) inline void stream_avx512(float* p, int64_t n, float value) {
  const __m512 v = _mm512_set1_ps(value);
  for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(p + i, v);
  _mm_sfence();
}

__attribute__((target("avx"))) inline void stream_avx2(float* p, int64_t n, float value) {
  const __m256 v = _mm256_set1_ps(value);
  for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(p + i, v);
  _mm_sfence();
}

inline void stream_sse(float* p, int64_t n, float value) {
  const __m128 v = _mm_set1_ps(value);
  for (int64_t i = 0; i < n; i += 4) _mm_stream_ps(p + i, v);
  _mm_sfence();
}
#endif

}  // namespace peaks_detail

// The peaks for the kernels' instruction set `isa` ("avx512", "avx2" or anything else: baseline;
// ops::cpu_kernel_isa() gives it, a "+...-clones" suffix ignored), the bandwidths over a buffer of
// `working_set_bytes` (at least 1 MiB).
inline MachinePeaks measure_machine_peaks(const std::string& kernel_isa, int64_t working_set_bytes) {
  using namespace peaks_detail;  // NOLINT(google-build-using-namespace)
#ifndef KVPRESS_BENCH_X86
  TORCH_CHECK(false, "measure_machine_peaks: only x86-64 with gcc or clang is measured, not this machine");
#else
  MachinePeaks out;
  const std::string isa = kernel_isa.substr(0, kernel_isa.find('+'));
  out.isa = isa == "avx512" || isa == "avx2" ? isa : "baseline";
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(static_cast<size_t>(threads));  // keeps every result alive

  constexpr int64_t kIters = int64_t{1} << 22;
  double flops_per_thread = 0;
  if (out.isa == "avx512") flops_per_thread = 2.0 * 24 * 16 * kIters;
  if (out.isa == "avx2") flops_per_thread = 2.0 * 12 * 8 * kIters;
  if (out.isa == "baseline") flops_per_thread = 2.0 * 12 * 4 * kIters;
  const double fma_seconds = fastest(
      [&] {
        on_every_thread(threads, [&](int64_t t) {
          const auto k = static_cast<size_t>(t);
          if (out.isa == "avx512") sink[k] += fma_avx512<24>(kIters);
          if (out.isa == "avx2") sink[k] += fma_avx2<12>(kIters);
          if (out.isa == "baseline") sink[k] += mul_add_sse<12>(kIters);
        });
      },
      5);
  out.fma_flops = flops_per_thread * static_cast<double>(threads) / fma_seconds;

  // The working set in equal parts of a multiple of 64 floats; each timed run passes over it until
  // about 1 GiB has moved, so that small buffers time well too.
  const int64_t floats = std::max<int64_t>(working_set_bytes, int64_t{1} << 20) / static_cast<int64_t>(sizeof(float));
  const int64_t part = std::max<int64_t>(floats / threads / 64 * 64, 64);
  const int64_t passes = std::max<int64_t>(1, (int64_t{1} << 28) / (part * threads));
  at::Tensor buffer = at::empty({part * threads}, at::kFloat);  // 64-byte aligned (c10's CPU allocator)
  float* data = buffer.data_ptr<float>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(data) % 64 == 0, "measure_machine_peaks: the buffer is not 64-byte aligned");
  const double bytes = static_cast<double>(part * threads) * sizeof(float) * static_cast<double>(passes);
  const auto write = [&](bool streaming) {
    return [&, streaming] {
      on_every_thread(threads, [&](int64_t t) {
        float* p = data + t * part;
        for (int64_t pass = 0; pass < passes; ++pass) {
          const auto value = static_cast<float>(pass);
          if (out.isa == "avx512") streaming ? stream_avx512(p, part, value) : store_avx512(p, part, value);
          if (out.isa == "avx2") streaming ? stream_avx2(p, part, value) : store_avx2(p, part, value);
          if (out.isa == "baseline") streaming ? stream_sse(p, part, value) : store_sse(p, part, value);
        }
      });
    };
  };
  out.write_bytes = bytes / std::min(fastest(write(true), 5), fastest(write(false), 5));
  const auto read = [&] {
    on_every_thread(threads, [&](int64_t t) {
      const float* p = data + t * part;
      const auto k = static_cast<size_t>(t);
      for (int64_t pass = 0; pass < passes; ++pass) {
        if (out.isa == "avx512") sink[k] += read_avx512(p, part);
        if (out.isa == "avx2") sink[k] += read_avx2(p, part);
        if (out.isa == "baseline") sink[k] += read_sse(p, part);
      }
    });
  };
  out.read_bytes = bytes / fastest(read, 5);
  const int64_t half = part / 2 / 64 * 64;
  const auto copy = [&](bool streaming) {
    return [&, streaming] {
      on_every_thread(threads, [&](int64_t t) {
        float* p = data + t * part;
        for (int64_t pass = 0; pass < passes; ++pass) {
          if (out.isa == "avx512") copy_avx512(p, p + half, half, streaming);
          if (out.isa == "avx2") copy_avx2(p, p + half, half, streaming);
          if (out.isa == "baseline") copy_sse(p, p + half, half, streaming);
        }
      });
    };
  };
  const double copied = 2.0 * static_cast<double>(half * threads) * sizeof(float) * static_cast<double>(passes);
  out.copy_bytes = copied / std::min(fastest(copy(true), 5), fastest(copy(false), 5));
  volatile float keep = 0;
  for (float s : sink) keep = keep + s;
  return out;
#endif
}

}  // namespace kvpress_bench
