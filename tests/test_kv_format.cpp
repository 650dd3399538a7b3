// Quantized pages (kvpress/kv_format.h): the formats' bytes, the quantizers' error bounds (from
// each format's rounding, not from a run), the int4 packing, and paged attention over quantized
// pages (the CPU kernel and the ATen composite against a dense float64 reference).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "kvpress/kv_format.h"
#include "kvpress/ops.h"
#include "paged/paged.h"
#include "quantized_pages.h"
#include "test_util.h"

namespace kvpress {
namespace {

constexpr std::array<KVFormat, 3> kQuantized{KVFormat::kInt8, KVFormat::kFp8, KVFormat::kInt4};

using testing::outlier_rows;
using testing::quantized_layout;
using testing::QuantizedLayout;
using testing::seeded_randn;

TEST(KVFormat, NamesRoundTripAndAnUnknownNameIsRefused) {
  for (KVFormat f : {KVFormat::kFull, KVFormat::kInt8, KVFormat::kFp8, KVFormat::kInt4})
    EXPECT_EQ(parse_kv_format(kv_format_name(f), "test"), f);
  testing::expect_error([] { parse_kv_format("int2", "generate --kv-dtype"); },
                        {"generate --kv-dtype: the KV format must be full, int8, fp8 or int4, got 'int2'"});
}

// Memory per page is exactly the codes plus the scales: the layout's arithmetic, and the tensors
// kv_quantize returns.
TEST(KVFormat, APageCostsItsCodesPlusItsScales) {
  const int64_t page = 16, dim = 128;
  // Written out: D codes per row and one float32 scale (int8, fp8); D / 2 bytes per row and
  // float16 scale and minimum per channel (int4 keys) or per token (int4 values).
  EXPECT_EQ(kv_page_layout(KVFormat::kFull, KVRole::kKeys, page, dim, at::kBFloat16).bytes_per_page(page), 4096);
  EXPECT_EQ(kv_page_layout(KVFormat::kInt8, KVRole::kKeys, page, dim, at::kBFloat16).bytes_per_page(page), 2048 + 4);
  EXPECT_EQ(kv_page_layout(KVFormat::kFp8, KVRole::kValues, page, dim, at::kBFloat16).bytes_per_page(page), 2048 + 4);
  EXPECT_EQ(kv_page_layout(KVFormat::kInt4, KVRole::kKeys, page, dim, at::kBFloat16).bytes_per_page(page),
            1024 + 2 * 128 * 2);
  EXPECT_EQ(kv_page_layout(KVFormat::kInt4, KVRole::kValues, page, dim, at::kBFloat16).bytes_per_page(page),
            1024 + 16 * 2 * 2);
  for (KVFormat f : kQuantized) {
    for (KVRole role : {KVRole::kKeys, KVRole::kValues}) {
      const auto [codes, scales] = ops::kv_quantize(outlier_rows(3, page, dim, 1), f, role);
      const KVPageLayout layout = kv_page_layout(f, role, page, dim, at::kFloat);
      EXPECT_EQ(codes.nbytes() + scales.nbytes(), static_cast<size_t>(3 * layout.bytes_per_page(page)))
          << kv_format_name(f);
      EXPECT_EQ(codes.scalar_type(), at::kByte);
      EXPECT_EQ(scales.scalar_type(), layout.scale_dtype);
    }
  }
}

// int8: symmetric, s = max|x| / 127 per page; rounding to the nearest code errs by at most s / 2
// (plus float32 rounding of x / s and code * s, a few units in 2^-24 of |x|).
TEST(KVFormat, Int8ErrsByAtMostHalfAStep) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor rows = outlier_rows(5, 16, 64, 2).to(dtype);
    const auto [codes, scales] = ops::kv_quantize(rows, KVFormat::kInt8, KVRole::kKeys);
    const at::Tensor x = rows.to(at::kFloat), y = ops::kv_dequantize(codes, scales, KVFormat::kInt8, KVRole::kKeys, 64);
    const at::Tensor s = scales.view({5, 1, 1});
    EXPECT_TRUE(at::allclose(s.view(-1), x.abs().amax({1, 2}) / 127.0, 1e-6, 0));
    const at::Tensor bound = s * 0.5 + x.abs() * 4e-7;
    EXPECT_TRUE(((x - y).abs() <= bound).all().item<bool>()) << (x - y).abs().max();
    // The largest magnitude of each page takes the largest code.
    EXPECT_TRUE((codes.view(at::kChar).abs().to(at::kInt).amax({1, 2}) == 127).all().item<bool>());
  }
}

// fp8 e4m3: s = max|x| / 448 per page; x / s rounds to 3 mantissa bits, half a unit in the last
// place being 2^-4 of |x / s| for normal values (>= 2^-6) and 2^-10 for subnormal ones.
TEST(KVFormat, Fp8ErrsByItsHalfUnitInTheLastPlace) {
  const at::Tensor x = outlier_rows(5, 16, 64, 3);
  const auto [codes, scales] = ops::kv_quantize(x, KVFormat::kFp8, KVRole::kValues);
  const at::Tensor y = ops::kv_dequantize(codes, scales, KVFormat::kFp8, KVRole::kValues, 64);
  const at::Tensor s = scales.view({5, 1, 1});
  EXPECT_TRUE(at::allclose(s.view(-1), x.abs().amax({1, 2}) / 448.0, 1e-6, 0));
  const at::Tensor bound = x.abs() * (std::ldexp(1.0, -4) * (1 + 1e-6)) + s * std::ldexp(1.0, -10);
  EXPECT_TRUE(((x - y).abs() <= bound).all().item<bool>()) << ((x - y).abs() / bound).max();
  // The codes are torch's own e4m3fn conversion of x / s.
  EXPECT_TRUE(at::equal(codes, (x / s).clamp(-448, 448).to(at::kFloat8_e4m3fn).view(at::kByte)));
}

// int4 (KIVI): per channel for keys, per token for values; min + code * scale with scale =
// (max - min) / 15, both stored as float16. Rounding errs by half a step of the stored scale, plus
// what float16 rounding of the minimum (2^-11 of it) and of the scale (15 steps of 2^-11 of it)
// moves the grid.
TEST(KVFormat, Int4ErrsByHalfAStepOfItsFloat16Grid) {
  for (KVRole role : {KVRole::kKeys, KVRole::kValues}) {
    const at::Tensor x = outlier_rows(4, 16, 32, 4);
    const auto [codes, scales] = ops::kv_quantize(x, KVFormat::kInt4, role);
    const at::Tensor y = ops::kv_dequantize(codes, scales, KVFormat::kInt4, role, 32);
    const int64_t over = role == KVRole::kKeys ? 1 : 2;
    const at::Tensor low = std::get<0>(x.min(over, true)), high = std::get<0>(x.max(over, true));
    const at::Tensor step = (high - low) / 15.0;
    const double u = std::ldexp(1.0, -11);
    const at::Tensor bound = step * (0.5 + 0.5 * u + 15 * u) + low.abs() * u + x.abs() * 1e-6;
    EXPECT_TRUE(((x - y).abs() <= bound).all().item<bool>()) << ((x - y).abs() - bound).max();
    const at::Tensor stored = scales.to(at::kFloat);
    const at::Tensor scale = role == KVRole::kKeys ? stored.narrow(1, 0, 1) : stored.narrow(2, 0, 1);
    EXPECT_TRUE(at::allclose(scale, step, u, 0)) << static_cast<int>(role);
  }
}

// Two codes per byte, the even channel in the low nibble; a channel ramp 0..15 over the page's 16
// tokens has scale 1 and minimum 0, so its codes are the token numbers.
TEST(KVFormat, Int4PacksTheEvenChannelInTheLowNibble) {
  const at::Tensor t = at::arange(16, at::kFloat);
  const at::Tensor rows = at::stack({t, 15 - t, t * 0 + 3, t}, 1).unsqueeze(0);  // [1, 16, 4]
  const auto [codes, scales] = ops::kv_quantize(rows, KVFormat::kInt4, KVRole::kKeys);
  ASSERT_EQ(codes.sizes(), at::IntArrayRef({1, 16, 2}));
  for (int64_t r = 0; r < 16; ++r) {
    EXPECT_EQ(codes[0][r][0].item<int>(), r | ((15 - r) << 4)) << r;
    EXPECT_EQ(codes[0][r][1].item<int>(), 0 | (r << 4)) << r;  // the constant channel codes as 0 over minimum 3
  }
  EXPECT_TRUE(at::equal(ops::kv_dequantize(codes, scales, KVFormat::kInt4, KVRole::kKeys, 4), rows));
}

TEST(KVFormat, AnAllZeroPageStaysZeroWithoutNaN) {
  for (KVFormat f : kQuantized) {
    for (KVRole role : {KVRole::kKeys, KVRole::kValues}) {
      const at::Tensor zeros = at::zeros({2, 8, 16});
      const auto [codes, scales] = ops::kv_quantize(zeros, f, role);
      EXPECT_TRUE(at::equal(ops::kv_dequantize(codes, scales, f, role, 16), zeros)) << kv_format_name(f);
    }
  }
}

// ---- paged attention over quantized pages ------------------------------------------------------

at::Tensor attend(const at::Tensor& q, const QuantizedLayout& l, KVFormat format, bool composite) {
  return composite ? ops::composite::paged_attention_quantized(
                         q, l.key_codes, l.key_scales, l.value_codes, l.value_scales, format, l.page_table, l.lengths,
                         l.residual_keys, l.residual_values, l.residual_slots, std::nullopt)
                   : ops::paged_attention_quantized(q, l.key_codes, l.key_scales, l.value_codes, l.value_scales, format,
                                                    l.page_table, l.lengths, l.residual_keys, l.residual_values,
                                                    l.residual_slots);
}

// The kernel reads every row as the reference does (the same float32 dequantization), so the
// tolerance is paged_attention's: float32 accumulation over up to a few thousand rows (1e-5), and
// for 16-bit outputs one rounding of the output (2^-8 relative) on values of order 1.
TEST(PagedQuantizedOps, AttentionMatchesDenseAttentionOverTheDequantizedRows) {
  struct Case {
    int64_t batch, kv_heads, groups, n, page_size, dim;
    std::vector<int64_t> lengths;
  };
  const std::vector<Case> cases = {
      {2, 2, 3, 1, 16, 16, {1, 17, 32, 40}},       // only residual rows, one of them, none, both kinds
      {2, 2, 1, 4, 8, 8, {4, 9, 23, 50}},          // n new tokens, no GQA
      {1, 1, 4, 1, 16, 64, {3000}},                // one long head: split across threads and merged
      {1, 4, 2, 1, 16, 128, {700, 16, 15, 2049}},  // Llama-like head_dim
  };
  for (const Case& c : cases) {
    for (KVFormat format : kQuantized) {
      for (auto dtype : {at::kFloat, at::kBFloat16}) {
        const QuantizedLayout l =
            quantized_layout(c.batch, c.kv_heads, c.lengths, c.page_size, c.dim, format, dtype, 7);
        const at::Tensor q = seeded_randn({c.batch, c.kv_heads * c.groups, c.n, c.dim}, 8, dtype);
        const at::Tensor expected = testing::reference_attention(q, l.keys, l.values, c.kv_heads);
        const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
        for (bool composite : {false, true}) {
          const at::Tensor got = attend(q, l, format, composite);
          EXPECT_EQ(got.scalar_type(), dtype);
          EXPECT_TRUE(at::allclose(got.to(at::kDouble), expected, tol, tol))
              << kv_format_name(format) << " " << dtype << " composite " << composite << " page " << c.page_size
              << " max err " << (got.to(at::kDouble) - expected).abs().max();
        }
      }
    }
  }
}

// The kernel decodes every one of the 256 fp8 bytes as torch's e4m3fn conversion does (its
// branch-free bit arithmetic: normal and subnormal codes, both zeros, the two NaNs), on the ISA path
// this run takes (the AVX2 rerun and KVPRESS_DISABLE_AVX2 reach the others). Row 0 of each head's
// page has keys at the largest code and every other row zero keys, so the softmax puts all weight on
// row 0 (the others' logits are 5,069 lower: exp underflows to 0) and the output is row 0's values:
// head h's value codes are the bytes 128 h .. 128 h + 127, their scale 1.
TEST(PagedQuantizedOps, EveryFp8CodeDecodesAsTorchDecodesIt) {
  QuantizedLayout l = quantized_layout(1, 2, {16, 16}, 16, 128, KVFormat::kFp8, at::kFloat, 41);
  l.key_codes.zero_();
  l.value_codes.zero_();
  l.key_scales.fill_(1.0);
  l.value_scales.fill_(1.0);
  const at::Tensor bytes = at::arange(256, at::kInt).to(at::kByte).view({2, 128});
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t page = l.page_table[0][h][0].item<int64_t>();
    l.key_codes[page][0].fill_(0x7E);  // 448
    l.value_codes[page][0].copy_(bytes[h]);
  }
  const at::Tensor q = at::ones({1, 2, 1, 128});
  const at::Tensor got = attend(q, l, KVFormat::kFp8, false).view({2, 128});
  const at::Tensor expected = bytes.view(at::kFloat8_e4m3fn).to(at::kFloat);
  EXPECT_EQ(expected.isnan().sum().item<int64_t>(), 2);  // 0x7f and 0xff
  EXPECT_TRUE(at::allclose(got, expected, 1e-6, 0, /*equal_nan=*/true))
      << "ISA " << ops::cpu_kernel_isa() << ", max err " << (got - expected).nan_to_num(0).abs().max();
}

// The CUDA kernel (src/ops/paged/cuda/paged.cuh, run through the CPU model by
// test_cuda_emulation.cpp everywhere) against the CPU kernel: the same dequantization, so the
// float32 sums' order and one rounding of 16-bit outputs (the emulated test's tolerances).
TEST(PagedQuantizedOps, CudaKernelMatchesTheCpuKernel) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  for (KVFormat format : kQuantized) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      const QuantizedLayout l = quantized_layout(2, 2, {700, 16, 15, 300}, 16, 128, format, dtype, 31);
      const at::Tensor q = seeded_randn({2, 8, 1, 128}, 32, dtype);
      const at::Tensor cpu = attend(q, l, format, false);
      if (!no_cuda.empty()) continue;
      const auto cuda = [](const at::Tensor& t) { return t.cuda(); };
      const at::Tensor gpu =
          ops::paged_attention_quantized(cuda(q), cuda(l.key_codes), cuda(l.key_scales), cuda(l.value_codes),
                                         cuda(l.value_scales), format, cuda(l.page_table), cuda(l.lengths),
                                         cuda(l.residual_keys), cuda(l.residual_values), cuda(l.residual_slots))
              .cpu();
      const double tol = dtype == at::kFloat ? 1e-4 : 1.6e-2;
      EXPECT_TRUE(at::allclose(gpu.to(at::kDouble), cpu.to(at::kDouble), tol, tol))
          << kv_format_name(format) << " " << dtype << " max err " << (gpu - cpu).abs().max();
    }
  }
  KVPRESS_SKIP_IF_NO_CUDA_HALF(no_cuda);
}

TEST(PagedQuantizedOps, BadArgumentsAreNamed) {
  const QuantizedLayout l = quantized_layout(1, 2, {20, 5}, 8, 16, KVFormat::kInt8, at::kFloat, 11);
  const at::Tensor q = seeded_randn({1, 2, 1, 16}, 12);
  const auto expect_error = [](const std::function<void()>& call, const std::string& message) {
    testing::expect_error(call, {message});
  };
  const auto call = [&](const at::Tensor& key_codes, const at::Tensor& key_scales, KVFormat format,
                        const at::Tensor& page_table, const at::Tensor& residual_slots) {
    return [=, &l, &q] {
      ops::paged_attention_quantized(q, key_codes, key_scales, l.value_codes, l.value_scales, format, page_table,
                                     l.lengths, l.residual_keys, l.residual_values, residual_slots);
    };
  };
  expect_error(call(l.key_codes.to(at::kChar), l.key_scales, KVFormat::kInt8, l.page_table, l.residual_slots),
               "paged_attention_quantized: key_codes must be uint8 [");
  expect_error(call(l.key_codes, l.key_scales.to(at::kHalf), KVFormat::kInt8, l.page_table, l.residual_slots),
               "paged_attention_quantized: key_scales must be Float [");
  expect_error(call(l.key_codes, l.key_scales, KVFormat::kInt4, l.page_table, l.residual_slots),
               "paged_attention_quantized: key_codes must be uint8 [");  // int4 codes are D / 2 bytes
  expect_error(call(l.key_codes, l.key_scales, KVFormat::kFull, l.page_table, l.residual_slots),
               "paged_attention_quantized: the format must be int8, fp8 or int4");
  expect_error(call(l.key_codes, l.key_scales, KVFormat::kInt8, l.page_table, l.residual_slots + 5),
               "paged_attention_quantized: residual_slots must be in [0, 2) (residual_keys' rows), got 6");
  at::Tensor bad_table = l.page_table.clone();
  bad_table[0][0][1] = 1000;
  expect_error(call(l.key_codes, l.key_scales, KVFormat::kInt8, bad_table, l.residual_slots),
               "paged_attention_quantized: page_table must hold pages in [0, 4) where used, got 1000");
  expect_error(
      [&] {
        ops::kv_quantize(seeded_randn({1, 4, 5}, 1), KVFormat::kInt4, KVRole::kKeys);
      },
      "kv_quantize: int4 packs two channels per byte, so head_dim must be even, got 5");
  expect_error([&] { ops::kv_dequantize(l.key_codes, l.key_scales, KVFormat::kFp8, KVRole::kKeys, 32); },
               "kv_dequantize: codes must be uint8 [4, 8, 32] for fp8 and head_dim 32");
}

}  // namespace
}  // namespace kvpress
