// KVzipPress: replay chunks, chunk scores, KVzip+ value norms and the global selection (see
// include/kvpress/presses/kvzip_press.h and docs/PRESS_NOTES.md).
#include "kvpress/presses/kvzip_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

using namespace checks;

constexpr const char* kPress = "KVzipPress";

[[noreturn]] void refuse_layer_compress(const char* op) {
  TORCH_CHECK(false, op,
              ": KVzip cannot compress one layer on its own; it needs a second pass of the model over the context "
              "(the context replayed after a repeat prompt) and evicts globally over layers: use "
              "kvpress::llama::kvzip_prefill, or KVzipPress::replay_chunks, chunk_scores and keep_masks");
}

// int(count * ratio) as Python computes it (the product in double, truncated).
int64_t evicted_count(int64_t count, double ratio) { return static_cast<int64_t>(static_cast<double>(count) * ratio); }

// [numel] bool with the `keep` best entries of `flat` [numel] set (ties: the lower index).
at::Tensor best_mask(const at::Tensor& flat, int64_t keep) {
  at::Tensor mask = at::zeros({flat.numel()}, flat.options().dtype(at::kBool));
  if (keep > 0) mask.index_fill_(0, ops::topk_indices(flat.view({1, 1, -1}), keep).view(-1), true);
  return mask;
}

}  // namespace

KVzipPress::KVzipPress(double compression_ratio, const Params& params)
    : compression_ratio_(compression_ratio),
      layerwise_(params.layerwise),
      n_sink_(params.n_sink),
      kvzip_plus_normalization_(params.kvzip_plus_normalization),
      chunk_size_(params.chunk_size) {
  check_ratio(kPress, compression_ratio);
  check_params(kPress, params);
}

KV KVzipPress::compress(const LayerInputs&) const { refuse_layer_compress("KVzipPress.compress"); }

RaggedKV KVzipPress::compress_ragged(const LayerInputs&) const { refuse_layer_compress("KVzipPress.compress_ragged"); }

at::Tensor KVzipPress::keep_mask(const LayerInputs&) const { refuse_layer_compress("KVzipPress.keep_mask"); }

std::vector<KVzipReplayChunk> KVzipPress::replay_chunks(const std::vector<int64_t>& context_ids,
                                                        const std::vector<int64_t>& first_prompt_ids,
                                                        const std::vector<int64_t>& next_prompt_ids,
                                                        const std::vector<int64_t>& suffix_ids,
                                                        int64_t prefix_length) const {
  constexpr const char* op = "KVzipPress.replay_chunks";
  TORCH_CHECK(!context_ids.empty(), op, ": context_ids must be non-empty, got 0 tokens");
  const int64_t n = static_cast<int64_t>(context_ids.size());
  TORCH_CHECK(prefix_length >= 0 && prefix_length < n, op, ": prefix_length must be in [0, ", n,
              ") (the context's tokens before its text), got ", prefix_length);
  std::vector<KVzipReplayChunk> chunks;
  for (int64_t start = prefix_length; start < n; start += chunk_size_) {
    KVzipReplayChunk chunk;
    chunk.start = start;
    chunk.end = std::min(n, start + chunk_size_);
    std::vector<int64_t>& ids = chunk.repeat_ids;
    if (start == prefix_length) {
      ids = first_prompt_ids;
    } else {
      ids = next_prompt_ids;
      const int64_t tail = std::min(kPreviousTailTokens, chunk_size_);  // the previous chunk is full
      ids.insert(ids.end(), context_ids.begin() + (start - tail), context_ids.begin() + start);
    }
    ids.insert(ids.end(), suffix_ids.begin(), suffix_ids.end());
    ids.insert(ids.end(), context_ids.begin() + chunk.start, context_ids.begin() + chunk.end);
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

at::Tensor KVzipPress::chunk_scores(const at::Tensor& queries, const at::Tensor& sink_keys,
                                    const at::Tensor& chunk_keys, const at::Tensor& repeat_keys, int64_t first_row,
                                    const at::Tensor& row_scale, const at::Tensor& column_scale) const {
  constexpr const char* op = "KVzipPress.chunk_scores";
  check_keys(op, chunk_keys);
  TORCH_CHECK(chunk_keys.size(0) == 1, op, ": batch must be 1 (as kvpress), got ", chunk_keys.size(0));
  check_queries(op, queries, chunk_keys, "rows");
  const int64_t hkv = chunk_keys.size(1), d = chunk_keys.size(3), c = chunk_keys.size(2);
  const int64_t hq = queries.size(1), groups = hq / hkv, rows = queries.size(2);
  check_non_negative(op, "first_row", first_row);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"sink_keys", &sink_keys},
                                std::pair<const char*, const at::Tensor*>{"repeat_keys", &repeat_keys}}) {
    check_rank(op, name, *t, 4, "[1, kv_heads, n, head_dim]");
    check_float(op, name, *t);
    check_same_device(op, name, *t, "chunk_keys", chunk_keys);
    TORCH_CHECK(t->size(0) == 1 && t->size(1) == hkv && t->size(3) == d, op, ": ", name, " must be [1, ", hkv, ", n, ",
                d, "], got ", shape_str(*t));
  }
  TORCH_CHECK(repeat_keys.size(2) == first_row + rows, op, ": repeat_keys must hold the repeat's keys 0 .. ",
              first_row + rows - 1, " (first_row + rows = ", first_row + rows, "), got ", repeat_keys.size(2));
  TORCH_CHECK(row_scale.defined() == column_scale.defined(), op,
              ": row_scale and column_scale come together (KVzip+), got only ",
              row_scale.defined() ? "row_scale" : "column_scale");
  if (row_scale.defined()) {
    TORCH_CHECK(row_scale.dim() == 2 && row_scale.size(0) == 1 && row_scale.size(1) == rows, op,
                ": row_scale must be [1, ", rows, "], got ", shape_str(row_scale));
    TORCH_CHECK(column_scale.dim() == 4 && column_scale.size(0) == 1 && column_scale.size(1) == hkv &&
                    column_scale.size(2) == groups && column_scale.size(3) == c,
                op, ": column_scale must be [1, ", hkv, ", ", groups, ", ", c, "], got ", shape_str(column_scale));
  }

  const int64_t s = sink_keys.size(2), total = s + c + repeat_keys.size(2);
  // Query head h * G + g uses KV head h: the group's rows become extra rows of one matmul.
  const at::Tensor qg = queries.to(at::kFloat).reshape({1, hkv, groups * rows, d});
  const at::Tensor keys = at::cat({sink_keys, chunk_keys, repeat_keys}, 2).to(at::kFloat);  // [1, Hkv, T, D]
  at::Tensor logits = at::matmul(qg, keys.transpose(2, 3)).div_(std::sqrt(static_cast<double>(d)));
  logits = logits.view({1, hkv, groups, rows, total});
  // Row i (repeat position first_row + i) sees the repeat's keys 0 .. first_row + i.
  const at::Tensor row = at::arange(rows, at::kLong).unsqueeze(1) + first_row;
  const at::Tensor col = at::arange(total, at::kLong).unsqueeze(0) - (s + c);
  logits.masked_fill_((col > row).to(logits.device()), -std::numeric_limits<double>::infinity());
  at::Tensor weights = at::softmax(logits, -1).narrow(-1, s, c);  // [1, Hkv, G, rows, c]
  if (row_scale.defined()) {
    weights = weights * row_scale.to(at::kFloat).view({1, 1, 1, rows, 1}) *
              column_scale.to(at::kFloat).view({1, hkv, groups, 1, c});
  }
  return weights.amax({2, 3});
}

at::Tensor KVzipPress::value_output_norms(const at::Tensor& values, const at::Tensor& o_proj) {
  constexpr const char* op = "KVzipPress.value_output_norms";
  check_rank(op, "values", values, 4, "[1, kv_heads, n, head_dim]");
  check_float(op, "values", values);
  check_rank(op, "o_proj", o_proj, 2, "[hidden, num_heads * head_dim]");
  check_float(op, "o_proj", o_proj);
  check_same_device(op, "o_proj", o_proj, "values", values);
  const int64_t hkv = values.size(1), d = values.size(3);
  TORCH_CHECK(values.size(0) == 1, op, ": batch must be 1 (as kvpress), got ", values.size(0));
  TORCH_CHECK(o_proj.size(1) % (hkv * d) == 0 && o_proj.size(1) > 0, op,
              ": o_proj must have a multiple of kv_heads * head_dim (", hkv * d, ") columns, got ", shape_str(o_proj));
  const int64_t groups = o_proj.size(1) / (hkv * d), hidden = o_proj.size(0);
  // W_hg [hidden, D] per query head; ||W_hg v||^2 = v^T (W_hg^T W_hg) v.
  const at::Tensor w = o_proj.to(at::kFloat).view({hidden, hkv, groups, d}).permute({1, 2, 0, 3});  // [Hkv, G, hid, D]
  const at::Tensor gram = at::matmul(w.transpose(2, 3), w);                                         // [Hkv, G, D, D]
  const at::Tensor v = values.to(at::kFloat)[0].unsqueeze(1);                                       // [Hkv, 1, c, D]
  return (at::matmul(v, gram) * v).sum(-1).clamp_min(0.0).sqrt().unsqueeze(0);                      // [1, Hkv, G, c]
}

std::vector<at::Tensor> kvzip_evict_lowest(const at::Tensor& scores, double compression_ratio, bool layerwise,
                                           const char* op) {
  check_rank(op, "scores", scores, 3, "[num_layers, kv_heads, seq_len]");
  check_float(op, "scores", scores);
  check_non_empty(op, "scores", scores);
  check_finite_scores(op, scores);
  check_fraction(op, "compression_ratio", compression_ratio);
  const int64_t layers = scores.size(0), hkv = scores.size(1), n = scores.size(2), per_layer = hkv * n;
  const at::Tensor s = scores.to(at::kFloat);
  std::vector<int64_t> evicted(static_cast<size_t>(layers), evicted_count(per_layer, compression_ratio));
  if (!layerwise && compression_ratio > 0.0) {
    const int64_t total = layers * per_layer;
    const at::Tensor kept = best_mask(s.reshape(-1), total - evicted_count(total, compression_ratio));
    const at::Tensor kept_per_layer = kept.view({layers, per_layer}).sum(1).cpu();
    for (int64_t l = 0; l < layers; ++l)
      evicted[static_cast<size_t>(l)] = per_layer - kept_per_layer[l].item<int64_t>();
  }
  std::vector<at::Tensor> masks;
  for (int64_t l = 0; l < layers; ++l)
    masks.push_back(best_mask(s[l].reshape(-1), per_layer - evicted[static_cast<size_t>(l)]).view({1, hkv, n}));
  return masks;
}

std::vector<at::Tensor> KVzipPress::keep_masks(const at::Tensor& scores) const {
  constexpr const char* op = "KVzipPress.keep_masks";
  check_rank(op, "scores", scores, 3, "[num_layers, kv_heads, seq_len]");
  check_float(op, "scores", scores);
  check_non_empty(op, "scores", scores);
  check_finite_scores(op, scores);
  at::Tensor s = scores.to(at::kFloat).clone();
  // The sinks are never evicted: kvpress gives them the highest score + 1.
  if (n_sink_ > 0 && compression_ratio_ > 0.0)
    s.narrow(2, 0, std::min(n_sink_, s.size(2))).fill_(s.max().item<double>() + 1.0);
  return kvzip_evict_lowest(s, eviction_ratio(s.size(2)), layerwise_, op);
}

double KVzipPress::eviction_ratio(int64_t) const { return compression_ratio_; }

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "KVzipPress",
      PressKind::kSecondPass,
      "tokens scored by how much the model attends to them while repeating the context; evicted globally over "
      "layers and heads",
      {{},
       {},
       {},
       "the context replayed after a repeat prompt through the model (kvpress::llama::kvzip_prefill, or "
       "KVzipPress::replay_chunks, chunk_scores and keep_masks)"},
      from_params<KVzipPress>};
});

}  // namespace

}  // namespace kvpress
