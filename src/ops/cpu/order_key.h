// order_key: a finite float as a uint32_t with the same order, for radix selection and for sorting
// scores as plain integers (no comparator).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvpress::kernels {

// A larger float gets a larger key. -0 and +0 get the same key, so they tie as they do in a float
// comparison. NaN has no place in this order: callers reject it first.
inline uint32_t order_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if (bits == 0x80000000u) bits = 0;  // -0 -> +0
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

}  // namespace kvpress::kernels
