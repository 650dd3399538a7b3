#include "kvpress/presses/entropy_gated_chunkkv_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "budget.h"
#include "checks.h"
#include "head_exchange.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

constexpr double kEpsilon = 1e-8;  // kvpress's EPSILON, in the probabilities and their log

// Normalised entropy in [0, 1] of each row of non-negative-rebased scores [n, L] -> [n]. The
// operations are kvpress's, in its order (float32), so medians and comparisons see its values.
at::Tensor normalised_entropy(const at::Tensor& scores) {
  const int64_t length = scores.size(1);
  if (length == 1) return at::zeros({scores.size(0)}, scores.options());
  const at::Tensor rebased = scores - scores.amin(1, true).clamp_max(0.0);
  const at::Tensor p = rebased / (rebased.sum(1, true) + kEpsilon);
  const at::Tensor h = -(p * (p + kEpsilon).log()).sum(1);
  return (h / std::log(static_cast<double>(length))).clamp(0.0, 1.0);
}

// Positions of the n highest of scores[positions], ties to the earlier position.
std::vector<int64_t> best_of(const std::vector<float>& scores, std::vector<int64_t> positions, int64_t n) {
  std::partial_sort(positions.begin(), positions.begin() + n, positions.end(),
                    [&](int64_t a, int64_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); });
  positions.resize(n);
  return positions;
}

}  // namespace

EntropyGatedChunkKVPress::EntropyGatedChunkKVPress(std::shared_ptr<const ScorerPress> press, int64_t chunk_length,
                                                   int64_t low_entropy_chunk_length)
    : ChunkedWrapperPress(std::move(press), chunk_length, "EntropyGatedChunkKVPress"),
      low_entropy_chunk_length_(low_entropy_chunk_length) {
  TORCH_CHECK(low_entropy_chunk_length >= 1 && low_entropy_chunk_length < chunk_length,
              "EntropyGatedChunkKVPress: low_entropy_chunk_length must be in [1, chunk_length - 1] = [1, ",
              chunk_length - 1, "], got ", low_entropy_chunk_length);
}

at::Tensor EntropyGatedChunkKVPress::kept_positions(const LayerInputs& in) const {
  constexpr const char* op = "EntropyGatedChunkKVPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (compression_ratio() == 0.0) return budget::keep_all(in).kept_indices;
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2);
  const int64_t length = chunk_length();
  const int64_t n_full = seq / length, rest = seq % length;

  // Head-summed scores [S] (kvpress: .sum(dim=1)[0].float(); here summed over the batch too).
  // (Over every head: on a rank's share, over every rank's.)
  const at::Tensor scores = head_exchange::sum_over_ranks(in, inner_scores(without_attentions(in), op).sum(1))
                                .sum(0)
                                .to(at::kFloat)
                                .cpu()
                                .contiguous();
  checks::check_finite_scores(op, scores);
  std::vector<at::Tensor> means, entropies;
  if (n_full > 0) {
    const at::Tensor full = scores.narrow(0, 0, n_full * length).view({n_full, length});
    means.push_back(full.mean(1));
    entropies.push_back(normalised_entropy(full));
  }
  if (rest > 0) {
    const at::Tensor tail = scores.narrow(0, n_full * length, rest).view({1, rest});
    means.push_back(tail.mean(1));
    entropies.push_back(normalised_entropy(tail));
  }
  const at::Tensor chunk_scores = at::cat(means), chunk_entropy = at::cat(entropies);  // [n_chunks]
  // torch.median: the lower of the two middle values for an even count.
  const at::Tensor important = chunk_scores >= chunk_scores.median();
  const at::Tensor spiky = chunk_entropy < chunk_entropy.median();
  const at::Tensor order = std::get<1>(chunk_scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));

  const float* s = scores.data_ptr<float>();
  const std::vector<float> token_scores(s, s + seq);
  const auto* imp = important.data_ptr<bool>();
  const auto* spk = spiky.data_ptr<bool>();
  const auto* ord = order.data_ptr<int64_t>();
  std::vector<bool> keep(seq, false);
  int64_t budget = ops::n_kept(seq, compression_ratio());
  for (int64_t i = 0; i < order.numel() && budget > 0; ++i) {
    const int64_t c = ord[i], start = c * length, end = std::min(start + length, seq);
    int64_t n = std::min(end - start, budget);
    if (imp[c] && spk[c]) n = std::min(n, low_entropy_chunk_length_);
    std::vector<int64_t> chunk(end - start);
    std::iota(chunk.begin(), chunk.end(), start);
    for (int64_t p : best_of(token_scores, std::move(chunk), n)) keep[p] = true;
    budget -= n;
  }
  if (budget > 0) {  // spiky chunks left budget unspent: the best tokens not yet kept
    std::vector<int64_t> leftover;
    for (int64_t p = 0; p < seq; ++p)
      if (!keep[p]) leftover.push_back(p);
    const int64_t n = std::min<int64_t>(budget, leftover.size());
    for (int64_t p : best_of(token_scores, std::move(leftover), n)) keep[p] = true;
  }
  std::vector<int64_t> kept;
  for (int64_t p = 0; p < seq; ++p)
    if (keep[p]) kept.push_back(p);
  const at::Tensor positions = at::tensor(kept, at::kLong).to(in.keys.device());
  return positions.view({1, 1, -1}).expand({batch, kv_heads, positions.size(0)}).contiguous();
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"EntropyGatedChunkKVPress",
                    PressKind::kWrapper,
                    "ChunkKV whose important low-entropy chunks keep only their best tokens",
                    {{}, {}, {}, "no attentions (kvpress refuses them)"},
                    wrapper_from_params<EntropyGatedChunkKVPress>};
});

}  // namespace

}  // namespace kvpress
