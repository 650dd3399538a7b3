// Small helpers shared by the unit tests.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace kvpress::testing {

// A temporary folder, removed afterwards (with the C library and rm: std::filesystem may resolve
// into libtorch's copy, which crashes).
struct TempDir {
  std::string path;
  TempDir() {
    std::string templ = "/tmp/kvpress_test_XXXXXX";
    path = ::mkdtemp(templ.data());
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
  void write(const std::string& name, const std::string& text) const {
    std::FILE* f = std::fopen((path + "/" + name).c_str(), "wb");
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }
};

// Runs `fn`, expects a c10::Error whose message (without backtrace) contains every `parts`.
inline void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& part : parts)
      EXPECT_NE(msg.find(part), std::string::npos) << "message: " << msg << "\nexpected to contain: " << part;
    return;
  }
  ADD_FAILURE() << "expected a c10::Error";
}

inline at::Tensor randn(std::initializer_list<int64_t> shape, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  at::manual_seed(seed);
  return at::randn(shape, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

// cos / sin [seq, dim] float32 of a Llama RoPE with this base (10000: Llama 2, 500000: Llama 3).
inline std::pair<at::Tensor, at::Tensor> rope_tables(int64_t seq, int64_t dim, double base = 10000.0) {
  const at::Tensor inv_freq = at::pow(base, -at::arange(0, dim, 2, at::kFloat) / static_cast<double>(dim));
  const at::Tensor angles = at::outer(at::arange(seq, at::kFloat), inv_freq);
  const at::Tensor both = at::cat({angles, angles}, -1);
  return {both.cos(), both.sin()};
}

// Whether libkvpress registered its CUDA kernels (built with KVPRESS_WITH_CUDA).
inline bool cuda_kernels_built() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("kvpress::topk_indices", "")
      .hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

// Sets libtorch's intra-op thread count for a scope (the test processes run with one).
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int threads) : previous_(at::get_num_threads()) { at::set_num_threads(threads); }
  ~IntraOpThreads() { at::set_num_threads(previous_); }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  int previous_;
};

// CPU-vs-CUDA tests run their CPU half on every machine (a reference that throws, e.g. a shape the
// test got wrong, shows everywhere) and their CUDA half where a GPU and the CUDA kernels are
// present. Why the CUDA half cannot run here, or "" (CUDA tensors would otherwise take the ATen
// composites, and the test would compare them instead of our kernels).
inline std::string cuda_half_unavailable() {
  if (!at::hasCUDA()) return "no CUDA device on this machine";
  if (!cuda_kernels_built()) return "libkvpress built without CUDA kernels";
  return "";
}

// How far two LagKV kernels' float32 softmax averages may differ, relative: per kernel, the std's
// sums over dim channels (relative error up to dim units of rounding, the std of values normalised to
// the reference's range being below 1 on random inputs), the softmax's normalising sum over lag
// tokens (lag units) and a few roundings (exp, sqrt, divisions: 8 units), for both kernels.
inline double lag_average_rtol(int64_t dim, int64_t lag) { return 2.0 * static_cast<double>(dim + lag + 8) * 0x1p-24; }

// LagKV's ranks against the partitions' softmax averages they rank. A rank is a step function of
// the averages, so two kernels that sum in different orders may swap two tokens whose averages lie
// within rounding of each other. Expects, in every scored partition, rank * lag to be a permutation
// of 0..lag-1 (each rank / lag rounded to `cache_dtype`, as kvpress rounds it), ordered as
// `averages` are wherever two differ by more than `rtol` of the larger.
inline void expect_lag_ranks_consistent(const at::Tensor& ranks,     // [..., seq] rank / lag
                                        const at::Tensor& averages,  // [..., seq] float32 averages
                                        int64_t n_sink, int64_t lag, int64_t scored, at::ScalarType cache_dtype,
                                        double rtol, const std::string& what) {
  ASSERT_EQ(ranks.sizes(), averages.sizes()) << what;
  const int64_t seq = ranks.size(-1);
  const at::Tensor r = ranks.reshape({-1, seq}).to(at::kDouble).contiguous();
  const at::Tensor a = averages.reshape({-1, seq}).to(at::kDouble).contiguous();
  const auto rank_of = r.accessor<double, 2>();
  const auto average = a.accessor<double, 2>();
  for (int64_t row = 0; row < r.size(0); ++row) {
    for (int64_t p = 0; p < scored; ++p) {
      const int64_t first = n_sink + p * lag;
      const std::string where = what + ", row " + std::to_string(row) + ", partition " + std::to_string(p);
      std::vector<int64_t> order(lag, -1);  // token of each rank
      for (int64_t t = 0; t < lag; ++t) {
        const double value = rank_of[row][first + t];
        const int64_t k = std::llround(value * static_cast<double>(lag));
        ASSERT_TRUE(k >= 0 && k < lag) << where << ": token " << t << " has rank value " << value;
        const double rounded =
            at::scalar_tensor(static_cast<double>(k) / static_cast<double>(lag)).to(cache_dtype).item<double>();
        ASSERT_EQ(value, rounded) << where << ": token " << t << " is not rank " << k << " / " << lag;
        ASSERT_EQ(order[k], -1) << where << ": tokens " << order[k] << " and " << t << " share rank " << k;
        order[k] = t;
      }
      for (int64_t k = 0; k + 1 < lag; ++k) {
        for (int64_t j = k + 1; j < lag; ++j) {  // order[k] ranks below order[j]
          const double lo = average[row][first + order[k]], hi = average[row][first + order[j]];
          ASSERT_LE(lo - hi, rtol * std::max(std::abs(lo), std::abs(hi)))
              << where << ": token " << order[k] << " (average " << lo << ") ranks below token " << order[j]
              << " (average " << hi << ")";
        }
      }
    }
  }
}

// Dense causal attention in float64 of queries [B, Hq, n, D] over per-head keys/values
// (keys[b * kv_heads + h]: [L_bh, D]), the paged and ragged caches' reference: new token i sees
// rows 0 .. L - n + i of its head.
inline at::Tensor reference_attention(const at::Tensor& queries, const std::vector<at::Tensor>& keys,
                                      const std::vector<at::Tensor>& values, int64_t kv_heads) {
  const int64_t batch = queries.size(0), q_heads = queries.size(1), n = queries.size(2), dim = queries.size(3);
  const int64_t group = q_heads / kv_heads;
  at::Tensor out = at::empty({batch, q_heads, n, dim}, at::kDouble);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t qh = 0; qh < q_heads; ++qh) {
      const size_t bh = static_cast<size_t>(b * kv_heads + qh / group);
      const at::Tensor k = keys[bh].to(at::kDouble), v = values[bh].to(at::kDouble);
      const int64_t len = k.size(0);
      at::Tensor logits = at::matmul(queries[b][qh].to(at::kDouble), k.t()) / std::sqrt(static_cast<double>(dim));
      const at::Tensor hidden =
          at::arange(len, at::kLong).unsqueeze(0) > (at::arange(n, at::kLong) + (len - n)).unsqueeze(1);
      logits.masked_fill_(hidden, -std::numeric_limits<double>::infinity());
      out[b][qh].copy_(at::matmul(at::softmax(logits, -1), v));
    }
  }
  return out;
}

}  // namespace kvpress::testing

// Ends a CPU-vs-CUDA test whose CPU half ran: skipped, with the reason, where the CUDA half could not.
#define KVPRESS_SKIP_IF_NO_CUDA_HALF(reason) \
  if (!(reason).empty()) GTEST_SKIP() << (reason) << " (the CPU half ran; the CUDA kernels' emulated tests cover them)"
