// Waiting for one c10d operation (a collective or a point-to-point message) in kvpress::distributed,
// with Gloo's own exception types (a rank that left, a timeout) turned into one c10::Error that says
// who waited for which step.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace kvpress::distributed::detail {

// who: "ShardedPress: rank 1 of 4", "send_sequence: rank 0 to rank 1", ...; step: "the keys".
inline void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const std::string& who, const char* step) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who, ": ", step,
                " failed (a rank left, or did not reach it within the group's timeout): ", c10::GetExceptionString(e));
  }
}

}  // namespace kvpress::distributed::detail
