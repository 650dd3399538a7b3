// kvpress-cli bench: for each example of a task folder (benchmarks/quality/make_tasks.py), the
// context is prefilled ONCE (LlamaModel::capture_prefill) and every press that compresses after the
// prefill's attention compresses that capture (the same cache its own prefill gives:
// tests/test_llama.cpp). Query-aware presses share a capture of their query-aware prefill (context
// and question) at every ratio; KVzipPress scores each example once (its scores do not depend on
// the ratio) and cuts the capture at every ratio; presses that change the forward otherwise
// (KVzip's relatives, KVCompose, DMS) run their own prefill. Each answer is scored as RULER
// scores it and appended to the results file at once, so an interrupted run continues where it
// stopped. See docs/QUALITY.md.
#include "bench.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cli_args.h"
#include "kvpress/calibration.h"
#include "kvpress/io/atomic_file.h"
#include "kvpress/kv_format.h"
#include "kvpress/llama/kvzip.h"
#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"
#include "plot_runner.h"
#include "progress.h"

namespace kvpress_cli {
namespace {

namespace llama = kvpress::llama;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// One press configuration of the benchmark: a registry press with parameters, or none.
struct BenchPress {
  std::string name;  // "" : no compression
  std::map<std::string, std::string> params;
  bool query_aware = false;    // its prefill holds the question (kvpress's query-aware evaluation)
  std::string label;           // what the rows and tables call it
  bool calibrated = false;     // its ratio searched per example (--calibrate); the runs' "ratio" is the tolerance
  std::vector<double> ratios;  // --press-ratios: its own ratios; empty: --ratios
  // --kv-dtype: answered over a PagedKVCache of this format (llama::PipelineOptions::paged_kv_format);
  // unset: over the dense cache, as kvpress.
  std::optional<kvpress::KVFormat> kv_format;
};

struct BenchArgs {
  std::string model = "smollm2-135m-instruct";
  std::string tasks;                    // folder written by make_tasks.py
  std::vector<std::string> task_names;  // empty: every task of the folder
  std::vector<int64_t> lengths;         // empty: every length
  int64_t examples = 0;                 // per task and length; 0: all
  std::vector<BenchPress> presses;      // empty: the default list
  std::vector<double> ratios = {0.25, 0.5, 0.75};
  // --calibrate: per example, the largest ratio whose attention output stays within each tolerance
  // (kvpress::calibration::search_max_ratio on the captured prefill), for every score-based press.
  std::vector<double> tolerances;
  std::string out, csv, png;
  int64_t threads = 0;  // 0: torch's default (use_threads)
  bool progress = true;
};

// The presses of kvpress's leaderboard that run here without artifacts, as kvpress's evaluation
// configures them: AdaKV over ExpectedAttention with epsilon 1e-2, CriticalKV over
// ExpectedAttention without its ||v|| rescaling; SnapKV also query-aware (the question in the
// prefill). DuoAttentionPress and QFilterPress need their artifacts (--press with --param).
// A press of the runs: `name` ("" for none) with `params`, its prefill holding the question when
// query_aware, called `label` in the tables ("" for its name).
BenchPress bench_press(std::string name, std::map<std::string, std::string> params = {}, bool query_aware = false,
                       std::string label = "") {
  BenchPress p;
  p.name = std::move(name);
  p.params = std::move(params);
  p.query_aware = query_aware;
  p.label = std::move(label);
  return p;
}

std::vector<BenchPress> default_presses() {
  std::vector<BenchPress> out = {
      bench_press(""),
      bench_press("StreamingLLMPress"),
      bench_press("KnormPress"),
      bench_press("KeyDiffPress"),
      bench_press("SnapKVPress"),
      bench_press("TOVAPress"),
      bench_press("ExpectedAttentionPress"),
      bench_press("CompactorPress"),
      bench_press("PyramidKVPress"),
      bench_press("KVzipPress"),
      bench_press("AdaKVPress", {{"press", "ExpectedAttentionPress"}, {"press.epsilon", "0.01"}}, false,
                  "AdaKVPress(ExpectedAttentionPress)"),
      bench_press("CriticalKVPress", {{"press", "ExpectedAttentionPress"}, {"press.use_vnorm", "false"}}, false,
                  "CriticalKVPress(ExpectedAttentionPress)"),
      bench_press("SnapKVPress", {}, true)};
  return out;
}

std::string label_of(const BenchPress& p) {
  if (!p.label.empty()) return p.label;
  std::string label = p.name.empty() ? "none" : p.name;
  if (!p.params.empty()) {
    std::string inner;
    for (const auto& [k, v] : p.params) inner += (inner.empty() ? "" : ",") + k + "=" + v;
    label += "(" + inner + ")";
  }
  if (p.calibrated) label += " [calibrated]";
  if (p.query_aware) label += " [query-aware]";
  return p.kv_format ? label + " [" + kvpress::kv_format_name(*p.kv_format) + " pages]" : label;
}

// A press that takes no ratio (DecodingPress's target_size, DuoAttention's heads) runs once.
bool takes_ratio(const BenchPress& p) {
  if (p.name.empty()) return false;
  const kvpress::PressInfo* info = kvpress::find_press(p.name);
  return info == nullptr || info->no_ratio.empty();
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

BenchArgs parse_args(const std::vector<std::string>& args) {
  BenchArgs out;
  // --press-ratios LABEL=LIST: a press's own ratios instead of --ratios, by its rows' label (e.g.
  // 0.9 for the best presses alone, in the same run so that they share its prefills); set on the
  // press (BenchPress::ratios) once every press is known.
  std::map<std::string, std::vector<double>> press_ratios;
  std::optional<kvpress::KVFormat> kv_format;  // --kv-dtype, for every press of the run
  for (size_t i = 0; i < args.size(); ++i) {
    std::string v;
    if (take_value(args, i, "--model", "", out.model)) {
    } else if (take_value(args, i, "--tasks", "", out.tasks)) {
    } else if (take_value(args, i, "--task", "", v)) {
      for (const std::string& t : split_list(v)) out.task_names.push_back(t);
    } else if (take_value(args, i, "--lengths", "", v)) {
      for (const std::string& l : split_list(v)) out.lengths.push_back(parse_int_option("--lengths", l, 1, 1 << 24));
    } else if (take_value(args, i, "--examples", "", v)) {
      out.examples = parse_int_option("--examples", v, 1, 1 << 30);
    } else if (take_value(args, i, "--press", "", v)) {
      if (v == "default") {  // the default list, e.g. before presses that need artifacts
        const std::vector<BenchPress> defaults = default_presses();
        out.presses.insert(out.presses.end(), defaults.begin(), defaults.end());
        continue;
      }
      if (v != "none" && kvpress::find_press(v) == nullptr)
        usage_error("bench: --press {}: no such press (kvpress-cli list)", v);
      out.presses.push_back(bench_press(v == "none" ? "" : v));
    } else if (take_value(args, i, "--query-aware", "", v)) {
      if (kvpress::find_press(v) == nullptr)
        usage_error("bench: --query-aware {}: no such press (kvpress-cli list)", v);
      out.presses.push_back(bench_press(v, {}, true));
    } else if (take_value(args, i, "--param", "", v)) {
      if (out.presses.empty() || out.presses.back().name.empty() || !out.presses.back().label.empty())
        usage_error("bench: --param {} must follow the --press it applies to", v);
      add_param(out.presses.back().params, v);
    } else if (take_value(args, i, "--label", "", v)) {
      // A short name for rows and tables, e.g. instead of an artifact's path among the parameters.
      if (out.presses.empty() || !out.presses.back().label.empty() || v.empty())
        usage_error("bench: --label {} must follow the --press (and its --param) it names", v);
      out.presses.back().label = v;
    } else if (take_value(args, i, "--kv-dtype", "", v)) {
      try {
        kv_format = kvpress::parse_kv_format(v, "bench: --kv-dtype");
      } catch (const c10::Error& e) {
        usage_error("{}", e.msg());
      }
    } else if (take_value(args, i, "--ratios", "", v)) {
      out.ratios = parse_ratios(v);
    } else if (take_value(args, i, "--press-ratios", "", v)) {
      // The label may hold '=' (its parameters), the list does not: split at the last one.
      const size_t eq = v.rfind('=');
      if (eq == std::string::npos || eq == 0)
        usage_error("bench: --press-ratios must be LABEL=LIST (e.g. KVzipPress=0.25,0.5,0.75,0.9), got '{}'", v);
      press_ratios[v.substr(0, eq)] = parse_ratios(v.substr(eq + 1), "--press-ratios");
    } else if (take_value(args, i, "--calibrate", "", v)) {
      const std::optional<std::vector<double>> list = kvpress::parse_double_list(v);
      if (!list || list->empty() ||
          !std::all_of(list->begin(), list->end(), [](double t) { return t > 0.0 && t < 1.0; }))
        usage_error("bench: --calibrate must be a comma-separated list of tolerances in (0, 1), got '{}'", v);
      out.tolerances = *list;
    } else if (take_value(args, i, "--out", "", out.out)) {
    } else if (take_value(args, i, "--csv", "", out.csv)) {
    } else if (take_value(args, i, "--png", "", out.png)) {
    } else if (take_value(args, i, "--threads", "", v)) {
      out.threads = parse_int_option("--threads", v, 1, 1024);
    } else if (args[i] == "--no-progress") {
      out.progress = false;
    } else {
      reject_argument("bench", args[i]);
    }
  }
  if (out.tasks.empty()) usage_error("bench: --tasks DIR is required (benchmarks/quality/make_tasks.py writes it)");
  if (out.out.empty()) usage_error("bench: --out RESULTS.jsonl is required (rows are appended; a rerun resumes)");
  if (!out.png.empty() && out.csv.empty()) usage_error("bench: --png draws the --csv summary: give --csv too");
  if (out.presses.empty()) out.presses = default_presses();
  for (BenchPress& p : out.presses) p.kv_format = kv_format;
  std::set<std::string> labels;  // a run's rows are keyed by label: two presses cannot share one
  for (const BenchPress& p : out.presses)
    if (!labels.insert(label_of(p)).second) usage_error("bench: two presses are labelled {}", label_of(p));
  for (const auto& entry : press_ratios) {
    const std::string& label = entry.first;  // a named variable: lambdas cannot capture bindings (C++17)
    const auto named =
        std::find_if(out.presses.begin(), out.presses.end(), [&](const BenchPress& p) { return label_of(p) == label; });
    if (named == out.presses.end())
      usage_error("bench: --press-ratios {}: no press of this run is labelled so (labels as the rows name them)",
                  label);
    if (!takes_ratio(*named)) usage_error("bench: --press-ratios {}: this press takes no compression ratio", label);
    named->ratios = entry.second;
  }
  return out;
}

// ---- tasks ---------------------------------------------------------------------------------------

struct Example {
  std::string id, task, context, question, answer_prefix, metric;
  int64_t length = 0, max_new_tokens = 0;
  std::vector<std::string> answers;
};

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "bench: cannot open ", path);
  try {
    return json::parse(in);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "bench: ", path, " is not valid JSON: ", e.what());
  }
}

std::vector<Example> read_examples(const BenchArgs& args) {
  const json manifest = read_json_file(args.tasks + "/manifest.json");
  std::vector<Example> out;
  std::set<std::string> tasks_seen;
  for (const auto& file : manifest.at("files")) {
    std::ifstream in(args.tasks + "/" + file.get<std::string>());
    TORCH_CHECK(in.good(), "bench: cannot open ", args.tasks, "/", file.get<std::string>());
    int64_t taken = 0;
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      const json j = json::parse(line);
      Example e;
      e.id = j.at("id");
      e.task = j.at("task");
      e.length = j.at("length");
      tasks_seen.insert(e.task);
      if (!args.task_names.empty() &&
          std::find(args.task_names.begin(), args.task_names.end(), e.task) == args.task_names.end())
        break;
      if (!args.lengths.empty() && std::find(args.lengths.begin(), args.lengths.end(), e.length) == args.lengths.end())
        break;
      if (args.examples > 0 && taken >= args.examples) break;
      e.context = j.at("context");
      e.question = j.at("question");
      e.answer_prefix = j.at("answer_prefix");
      e.metric = j.at("metric");
      e.max_new_tokens = j.at("max_new_tokens");
      e.answers = j.at("answers").get<std::vector<std::string>>();
      TORCH_CHECK(e.metric == "all" || e.metric == "part", "bench: ", e.id, ": metric must be all or part, got ",
                  e.metric);
      out.push_back(std::move(e));
      ++taken;
    }
  }
  for (const std::string& t : args.task_names)
    TORCH_CHECK(tasks_seen.count(t), "bench: --task ", t, ": not in ", args.tasks, "/manifest.json");
  TORCH_CHECK(!out.empty(), "bench: no example of ", args.tasks, " matches --task/--lengths");
  return out;
}

// RULER's string match, ASCII case folded (the answers are ASCII): "all" the fraction of the
// expected strings found in the answer, "part" 1 when any is.
double score(const std::string& metric, const std::string& answer, const std::vector<std::string>& expected) {
  const auto lower = [](std::string s) {
    for (char& c : s) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    return s;
  };
  const std::string a = lower(answer);
  double found = 0.0;
  for (const std::string& e : expected) found += a.find(lower(e)) != std::string::npos ? 1.0 : 0.0;
  if (metric == "part") return found > 0.0 ? 1.0 : 0.0;
  return expected.empty() ? 0.0 : found / static_cast<double>(expected.size());
}

// ---- results -------------------------------------------------------------------------------------

struct RunKey {
  std::string id, press;
  double ratio;
  bool operator<(const RunKey& o) const { return std::tie(id, press, ratio) < std::tie(o.id, o.press, o.ratio); }
};

// The rows already in the results file (a run that stopped mid-line leaves a partial last line,
// which is dropped from the file). Rows of another model are refused: one file, one model.
std::vector<json> read_results(const std::string& path, const std::string& model) {
  std::vector<json> rows;
  std::ifstream in(path);
  if (!in.good()) return rows;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t keep = 0;  // bytes of whole, parsable lines
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = text.find('\n', begin);
    if (end == std::string::npos) break;  // no newline: the last write was cut short
    const std::string line = text.substr(begin, end - begin);
    json row;
    try {
      row = json::parse(line);
    } catch (const std::exception&) {
      break;
    }
    TORCH_CHECK(row.value("model", "") == model, "bench: ", path, " holds results of model ", row.value("model", ""),
                ", not ", model, ": use another --out");
    rows.push_back(std::move(row));
    keep = begin = end + 1;
  }
  if (keep < text.size()) {
    fmt::print(stderr, "bench: {}: dropping an incomplete last row ({} bytes) before resuming\n", path,
               text.size() - keep);
    kvpress::io::write_text_atomically("--out", path, text.substr(0, keep));
  }
  return rows;
}

// Per (press, ratio, task, length): mean score over examples, in percent.
struct Cell {
  double sum = 0.0;       // of the scores
  double kept_sum = 0.0;  // of the kept fractions
  int64_t n = 0;
};
using Summary = std::map<std::tuple<std::string, double, std::string, int64_t>, Cell>;

Summary summarize(const std::vector<json>& rows) {
  Summary s;
  for (const json& r : rows) {
    Cell& c = s[{r.at("press").get<std::string>(), r.at("ratio").is_null() ? -1.0 : r.at("ratio").get<double>(),
                 r.at("task").get<std::string>(), r.at("length").get<int64_t>()}];
    c.sum += r.at("score").get<double>();
    c.kept_sum += r.at("kept_fraction").get<double>();
    ++c.n;
  }
  return s;
}

std::string ratio_text(double r) { return r < 0 ? "-" : fmt::format("{:.2f}", r); }

void print_table(const Summary& s) {
  std::vector<std::string> tasks;
  std::map<std::pair<std::string, double>, std::map<std::string, Cell>> by_press;
  for (const auto& [key, cell] : s) {
    const auto& [press, ratio, task, length] = key;
    if (std::find(tasks.begin(), tasks.end(), task) == tasks.end()) tasks.push_back(task);
    Cell& c = by_press[{press, ratio}][task];
    c.sum += cell.sum;
    c.kept_sum += cell.kept_sum;
    c.n += cell.n;
  }
  std::string header = fmt::format("{:<44} {:>5}", "press", "ratio");
  for (const std::string& t : tasks) header += fmt::format(" {:>9}", t.substr(0, 9));
  fmt::print("{} {:>6}\n", header, "mean");
  for (const auto& [key, per_task] : by_press) {
    std::string line = fmt::format("{:<44} {:>5}", key.first.substr(0, 44), ratio_text(key.second));
    double total = 0.0;
    int64_t counted = 0;
    for (const std::string& t : tasks) {
      const auto it = per_task.find(t);
      if (it == per_task.end()) {
        line += fmt::format(" {:>9}", "");
        continue;
      }
      const double acc = 100.0 * it->second.sum / static_cast<double>(it->second.n);
      line += fmt::format(" {:>9.1f}", acc);
      total += acc;
      ++counted;
    }
    fmt::print("{} {:>6.1f}\n", line, counted ? total / static_cast<double>(counted) : 0.0);
  }
}

std::string summary_csv(const Summary& s) {
  std::string out = "press,ratio,task,length,examples,accuracy,kept_fraction\n";
  for (const auto& [key, cell] : s) {
    const auto& [press, ratio, task, length] = key;
    const double n = static_cast<double>(cell.n);
    out += fmt::format("\"{}\",{},{},{},{},{:.4f},{:.4f}\n", press, ratio < 0 ? "" : fmt::format("{:.4g}", ratio), task,
                       length, cell.n, 100.0 * cell.sum / n, cell.kept_sum / n);
  }
  return out;
}

// The prefill of `ids` kept for many presses (the pipeline needs only its last logits).
llama::CapturedPrefill capture_prefill_of(const llama::LlamaModel& model, const std::vector<int64_t>& ids) {
  llama::ForwardOptions last;
  last.last_logits_only = true;
  return model.capture_prefill(at::tensor(ids).unsqueeze(0), last);
}

// The presses to run: each built once before the long run, so that a bad parameter or a press the
// pipeline refuses stops it now rather than hours in; with --calibrate, each press that can
// compress a captured prefill also as its calibrated variant.
std::vector<BenchPress> checked_presses(const BenchArgs& args) {
  std::vector<BenchPress> presses;
  for (const BenchPress& p : args.presses) {
    if (!p.name.empty()) {
      const auto built = kvpress::make_press(p.name, takes_ratio(p) ? args.ratios.front() : 0.0, p.params);
      TORCH_CHECK(!built->observes_question() || p.query_aware, "bench: ", label_of(p),
                  " observes the question: give it with --query-aware");
      if (p.kv_format) {  // what prefill_paged and decode_paged take (PipelineOptions::paged_kv_format)
        TORCH_CHECK(!built->observes_question() && !built->needs_second_pass(), "bench: --kv-dtype: ", label_of(p),
                    built->needs_second_pass() ? " runs a second pass over the context" : " observes the question",
                    ", which a paged prefill does not run");
        const std::string why = llama::LlamaModel::why_not_paged_decoding(built.get());
        TORCH_CHECK(why.empty(), "bench: --kv-dtype: ", why);
      }
      if (!args.tolerances.empty() && takes_ratio(p) && !p.query_aware) {
        // The search compresses the captured prefill's layers, so only presses that can use it.
        const std::string why = llama::LlamaModel::why_not_captured(built.get(), llama::PressAttentions::kAuto);
        if (why.empty()) {
          BenchPress calibrated = p;
          calibrated.calibrated = true;
          presses.push_back(p);
          presses.push_back(std::move(calibrated));
          continue;
        }
        fmt::print("bench: --calibrate leaves out {}: {}\n", label_of(p), why);
      }
    }
    presses.push_back(p);
  }
  return presses;
}

// One (press, ratio) still to run for an example.
struct Planned {
  const BenchPress* press;
  double ratio;  // -1: the press takes none; a calibrated press: the tolerance
};
using Plan = std::vector<std::pair<const Example*, std::vector<Planned>>>;

// Every (example, press, ratio) not yet in `done`.
Plan plan_runs(const std::vector<Example>& examples, const std::vector<BenchPress>& presses, const BenchArgs& args,
               const std::set<RunKey>& done) {
  Plan plan;
  for (const Example& e : examples) {
    std::vector<Planned> todo;
    for (const BenchPress& p : presses) {
      const std::vector<double> ratios = p.calibrated        ? args.tolerances
                                         : !takes_ratio(p)   ? std::vector<double>{-1.0}
                                         : !p.ratios.empty() ? p.ratios
                                                             : args.ratios;
      for (double r : ratios)
        if (!done.count({e.id, label_of(p), r})) todo.push_back({&p, r});
    }
    if (!todo.empty()) plan.emplace_back(&e, std::move(todo));
  }
  return plan;
}

// The runs of one example, sharing its prefills: the captured context (made when the first press
// can use it), the query-aware prefills by their tokens (context + question as one text, SnapKV's
// query-aware mode; or the framed context then the question, FinchPress), and each KVzipPress
// configuration's scores, which do not depend on the ratio.
class ExampleRuns {
 public:
  ExampleRuns(const llama::Checkpoint& checkpoint, const llama::ChatTemplate* chat, const Example& e)
      : checkpoint_(checkpoint), e_(e) {
    base_.chat_template = chat;
    base_.answer_prefix = e.answer_prefix;
    base_.max_new_tokens = e.max_new_tokens;
    ids_ = llama::context_prefill_ids(checkpoint.model, checkpoint.tokenizer, e.context, base_);
  }

  // The result row of one run.
  json run(const Planned& planned, const std::string& model_name) {
    const BenchPress& p = *planned.press;
    const auto t0 = Clock::now();
    double ratio = std::max(planned.ratio, 0.0);
    json calibration = nullptr;
    if (p.calibrated) std::tie(ratio, calibration) = calibrate(p, planned.ratio);
    std::unique_ptr<kvpress::BasePress> press;
    if (!p.name.empty()) press = kvpress::make_press(p.name, ratio, p.params);
    llama::PipelineOptions opt = base_;
    opt.press = press.get();
    opt.query_aware = p.query_aware;
    opt.paged_kv_format = p.kv_format;
    const bool shared = !p.kv_format && share_prefill(p, opt);  // pages: each run prefills with prefill_paged
    at::manual_seed(0);
    const llama::Answer a =
        llama::answer_questions(checkpoint_.model, checkpoint_.tokenizer, e_.context, {e_.question}, opt).at(0);
    return {{"model", model_name},
            {"id", e_.id},
            {"task", e_.task},
            {"length", e_.length},
            {"press", label_of(p)},
            {"press_name", p.name},  // with params and query_aware: the press rebuilt elsewhere
            {"params", p.params},
            {"query_aware", p.query_aware},
            {"ratio", planned.ratio < 0 ? json(nullptr) : json(planned.ratio)},
            {"prefill_tokens", a.prefill_length},
            {"kept_fraction", a.kept_fraction},
            {"answer", a.text},
            {"answer_tokens", a.tokens},
            {"expected", e_.answers},
            {"score", score(e_.metric, a.text, e_.answers)},
            {"shared_prefill", shared},
            {"kv_format", p.kv_format ? kvpress::kv_format_name(*p.kv_format) : "dense"},
            {"calibration", calibration},  // --calibrate: the tolerance and the ratio found
            {"seconds", std::chrono::duration<double>(Clock::now() - t0).count()}};
  }

 private:
  const llama::CapturedPrefill& captured() {
    if (!captured_) captured_ = capture_prefill_of(checkpoint_.model, ids_);
    return *captured_;
  }

  // The largest ratio whose attention output stays within `tolerance`, and its record.
  std::pair<double, json> calibrate(const BenchPress& p, double tolerance) {
    std::vector<kvpress::calibration::ObservedLayer> observed;
    for (const kvpress::LayerInputs& in : captured().layers) observed.push_back(kvpress::calibration::observe_last(in));
    const auto make = [&](double r) { return kvpress::make_press(p.name, r, p.params); };
    const kvpress::calibration::SearchResult found = kvpress::calibration::search_max_ratio(observed, make, tolerance);
    return {found.ratio,
            {{"tolerance", tolerance},
             {"ratio", found.ratio},
             {"quality", found.quality},
             {"evaluations", found.evaluations.size()},
             {"observed_queries", kvpress::calibration::kDefaultObservedQueries}}};
  }

  // Points `opt` at a shared prefill when the press can compress one; true when it does.
  bool share_prefill(const BenchPress& p, llama::PipelineOptions& opt) {
    bool shared = llama::LlamaModel::why_not_captured(opt.press, opt.press_attentions).empty();
    if (const kvpress::KVzipPress* kvzip = p.query_aware ? nullptr : llama::plain_kvzip(opt.press)) {
      // One scoring pass per configuration; the capture is cut to each ratio's selection
      // (llama::kvzip_compress_captured).
      at::Tensor& scores = kvzip_scores_[&p];
      if (!scores.defined())
        scores = llama::kvzip_scores(checkpoint_.model, at::tensor(ids_).unsqueeze(0), *kvzip, checkpoint_.tokenizer,
                                     base_.chat_template, {}, &captured());
      opt.kvzip_scores = &scores;
      shared = true;
    }
    if (shared && p.query_aware) {
      std::vector<int64_t> aware =
          llama::context_prefill_ids(checkpoint_.model, checkpoint_.tokenizer, e_.context, opt, e_.question);
      auto found = captured_with_question_.find(aware);
      if (found == captured_with_question_.end())
        found = captured_with_question_.emplace(aware, capture_prefill_of(checkpoint_.model, aware)).first;
      opt.captured = &found->second;
    } else if (shared) {
      opt.captured = &captured();
    }
    return shared;
  }

  const llama::Checkpoint& checkpoint_;
  const Example& e_;
  llama::PipelineOptions base_;
  std::vector<int64_t> ids_;
  std::optional<llama::CapturedPrefill> captured_;
  std::map<std::vector<int64_t>, llama::CapturedPrefill> captured_with_question_;
  std::map<const BenchPress*, at::Tensor> kvzip_scores_;
};

}  // namespace

int run_bench(const std::vector<std::string>& argv) {
  const BenchArgs args = parse_args(argv);
  std::optional<Plotter> plotter;
  if (!args.png.empty()) plotter = find_plotter("--png");  // before the long work
  use_threads(args.threads);
  // Presses without a seed (RandomPress, LeverageScorePress's sketch) draw from the global generator.
  at::manual_seed(0);

  const std::vector<Example> examples = read_examples(args);
  const llama::Checkpoint checkpoint = llama::load_checkpoint(args.model);
  std::optional<llama::ChatTemplate> chat;
  if (!checkpoint.chat_template.empty()) chat = llama::chat_template_of(checkpoint);
  const std::string model_name = checkpoint.path.substr(checkpoint.path.find_last_of('/') + 1);
  const std::vector<BenchPress> presses = checked_presses(args);

  std::vector<json> rows = read_results(args.out, model_name);
  std::set<RunKey> done;
  for (const json& r : rows)
    done.insert({r.at("id"), r.at("press"), r.at("ratio").is_null() ? -1.0 : r.at("ratio").get<double>()});
  const Plan plan = plan_runs(examples, presses, args, done);
  int64_t total = 0;
  for (const auto& [example, todo] : plan) total += static_cast<int64_t>(todo.size());
  fmt::print("bench: {} examples, {} presses, ratios {}: {} runs to do ({} already in {})\n", examples.size(),
             presses.size(), fmt::join(args.ratios, ","), total, rows.size(), args.out);

  std::ofstream results(args.out, std::ios::app);
  TORCH_CHECK(results.good(), "bench: --out ", args.out, ": cannot open for appending");
  Progress progress(total, args.progress);
  int64_t finished = 0;
  const auto start = Clock::now();
  for (const auto& [example, todo] : plan) {
    ExampleRuns runs(checkpoint, chat ? &*chat : nullptr, *example);
    for (const Planned& planned : todo) {
      progress.step(finished, example->id + " " + label_of(*planned.press));
      json row = runs.run(planned, model_name);
      results << row.dump() << '\n' << std::flush;
      TORCH_CHECK(results.good(), "bench: --out ", args.out, ": write failed");
      rows.push_back(std::move(row));
      ++finished;
    }
  }
  progress.finish();
  if (total > 0)
    fmt::print("bench: {} runs in {}\n", total,
               fmt_duration(std::chrono::duration<double>(Clock::now() - start).count()));

  const Summary summary = summarize(rows);
  print_table(summary);
  if (!args.csv.empty()) kvpress::io::write_text_atomically("--csv", args.csv, summary_csv(summary));
  if (plotter) run_plotter(*plotter, {"bench", args.csv, "--out", args.png}, "--png");
  return 0;
}

}  // namespace kvpress_cli
