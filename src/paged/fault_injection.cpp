// The fault points of fault_injection.h: one countdown shared by the cache's own points and a CPU
// allocator that wraps c10's.
#include "paged/fault_injection.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <limits>

namespace kvpress::detail {
namespace {

std::atomic<int64_t> points_before_failure{-1};  // negative: off
std::atomic<unsigned> armed_points{0};

const char* point_name(FaultPoint point) {
  switch (point) {
    case FaultPoint::kTensorAllocation: return "a tensor allocation";
    case FaultPoint::kPageTaking: return "a page taking";
    case FaultPoint::kTableGrowth: return "a device-table growth";
    case FaultPoint::kTableUpload: return "a device-table upload";
  }
  return "a fault point";
}

// c10's CPU allocator with a fault point before each allocation.
class FailingCpuAllocator final : public c10::Allocator {
 public:
  explicit FailingCpuAllocator(c10::Allocator* wrapped) : wrapped_(wrapped) {}
  c10::DataPtr allocate(size_t n) override {
    fault_point(FaultPoint::kTensorAllocation);
    return wrapped_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return wrapped_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    wrapped_->copy_data(dest, src, count);
  }

 private:
  c10::Allocator* wrapped_;
};

void install_failing_allocator() {
  static FailingCpuAllocator* const allocator = [] {
    auto* a = new FailingCpuAllocator(c10::GetCPUAllocator());  // lives as long as the tensors it made
    c10::SetCPUAllocator(a, std::numeric_limits<uint8_t>::max());
    return a;
  }();
  TORCH_CHECK(c10::GetCPUAllocator() == allocator,
              "inject_failure_after: another CPU allocator replaced the counting one");
}

}  // namespace

void inject_failure_after(int64_t successes, unsigned points) {
  if (successes >= 0 && (points & static_cast<unsigned>(FaultPoint::kTensorAllocation)) != 0)
    install_failing_allocator();
  armed_points = points;
  points_before_failure = successes < 0 ? -1 : successes;
}

bool failure_pending() { return points_before_failure.load() >= 0; }

void fault_point(FaultPoint point) {
  if (points_before_failure.load(std::memory_order_relaxed) < 0) return;
  if ((armed_points.load() & static_cast<unsigned>(point)) == 0) return;
  if (points_before_failure.fetch_sub(1) != 0) return;  // this point passes (or the hook was off)
  points_before_failure = -1;
  TORCH_CHECK(false, "fault injection: injected failure of ", point_name(point));
}

}  // namespace kvpress::detail
