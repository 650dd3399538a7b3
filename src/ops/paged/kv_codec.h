// Reading one token row of a quantized page as float32 (kvpress/kv_format.h): what the paged
// attention kernels do in their inner loop instead of loading a full-precision row. Plain C++ on
// raw pointers, host and device (C10_HOST_DEVICE), so the CPU kernel and the CUDA kernel read a
// page alike. ops::kv_dequantize is the ATen form of the same, the tests' reference.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace kvpress::kernels {

// kvpress::KVFormat's quantized formats, as kernels take them.
enum class PageCodec : int8_t { kInt8 = 1, kFp8 = 2, kInt4 = 3 };

// Where one quantized page of one role (keys or values) lies: codes [page_size, code_bytes] and
// its scales (kvpress/kv_format.h: float32 [1]; int4 keys float16 [2, D]; int4 values float16
// [page_size, 2]).
struct PageRef {
  const uint8_t* codes;  // the page's first row
  const void* scales;    // the page's scales
};

// e4m3fn byte -> float (c10's conversion: exact, subnormals and NaN included). On the host through
// a table of the 256 values made by that conversion once (the conversion's bit arithmetic per
// element made fp8 pages 5x slower to attend than int8 ones).
C10_HOST_DEVICE inline float fp8_e4m3_to_float(uint8_t code) {
#ifdef __CUDA_ARCH__
  return static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()));
#else
  struct Table {
    float value[256];
    Table() {
      for (int c = 0; c < 256; ++c)
        value[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
    }
  };
  static const Table table;
  return table.value[code];
#endif
}

// Row r of `page` ([D] float32 into out). keys: whether the page holds keys (int4 only differs).
C10_HOST_DEVICE inline void dequantize_row(PageCodec codec, bool keys, PageRef page, int64_t r, int64_t dim,
                                           float* out) {
  switch (codec) {
    case PageCodec::kInt8: {
      const float s = *static_cast<const float*>(page.scales);
      const auto* q = reinterpret_cast<const int8_t*>(page.codes + r * dim);
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(q[d]) * s;
      return;
    }
    case PageCodec::kFp8: {
      const float s = *static_cast<const float*>(page.scales);
      const uint8_t* q = page.codes + r * dim;
      for (int64_t d = 0; d < dim; ++d) out[d] = fp8_e4m3_to_float(q[d]) * s;
      return;
    }
    case PageCodec::kInt4: {
      const uint8_t* q = page.codes + r * (dim / 2);
      const auto* s = static_cast<const c10::Half*>(page.scales);
      for (int64_t d = 0; d < dim; d += 2) {
        const float lo = static_cast<float>(q[d / 2] & 15), hi = static_cast<float>(q[d / 2] >> 4);
        if (keys) {  // [2, D]: scale then minimum, per channel
          out[d] = lo * static_cast<float>(s[d]) + static_cast<float>(s[dim + d]);
          out[d + 1] = hi * static_cast<float>(s[d + 1]) + static_cast<float>(s[dim + d + 1]);
        } else {  // [page_size, 2]: the row's scale and minimum
          const float scale = static_cast<float>(s[2 * r]), minimum = static_cast<float>(s[2 * r + 1]);
          out[d] = lo * scale + minimum;
          out[d + 1] = hi * scale + minimum;
        }
      }
      return;
    }
  }
}

}  // namespace kvpress::kernels
