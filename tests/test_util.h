// Small helpers shared by the unit tests.
#pragma once

#include <ATen/ATen.h>
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

}  // namespace kvpress::testing
