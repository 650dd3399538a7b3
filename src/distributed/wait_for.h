// Waiting for one c10d operation (a collective or a point-to-point message) in kvpress::distributed,
// with Gloo's own exception types (a rank that left, a timeout) turned into one c10::Error that says
// who waited for which step.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <string>

namespace kvpress::distributed::detail {

// The one message for a failed operation: who waited for which step, and the backend's error.
[[noreturn]] inline void operation_failed(const std::string& who, const char* step, const std::exception& e) {
  TORCH_CHECK(false, who, ": ", step,
              " failed (a rank left, or did not reach it within the group's timeout): ", c10::GetExceptionString(e));
}

// Starts one c10d operation: `begin` enqueues it (group->send(...), ...). Gloo raises at once, not
// at the wait, when a peer's connection is already closed: that too becomes the c10::Error above.
inline c10::intrusive_ptr<c10d::Work> start_operation(const std::function<c10::intrusive_ptr<c10d::Work>()>& begin,
                                                      const std::string& who, const char* step) {
  try {
    return begin();
  } catch (const std::exception& e) {
    operation_failed(who, step, e);
  }
}

// who: "ShardedPress: rank 1 of 4", "send_sequence: rank 0 to rank 1", ...; step: "the keys".
inline void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& who, const char* step) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    operation_failed(who, step, e);
  }
}

// start_operation then wait_for.
inline void run_operation(const std::function<c10::intrusive_ptr<c10d::Work>()>& begin, const std::string& who,
                          const char* step) {
  wait_for(start_operation(begin, who, step), who, step);
}

}  // namespace kvpress::distributed::detail
