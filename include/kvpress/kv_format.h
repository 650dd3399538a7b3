// The formats a paged KV cache stores its pages in, and what one page of each costs. One place for
// the facts every user of a format reads: the names, the codes' and scales' shapes and dtypes, the
// bytes. The arithmetic of quantizing and dequantizing is ops::kv_quantize / ops::kv_dequantize
// (kvpress/ops.h) and the kernels' row readers (src/ops/paged/kv_codec.h).
//
// A quantized page holds page_size tokens of one (sequence, layer, KV head), keys and values apart:
//   int8  symmetric: code = round(x / s), s = max|x| / 127 over the page, one float32 s per page.
//   fp8   e4m3 (OCP "e4m3fn", max 448): code = fp8(x / s), s = max|x| / 448 over the page, one
//         float32 s per page.
//   int4  KIVI's split (Liu et al. 2024, arXiv 2402.02750), asymmetric: keys per channel (a scale
//         and a minimum for each of the D channels over the page's tokens: [2, D]), values per token
//         (a scale and a minimum for each token over its D channels: [page_size, 2]); the scales and
//         minima are float16, as KIVI stores them; code = round((x - min) / scale) in [0, 15], two
//         codes per byte (the even channel in the low nibble).
// A scale is computed over the whole page, so a page is quantized once it is full: the cache keeps
// each head's last, partly filled page in the cache's own dtype until it fills (KIVI's residual).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvpress {

enum class KVFormat : int8_t {
  kFull,  // the cache's own dtype (float32, float16, bfloat16): no codes, no scales
  kInt8,
  kFp8,
  kInt4,
};

// Keys and values differ only in int4 (per channel for keys, per token for values).
enum class KVRole : int8_t { kKeys, kValues };

const char* kv_format_name(KVFormat format);  // "full", "int8", "fp8", "int4"
// The format named `name` (one of kv_format_name's); raises naming `op` and the accepted names.
KVFormat parse_kv_format(const std::string& name, const char* op);

// One quantized page of one head, keys or values: codes [page_size, code_bytes] uint8 and scales
// of scale_shape and scale_dtype. For KVFormat::kFull, the page's rows themselves.
struct KVPageLayout {
  int64_t code_bytes = 0;            // per token row: D (int8, fp8), D / 2 (int4)
  std::vector<int64_t> scale_shape;  // [1], [2, D] (int4 keys), [page_size, 2] (int4 values); empty for kFull
  c10::ScalarType scale_dtype = c10::ScalarType::Float;
  int64_t code_bytes_per_page(int64_t page_size) const { return page_size * code_bytes; }
  int64_t scale_bytes_per_page() const;
  int64_t bytes_per_page(int64_t page_size) const { return code_bytes_per_page(page_size) + scale_bytes_per_page(); }
};

// Raises (naming `op`) unless head_dim > 0 and page_size > 0, and head_dim is even for int4.
// `full_dtype`: the cache's dtype, the rows' for kFull.
KVPageLayout kv_page_layout(KVFormat format, KVRole role, int64_t page_size, int64_t head_dim,
                            c10::ScalarType full_dtype, const char* op = "kv_page_layout");

}  // namespace kvpress
