// A cache's observable state, and a call run with an injected failure at each of its fault points
// in turn (src/paged/fault_injection.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvpress/paged.h"
#include "paged/fault_injection.h"

namespace kvpress::testing {

// What an engine can observe of a cache: per sequence, layer and head its pages, positions and
// rows, and each layer's free pages.
struct CacheImage {
  std::vector<std::vector<int64_t>> indices;
  std::vector<at::Tensor> rows;
};

inline CacheImage image_of(const PagedKVCache& cache) {
  const PagedCacheOptions& o = cache.options();
  CacheImage image;
  for (SequenceId s : cache.sequences())
    for (int64_t l = 0; l < o.num_layers; ++l) {
      image.indices.push_back({s, cache.next_position(s, l)});
      for (int64_t h = 0; h < o.kv_heads; ++h) {
        image.indices.push_back(cache.positions(s, l, h));
        image.indices.push_back(cache.pages(s, l, h));
        image.rows.push_back(cache.head_keys(s, l, h));
        image.rows.push_back(cache.head_values(s, l, h));
      }
    }
  for (int64_t l = 0; l < o.num_layers; ++l) image.indices.push_back({cache.free_pages(l)});
  return image;
}

inline ::testing::AssertionResult same_image(const CacheImage& a, const CacheImage& b) {
  if (a.indices.size() != b.indices.size() || a.rows.size() != b.rows.size())
    return ::testing::AssertionFailure() << "the cache holds other sequences";
  for (size_t i = 0; i < a.indices.size(); ++i)
    if (a.indices[i] != b.indices[i])
      return ::testing::AssertionFailure() << "index list " << i << " of " << a.indices.size() << " differs";
  for (size_t i = 0; i < a.rows.size(); ++i)
    if (!at::equal(a.rows[i], b.rows[i]))
      return ::testing::AssertionFailure() << "row block " << i << " of " << a.rows.size() << " differs";
  return ::testing::AssertionSuccess();
}

// Whether `e` is the failure fault_injection.h injected (its message, "injected failure of ...").
inline bool is_injected_failure(const c10::Error& e) {
  return std::string(e.what_without_backtrace()).find("injected failure") != std::string::npos;
}

// Makes `call` fail at its first fault point among `points`, then its second, and so on, checking
// `after_failure()` after each failure, until the call passes all its points and succeeds (that
// last run stays). Returns how many failures were injected. A call that fails for another reason
// rethrows; one that swallows an injected failure fails the test.
template <typename Call, typename AfterFailure>
int64_t sweep_fault_points(Call&& call, AfterFailure&& after_failure, unsigned points = detail::kEveryFaultPoint) {
  for (int64_t failing = 0;; ++failing) {
    detail::inject_failure_after(failing, points);
    try {
      call();
    } catch (const c10::Error& e) {
      detail::inject_failure_after(-1);
      if (!is_injected_failure(e)) throw;
      after_failure();
      continue;
    } catch (...) {
      detail::inject_failure_after(-1);
      throw;
    }
    const bool swallowed = !detail::failure_pending();
    detail::inject_failure_after(-1);
    EXPECT_FALSE(swallowed) << "the call succeeded although its fault point " << failing << " failed";
    return failing;
  }
}

}  // namespace kvpress::testing
