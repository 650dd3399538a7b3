#include "kvpress/presses/duo_attention_press.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "budget.h"
#include "checks.h"
#include "head_exchange.h"
#include "io/json_text.h"
#include "presses/registration.h"

namespace kvpress {
namespace {

// full_attention_heads.tsv: one row per layer, one tab-separated score per KV head.
at::Tensor read_head_scores(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "DuoAttentionPress: ", path, ": cannot open the file");
  std::vector<double> scores;
  int64_t rows = 0, cols = -1;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    std::istringstream fields(line);
    std::string field;
    int64_t n = 0;
    while (std::getline(fields, field, '\t')) {
      char* end = nullptr;
      const double v = std::strtod(field.c_str(), &end);
      TORCH_CHECK(end != field.c_str() && *end == '\0' && std::isfinite(v), "DuoAttentionPress: ", path, ": row ",
                  rows + 1, ": '", field, "' is not a finite number");
      scores.push_back(v);
      ++n;
    }
    TORCH_CHECK(cols < 0 || n == cols, "DuoAttentionPress: ", path, ": row ", rows + 1, " has ", n,
                " scores, the first row ", cols);
    cols = n;
    ++rows;
  }
  TORCH_CHECK(rows > 0 && cols > 0, "DuoAttentionPress: ", path, ": no scores (one row per layer expected)");
  return at::tensor(scores, at::kDouble).view({rows, cols});
}

}  // namespace

namespace {

DuoAttentionPattern pattern_of(const DuoAttentionPress::Params& params) {
  TORCH_CHECK(!params.on_the_fly_scoring,
              "DuoAttentionPress: on_the_fly_scoring needs the model and a dataset at run time; "
              "compute the pattern offline (scripts/make_artifact.py duo-attention, kvpress's on-the-fly "
              "recipe) and give attention_pattern=FOLDER");
  if (params.attention_pattern.empty()) return {};
  return DuoAttentionPress::load_pattern(params.attention_pattern);
}

}  // namespace

DuoAttentionPress::DuoAttentionPress(const Params& params)
    : DuoAttentionPress(params.head_compression_ratio, pattern_of(params)) {}

DuoAttentionPress::DuoAttentionPress(double head_compression_ratio, Pattern pattern)
    : head_compression_ratio_(head_compression_ratio), pattern_(std::move(pattern)) {
  check_params("DuoAttentionPress", Params{head_compression_ratio, false, {}});
  if (!pattern_.head_scores.defined()) return;
  checks::check_non_negative("DuoAttentionPress", "sink_size", pattern_.sink_size);
  checks::check_non_negative("DuoAttentionPress", "recent_size", pattern_.recent_size);
  TORCH_CHECK(pattern_.head_scores.dim() == 2,
              "DuoAttentionPress: head_scores must be [num_layers, num_kv_heads], got ",
              checks::shape_str(pattern_.head_scores));
  const at::Tensor scores = pattern_.head_scores.to(at::kDouble).clamp(0, 1);  // as kvpress clips the file
  pattern_.head_scores = scores;
  // The round(ratio · L · Hkv) lowest scores become streaming heads (Python's round: half to even).
  const int64_t n_streaming =
      static_cast<int64_t>(std::nearbyint(static_cast<double>(scores.numel()) * head_compression_ratio));
  const at::Tensor order = std::get<1>(scores.flatten().sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  streaming_ =
      at::zeros({scores.numel()}, at::kBool).index_fill_(0, order.narrow(0, 0, n_streaming), true).view(scores.sizes());
}

DuoAttentionPress::Pattern DuoAttentionPress::load_pattern(const std::string& folder) {
  const std::string config_path = folder + "/config.json";
  const std::string where = "DuoAttentionPress: " + config_path;
  const nlohmann::json config = io::read_json_file(config_path, where);
  TORCH_CHECK(config.is_object(), where, ": not a JSON object");
  Pattern p;
  for (const auto& [key, member] : {std::pair<const char*, int64_t*>{"sink_size", &p.sink_size},
                                    std::pair<const char*, int64_t*>{"recent_size", &p.recent_size}}) {
    TORCH_CHECK(config.contains(key) && config[key].is_number_integer(), "DuoAttentionPress: ", config_path,
                ": needs an integer '", key, "'");
    *member = config[key].get<int64_t>();
  }
  p.head_scores = read_head_scores(folder + "/full_attention_heads.tsv");
  return p;
}

KV DuoAttentionPress::compress(const LayerInputs&) const { refuse_uniform_compress(); }

at::Tensor DuoAttentionPress::keep_mask(const LayerInputs& in) const {
  constexpr const char* op = "DuoAttentionPress.compress_ragged";
  checks::check_kv(op, in.keys, in.values);
  if (head_compression_ratio_ == 0.0) return budget::keep_everything(in);  // no streaming head
  TORCH_CHECK(streaming_.defined(), op,
              ": no attention pattern: give attention_pattern=FOLDER (config.json and "
              "full_attention_heads.tsv; scripts/make_artifact.py duo-attention computes one for a model)");
  const int64_t layers = streaming_.size(0), kv_heads = head_exchange::layer_kv_heads(in), seq = in.keys.size(2);
  TORCH_CHECK(in.layer_idx >= 0 && in.layer_idx < layers, op, ": layer_idx must be in [0, ", layers,
              ") (the pattern's layers), got ", in.layer_idx);
  TORCH_CHECK(streaming_.size(1) == kv_heads, op, ": the pattern has ", streaming_.size(1), " KV heads, the keys have ",
              kv_heads);
  at::Tensor keep = budget::keep_everything(in);
  const int64_t begin = pattern_.sink_size, end = seq - pattern_.recent_size;
  if (begin < end) {
    // [Hkv] -> [1, Hkv, 1] & [S] -> [1, 1, S]: a streaming head's middle positions are dropped.
    const at::Tensor streaming =
        head_exchange::own_rows(op, "the pattern", streaming_[in.layer_idx], 0, in).to(keep.device()).view({1, -1, 1});
    const at::Tensor pos = at::arange(seq, keep.options().dtype(at::kLong)).view({1, 1, seq});
    keep.masked_fill_(streaming & (pos >= begin) & (pos < end), false);
  }
  return keep;
}

namespace {

using namespace registration;  // NOLINT(google-build-using-namespace)

const Registration kRegistration([] {
  return PressEntry{
      "DuoAttentionPress",
      PressKind::kLayer,
      "DuoAttention: streaming KV heads (lowest pattern scores) keep only sink and recent tokens; head-ragged",
      {{}, {}, {"layer_idx"}, "the pattern comes from the folder named by attention_pattern; layer_idx picks its row"},
      from_params<DuoAttentionPress>,
      "each KV head keeps its whole cache or only sink and recent tokens, by the pattern and head_compression_ratio"};
});

}  // namespace

}  // namespace kvpress
