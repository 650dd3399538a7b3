// CPU kernels of kvpress::topk_indices (top-k per row without a full sort), kvpress::gather_kv
// (one memcpy per kept K/V row) and kvpress::compact_kv_ (the same rows moved forward in place).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu/order_key.h"
#include "selection/selection.h"

namespace kvpress::kernels {
namespace {

// Large fresh outputs are written once, row by row: with 4 KiB pages the first touch of every page
// faults (a 64 MiB output costs ~16k faults, more than the copy itself). Asking for transparent
// huge pages on the 2 MiB-aligned interior turns them into a few dozen. Advice only: ignored where
// unsupported.
void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(t.nbytes());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
}

// The k-th largest key of keys[0, n) by radix selection on 11 + 11 + 10 bits from the top (three
// histogram passes, each over the keys left in the chosen bucket; `keys` is reordered and
// overwritten). `above` receives how many keys are strictly larger. O(n), unlike a comparison sort.
uint32_t kth_largest_key(uint32_t* keys, int64_t n, int64_t k, int64_t& above) {
  constexpr int kShift[3] = {21, 10, 0};
  constexpr uint32_t kMask[3] = {0x7FF, 0x7FF, 0x3FF};
  uint32_t counts[2 * 2048];
  uint32_t threshold = 0;
  int64_t rank = k - 1;  // 0-based rank from the top among the keys left
  above = 0;
  for (int level = 0; level < 3; ++level) {
    const int shift = kShift[level];
    const uint32_t mask = kMask[level];
    // Two interleaved histograms: neighbouring scores often share a bucket, and one histogram would
    // make every increment wait for the previous one's store.
    std::fill(counts, counts + 2 * (mask + 1), 0u);
    int64_t i = 0;
    for (; i + 1 < n; i += 2) {
      ++counts[(keys[i] >> shift) & mask];
      ++counts[(mask + 1) + ((keys[i + 1] >> shift) & mask)];
    }
    if (i < n) ++counts[(keys[i] >> shift) & mask];
    for (uint32_t b = 0; b <= mask; ++b) counts[b] += counts[mask + 1 + b];
    uint32_t bucket = mask;
    while (counts[bucket] <= rank) {  // ends: the counts sum to n > rank
      rank -= counts[bucket];
      above += counts[bucket];
      --bucket;
    }
    threshold |= bucket << shift;
    if (level < 2) {  // keep the keys of the chosen bucket, in place (branch-free: the test is a coin flip)
      int64_t m = 0;
      for (int64_t j = 0; j < n; ++j) {
        const uint32_t key = keys[j];
        keys[m] = key;
        m += ((key >> shift) & mask) == bucket;
      }
      n = m;
    }
  }
  return threshold;
}

// One row: the indices of its k highest scores, ascending. Every score above the k-th largest is
// kept, and the ties at that value in position order until k are kept (= a stable descending
// sort's choice). `work` is scratch of at least `seq` elements. Returns false on a non-finite score.
template <typename scalar_t>
bool topk_row(const scalar_t* row, int64_t seq, int64_t k, std::vector<uint32_t>& work, int64_t* out) {
  bool finite = true;
  for (int64_t i = 0; i < seq; ++i) {
    const auto v = static_cast<float>(row[i]);
    finite &= std::isfinite(v);
    work[static_cast<size_t>(i)] = order_key(v);
  }
  if (!finite) return false;
  int64_t above = 0;
  const uint32_t threshold = kth_largest_key(work.data(), seq, k, above);
  // The ordered sweep, branch-free (with k near seq / 2, whether a score is kept is a coin flip):
  // every position is written at out[n] and n advances when it is kept.
  int64_t ties_left = k - above;
  int64_t n = 0;
  for (int64_t i = 0; i < seq && n < k; ++i) {
    const uint32_t key = order_key(static_cast<float>(row[i]));
    const bool tie = key == threshold && ties_left > 0;
    ties_left -= tie;
    out[n] = i;
    n += (key > threshold) | tie;
  }
  return true;
}

// Float64 scores, whose order needs 64-bit keys: nth_element on a copy, then the same sweep.
bool topk_row(const double* row, int64_t seq, int64_t k, std::vector<double>& work, int64_t* out) {
  bool finite = true;
  for (int64_t i = 0; i < seq; ++i) {
    finite &= std::isfinite(row[i]);
    work[static_cast<size_t>(i)] = row[i];
  }
  if (!finite) return false;
  std::nth_element(work.begin(), work.begin() + (k - 1), work.begin() + seq, std::greater<double>());
  const double threshold = work[static_cast<size_t>(k - 1)];
  int64_t above = 0;
  for (int64_t i = 0; i < seq; ++i) above += row[i] > threshold;
  int64_t ties_left = k - above;
  int64_t n = 0;
  for (int64_t i = 0; i < seq && n < k; ++i)
    if (row[i] > threshold || (row[i] == threshold && ties_left-- > 0)) out[n++] = i;
  return true;
}

// The k highest scores of every row, ties to the lower position, returned in ascending position
// order: the same set as a stable descending sort, in O(S) per row (a radix select of the k-th
// largest value, then one ordered sweep). Finiteness is checked on the way; only a failure pays
// for the named error.
at::Tensor topk_indices_cpu(const at::Tensor& scores_in, int64_t k) {
  constexpr const char* op = "topk_indices";
  checks::check_topk(op, scores_in, k);
  const at::Tensor scores = scores_in.contiguous();
  const int64_t rows = scores.size(0) * scores.size(1), seq = scores.size(2);
  at::Tensor out = at::empty({scores.size(0), scores.size(1), k}, scores.options().dtype(at::kLong));
  int64_t* out_ptr = out.data_ptr<int64_t>();
  std::atomic<bool> all_finite{true};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "topk_indices_cpu", [&] {
    using work_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, uint32_t>;
    const scalar_t* s = scores.data_ptr<scalar_t>();
    at::parallel_for(0, rows, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
      std::vector<work_t> work(static_cast<size_t>(seq));
      for (int64_t r = begin; r < end; ++r) {
        if (!topk_row(s + r * seq, seq, k, work, out_ptr + r * k)) all_finite = false;
      }
    });
  });
  if (!all_finite.load()) checks::check_finite_scores(op, scores);  // raises, naming the bad values
  return out;
}

// Copies one K or V row to an output that nobody reads soon. Non-temporal stores write whole cache
// lines without first reading them (a regular store reads each destination line before writing it,
// a third of a copy's traffic), and the rows do not evict the source from the cache. Needs a
// 16-byte-aligned destination and a whole number of 16-byte chunks; memcpy otherwise.
inline void copy_row_streaming(char* dst, const char* src, size_t bytes) {
#if defined(__SSE2__)
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0 && (bytes & 15) == 0) {
    for (size_t i = 0; i < bytes; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Orders the streaming stores of this thread before whatever reads the output next.
inline void end_streaming_stores() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Copies the rows `indices` of keys and values into new contiguous tensors, parallel over the kept
// rows of all heads. An index outside [0, S) raises once the copy is done.
std::tuple<at::Tensor, at::Tensor> gather_kv_cpu(const at::Tensor& keys_in, const at::Tensor& values_in,
                                                 const at::Tensor& indices_in) {
  constexpr const char* op = "gather_kv";
  checks::check_gather(op, keys_in, values_in, indices_in);
  const at::Tensor keys = keys_in.contiguous(), values = values_in.contiguous();
  const at::Tensor indices = indices_in.contiguous();
  const int64_t batch = keys.size(0), heads = keys.size(1), seq = keys.size(2), dim = keys.size(3);
  const int64_t n = indices.size(2);
  at::Tensor keys_out = at::empty({batch, heads, n, dim}, keys.options());
  at::Tensor values_out = at::empty({batch, heads, n, dim}, values.options());
  advise_huge_pages(keys_out);
  advise_huge_pages(values_out);
  const size_t row_bytes = static_cast<size_t>(dim) * keys.element_size();
  const auto* k_src = static_cast<const char*>(keys.data_ptr());
  const auto* v_src = static_cast<const char*>(values.data_ptr());
  auto* k_dst = static_cast<char*>(keys_out.data_ptr());
  auto* v_dst = static_cast<char*>(values_out.data_ptr());
  const int64_t* idx = indices.data_ptr<int64_t>();
  std::atomic<bool> all_in_range{true};
  constexpr int64_t kPrefetchRows = 4;
  // Each task copies a contiguous block of output rows.
  at::parallel_for(0, batch * heads * n, /*grain_size=*/256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t head = r / std::max<int64_t>(n, 1);
      const int64_t pos = idx[r];
      if (pos < 0 || pos >= seq) {
        all_in_range = false;
        continue;
      }
      const size_t src = static_cast<size_t>(head * seq + pos) * row_bytes;
      const size_t dst = static_cast<size_t>(r) * row_bytes;
      if (r + kPrefetchRows < end) {  // kept positions jump: fetch the rows a few copies ahead
        const int64_t ahead = r + kPrefetchRows, ahead_pos = idx[ahead];
        if (ahead_pos >= 0 && ahead_pos < seq) {
          const size_t a = static_cast<size_t>(ahead / std::max<int64_t>(n, 1) * seq + ahead_pos) * row_bytes;
          for (size_t line = 0; line < row_bytes; line += 64) {
            __builtin_prefetch(k_src + a + line);
            __builtin_prefetch(v_src + a + line);
          }
        }
      }
      copy_row_streaming(k_dst + dst, k_src + src, row_bytes);
      copy_row_streaming(v_dst + dst, v_src + src, row_bytes);
    }
    end_streaming_stores();
  });
  if (!all_in_range.load()) checks::check_index_range(op, indices, seq);  // raises
  return {keys_out, values_out};
}

// Moves each head's kept rows forward within keys and values, heads in parallel, rows in ascending
// order: indices strictly ascending means index[i] >= i, so row i is written only after every row
// that still has to move from there (a position < i) has been read. No allocation.
void compact_kv_cpu(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& indices_in) {
  checks::check_compact("compact_kv_in_place", keys, values, indices_in);  // before any row moves
  const at::Tensor indices = indices_in.contiguous();
  const int64_t heads = keys.size(1), n = indices.size(2);
  const size_t row_bytes = static_cast<size_t>(keys.size(3)) * keys.element_size();
  auto* k_base = static_cast<char*>(keys.data_ptr());
  auto* v_base = static_cast<char*>(values.data_ptr());
  const int64_t* idx = indices.data_ptr<int64_t>();
  const int64_t ke = keys.element_size(), ve = values.element_size();
  at::parallel_for(0, keys.size(0) * heads, /*grain_size=*/1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      char* k_head = k_base + (b * keys.stride(0) + h * keys.stride(1)) * ke;
      char* v_head = v_base + (b * values.stride(0) + h * values.stride(1)) * ve;
      const int64_t* kept = idx + bh * n;
      for (int64_t i = 0; i < n; ++i) {
        if (kept[i] == i) continue;  // a kept prefix stays where it is
        std::memcpy(k_head + i * keys.stride(2) * ke, k_head + kept[i] * keys.stride(2) * ke, row_bytes);
        std::memcpy(v_head + i * values.stride(2) * ve, v_head + kept[i] * values.stride(2) * ve, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress, CPU, m) {
  m.impl("topk_indices", &topk_indices_cpu);
  m.impl("gather_kv", &gather_kv_cpu);
  m.impl("compact_kv_", &compact_kv_cpu);
}

}  // namespace kvpress::kernels
