// Small helpers shared by the unit tests.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace kvpress::testing {

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

}  // namespace kvpress::testing

// CPU-vs-CUDA tests: skipped where no GPU is present or the library has no CUDA kernels (CUDA
// tensors would then take the ATen composites).
#define KVPRESS_REQUIRE_CUDA_KERNELS()                                  \
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine"; \
  if (!kvpress::testing::cuda_kernels_built()) GTEST_SKIP() << "libkvpress built without CUDA kernels"
