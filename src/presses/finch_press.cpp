#include "kvpress/presses/finch_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "kvpress/presses/key_rerotation_press.h"
#include "presses/registration.h"

namespace kvpress {

FinchPress::FinchPress(double compression_ratio, const Params& params)
    : compression_ratio_(compression_ratio), params_(params) {
  checks::check_ratio("FinchPress", compression_ratio);
  check_params("FinchPress", params_);
}

at::Tensor FinchPress::score(const LayerInputs& in) const {
  constexpr const char* op = "FinchPress.score";
  checks::check_kv(op, in.keys, in.values);
  const int64_t seq = in.keys.size(2), window = in.question_length;
  TORCH_CHECK(window > 0, op,
              ": question_length must be > 0 (the prefill must end with the question: a query-aware "
              "prefill, e.g. kvpress-cli ask --query-aware), got ",
              window);
  checks::check_window(op, "question_length", window, seq);
  at::Tensor attn = ops::window_attention(in, window, op);  // [B, Hq, w, S - w] float32
  if (params_.normalize_scores) {
    // Row i sits at position S - w + i; weighting it by that position undoes the dilution of a
    // softmax over more keys (kvpress multiplies by arange(S - w, S)).
    attn = attn * at::arange(seq - window, seq, attn.options()).view({1, 1, window, 1});
  }
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), heads = attn.size(1);
  checks::check_gqa(op, heads, kv_heads);
  const at::Tensor scores = attn.mean(2).view({batch, kv_heads, heads / kv_heads, seq - window}).mean(2);
  // The question itself gets max + 1 so it is always kept.
  return at::constant_pad_nd(scores, {0, window}, scores.max().item<double>() + 1);
}

at::Tensor FinchPress::select(const LayerInputs& in) const {
  const at::Tensor scores = score(in);
  const int64_t seq = in.keys.size(2);
  if (!params_.chunk_length) return ops::topk_indices(scores, ops::n_kept(seq, compression_ratio_));
  const int64_t chunk = *params_.chunk_length;
  TORCH_CHECK(static_cast<double>(chunk) > static_cast<double>(in.question_length) / (1 - compression_ratio_),
              "FinchPress: chunk_length must be > question_length / (1 - compression_ratio) = ",
              static_cast<double>(in.question_length) / (1 - compression_ratio_), " so that every chunk keeps the ",
              "question's share, got ", chunk);
  std::vector<at::Tensor> kept;  // each chunk's best, offset to layer positions: ascending overall
  for (int64_t start = 0; start < seq; start += chunk) {
    const int64_t len = std::min(chunk, seq - start);
    kept.push_back(start + ops::topk_indices(scores.narrow(2, start, len), ops::n_kept(len, compression_ratio_)));
  }
  return at::cat(kept, 2);
}

at::Tensor FinchPress::kept_positions(const LayerInputs& in) const {
  if (params_.rerotate_keys) return {};  // the kept keys change: compress() only
  checks::check_kv("FinchPress.kept_positions", in.keys, in.values);
  if (compression_ratio_ == 0.0) return budget::keep_all(in).kept_indices;
  return select(in);
}

KV FinchPress::compress(const LayerInputs& in) const {
  constexpr const char* op = "FinchPress.compress";
  checks::check_kv(op, in.keys, in.values);
  if (compression_ratio_ == 0.0) return budget::keep_all(in);  // kvpress returns the cache untouched
  if (!params_.rerotate_keys) return gather_kept(in);
  const at::Tensor inv_freq = ops::rope_inv_freq(in, op);
  KV kv = ops::gather_kv(in.keys, in.values, select(in));
  KeyRerotationPress::rerotate_kept_keys(kv, inv_freq);
  return kv;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"FinchPress",
                    PressKind::kQueryAware,
                    "SnapKV-style attention of the question (the prefill's last question_length tokens), re-rotated",
                    {window_attention_inputs().alternatives,
                     {"question_length"},
                     {"inv_freq"},
                     "rerotate_keys needs inv_freq or cos/sin; kvpress marks the question with a delimiter token"},
                    from_params<FinchPress>};
});

}  // namespace

}  // namespace kvpress
