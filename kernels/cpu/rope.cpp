// CPU kernels for kvpress::invert_rope and kvpress::centred_prerope_sketch on float32
// (LeverageScorePress and CompactorPress recover pre-RoPE keys this way).
//
// invert_rope: one pass writing x * cos - rotate_half(x) * sin, where the composite's
// chain of ATen ops writes five full-size temporaries. The result is the composite's bit for bit:
// per element the same two products, each rounded, then one subtraction (written as an addition
// for the first half: a - (-b) * s == a + b * s exactly), and this file is compiled with
// -ffp-contract=off so that no product is fused into the addition. Other dtypes take the composite.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "kernel_ops.h"
#include "vector_clones.h"

namespace kvpress::kernels {
namespace {

// One row: out = x * cos - rotate_half(x) * sin, for x, cos, sin, out of `dim` floats. Inlined
// into the vector clones below, which gcc vectorises.
inline __attribute__((always_inline)) void invert_rope_row(const float* __restrict x, const float* __restrict c,
                                                           const float* __restrict s, float* __restrict o,
                                                           int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) o[d] = x[d] * c[d] + x[d + half] * s[d];
  for (int64_t d = half; d < dim; ++d) o[d] = x[d] * c[d] - x[d - half] * s[d];
}

// Rows [begin, end) of x [rows, D] (row r at position r % n), cos/sin [n, D], out [rows, D].
KVPRESS_VECTOR_CLONES
void invert_rope_rows(const float* x, const float* cos, const float* sin, float* out, int64_t begin, int64_t end,
                      int64_t n, int64_t dim) {
  for (int64_t r = begin; r < end; ++r)
    invert_rope_row(x + r * dim, cos + (r % n) * dim, sin + (r % n) * dim, out + r * dim, dim);
}

// sum[d] += the pre-RoPE rows [first, last) of one head's x [S, D] (cos/sin [S, D]): a float32
// partial sum over each group of kRowsPerPartial rows (16 roundings at most), added to the double.
// partial: D floats of scratch.
constexpr int64_t kRowsPerPartial = 16;
KVPRESS_VECTOR_CLONES
void add_prerope_rows(const float* x, const float* cos, const float* sin, int64_t first, int64_t last, int64_t dim,
                      float* __restrict partial, double* __restrict sum) {
  const int64_t half = dim / 2;
  for (int64_t group = first; group < last; group += kRowsPerPartial) {
    for (int64_t d = 0; d < dim; ++d) partial[d] = 0.0f;
    for (int64_t r = group; r < std::min(last, group + kRowsPerPartial); ++r) {
      const float *xr = x + r * dim, *c = cos + r * dim, *s = sin + r * dim;
      for (int64_t d = 0; d < half; ++d) partial[d] += xr[d] * c[d] + xr[d + half] * s[d];
      for (int64_t d = half; d < dim; ++d) partial[d] += xr[d] * c[d] - xr[d - half] * s[d];
    }
    for (int64_t d = 0; d < dim; ++d) sum[d] += static_cast<double>(partial[d]);
  }
}

// out[i] = pre-RoPE row first + i of one head's x [S, D] minus mean [D], for i < len.
KVPRESS_VECTOR_CLONES
void centred_prerope_rows(const float* x, const float* cos, const float* sin, int64_t first, int64_t len, int64_t dim,
                          const float* __restrict mean, float* __restrict out) {
  for (int64_t i = 0; i < len; ++i) {
    const int64_t r = first + i;
    float* o = out + i * dim;
    invert_rope_row(x + r * dim, cos + r * dim, sin + r * dim, o, dim);
    for (int64_t d = 0; d < dim; ++d) o[d] -= mean[d];
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

// centred_prerope_sketch: X = (K_pre - mean_S K_pre) Φ per KV head, without a head's pre-RoPE keys
// in memory. Pass 1 sums the inverse-rotated rows per column over fixed chunks of positions (in
// double, chunk sums added in order: the means do not depend on the thread count). Pass 2 rotates
// and centres a block of rows into a buffer that stays in the core's cache and multiplies it by Φ
// straight into X's rows: the keys are read twice and X written once, where the composite writes
// and rereads the pre-RoPE keys three times (rotate, mean, centre) before its GEMM reads them.
constexpr int64_t kMeanChunkRows = 1024;
constexpr int64_t kSketchBlockRows = 256;  // 128 KiB of rows at D = 128: in L2 for the GEMM

at::Tensor centred_prerope_sketch_cpu(const at::Tensor& keys_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                      const at::Tensor& sketch_in) {
  if (keys_in.scalar_type() != at::kFloat)  // half-precision keys are rounded and centred in their dtype
    return ops::composite::centred_prerope_sketch(keys_in, cos_in, sin_in, sketch_in);
  constexpr const char* op = "centred_prerope_sketch";
  checks::check_sketch(op, keys_in, sketch_in, "keys");
  checks::check_rope(op, keys_in, cos_in, sin_in, "keys");
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  const at::Tensor sketch = sketch_in.to(at::kFloat).contiguous();
  const int64_t batch = keys.size(0), heads = keys.size(1), seq = keys.size(2), dim = keys.size(3);
  const int64_t k = sketch.size(-1), units = batch * heads;
  at::Tensor x = at::empty({batch, heads, seq, k}, keys.options());
  const float *kp = keys.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();

  // Pass 1: per (chunk, unit) column sums of the pre-RoPE rows. A chunk's positions are the outer
  // loop so that its cos/sin rows, as large as a head's keys, are read from memory once for all heads.
  const int64_t chunks = (seq + kMeanChunkRows - 1) / kMeanChunkRows;
  std::vector<double> chunk_sums(static_cast<size_t>(chunks * units * dim), 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(dim));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * kMeanChunkRows, last = std::min(seq, first + kMeanChunkRows);
      for (int64_t unit = 0; unit < units; ++unit)
        add_prerope_rows(kp + unit * seq * dim, cp, sp, first, last, dim, row.data(),
                         chunk_sums.data() + (c * units + unit) * dim);
    }
  });
  std::vector<float> means(static_cast<size_t>(units * dim));
  for (int64_t unit = 0; unit < units; ++unit) {
    for (int64_t d = 0; d < dim; ++d) {
      double total = 0.0;
      for (int64_t c = 0; c < chunks; ++c) total += chunk_sums[(c * units + unit) * dim + d];
      means[unit * dim + d] = static_cast<float>(total / static_cast<double>(seq));
    }
  }

  // Pass 2: for a block of positions and each head in turn, rotate and centre the rows into a buffer
  // that stays in the core's cache, then X[block] = buffer · Φ (one thread's GEMM).
  const int64_t blocks = (seq + kSketchBlockRows - 1) / kSketchBlockRows;
  const at::ThreadLocalState caller;  // the workers' ATen calls run under the caller's modes (InferenceMode)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard same_modes(caller);
    at::Tensor buffer = at::empty({kSketchBlockRows, dim}, keys.options());
    float* rows = buffer.data_ptr<float>();
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * kSketchBlockRows, len = std::min(seq, first + kSketchBlockRows) - first;
      for (int64_t unit = 0; unit < units; ++unit) {
        centred_prerope_rows(kp + unit * seq * dim, cp, sp, first, len, dim, means.data() + unit * dim, rows);
        const at::Tensor phi = sketch.dim() == 2 ? sketch : sketch[unit / heads][unit % heads];  // [D, k]
        at::Tensor out = x[unit / heads][unit % heads].narrow(0, first, len);                    // [len, k]
        at::mm_out(out, buffer.narrow(0, 0, len), phi);
      }
    }
  });
  return x;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) {
  m.impl("invert_rope", &invert_rope_cpu);
  m.impl("centred_prerope_sketch", &centred_prerope_sketch_cpu);
}

}  // namespace kvpress::kernels
