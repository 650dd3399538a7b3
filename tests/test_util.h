// Small helpers shared by the unit tests.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

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

}  // namespace kvpress::testing

// Ends a CPU-vs-CUDA test whose CPU half ran: skipped, with the reason, where the CUDA half could not.
#define KVPRESS_SKIP_IF_NO_CUDA_HALF(reason) \
  if (!(reason).empty()) GTEST_SKIP() << (reason) << " (the CPU half ran; the CUDA kernels' emulated tests cover them)"
