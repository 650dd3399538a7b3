// Test hook for PagedKVCache's all-or-nothing promise: makes the N-th fault point fail as running
// out of memory would. Not part of the public API.
#pragma once

#include <cstdint>

namespace kvpress::detail {

// The places a cache mutation can fail other than by a bad argument.
enum class FaultPoint : unsigned {
  kTensorAllocation = 1u,  // any CPU tensor allocation (host tensors, and device tensors on a CPU cache)
  kPageTaking = 2u,        // a page taken from a layer's free pages
  kTableGrowth = 4u,       // the device tables growing (more slots or pages)
  kTableUpload = 8u,       // page-table and length rows sent to the device
};
constexpr unsigned kEveryFaultPoint = 15u;

// The next `successes` fault points among `points` (a mask of FaultPoint values) pass and the one
// after throws a c10::Error saying "injected failure of <point>"; the hook is then off again. A
// negative value turns it off. Arming kTensorAllocation installs, once, a CPU allocator that counts
// each allocation before passing it to the one it replaced (CUDA tensors are not counted). Counts
// allocations of every thread; tests only.
void inject_failure_after(int64_t successes, unsigned points = kEveryFaultPoint);
inline void inject_failure_after(int64_t successes, FaultPoint point) {
  inject_failure_after(successes, static_cast<unsigned>(point));
}

// Whether the armed failure has not happened yet (false once it has, or when the hook is off).
bool failure_pending();

// Where the cache reaches `point`: throws if it is the armed failure.
void fault_point(FaultPoint point);

}  // namespace kvpress::detail
