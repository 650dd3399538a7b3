// `kvpress-cli query-stats`: one prefill of a calibration text, every layer's pre-RoPE queries
// averaged into TriAttentionPress's statistics (TriAttentionPress::calibrate), written as safetensors.
#include "query_stats.h"

#include <ATen/ATen.h>
#include <fmt/core.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli_args.h"
#include "kvpress/llama/llama.h"
#include "kvpress/presses/triattention_press.h"

namespace kvpress_cli {

namespace {

struct QueryStatsArgs {
  ModelRunArgs run;  // --model, --threads, --quiet
  std::string text;  // default: the bundled stories
  std::string out;
  int64_t max_tokens = 32768;  // the authors' calibrate.py default
};

QueryStatsArgs parse_query_stats_args(const std::vector<std::string>& args) {
  QueryStatsArgs a;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string value;
    if (a.run.take(args, i)) continue;
    if (take_value(args, i, "--text", "", a.text) || take_value(args, i, "--out", "-o", a.out)) continue;
    if (take_value(args, i, "--max-tokens", "", value)) {
      a.max_tokens = parse_int_option("--max-tokens", value, 2, int64_t{1} << 24);
      continue;
    }
    reject_argument("query-stats", args[i]);
  }
  if (a.out.empty()) usage_error("query-stats: --out FILE is required");
  if (!a.run.json.empty() || a.run.chat) usage_error("query-stats: --json and --chat do not apply");
  return a;
}

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "--text ", path, ": cannot read the file");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

int run_query_stats(const std::vector<std::string>& argv) {
  const QueryStatsArgs args = parse_query_stats_args(argv);
  use_threads(args.run.threads);
  const std::string text_path = args.text.empty() ? kvpress::llama::default_stories_path() : args.text;
  const std::string text = read_whole_file(text_path);  // the text first (cheap), then the model
  const kvpress::llama::Checkpoint checkpoint = kvpress::llama::load_checkpoint(args.run.model);
  std::vector<int64_t> ids = checkpoint.tokenizer.encode(text);  // BOS first, as the authors' tokenizer call
  TORCH_CHECK(ids.size() >= 2, "--text ", text_path, ": needs at least 2 tokens, got ", ids.size());
  ids.resize(std::min<size_t>(ids.size(), static_cast<size_t>(args.max_tokens)));
  const kvpress::llama::CapturedPrefill prefill =
      checkpoint.model.capture_prefill(at::tensor(ids, at::kLong).unsqueeze(0));
  const kvpress::TriAttentionPress::Statistics stats = kvpress::TriAttentionPress::calibrate(prefill.layers);
  kvpress::TriAttentionPress::save_statistics(args.out, stats);
  if (!args.run.quiet)
    fmt::print("query statistics of {} over {} tokens of {}: {} layers x {} heads x {} frequency pairs -> {}\n",
               checkpoint.path, ids.size(), text_path, stats.q_mean_real.size(0), stats.q_mean_real.size(1),
               stats.q_mean_real.size(2), args.out);
  return 0;
}

}  // namespace kvpress_cli
