// The page formats (kvpress/kv_format.h) and ops::kv_quantize / ops::kv_dequantize: ATen code
// that runs on any device (a page is quantized once, when it fills; the kernels only dequantize).
#include "kvpress/kv_format.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <tuple>

#include "checks.h"
#include "kvpress/ops.h"

namespace kvpress {
namespace {

constexpr std::array<KVFormat, 4> kFormats{KVFormat::kFull, KVFormat::kInt8, KVFormat::kFp8, KVFormat::kInt4};
constexpr float kInt8Max = 127.f;
constexpr float kFp8Max = 448.f;  // e4m3fn's largest finite value
constexpr float kInt4Levels = 15.f;

// A scale of 0 (an all-zero page or channel) would turn zeros into NaN: 1 codes them as 0 alike.
at::Tensor nonzero_scale(const at::Tensor& scale) { return at::where(scale > 0, scale, at::ones_like(scale)); }

// codes [..., D] in [0, 15] -> [..., D / 2] uint8, the even channel in the low nibble.
at::Tensor pack_nibbles(const at::Tensor& codes) {
  const at::Tensor c = codes.to(at::kByte);
  return at::bitwise_or(c.slice(-1, 0, c.size(-1), 2), at::bitwise_left_shift(c.slice(-1, 1, c.size(-1), 2), 4));
}

at::Tensor unpack_nibbles(const at::Tensor& packed) {
  const at::Tensor low = at::bitwise_and(packed, 15), high = at::bitwise_right_shift(packed, 4);
  return at::stack({low, high}, -1).flatten(-2);  // [..., D]
}

KVRole role_of(bool keys) { return keys ? KVRole::kKeys : KVRole::kValues; }

}  // namespace

const char* kv_format_name(KVFormat format) {
  switch (format) {
    case KVFormat::kFull: return "full";
    case KVFormat::kInt8: return "int8";
    case KVFormat::kFp8: return "fp8";
    case KVFormat::kInt4: return "int4";
  }
  TORCH_CHECK(false, "kv_format_name: unknown KVFormat ", static_cast<int>(format));
}

KVFormat parse_kv_format(const std::string& name, const char* op) {
  for (KVFormat f : kFormats)
    if (name == kv_format_name(f)) return f;
  TORCH_CHECK(false, op, ": the KV format must be full, int8, fp8 or int4, got '", name, "'");
}

int64_t KVPageLayout::scale_bytes_per_page() const {
  int64_t n = 1;
  for (int64_t s : scale_shape) n *= s;
  return scale_shape.empty() ? 0 : n * static_cast<int64_t>(c10::elementSize(scale_dtype));
}

KVPageLayout kv_page_layout(KVFormat format, KVRole role, int64_t page_size, int64_t head_dim,
                            c10::ScalarType full_dtype, const char* op) {
  TORCH_CHECK(page_size > 0 && head_dim > 0, op, ": page_size and head_dim must be positive, got ", page_size, " and ",
              head_dim);
  KVPageLayout l;
  switch (format) {
    case KVFormat::kFull:
      l.code_bytes = head_dim * static_cast<int64_t>(c10::elementSize(full_dtype));
      l.scale_dtype = full_dtype;
      return l;
    case KVFormat::kInt8:
    case KVFormat::kFp8:
      l.code_bytes = head_dim;
      l.scale_shape = {1};
      l.scale_dtype = at::kFloat;
      return l;
    case KVFormat::kInt4:
      TORCH_CHECK(head_dim % 2 == 0, op, ": int4 packs two channels per byte, so head_dim must be even, got ",
                  head_dim);
      l.code_bytes = head_dim / 2;
      l.scale_shape = role == KVRole::kKeys ? std::vector<int64_t>{2, head_dim} : std::vector<int64_t>{page_size, 2};
      l.scale_dtype = at::kHalf;
      return l;
  }
  TORCH_CHECK(false, op, ": unknown KVFormat ", static_cast<int>(format));
}

namespace ops {

std::tuple<at::Tensor, at::Tensor> kv_quantize(const at::Tensor& rows, KVFormat format, KVRole role) {
  constexpr const char* op = "kv_quantize";
  checks::check_defined(op, "rows", rows);
  checks::check_rank(op, "rows", rows, 3, "[pages, page_size, head_dim]");
  checks::check_float(op, "rows", rows);
  TORCH_CHECK(format != KVFormat::kFull, op,
              ": the format must be int8, fp8 or int4 (full pages are stored as they are)");
  const int64_t pages = rows.size(0), page_size = rows.size(1), dim = rows.size(2);
  const KVPageLayout layout = kv_page_layout(format, role, page_size, dim, rows.scalar_type(), op);
  std::vector<int64_t> scale_shape{pages};
  scale_shape.insert(scale_shape.end(), layout.scale_shape.begin(), layout.scale_shape.end());
  const at::Tensor x = rows.to(at::kFloat);
  if (format == KVFormat::kInt4) {
    // Keys: a minimum and a scale per channel (over the page's tokens, dim 1); values: per token (dim 2).
    const int64_t over = role == KVRole::kKeys ? 1 : 2;
    const at::Tensor low = std::get<0>(x.min(over, true)), high = std::get<0>(x.max(over, true));
    // Quantized with the float16 scale and minimum that are stored, so decoding inverts exactly this.
    const at::Tensor scale = nonzero_scale((high - low) / kInt4Levels).to(at::kHalf);
    const at::Tensor minimum = low.to(at::kHalf);
    const at::Tensor codes =
        ((x - minimum.to(at::kFloat)) / scale.to(at::kFloat)).round().nan_to_num(0.0).clamp(0.0, kInt4Levels);
    const at::Tensor scales = role == KVRole::kKeys ? at::cat({scale, minimum}, 1)   // [P, 2, D]
                                                    : at::cat({scale, minimum}, 2);  // [P, page_size, 2]
    return {pack_nibbles(codes).contiguous(), scales.contiguous()};
  }
  const float code_max = format == KVFormat::kInt8 ? kInt8Max : kFp8Max;
  const at::Tensor scale = nonzero_scale(x.abs().amax({1, 2}) / code_max).view(scale_shape);  // [P, 1] float32
  const at::Tensor scaled = (x / scale.view({pages, 1, 1})).nan_to_num(0.0).clamp(-code_max, code_max);
  const at::Tensor codes = format == KVFormat::kInt8 ? scaled.round().to(at::kChar).view(at::kByte)
                                                     : scaled.to(at::kFloat8_e4m3fn).view(at::kByte);
  return {codes.contiguous(), scale.contiguous()};
}

at::Tensor kv_dequantize(const at::Tensor& codes, const at::Tensor& scales, KVFormat format, KVRole role,
                         int64_t head_dim) {
  constexpr const char* op = "kv_dequantize";
  checks::check_defined(op, "codes", codes);
  checks::check_defined(op, "scales", scales);
  checks::check_rank(op, "codes", codes, 3, "[pages, page_size, code_bytes]");
  TORCH_CHECK(format != KVFormat::kFull, op, ": the format must be int8, fp8 or int4");
  const int64_t pages = codes.size(0), page_size = codes.size(1);
  const KVPageLayout layout = kv_page_layout(format, role, page_size, head_dim, at::kFloat, op);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(2) == layout.code_bytes, op, ": codes must be uint8 [",
              pages, ", ", page_size, ", ", layout.code_bytes, "] for ", kv_format_name(format), " and head_dim ",
              head_dim, ", got ", codes.scalar_type(), " ", checks::shape_str(codes));
  std::vector<int64_t> scale_shape{pages};
  scale_shape.insert(scale_shape.end(), layout.scale_shape.begin(), layout.scale_shape.end());
  TORCH_CHECK(scales.scalar_type() == layout.scale_dtype && scales.sizes() == at::IntArrayRef(scale_shape), op,
              ": scales must be ", layout.scale_dtype, " ", at::IntArrayRef(scale_shape), ", got ",
              scales.scalar_type(), " ", checks::shape_str(scales));
  checks::check_same_device(op, "scales", scales, "codes", codes);
  if (format == KVFormat::kInt4) {
    const at::Tensor q = unpack_nibbles(codes).to(at::kFloat);  // [P, page_size, D]
    const at::Tensor s = scales.to(at::kFloat);
    if (role == KVRole::kKeys) return q * s.narrow(1, 0, 1) + s.narrow(1, 1, 1);
    return q * s.narrow(2, 0, 1) + s.narrow(2, 1, 1);
  }
  const at::Tensor q =
      format == KVFormat::kInt8 ? codes.view(at::kChar).to(at::kFloat) : codes.view(at::kFloat8_e4m3fn).to(at::kFloat);
  return q * scales.view({pages, 1, 1});
}

}  // namespace ops

namespace {

std::tuple<at::Tensor, at::Tensor> kv_quantize_op(const at::Tensor& rows, c10::string_view format, bool keys) {
  return ops::kv_quantize(rows, parse_kv_format(std::string(format), "kv_quantize"), role_of(keys));
}

at::Tensor kv_dequantize_op(const at::Tensor& codes, const at::Tensor& scales, c10::string_view format, bool keys,
                            int64_t head_dim) {
  return ops::kv_dequantize(codes, scales, parse_kv_format(std::string(format), "kv_dequantize"), role_of(keys),
                            head_dim);
}

}  // namespace

// ---- registration: torch.ops.kvpress (src/ops/library.cpp holds the library's root) ----------

TORCH_LIBRARY_FRAGMENT(kvpress, m) {
  m.def("kv_quantize(Tensor rows, str format, bool keys) -> (Tensor, Tensor)");
  m.def("kv_dequantize(Tensor codes, Tensor scales, str format, bool keys, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpress, CompositeExplicitAutograd, m) {
  m.impl("kv_quantize", &kv_quantize_op);
  m.impl("kv_dequantize", &kv_dequantize_op);
}

}  // namespace kvpress
