// QSMPress (CTR-Press stage I): query-aware scores, semantic weights, forced keeps, value merge.
// docs/PRESS_NOTES.md "QSMPress / CTRPress" lists where this differs from the reference.
#include "kvpress/presses/qsm_press.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <vector>

#include "budget.h"
#include "checks.h"
#include "kvpress/ops.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

// UTF-8 -> code points; a malformed byte becomes U+FFFD on its own.
std::vector<char32_t> code_points(const std::string& text) {
  std::vector<char32_t> out;
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    int extra = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    char32_t cp = extra == 0 ? c : extra == 1 ? (c & 0x1F) : extra == 2 ? (c & 0x0F) : (c & 0x07);
    bool ok = extra >= 0 && i + static_cast<size_t>(extra) < text.size();
    for (int k = 1; ok && k <= extra; ++k) {
      const auto cc = static_cast<unsigned char>(text[i + static_cast<size_t>(k)]);
      ok = (cc >> 6) == 0x2;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += static_cast<size_t>(extra) + 1;
  }
  return out;
}

// Python's str.isspace() for the characters tokenizers produce.
bool is_space(char32_t c) {
  return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool contains_any(const std::vector<char32_t>& text, const char* chars) {
  for (char32_t c : text)
    for (const char* p = chars; *p; ++p)
      if (c == static_cast<char32_t>(static_cast<unsigned char>(*p))) return true;
  return false;
}

// The reference's 28 stopwords.
bool is_stopword(const std::string& lowered) {
  static const char* const words[] = {"a",   "an",   "and",  "are", "as", "at",  "be",   "but",  "by",
                                      "for", "from", "has",  "he",  "in", "is",  "it",   "its",  "of",
                                      "on",  "or",   "that", "the", "to", "was", "were", "will", "with"};
  for (const char* w : words)
    if (lowered == w) return true;
  return false;
}

void check_options(const QSMOptions& o) {
  constexpr const char* op = "QSMPress";
  TORCH_CHECK(o.qa_alpha >= 0.0 && o.qa_alpha <= 1.0, op, ": qa_alpha must be in [0, 1], got ", o.qa_alpha);
  TORCH_CHECK(o.pseudo_query_max_fraction > 0.0 && o.pseudo_query_max_fraction <= 1.0, op,
              ": pseudo_query_max_fraction must be in (0, 1], got ", o.pseudo_query_max_fraction);
  checks::check_non_negative(op, "query_length", o.query_length);
  checks::check_non_negative(op, "pseudo_query_len", o.pseudo_query_len);
  checks::check_non_negative(op, "sink_tokens", o.sink_tokens);
  checks::check_non_negative(op, "recent_tokens", o.recent_tokens);
  checks::check_non_negative(op, "rare_min_chars", o.semantic.rare_min_chars);
  TORCH_CHECK(std::isfinite(o.lambda_sem) && o.lambda_sem >= 0.0, op, ": lambda_sem must be >= 0, got ", o.lambda_sem);
  TORCH_CHECK(std::isfinite(o.merge_alpha) && o.merge_alpha >= 0.0, op, ": merge_alpha must be >= 0, got ",
              o.merge_alpha);
  TORCH_CHECK(std::isfinite(o.merge_score_power) && o.merge_score_power > 0.0, op,
              ": merge_score_power must be > 0, got ", o.merge_score_power);
  TORCH_CHECK(o.merge_min_score_ratio >= 0.0 && o.merge_min_score_ratio <= 1.0, op,
              ": merge_min_score_ratio must be in [0, 1], got ", o.merge_min_score_ratio);
  TORCH_CHECK(o.merge_count_power >= 0.0 && o.merge_count_power <= 1.0, op,
              ": merge_count_power must be in [0, 1], got ", o.merge_count_power);
}

}  // namespace

double semantic_weight(const std::string& text, int64_t token_id, const SemanticWeightOptions& o) {
  const std::vector<char32_t> cps = code_points(text);
  size_t begin = 0, end = cps.size();
  while (begin < end && is_space(cps[begin])) ++begin;
  while (end > begin && is_space(cps[end - 1])) --end;
  const std::vector<char32_t> stripped(cps.begin() + static_cast<std::ptrdiff_t>(begin),
                                       cps.begin() + static_cast<std::ptrdiff_t>(end));
  bool digit = false, upper = false, alpha = false;
  for (char32_t c : cps) {
    digit = digit || (c >= '0' && c <= '9');
    upper = upper || (c >= 'A' && c <= 'Z');
    alpha = alpha || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
  }
  double w = 0.0;
  if (digit) w += o.digit_weight;
  if (upper && alpha) w += o.capital_weight;
  if (static_cast<int64_t>(stripped.size()) >= o.rare_min_chars) w += o.rare_weight;
  if (o.rare_token_id_threshold && token_id >= *o.rare_token_id_threshold) w += o.rare_weight;
  if (contains_any(cps, ".!?;:\n")) w += o.punctuation_weight;
  if (contains_any(cps, "_./=()[]{}<>\\")) w += o.code_weight;
  // Stopwords are ASCII: only an all-ASCII stripped text can be one.
  std::string lowered;
  bool ascii = true;
  for (char32_t c : stripped) {
    ascii = ascii && c < 0x80;
    lowered.push_back(static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c & 0x7F));
  }
  if (ascii && is_stopword(lowered)) w -= o.stopword_weight;
  if (stripped.empty()) w -= o.whitespace_weight;
  return w;
}

QSMPress::QSMPress(double compression_ratio, QSMOptions options, TokenTextFn token_text)
    : ScorerPress(compression_ratio), options_(std::move(options)), token_text_(std::move(token_text)) {
  check_options(options_);
}

std::pair<int64_t, int64_t> QSMPress::query_span(int64_t seq_len) const {
  if (options_.query_length > 0) {
    const int64_t len = std::min(options_.query_length, seq_len);
    return {seq_len - len, seq_len};
  }
  const int64_t by_fraction =
      std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(seq_len) * options_.pseudo_query_max_fraction));
  const int64_t len = std::min({options_.pseudo_query_len, by_fraction, seq_len});
  return {seq_len - len, seq_len};
}

at::Tensor QSMPress::forced_keep_mask(int64_t seq_len) const {
  at::Tensor mask = at::zeros({seq_len}, at::kBool);
  const auto [start, end] = query_span(seq_len);
  const bool explicit_query = options_.query_length > 0;
  const int64_t context_end = explicit_query ? start : seq_len;
  const int64_t sinks = std::min(options_.sink_tokens, context_end);
  if (sinks > 0) mask.narrow(0, 0, sinks).fill_(true);
  const int64_t recent_start = std::max<int64_t>(0, context_end - options_.recent_tokens);
  if (context_end > recent_start) mask.narrow(0, recent_start, context_end - recent_start).fill_(true);
  if (end > start && (explicit_query || options_.keep_pseudo_query)) mask.narrow(0, start, end - start).fill_(true);
  return mask;
}

int64_t QSMPress::kept_count(int64_t seq_len) const {
  const int64_t forced = forced_keep_mask(seq_len).sum().item<int64_t>();
  return std::min(std::max(ops::n_kept(seq_len, compression_ratio()), forced), seq_len);
}

at::Tensor QSMPress::semantic_weights(const LayerInputs& in) const {
  const std::string op = name() + ".semantic_weights";
  if (in.input_ids.defined()) {
    checks::check_rank(op.c_str(), "input_ids", in.input_ids, 2, "[batch, seq_len]");
    TORCH_CHECK(in.input_ids.scalar_type() == at::kLong || in.input_ids.scalar_type() == at::kInt, op,
                ": input_ids must be int64 (or int32), got ", in.input_ids.scalar_type());
    if (in.keys.defined() && in.keys.dim() == 4) {
      TORCH_CHECK(in.input_ids.size(0) == in.keys.size(0) && in.input_ids.size(1) == in.keys.size(2), op,
                  ": input_ids must be [", in.keys.size(0), ", ", in.keys.size(2), "] to match keys, got ",
                  checks::shape_str(in.input_ids));
    }
  }
  const TokenTextFn& token_text = token_text_ ? token_text_ : in.token_text;
  if (!options_.use_semantic || !token_text || !in.input_ids.defined()) return {};
  const at::Tensor ids = in.input_ids.to(at::kCPU, at::kLong).contiguous();
  at::Tensor out = at::empty(ids.sizes(), at::kFloat);
  const int64_t* id = ids.data_ptr<int64_t>();
  float* w = out.data_ptr<float>();
  std::unordered_map<int64_t, float> memo;  // a prompt repeats its tokens: decode each id once
  for (int64_t i = 0; i < ids.numel(); ++i) {
    auto it = memo.find(id[i]);
    if (it == memo.end())
      it = memo.emplace(id[i], static_cast<float>(semantic_weight(token_text(id[i]), id[i], options_.semantic))).first;
    w[i] = it->second;
  }
  return in.keys.defined() ? out.to(in.keys.device()) : out;
}

QSMScores QSMPress::stage_one_scores(const LayerInputs& in) const {
  const std::string op_name = name() + ".score";
  const char* op = op_name.c_str();
  checks::check_kv(op, in.keys, in.values);
  const int64_t batch = in.keys.size(0), kv_heads = in.keys.size(1), seq = in.keys.size(2), head_dim = in.keys.size(3);
  const auto [start, end] = query_span(seq);
  const int64_t q_len = end - start;
  const auto fopts = in.keys.options().dtype(at::kFloat);

  at::Tensor s;
  if (!options_.use_query_aware || q_len == 0) {
    s = at::zeros({batch, kv_heads, seq}, fopts);
  } else {
    const at::Tensor q = ops::window_queries(in, q_len, op).to(at::kFloat);  // [B, Hq, q, D]
    checks::check_gqa(op, q.size(1), kv_heads);
    // The reference averages the QUERIES of a GQA group (not their attention) before the softmax.
    const at::Tensor grouped = q.reshape({batch, kv_heads, q.size(1) / kv_heads, q_len, head_dim}).mean(2);
    const at::Tensor keys_t = in.keys.to(at::kFloat).transpose(2, 3);  // [B, Hkv, D, S]
    // Query rows in chunks of at most 4M logits (16 MiB), so that long contexts never hold the
    // [B, Hkv, q, S] logits and probabilities at once; one chunk whenever they fit.
    const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(1, batch * kv_heads * seq));
    at::Tensor prob_sum, prob_max;  // [B, Hkv, S]
    for (int64_t r0 = 0; r0 < q_len; r0 += chunk) {
      const int64_t rows = std::min(chunk, q_len - r0);
      at::Tensor logits = at::matmul(grouped.narrow(2, r0, rows), keys_t)
                              .div_(std::sqrt(static_cast<double>(head_dim)));  // [B, Hkv, rows, S]
      // Query i sits at position start + i and sees keys 0 .. start + i.
      const at::Tensor future = at::ones({rows, seq}, in.keys.options().dtype(at::kBool)).triu(start + r0 + 1);
      logits.masked_fill_(future, -std::numeric_limits<float>::infinity());
      const at::Tensor probs = at::softmax(logits, -1);
      if (rows == q_len) {  // everything in one chunk: the reference's mean and max as they are
        s = probs.mean(2).mul_(options_.qa_alpha).add_(std::get<0>(probs.max(2)), 1.0 - options_.qa_alpha);
        break;
      }
      const at::Tensor part_sum = probs.sum(2), part_max = std::get<0>(probs.max(2));
      prob_sum = prob_sum.defined() ? prob_sum.add_(part_sum) : part_sum;
      prob_max = prob_max.defined() ? at::maximum(prob_max, part_max) : part_max;
    }
    if (!s.defined()) {
      s = prob_sum.div_(static_cast<double>(q_len)).mul_(options_.qa_alpha).add_(prob_max, 1.0 - options_.qa_alpha);
    }
    s = at::nan_to_num(s, 0.0, 0.0, 0.0);
    if (options_.score_normalization) {
      const at::Tensor lo = s.amin(-1, true), hi = s.amax(-1, true);
      s = (s - lo) / (hi - lo).clamp_min(1e-6);
    }
  }
  // The pseudo-query does not rank itself.
  if (options_.query_length == 0 && q_len > 0) s.narrow(2, start, q_len).zero_();

  const at::Tensor forced = forced_keep_mask(seq).to(in.keys.device());
  constexpr double float_max = std::numeric_limits<float>::max();
  QSMScores out;
  out.forced = forced;
  out.base = s.masked_fill(forced, float_max);
  out.scores = out.base;
  const at::Tensor w = semantic_weights(in);
  if (w.defined()) {
    const at::Tensor gate = at::tanh(w).unsqueeze(1).mul(options_.lambda_sem).add_(1.0);  // [B, 1, S]
    const at::Tensor modified = at::nan_to_num(out.base.masked_fill(forced, 0.0) * gate, 0.0, 0.0, 0.0);
    out.scores = modified.masked_fill(forced, float_max);
  }
  return out;
}

at::Tensor QSMPress::score(const LayerInputs& inputs) const { return stage_one_scores(inputs).scores; }

bool QSMPress::merge_enabled() const {
  return options_.use_merge && (options_.query_length > 0 || options_.merge_in_pseudo_query);
}

at::Tensor QSMPress::merge_weights(const QSMScores& st, const at::Tensor& kept_indices) const {
  const at::Tensor keep =
      at::zeros(st.base.sizes(), st.base.options().dtype(at::kBool)).scatter_(2, kept_indices, true);
  at::Tensor w;
  if (options_.merge_weighting == MergeWeighting::kUniform) {
    w = at::ones(st.base.sizes(), st.base.options());
  } else {
    // Relative to the weakest non-forced token this head kept (tau), pre-semantic scores.
    const at::Tensor s = at::nan_to_num(st.base, 0.0, 0.0, 0.0);
    const at::Tensor candidates = keep.logical_and(st.forced.logical_not());
    at::Tensor tau = s.masked_fill(candidates.logical_not(), std::numeric_limits<double>::infinity()).amin(-1, true);
    tau = at::where(at::isfinite(tau), tau.clamp_min(1e-6), at::ones_like(tau));
    at::Tensor rel = (s.clamp_min(0.0) / tau).clamp(0.0, 1.0);
    if (options_.merge_min_score_ratio > 0.0) rel.masked_fill_(rel < options_.merge_min_score_ratio, 0.0);
    w = rel.pow(options_.merge_score_power);
  }
  return w.masked_fill(keep, 0.0);
}

KV QSMPress::select_and_merge(const LayerInputs& in, const QSMScores& st, int64_t n_kept) const {
  const at::Tensor kept = ops::topk_indices(st.scores, n_kept);
  KV kv = ops::gather_kv(in.keys, in.values, kept);
  if (merge_enabled() && n_kept < in.keys.size(2)) {
    kv.values = merge_into_nearest_kept(kv.values, in.values, kept, merge_weights(st, kept), options_.merge_alpha,
                                        options_.merge_count_power);
  }
  return kv;
}

KV QSMPress::compress(const LayerInputs& inputs) const {
  const std::string op = name() + ".compress";
  checks::check_kv(op.c_str(), inputs.keys, inputs.values);
  if (compression_ratio() == 0.0) return budget::keep_all(inputs);  // the reference returns the cache untouched
  const int64_t seq = inputs.keys.size(2);
  return select_and_merge(inputs, stage_one_scores(inputs), kept_count(seq));
}

at::Tensor merge_into_nearest_kept(const at::Tensor& kept_values, const at::Tensor& values,
                                   const at::Tensor& kept_indices, const at::Tensor& weights, double alpha,
                                   double count_power) {
  constexpr const char* op = "merge_into_nearest_kept";
  checks::check_kv(op, values, values);
  checks::check_rank(op, "kept_values", kept_values, 4, "[batch, kv_heads, n_kept, head_dim]");
  checks::check_rank(op, "kept_indices", kept_indices, 3, "[batch, kv_heads, n_kept]");
  checks::check_rank(op, "weights", weights, 3, "[batch, kv_heads, seq_len]");
  const int64_t batch = values.size(0), heads = values.size(1), seq = values.size(2), dim = values.size(3);
  const int64_t n = kept_indices.size(2);
  TORCH_CHECK(kept_indices.scalar_type() == at::kLong, op, ": kept_indices must be int64, got ",
              kept_indices.scalar_type());
  TORCH_CHECK(kept_indices.size(0) == batch && kept_indices.size(1) == heads && n >= 1 && n <= seq, op,
              ": kept_indices must be [", batch, ", ", heads, ", n_kept] with 1 <= n_kept <= ", seq, ", got ",
              checks::shape_str(kept_indices));
  TORCH_CHECK(kept_values.size(0) == batch && kept_values.size(1) == heads && kept_values.size(2) == n &&
                  kept_values.size(3) == dim,
              op, ": kept_values must be [", batch, ", ", heads, ", ", n, ", ", dim, "], got ",
              checks::shape_str(kept_values));
  TORCH_CHECK(weights.size(0) == batch && weights.size(1) == heads && weights.size(2) == seq, op, ": weights must be [",
              batch, ", ", heads, ", ", seq, "], got ", checks::shape_str(weights));
  TORCH_CHECK(std::isfinite(alpha) && alpha >= 0.0, op, ": alpha must be >= 0, got ", alpha);
  TORCH_CHECK(count_power >= 0.0 && count_power <= 1.0, op, ": count_power must be in [0, 1], got ", count_power);
  for (const auto* t : {&kept_values, &kept_indices, &weights})
    checks::check_same_device(op, "every input", *t, "values", values);
  const int64_t lo = kept_indices.min().item<int64_t>(), hi = kept_indices.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < seq, op, ": kept_indices must be in [0, ", seq, "), got values in [", lo, ", ", hi, "]");
  TORCH_CHECK(n == 1 || (kept_indices.narrow(2, 1, n - 1) > kept_indices.narrow(2, 0, n - 1)).all().item<bool>(), op,
              ": kept_indices must be strictly ascending per head");

  // Nearest kept slot of every position: j = first kept >= p; the one before it wins ties.
  const at::Tensor positions = at::arange(seq, kept_indices.options()).expand({batch, heads, seq}).contiguous();
  const at::Tensor right_slot = at::searchsorted(kept_indices.contiguous(), positions);  // [B, H, S] in [0, n]
  const at::Tensor left = (right_slot - 1).clamp(0, n - 1), right = right_slot.clamp(0, n - 1);
  const at::Tensor left_gap = positions - kept_indices.gather(2, left);
  const at::Tensor right_gap = kept_indices.gather(2, right) - positions;
  const at::Tensor use_left = (right_slot > 0).logical_and((right_slot == n).logical_or(left_gap <= right_gap));
  const at::Tensor slot = at::where(use_left, left, right);

  const at::Tensor keep =
      at::zeros({batch, heads, seq}, kept_indices.options().dtype(at::kBool)).scatter_(2, kept_indices, true);
  const at::Tensor w = at::nan_to_num(weights.to(at::kFloat), 0.0, 0.0, 0.0).clamp_min(0.0).masked_fill(keep, 0.0);

  // Only positions with a positive weight contribute (a tenth of the evicted ones for CTR's
  // rescue): their values are gathered and summed into the slots they touch, never a [B, H, S, D]
  // product. Sums run in position order per slot, as a scatter_add over all positions would.
  const at::Tensor sources = w.nonzero();  // [M, 3] (b, h, p), ascending
  const at::Tensor b_idx = sources.select(1, 0), h_idx = sources.select(1, 1), p_idx = sources.select(1, 2);
  const at::Tensor source_weight = w.index({b_idx, h_idx, p_idx});                               // [M]
  const at::Tensor flat_slot = (b_idx * heads + h_idx) * n + slot.index({b_idx, h_idx, p_idx});  // [M]
  const auto [touched, source_to_touched, unused_counts] = at::_unique2(flat_slot, /*sorted=*/true, true);
  const int64_t n_touched = touched.numel();
  const at::Tensor contributions =
      at::zeros({n_touched, dim}, w.options())
          .index_add_(0, source_to_touched,
                      values.index({b_idx, h_idx, p_idx}).to(at::kFloat) * source_weight.unsqueeze(-1));
  const at::Tensor mass =
      at::zeros({n_touched}, w.options()).index_add_(0, source_to_touched, source_weight).unsqueeze(-1);
  const double eps = values.scalar_type() == at::kFloat  ? std::numeric_limits<float>::epsilon()
                     : values.scalar_type() == at::kHalf ? 9.765625e-4  // float16
                                                         : 7.8125e-3;   // bfloat16
  at::Tensor merged = kept_values.clone(at::MemoryFormat::Contiguous);
  const at::Tensor merged_rows = merged.view({-1, dim});  // [B * H * n_kept, D]
  const at::Tensor base = merged_rows.index_select(0, touched).to(at::kFloat);
  const at::Tensor effective = mass.pow(1.0 - count_power).mul_(alpha);
  const at::Tensor blended = (base + effective * (contributions / mass.clamp_min(eps))) / (effective + 1.0);
  merged_rows.index_copy_(0, touched, blended.to(values.scalar_type()));
  return merged;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{"QSMPress",
                    PressKind::kScorer,
                    "CTR-Press stage I: query-span attention x semantic factor, forced keeps, value merge",
                    {{{{"queries"}}, {{"hidden_states", "q_proj", "cos", "sin"}}},
                     {},
                     {"input_ids"},
                     "input_ids and a token-text callback on the press enable its semantic weights"},
                    from_params<QSMPress>};
});

}  // namespace

}  // namespace kvpress
