// Reading a quantized page (kvpress/kv_format.h) as float32: what the paged attention kernels do
// in their inner loop instead of loading a full-precision row. Torch-free plain C++ on raw
// pointers, host and device, so that the CPU kernel (src/ops/paged/cpu/paged.cpp) and the CUDA
// kernel (src/ops/paged/cuda/paged.cuh) decode a page by the same formulas. The two conversions a
// format rests on (float16 and fp8 e4m3fn bits to float, both exact) come from a `Numbers` policy:
// c10's on the CPU, CUDA's own types on the GPU. ops::kv_dequantize is the ATen form of the same,
// the tests' reference.
#pragma once

#include <cstdint>

// Host and device; always inlined, so that the CPU kernel's per-ISA loops (run_per_isa) compile it
// for their ISA and vectorise it.
#if defined(__CUDACC__)
#define KVPRESS_CODEC_FN __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define KVPRESS_CODEC_FN inline __attribute__((always_inline))
#else
#define KVPRESS_CODEC_FN inline
#endif

namespace kvpress::kernels {

// kvpress::KVFormat's quantized formats, as kernels take them (the same values).
enum class PageCodec : int8_t { kInt8 = 1, kFp8 = 2, kInt4 = 3 };

// A page-table row, full and quantized caches alike: the pages it lists for a head of `length`
// tokens (a quantized head's last length % page_size tokens are residual rows, in no page), and the
// most tokens a row of max_pages pages can stand for.
KVPRESS_CODEC_FN int64_t table_pages(bool quantized, int64_t length, int64_t page_size) {
  return quantized ? length / page_size : (length + page_size - 1) / page_size;
}
KVPRESS_CODEC_FN int64_t table_capacity(bool quantized, int64_t max_pages, int64_t page_size) {
  return quantized ? (max_pages + 1) * page_size - 1 : max_pages * page_size;
}

// Where one quantized page of one role (keys or values) lies: codes [page_size, code_bytes] and
// its scales (kvpress/kv_format.h: float32 [1]; int4 keys float16 [2, D]; int4 values float16
// [page_size, 2]).
struct PageRef {
  const uint8_t* codes;  // the page's first row
  const void* scales;    // the page's scales
};

// A batch's quantized pages and each head's last tokens that fill no page, as
// paged_attention_quantized takes them: a head of length L has its first full_tokens(L) tokens in
// the pages of its table row and the rest in its residual rows.
template <typename T>
struct QuantizedPagePools {
  PageCodec codec;
  int64_t page_size, dim;
  const uint8_t* key_codes;    // [P, page_size, code_bytes]
  const uint8_t* value_codes;  // [P, page_size, code_bytes]
  const void* key_scales;      // [P, ...] (kv_page_layout), key_scale_bytes a page
  const void* value_scales;    // [P, ...], value_scale_bytes a page
  int64_t code_bytes, key_scale_bytes, value_scale_bytes;
  const T* residual_keys;         // [R, Hkv, page_size, D]
  const T* residual_values;       // [R, Hkv, page_size, D]
  const int64_t* residual_slots;  // [B]: batch row b's residual row
  int64_t residual_rows;          // R

  KVPRESS_CODEC_FN int64_t full_tokens(int64_t length) const { return length / page_size * page_size; }
  KVPRESS_CODEC_FN PageRef page(bool keys, int64_t p) const {
    return keys ? PageRef{key_codes + p * page_size * code_bytes,
                          static_cast<const char*>(key_scales) + p * key_scale_bytes}
                : PageRef{value_codes + p * page_size * code_bytes,
                          static_cast<const char*>(value_scales) + p * value_scale_bytes};
  }
  // Residual row i of head h of batch row b (Hkv heads).
  KVPRESS_CODEC_FN const T* residual(bool keys, int64_t b, int64_t h, int64_t kv_heads, int64_t i) const {
    return (keys ? residual_keys : residual_values) + ((residual_slots[b] * kv_heads + h) * page_size + i) * dim;
  }
};

// int4: two codes a byte, the even channel in the low nibble.
KVPRESS_CODEC_FN uint8_t int4_even_code(uint8_t byte) { return byte & 15; }
KVPRESS_CODEC_FN uint8_t int4_odd_code(uint8_t byte) { return byte >> 4; }

// int4: element d of row r from its code, with the page's float16 scales `s`: a scale and a minimum
// per channel for keys ([2, D]: scales, then minima), per row for values ([page_size, 2]).
template <typename Numbers>
KVPRESS_CODEC_FN float int4_value(float code, bool keys, const uint16_t* s, int64_t r, int64_t dim, int64_t d) {
  return keys ? code * Numbers::half(s[d]) + Numbers::half(s[dim + d])
              : code * Numbers::half(s[2 * r]) + Numbers::half(s[2 * r + 1]);
}

// Element d of row r of `page` (head size `dim`) as float32. kCodec: the page's format; keys:
// whether the page holds keys (int4 only differs). Numbers: static float half(uint16_t bits) and
// static float fp8(uint8_t bits).
template <typename Numbers, PageCodec kCodec>
KVPRESS_CODEC_FN float page_element(bool keys, PageRef page, int64_t r, int64_t dim, int64_t d) {
  if constexpr (kCodec == PageCodec::kInt8) {
    return static_cast<float>(static_cast<int8_t>(page.codes[r * dim + d])) * *static_cast<const float*>(page.scales);
  } else if constexpr (kCodec == PageCodec::kFp8) {
    return Numbers::fp8(page.codes[r * dim + d]) * *static_cast<const float*>(page.scales);
  } else {
    const uint8_t byte = page.codes[r * (dim / 2) + d / 2];
    const float code = static_cast<float>(d % 2 == 0 ? int4_even_code(byte) : int4_odd_code(byte));
    return int4_value<Numbers>(code, keys, static_cast<const uint16_t*>(page.scales), r, dim, d);
  }
}

}  // namespace kvpress::kernels
