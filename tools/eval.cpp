// kvpress-cli eval: for each held-out story, prefill its first tokens, compress with each press at
// each ratio, teacher-force the rest, and report mean NLL and greedy agreement with the full cache
// (kvpress::llama::score_continuation). See docs/CLI.md and docs/EVAL.md.
#include "eval.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_args.h"
#include "kvpress/io/atomic_file.h"
#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"
#include "plot_runner.h"
#include "progress.h"

namespace kvpress_cli {
namespace {

namespace llama = kvpress::llama;
using Clock = std::chrono::steady_clock;

struct PressSpec {
  std::string name;
  std::map<std::string, std::string> params;
  std::string label;  // name, or name(k=v,...) with parameters
  // Default list only: compression_ratios set per evaluated ratio by per_layer_ramp().
  bool per_layer_ramp = false;
};

struct EvalArgs {
  std::string model = "tinystories-656k";
  std::string text;
  std::vector<PressSpec> presses;  // empty: every registry press with its defaults
  std::vector<double> ratios = {0.25, 0.5, 0.75};
  int64_t prefix_tokens = 0;  // > 0: fixed prefix length
  double prefix_fraction = 0.5;
  int64_t min_prefix = 65;  // SnapKVPress's default window_size + 1: it observes the last 64 queries
  int64_t max_stories = 0;  // 0: all
  std::string json, csv, png;
  int64_t threads = 0;  // intra-op threads; 0: torch's default (use_threads)
  bool progress = true;
  bool quiet = false;
};

EvalArgs parse_eval_args(const std::vector<std::string>& args) {
  EvalArgs out;
  bool fraction_given = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    std::string key = a, value;
    bool has_inline = false;
    if (a.rfind("--", 0) == 0 && a.find('=') != std::string::npos) {
      key = a.substr(0, a.find('='));
      value = a.substr(a.find('=') + 1);
      has_inline = true;
    }
    auto take = [&]() -> std::string {
      if (has_inline) return value;
      TORCH_CHECK(i + 1 < args.size(), "option ", key, " needs a value");
      return args[++i];
    };
    if (key == "--model") {
      out.model = take();
    } else if (key == "--text") {
      out.text = take();
    } else if (key == "--press") {
      PressSpec p;
      p.name = take();
      p.label = p.name;
      out.presses.push_back(p);
    } else if (key == "--param") {
      const std::string kv = take();
      const auto eq = kv.find('=');
      TORCH_CHECK(eq != std::string::npos && eq > 0, "--param expects KEY=VALUE, got '", kv, "'");
      TORCH_CHECK(!out.presses.empty(), "eval: --param ", kv, " must follow the --press it applies to");
      TORCH_CHECK(out.presses.back().params.emplace(kv.substr(0, eq), kv.substr(eq + 1)).second, "--param ",
                  kv.substr(0, eq), " given more than once for ", out.presses.back().name);
    } else if (key == "--ratios") {
      out.ratios = parse_ratios(take());
    } else if (key == "--prefix-tokens") {
      const std::string v = take();
      const auto n = kvpress::parse_int(v);
      TORCH_CHECK(n && *n >= 1, "--prefix-tokens must be an integer >= 1, got '", v, "'");
      out.prefix_tokens = *n;
    } else if (key == "--prefix-fraction") {
      const std::string v = take();
      const auto f = kvpress::parse_double(v);
      TORCH_CHECK(f && *f > 0.0 && *f < 1.0, "--prefix-fraction must be a number in (0, 1), got '", v, "'");
      out.prefix_fraction = *f;
      fraction_given = true;
    } else if (key == "--min-prefix") {
      const std::string v = take();
      const auto n = kvpress::parse_int(v);
      TORCH_CHECK(n && *n >= 1, "--min-prefix must be an integer >= 1, got '", v, "'");
      out.min_prefix = *n;
    } else if (key == "--max-stories") {
      const std::string v = take();
      const auto n = kvpress::parse_int(v);
      TORCH_CHECK(n && *n >= 1, "--max-stories must be an integer >= 1, got '", v, "'");
      out.max_stories = *n;
    } else if (key == "--threads") {
      const std::string v = take();
      const auto n = kvpress::parse_int(v);
      TORCH_CHECK(n && *n >= 1 && *n <= 1024, "--threads must be an integer >= 1, got '", v, "'");
      out.threads = *n;
    } else if (key == "--json") {
      out.json = take();
    } else if (key == "--csv") {
      out.csv = take();
    } else if (key == "--png") {
      out.png = take();
    } else if (a == "--no-progress") {
      out.progress = false;
    } else if (a == "--quiet" || a == "-q") {
      out.quiet = true;
    } else {
      TORCH_CHECK(false, "eval: unknown ", a.rfind("-", 0) == 0 ? "option" : "argument", " '", a,
                  "' (see kvpress-cli --help)");
    }
  }
  TORCH_CHECK(!(fraction_given && out.prefix_tokens > 0), "eval: give --prefix-tokens or --prefix-fraction, not both");
  for (auto& p : out.presses) {
    if (p.params.empty()) continue;
    std::string inner;
    for (const auto& [k, v] : p.params) inner += (inner.empty() ? "" : ",") + k + "=" + v;
    p.label = p.name + "(" + inner + ")";
  }
  return out;
}

// A press without a ratio (PressInfo::no_ratio: DecodingPress's budget is its target_size,
// SimLayerKVPress's layers decide; the registry refuses one) runs once, whatever --ratios says, and
// its rows carry no ratio (NaN here; null in JSON, empty in CSV, "-").
bool fixed_budget(const PressSpec& p) {
  const kvpress::PressInfo* info = kvpress::find_press(p.name);
  return info != nullptr && !info->no_ratio.empty();
}

// The wrappers with head or layer budgets join the default press list configured as kvpress's
// evaluation uses them (the other wrappers are left out: built by name alone they only wrap
// KnormPress): AdaKV over ExpectedAttention with epsilon 1e-2 (kvpress's leaderboard
// "expected_attention"), CriticalKV and CriticalAdaKV over ExpectedAttention without its ||v||
// rescaling (kvpress's advice), PerLayerCompression over SnapKV with a per-layer ramp, and the
// three decoding presses over KnormPress (PrefillDecodingPress: SnapKV at prefill).
std::vector<PressSpec> default_budget_wrappers() {
  const std::map<std::string, std::string> ea_no_vnorm{{"press", "ExpectedAttentionPress"},
                                                       {"press.use_vnorm", "false"}};
  return {
      {"AdaKVPress",
       {{"press", "ExpectedAttentionPress"}, {"press.epsilon", "0.01"}},
       "AdaKVPress(ExpectedAttentionPress)"},
      {"CriticalKVPress", ea_no_vnorm, "CriticalKVPress(ExpectedAttentionPress)"},
      {"CriticalAdaKVPress", ea_no_vnorm, "CriticalAdaKVPress(ExpectedAttentionPress)"},
      {"PerLayerCompressionPress", {{"press", "SnapKVPress"}}, "PerLayerCompressionPress(SnapKVPress, ramp)", true},
      // kvpress's decoding defaults (every 512 steps) never fire on stories this short: compress
      // every 16 continuation tokens instead, so that the decoding presses are measured.
      {"DecodingPress",
       {{"press", "KnormPress"}, {"compression_interval", "16"}, {"target_size", "64"}},
       "DecodingPress(KnormPress, every 16, 64 tokens)"},
      {"CompressionRatioDecodingPress",
       {{"press", "KnormPress"}, {"compression_interval", "16"}},
       "CompressionRatioDecodingPress(KnormPress, every 16)"},
      {"PrefillDecodingPress",
       {{"prefilling_press", "SnapKVPress"},
        {"decoding_press", "CompressionRatioDecodingPress"},
        {"decoding_press.press", "KnormPress"},
        {"decoding_press.compression_interval", "16"}},
       "PrefillDecodingPress(SnapKVPress, CompressionRatioDecodingPress(KnormPress, every 16))"},
  };
}

// compression_ratios for the default PerLayerCompressionPress at `ratio`: a linear ramp from
// ratio - delta (first layer) to ratio + delta (last), delta = min(ratio, 1 - ratio) / 2, so the mean
// is `ratio` and lower layers keep more (as PyramidKV's budgets).
std::string per_layer_ramp(double ratio, int64_t num_layers) {
  const double delta = std::min(ratio, 1.0 - ratio) / 2.0;
  std::string out;
  for (int64_t l = 0; l < num_layers; ++l) {
    const double t = num_layers > 1 ? 2.0 * static_cast<double>(l) / static_cast<double>(num_layers - 1) - 1.0 : 0.0;
    out += (l ? "," : "") + fmt::format("{:.17g}", ratio + delta * t);
  }
  return out;
}

double mean(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

// Written whole or not at all (kvpress::io::write_text_atomically): an interrupted run never leaves a
// partial file or clobbers an existing one.
void write_text(const std::string& path, const std::string& text, const char* option) {
  kvpress::io::write_text_atomically(option, path, text);
}

// A file in $TMPDIR (else /tmp), removed when this goes out of scope.
class TempFile {
 public:
  explicit TempFile(const std::string& suffix) {
    const char* dir = std::getenv("TMPDIR");
    std::string pattern = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/kvpress-eval-XXXXXX" + suffix;
    const int fd = mkstemps(pattern.data(), static_cast<int>(suffix.size()));
    TORCH_CHECK(fd >= 0, "cannot create a temporary file ", pattern, ": ", std::strerror(errno));
    close(fd);
    path_ = pattern;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// ---- running -----------------------------------------------------------------------------

struct Story {
  int64_t index = 0;
  std::vector<int64_t> ids;
  int64_t prefix = 0;
  llama::ContinuationScore full;  // with the full cache
};

struct Result {
  const PressSpec* press;
  double ratio;                        // NaN for a fixed budget
  std::vector<double> nll, agreement;  // per story
};

// Everything an evaluation measured, for the table and the files.
struct Evaluation {
  std::string model_dir, text_path;
  std::vector<Story> stories;
  int64_t skipped = 0;  // stories whose prefix was too short
  std::vector<Result> results;
  double seconds = 0.0;
  int64_t runs = 0;
  std::vector<double> full_nll;  // per story
  double full_mean = 0.0;
};

// The stories long enough for the prefix (at most --max-stories), tokenized.
std::vector<Story> select_stories(const EvalArgs& args, const std::vector<std::string>& texts,
                                  const llama::Tokenizer& tokenizer, int64_t& skipped) {
  std::vector<Story> stories;
  for (size_t i = 0; i < texts.size(); ++i) {
    if (args.max_stories > 0 && static_cast<int64_t>(stories.size()) >= args.max_stories) break;
    Story s;
    s.index = static_cast<int64_t>(i);
    s.ids = tokenizer.encode(texts[i]);
    s.prefix = llama::prefix_length(static_cast<int64_t>(s.ids.size()), args.prefix_tokens, args.prefix_fraction);
    if (s.prefix < args.min_prefix) {  // also -1: too short for any prefix
      ++skipped;
      continue;
    }
    stories.push_back(std::move(s));
  }
  return stories;
}

// Every press at every ratio on every story, after the full-cache run of each story.
Evaluation evaluate(const EvalArgs& args) {
  use_threads(args.threads);
  // Presses without a seed (RandomPress, LeverageScorePress's sketch) draw from the global
  // generator: seed it so that a run is reproducible.
  at::manual_seed(0);
  const auto start = Clock::now();
  Evaluation e;
  // The text first (cheap), then the model.
  e.text_path = args.text.empty() ? llama::default_stories_path() : args.text;
  const std::vector<std::string> texts = llama::read_stories(e.text_path);
  TORCH_CHECK(!texts.empty(), "--text ", e.text_path, ": no stories (stories are separated by <|endoftext|> lines)");
  const llama::Checkpoint checkpoint = llama::load_checkpoint(args.model);
  e.model_dir = checkpoint.path;
  const llama::LlamaModel& model = checkpoint.model;
  const llama::Tokenizer& tokenizer = checkpoint.tokenizer;
  e.stories = select_stories(args, texts, tokenizer, e.skipped);
  TORCH_CHECK(!e.stories.empty(), "--text ", e.text_path, ": no story is long enough for the prefix (",
              args.prefix_tokens > 0 ? fmt::format("{} tokens", args.prefix_tokens)
                                     : fmt::format("fraction {}", args.prefix_fraction),
              ", at least --min-prefix ", args.min_prefix, " tokens) plus 2 tokens");

  size_t press_runs = 0;
  for (const auto& p : args.presses) press_runs += fixed_budget(p) ? 1 : args.ratios.size();
  e.runs = static_cast<int64_t>(e.stories.size() * (1 + press_runs));
  Progress progress(e.runs, args.progress && !args.quiet);
  int64_t done = 0;
  for (auto& s : e.stories) {
    s.full = llama::score_continuation(model, s.ids, s.prefix, nullptr);
    e.full_nll.push_back(s.full.mean_nll);
    progress.step(++done);
  }
  e.full_mean = mean(e.full_nll);

  for (const auto& p : args.presses) {
    for (double ratio : fixed_budget(p) ? std::vector<double>{0.0} : args.ratios) {
      Result r{&p, fixed_budget(p) ? std::nan("") : ratio, {}, {}};
      std::map<std::string, std::string> params = p.params;
      if (p.per_layer_ramp) params["compression_ratios"] = per_layer_ramp(ratio, model.config().num_layers);
      const auto press = kvpress::make_press(p.name, ratio, params);
      for (const auto& s : e.stories) {
        llama::ContinuationScore c;
        try {
          c = llama::score_continuation(model, s.ids, s.prefix, press.get(), &tokenizer);
        } catch (const c10::Error& error) {
          progress.finish();
          TORCH_CHECK(false, p.label, " at ratio ", ratio, " on story ", s.index, " (prefix ", s.prefix,
                      " tokens): ", error.what_without_backtrace());
        }
        r.nll.push_back(c.mean_nll);
        r.agreement.push_back(llama::greedy_agreement(c, s.full));
        progress.step(++done);
      }
      e.results.push_back(std::move(r));
    }
  }
  progress.finish();
  e.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return e;
}

// ---- reporting ---------------------------------------------------------------------------

void print_table(const EvalArgs& args, const Evaluation& e) {
  double prefix_sum = 0, scored_sum = 0;
  for (const auto& s : e.stories) {
    prefix_sum += static_cast<double>(s.prefix);
    scored_sum += static_cast<double>(s.full.scored);
  }
  const double n_stories = static_cast<double>(e.stories.size());
  size_t w = std::string("full cache").size();
  for (const auto& p : args.presses) w = std::max(w, p.label.size());
  fmt::print("model: {}\n", e.model_dir);
  fmt::print("stories: {} from {}{}; prefix {} (mean {:.1f} tokens), scored tokens per story: mean {:.1f}\n",
             e.stories.size(), e.text_path,
             e.skipped ? fmt::format(" ({} with a prefix under {} tokens skipped)", e.skipped, args.min_prefix) : "",
             args.prefix_tokens > 0 ? fmt::format("{} tokens", args.prefix_tokens)
                                    : fmt::format("{:g} of each story", args.prefix_fraction),
             prefix_sum / n_stories, scored_sum / n_stories);
  fmt::print(
      "NLL: mean over stories of the mean NLL (nats/token) of the teacher-forced continuation; agree: "
      "fraction of positions whose argmax matches the full cache's\n\n");
  fmt::print("{:<{}}  {:>5}  {:>8}  {:>8}  {:>6}\n", "press", w, "ratio", "NLL", "dNLL", "agree");
  fmt::print("{:<{}}  {:>5}  {:>8.4f}  {:>8}  {:>6.3f}\n", "full cache", w, "-", e.full_mean, "-", 1.0);
  for (const auto& r : e.results) {
    const double m = mean(r.nll);
    fmt::print("{:<{}}  {:>5}  {:>8.4f}  {:>+8.4f}  {:>6.3f}\n", r.press->label, w,
               std::isnan(r.ratio) ? std::string("-") : fmt::format("{:.2f}", r.ratio), m, m - e.full_mean,
               mean(r.agreement));
  }
  const auto fixed = static_cast<size_t>(std::count_if(args.presses.begin(), args.presses.end(), fixed_budget));
  std::string runs_of;  // e.g. "2 presses x 3 ratios + 1 without a ratio, once"
  if (fixed < args.presses.size())
    runs_of = fmt::format("{} press{} x {} ratio{}", args.presses.size() - fixed,
                          args.presses.size() - fixed == 1 ? "" : "es", args.ratios.size(),
                          args.ratios.size() == 1 ? "" : "s");
  if (fixed > 0) runs_of += fmt::format("{}{} without a ratio, once", runs_of.empty() ? "" : " + ", fixed);
  fmt::print("\n{} runs ({} stories x (1 + {} press runs: {})) in {}\n", e.runs, e.stories.size(), e.results.size(),
             runs_of, fmt_duration(e.seconds));
}

nlohmann::json to_json(const EvalArgs& args, const Evaluation& e) {
  nlohmann::json j;
  j["model"] = e.model_dir;
  j["text"] = e.text_path;
  j["prefix_tokens"] = args.prefix_tokens > 0 ? nlohmann::json(args.prefix_tokens) : nlohmann::json(nullptr);
  j["prefix_fraction"] = args.prefix_tokens > 0 ? nlohmann::json(nullptr) : nlohmann::json(args.prefix_fraction);
  j["min_prefix"] = args.min_prefix;
  j["skipped_stories"] = e.skipped;
  j["seconds"] = e.seconds;
  nlohmann::json stories = nlohmann::json::array();
  for (const auto& s : e.stories)
    stories.push_back({{"index", s.index}, {"tokens", s.ids.size()}, {"prefix", s.prefix}, {"scored", s.full.scored}});
  j["stories"] = stories;
  j["full"] = {{"mean_nll", e.full_mean}, {"nll", e.full_nll}};
  nlohmann::json results = nlohmann::json::array();
  for (const auto& r : e.results) {
    const double m = mean(r.nll);
    results.push_back({{"press", r.press->name},
                       {"params", r.press->params},
                       {"label", r.press->label},
                       {"ratio", std::isnan(r.ratio) ? nlohmann::json(nullptr) : nlohmann::json(r.ratio)},
                       {"mean_nll", m},
                       {"delta_nll", m - e.full_mean},
                       {"greedy_agreement", mean(r.agreement)},
                       {"nll", r.nll},
                       {"agreement", r.agreement}});
  }
  j["results"] = results;
  return j;
}

std::string to_csv(const Evaluation& e) {
  std::string csv = "press,ratio,mean_nll,delta_nll,greedy_agreement,stories\n";
  auto quoted = [](const std::string& s) {
    return s.find_first_of(",\"") == std::string::npos ? s : "\"" + s + "\"";  // labels have no quotes
  };
  csv += fmt::format("full cache,0,{:.6f},0,1,{}\n", e.full_mean, e.stories.size());
  for (const auto& r : e.results) {
    const double m = mean(r.nll);
    csv += fmt::format("{},{},{:.6f},{:.6f},{:.6f},{}\n", quoted(r.press->label),
                       std::isnan(r.ratio) ? std::string() : fmt::format("{:g}", r.ratio), m, m - e.full_mean,
                       mean(r.agreement), e.stories.size());
  }
  return csv;
}

}  // namespace

int run_eval(const std::vector<std::string>& argv) {
  EvalArgs args = parse_eval_args(argv);
  if (args.presses.empty()) {
    // Every scorer with its defaults, and KVComposePress and KVzipPress (kSecondPass): the runner's
    // prefill runs their second pass inside score_continuation (KVzip's repeat prompt needs the
    // tokenizer, which score_continuation is given). Not the presses
    // that read a file made for a model (QFilterPress: name it with --param q_filters=F).
    for (const auto& info : kvpress::list_presses())
      if ((info.kind == kvpress::PressKind::kScorer || info.kind == kvpress::PressKind::kSecondPass) &&
          !kvpress::needs_file(info))
        args.presses.push_back({info.name, {}, info.name});
    for (const auto& p : default_budget_wrappers()) args.presses.push_back(p);
  }
  // Presses first: an unknown press or parameter fails before the model is read.
  for (const auto& p : args.presses) kvpress::make_press(p.name, fixed_budget(p) ? 0.0 : 0.5, p.params);
  // --png needs Python with matplotlib: find out now rather than after the whole evaluation.
  std::optional<Plotter> plotter;
  if (!args.png.empty()) plotter = find_plotter("--png");

  const Evaluation e = evaluate(args);
  if (!args.quiet) print_table(args, e);
  // The chart (last) is scripts/plot.py's, drawn from the JSON: --json's file, or a temporary one.
  if (!args.json.empty()) write_text(args.json, to_json(args, e).dump(1) + "\n", "--json");
  if (!args.csv.empty()) write_text(args.csv, to_csv(e), "--csv");
  if (plotter) {
    std::optional<TempFile> temp;
    if (args.json.empty()) {
      temp.emplace(".json");
      write_text(temp->path(), to_json(args, e).dump() + "\n", "--png (its temporary JSON)");
    }
    run_plotter(*plotter, {"eval", temp ? temp->path() : args.json, "--out", args.png}, "--png " + args.png);
  }
  return 0;
}

}  // namespace kvpress_cli
