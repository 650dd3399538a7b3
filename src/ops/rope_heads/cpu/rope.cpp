// CPU kernel for kvpress::invert_rope on float32 (LeverageScorePress and CompactorPress recover
// pre-RoPE keys this way): one pass writing x * cos - rotate_half(x) * sin, where the composite's
// chain of ATen ops writes five full-size temporaries. The result is the composite's bit for bit:
// per element the same two products, each rounded, then one subtraction (written as an addition
// for the first half: a - (-b) * s == a + b * s exactly), and this file is compiled with
// -ffp-contract=off so that no product is fused into the addition. Other dtypes take the composite.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "rope_heads/rope_heads.h"

namespace kvpress::kernels {
namespace {

// Rows [begin, end) of x [rows, D] (row r at position r % n), cos/sin [n, D], out [rows, D].
void invert_rope_rows(const float* x, const float* cos, const float* sin, float* out, int64_t begin, int64_t end,
                      int64_t n, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = x + r * dim;
    const float* c = cos + (r % n) * dim;
    const float* s = sin + (r % n) * dim;
    float* o = out + r * dim;
    for (int64_t d = 0; d < half; ++d) o[d] = xr[d] * c[d] + xr[d + half] * s[d];
    for (int64_t d = half; d < dim; ++d) o[d] = xr[d] * c[d] - xr[d - half] * s[d];
  }
}

at::Tensor invert_rope_cpu(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  if (x_in.scalar_type() != at::kFloat) return ops::composite::invert_rope(x_in, cos_in, sin_in);  // checks too
  checks::check_rope("invert_rope", x_in, cos_in, sin_in);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(2), dim = x.size(3), rows = x.numel() / std::max<int64_t>(dim, 1);
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, /*grain_size=*/1024,
                   [&](int64_t begin, int64_t end) { invert_rope_rows(xp, cp, sp, op, begin, end, n, dim); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) { m.impl("invert_rope", &invert_rope_cpu); }

}  // namespace kvpress::kernels
