// kvpress-cli: compress one attention layer's KV cache stored as safetensors with any press of
// the registry, and list the presses. See docs/CLI.md.
//
//   kvpress-cli compress --press NAME --ratio R [--param KEY=VALUE ...] --input IN --output OUT
//   kvpress-cli ask --context FILE --question Q [--question Q ...] [--press NAME --ratio R ...]
//   kvpress-cli list [--names | --json | --markdown]
//   kvpress-cli --help | --version
//
// Exit codes: 0 success; 2 bad usage or bad input (one line on stderr starting with
// "kvpress-cli: error: "); 1 unexpected internal failure (same one-line format).
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvpress/cache.h"
#include "kvpress/calibration.h"
#include "kvpress/io/atomic_file.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/ops.h"
#include "kvpress/presses/base_press.h"
#include "kvpress/registry.h"
#include "kvpress/types.h"
#include "kvpress/version.h"

#include "ask.h"
#include "bench.h"
#include "cli_args.h"
#include "eval.h"
#include "generate.h"
#include "query_stats.h"

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#endif
#ifndef TORCH_VERSION
#define TORCH_VERSION "unknown"
#endif

namespace {

constexpr const char* kProg = "kvpress-cli";

using kvpress_cli::usage_error;
using kvpress_cli::UsageError;

constexpr const char* kHelp = R"(kvpress-cli — compress a layer's KV cache with a kvpress press

Usage:
  kvpress-cli compress --press NAME --ratio R [--param KEY=VALUE ...]
                       --input IN.safetensors --output OUT.safetensors
                       [--device DEVICE] [--allow-unknown-tensors] [--quiet]
  kvpress-cli calibrate --press NAME [--param KEY=VALUE ...] --input LAYER.safetensors
                       [--input ...] [--tolerance T] [--observe N] [--max-ratio M] [--json OUT]
  kvpress-cli eval [--model DIR] [--text FILE] [--press NAME [--param KEY=VALUE ...]]...
                   [--ratios LIST] [--prefix-tokens P | --prefix-fraction F] [--min-prefix N]
                   [--max-stories N] [--threads N] [--json OUT] [--csv OUT] [--png OUT]
  kvpress-cli generate (--prompts FILE | --prompt TEXT ...) [--press NAME --ratio R
                   [--param KEY=VALUE ...]] [--max-new-tokens N] [--model DIR] [--paged
                   [--page-size P] [--kv-dtype F] [--pages-per-layer N] [--max-batch B]]
                   [--tp N [--budgets global|per_rank]] [--no-stop-at-eos]
                   [--chat] [--threads N] [--json OUT] [--quiet]
  kvpress-cli ask --context FILE --question Q [--question Q ...] [--press NAME --ratio R
                   [--param KEY=VALUE ...]] [--query-aware] [--chat] [--max-new-tokens N]
                   [--answer-prefix TEXT] [--max-context-length N] [--model DIR] [--threads N]
                   [--json OUT] [--quiet]
  kvpress-cli bench --tasks DIR --out RESULTS.jsonl [--model NAME|DIR] [--task LIST]
                   [--lengths LIST] [--examples N] [--press NAME [--param KEY=VALUE ...] [--label TEXT]]...
                   [--query-aware NAME]... [--ratios LIST] [--press-ratios LABEL=LIST]...
                   [--calibrate LIST] [--kv-dtype F] [--csv OUT [--png OUT]] [--threads N]
                   [--no-progress]
  kvpress-cli query-stats --out FILE [--model NAME|DIR] [--text FILE] [--max-tokens N]
                   [--threads N] [--quiet]
  kvpress-cli list [--names | --json | --markdown]
  kvpress-cli --help
  kvpress-cli --version

compress options:
  --press NAME             kvpress class name, e.g. SnapKVPress (see `kvpress-cli list`)
  --ratio R                compression ratio in [0, 1): the fraction of tokens removed
  --param KEY=VALUE        a press parameter, e.g. --param window_size=32 (repeatable)
  --input PATH, -i PATH    safetensors with keys, values [B, Hkv, S, D] and, as the press
                           needs them, any other input by its name (queries, attentions,
                           hidden_states, q_proj, k_proj, o_proj, q_norm, k_norm, cos, sin,
                           inv_freq, input_ids); metadata num_heads, layer_idx, num_layers,
                           norm_eps, question_length (docs/CLI.md; `list --json` lists them)
  --output PATH, -o PATH   written with keys, values [B, Hkv, n_kept, D], scores [B, Hkv, S]
                           float32, kept_indices [B, Hkv, n_kept] int64 (ascending); for a
                           head-ragged press (e.g. CompactorPress selection=across_heads):
                           keys, values [T, D] and kept_indices [T] packed head after head,
                           lengths [B, Hkv] int64 (docs/CLI.md)
  --device DEVICE          where the press runs: cpu (default), cuda, cuda:1, ...
  --allow-unknown-tensors  ignore input tensors the CLI does not know (default: error)
  --quiet, -q              do not print the summary line

calibrate options (largest ratio whose attention output stays within a tolerance):
  --input PATH, -i PATH    one file per layer of the same context, as for compress, with
                           queries: their last N rows are the observation queries
  --tolerance T            allowed drop of quality = 1 - relative attention-output error
                           (default 0.05)
  --observe N              number of observation queries (default 16)
  --max-ratio M            largest ratio tried, in (0, 1) (default 0.95)
  --json OUT               also write the result and every evaluation as JSON

eval options (perplexity under compression with the kvpress::llama runner):
  --model NAME|DIR         checkpoint folder, .gguf file or model name (default tinystories-656k)
  --text FILE              stories separated by <|endoftext|> lines (default: the bundled
                           tinystories_valid_100.txt)
  --press NAME             a press to evaluate (repeatable; default: every registry press)
  --param KEY=VALUE        a parameter of the --press it follows
  --ratios LIST            comma-separated compression ratios (default 0.25,0.5,0.75)
  --prefix-tokens P        prefill the first P tokens of each story (BOS included)
  --prefix-fraction F      ... or the first floor(F * length) tokens (default 0.5)
  --min-prefix N           skip stories whose prefix is shorter (default 65: SnapKVPress
                           observes the last 64 prefix tokens)
  --max-stories N          only the first N stories long enough for the prefix
  --threads N              intra-op threads (default: torch's, every core or OMP_NUM_THREADS)
  --json OUT               per-story and mean figures
  --csv OUT                the table (mean figures)
  --png OUT                chart of mean NLL against ratio, one curve per press, drawn by
                           scripts/plot.py: needs Python with matplotlib ($KVPRESS_PYTHON,
                           else the build's Python, else python3; docs/CLI.md)
  --no-progress, --quiet   no progress bar (shown only on a terminal) / also no table

generate options (greedy continuations with the kvpress::llama runner):
  --prompts FILE           one prompt per non-blank line (tokenized with BOS)
  --prompt TEXT            a prompt (repeatable; before the file's)
  --press NAME, --ratio R  the press and its ratio (decoding presses: their own budget,
                           --ratio optional); --param KEY=VALUE as for compress
  --max-new-tokens N       tokens generated per prompt (default 32)
  --model NAME|DIR         checkpoint folder, .gguf file or model name (default tinystories-656k)
  --paged                  continuous batching over one paged KV cache: prompts run together,
                           each compressed while its pages are written; a finished prompt's
                           pages go to the next one; prints the pool's figures
  --page-size P            tokens per page (default 16)
  --kv-dtype F             how full pages are stored: full (the model's dtype, default), int8,
                           fp8 (e4m3) or int4 (KIVI); a head's last, partly filled page stays full
  --pages-per-layer N      pool size per layer (default: max-batch prompts' worst case)
  --max-batch B            sequences running at once (default 8)
  --no-stop-at-eos         generate N tokens even after the end-of-story token
  --chat                   each prompt as a user message through the model's chat template
                           (the generation prompt after it; no BOS added)
  --threads N              intra-op threads (default: torch's, every core or OMP_NUM_THREADS)
  --json OUT               prompts, tokens, texts, cache lengths and the pool's figures
  --quiet, -q              print nothing (with --json)

ask options (kvpress's KVPressTextGenerationPipeline: compress once, answer each question):
  --context FILE           the text the questions are about (prefilled after BOS)
  --question TEXT          a question (repeatable); each runs over the same compressed cache,
                           followed by a newline, and is answered greedily
  --press NAME, --ratio R  the press and its ratio, --param KEY=VALUE as for compress
                           (a decoding press takes one question)
  --query-aware            compress each question's own prefill of context + question (the
                           press sees the question; FinchPress needs it)
  --chat                   prompt through the model's chat template, as kvpress's pipeline
                           does (required for a model that has one): the context in a user
                           message, each question ending it before the generation prompt
  --max-new-tokens N       tokens per answer (default 50, kvpress's)
  --answer-prefix TEXT     text after each question's newline, before the answer
  --max-context-length N   cut the prefill to its first N tokens
  --model NAME|DIR         checkpoint folder, .gguf file or model name (default tinystories-656k;
                           smollm2-135m-instruct: SmolLM2, installed by scripts/setup.sh)
  --threads N              intra-op threads (default: torch's, every core or OMP_NUM_THREADS)
  --json OUT               questions, answers, tokens and cache lengths
  --quiet, -q              print nothing (with --json)

bench options (RULER-style accuracy of every press on a real model; docs/QUALITY.md):
  --tasks DIR              examples written by benchmarks/quality/make_tasks.py
  --out RESULTS.jsonl      one JSON row per answer, appended as it comes; a rerun with the
                           same file skips what is there (resumes an interrupted run)
  --model NAME|DIR         checkpoint (default smollm2-135m-instruct), prompted through its
                           chat template when it has one
  --task LIST, --lengths LIST, --examples N
                           only these tasks / context lengths / the first N examples of each
  --press NAME             a press (repeatable; "none": no compression; "default": the
                           default list); default: none,
                           StreamingLLM, Knorm, KeyDiff, SnapKV, TOVA, ExpectedAttention,
                           Compactor, PyramidKV, KVzip, AdaKV(ExpectedAttention),
                           CriticalKV(ExpectedAttention) and query-aware SnapKV
  --param KEY=VALUE        a parameter of the --press (or --query-aware) it follows
  --label TEXT             what the rows and tables call the --press it follows (after its
                           --param), e.g. a name without an artifact's path
  --query-aware NAME       a press whose prefill holds the question (repeatable)
  --ratios LIST            comma-separated compression ratios (default 0.25,0.5,0.75)
  --press-ratios LABEL=LIST
                           the ratios of one press, by its rows' label, instead of --ratios
                           (e.g. KVzipPress=0.25,0.5,0.75,0.9; repeatable)
  --calibrate LIST         tolerances in (0, 1): each score-based press also runs "[calibrated]",
                           its ratio per example the largest whose attention output (last 16
                           queries) stays within the tolerance; its rows' ratio is the tolerance
  --kv-dtype F              answer over a paged KV cache whose full pages are F: full, int8,
                           fp8 or int4 (every press of the run, labelled "[F pages]"; each run
                           prefills with compression while storing; default: the dense cache)
  --csv OUT                accuracy and mean kept fraction per press, ratio, task and length
  --png OUT                accuracy against ratio, one line per press (scripts/plot.py)
  --threads N              intra-op threads (default: torch's, every core or OMP_NUM_THREADS)
  --no-progress            no progress bar (shown only on a terminal)

query-stats options (TriAttentionPress's statistics: one prefill of a calibration text):
  --out FILE, -o FILE      where the statistics go (safetensors: q_mean_real, q_mean_imag,
                           q_abs_mean [layers, heads, head_dim / 2]; TriAttentionPress's stats_file)
  --model NAME|DIR         checkpoint folder, .gguf file or model name (default tinystories-656k)
  --text FILE              plain text (default: the bundled tinystories_valid_100.txt, whole)
  --max-tokens N           its first N tokens, BOS included (default 32768, as the authors')
  --threads N              intra-op threads (default: torch's, every core or OMP_NUM_THREADS)

list options:
  --names                  print only the press names, one per line
  --json                   every press (kind, inputs, parameters) and every input field as JSON
  --markdown               every press's parameters as docs/PRESS_PARAMETERS.md holds them

Errors print one line "kvpress-cli: error: ..." on stderr and exit with code 2.
Full reference: docs/CLI.md.
)";

// ---- small helpers -----------------------------------------------------------------------

using kvpress::parse_double;
using kvpress::parse_int;

// First line of an exception message.
std::string first_line(const std::string& message) {
  const auto pos = message.find('\n');
  std::string line = pos == std::string::npos ? message : message.substr(0, pos);
  while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.pop_back();
  return line.empty() ? "unknown error" : line;
}

// ---- compress ---------------------------------------------------------------------------

struct CompressArgs {
  std::string press;
  std::optional<std::string> ratio_text;
  std::map<std::string, std::string> params;
  std::string input;
  std::string output;
  std::string device = "cpu";
  bool allow_unknown_tensors = false;
  bool quiet = false;
};

using kvpress_cli::take_value;

CompressArgs parse_compress_args(const std::vector<std::string>& args) {
  CompressArgs out;
  std::set<std::string> seen;
  auto once = [&](const char* option) {
    if (!seen.insert(option).second) usage_error("option {} given more than once", option);
  };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string value;
    const std::string& a = args[i];
    if (take_value(args, i, "--press", "", value)) {
      once("--press");
      out.press = value;
    } else if (take_value(args, i, "--ratio", "", value)) {
      once("--ratio");
      out.ratio_text = value;
    } else if (take_value(args, i, "--param", "", value)) {
      kvpress_cli::add_param(out.params, value);
    } else if (take_value(args, i, "--input", "-i", value)) {
      once("--input");
      out.input = value;
    } else if (take_value(args, i, "--output", "-o", value)) {
      once("--output");
      out.output = value;
    } else if (take_value(args, i, "--device", "", value)) {
      once("--device");
      out.device = value;
    } else if (a == "--allow-unknown-tensors") {
      out.allow_unknown_tensors = true;
    } else if (a == "--quiet" || a == "-q") {
      out.quiet = true;
    } else {
      kvpress_cli::reject_argument("compress", a);
    }
  }
  if (out.press.empty()) usage_error("compress needs --press NAME (see kvpress-cli list)");
  if (!out.ratio_text) usage_error("compress needs --ratio R, a number in [0, 1)");
  if (out.input.empty()) usage_error("compress needs --input PATH");
  if (out.output.empty()) usage_error("compress needs --output PATH");
  return out;
}

using kvpress_cli::parse_ratio;

c10::Device parse_device(const std::string& text) {
  try {
    return c10::Device(text);
  } catch (const c10::Error&) {
    usage_error("--device must be a torch device such as cpu, cuda or cuda:1, got '{}'", text);
  }
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

// The value of a scalar LayerInputs field given as file metadata.
template <typename T>
T metadata_value(const std::string& path, const char* key, const std::string& text) {
  if constexpr (std::is_same_v<T, int64_t>) {
    const auto v = parse_int(text);
    TORCH_CHECK(v.has_value(), "input ", path, ": metadata ", key, " must be an integer, got '", text, "'");
    return *v;
  } else {
    const auto v = parse_double(text);
    TORCH_CHECK(v.has_value(), "input ", path, ": metadata ", key, " must be a number, got '", text, "'");
    return *v;
  }
}

// LayerInputs from a safetensors file: every tensor field by its name, every scalar field from the
// metadata (docs/CLI.md lists them), checked against each other by kvpress::validate_layer_inputs.
// A tensor that is no field is refused, or ignored with a warning when allow_unknown.
kvpress::LayerInputs layer_inputs(const kvpress::io::SafetensorsFile& file, const std::string& path,
                                  bool allow_unknown) {
  kvpress::LayerInputs in;
  std::vector<std::string> tensor_fields;
  kvpress::for_each_field(in, [&](const kvpress::LayerInputField& field, auto& member) {
    using T = std::decay_t<decltype(member)>;
    if constexpr (std::is_same_v<T, at::Tensor>) {
      tensor_fields.push_back(field.name);
      if (const auto it = file.tensors.find(field.name); it != file.tensors.end()) member = it->second;
    } else if (const auto it = file.metadata.find(field.name); it != file.metadata.end()) {
      member = metadata_value<T>(path, field.name, it->second);
    }
  });
  for (const auto& [name, tensor] : file.tensors) {
    if (std::find(tensor_fields.begin(), tensor_fields.end(), name) != tensor_fields.end()) continue;
    TORCH_CHECK(allow_unknown, "input ", path, ": unknown tensor '", name, "' (expected ", join(tensor_fields, ", "),
                "; --allow-unknown-tensors ignores it)");
    fmt::print(stderr, "{}: warning: input {}: ignoring unknown tensor '{}'\n", kProg, path, name);
  }
  kvpress::validate_layer_inputs(in, "input " + path);
  return in;
}

kvpress::LayerInputs to_device(kvpress::LayerInputs in, const c10::Device& device) {
  kvpress::for_each_field(in, [&](const kvpress::LayerInputField&, auto& member) {
    if constexpr (std::is_same_v<std::decay_t<decltype(member)>, at::Tensor>) {
      if (member.defined()) member = member.to(device);
    }
  });
  return in;
}

int run_compress(const std::vector<std::string>& argv) {
  const CompressArgs args = parse_compress_args(argv);
  const double ratio = parse_ratio(*args.ratio_text);
  const c10::Device device = parse_device(args.device);

  // The press first: an unknown press or parameter is reported before any file is read.
  std::unique_ptr<kvpress::BasePress> press = kvpress::make_press(args.press, ratio, args.params);

  auto file = kvpress::io::load_safetensors(args.input);
  const kvpress::LayerInputs inputs = to_device(layer_inputs(file, args.input, args.allow_unknown_tensors), device);
  const int64_t B = inputs.keys.size(0), Hkv = inputs.keys.size(1), S = inputs.keys.size(2);

  const auto start = std::chrono::steady_clock::now();
  at::Tensor scores;
  kvpress::KV kv;
  std::map<std::string, at::Tensor> out;
  std::string summary_kept;  // "64 tokens per head" or the ragged spread
  int64_t n_kept = 0;        // per head, or in total for a head-ragged press
  if (press->head_ragged()) {
    // Heads keep different numbers of tokens: every head's kept tokens packed one after another,
    // with a [B, Hkv] lengths tensor (docs/CLI.md, "Head-ragged output").
    const kvpress::RaggedKV ragged = press->compress_ragged(inputs);
    TORCH_CHECK(ragged.batch == B && ragged.kv_heads == Hkv, press->name(), ": compress_ragged() returned ",
                ragged.batch, " x ", ragged.kv_heads, " heads, expected ", B, " x ", Hkv);
    const kvpress::HeadRaggedLayer layer = kvpress::HeadRaggedLayer::from_ragged(ragged, S);
    out = {
        {"keys", layer.packed_keys().to(at::kCPU).contiguous()},
        {"values", layer.packed_values().to(at::kCPU).contiguous()},
        {"kept_indices", layer.packed_positions().to(at::kCPU).contiguous()},
        {"lengths", layer.lengths()},
    };
    n_kept = layer.packed_tokens();
    summary_kept = fmt::format("{} tokens per head on average (min {}, max {}; head-ragged)",
                               fmt::format("{:.1f}", static_cast<double>(n_kept) / static_cast<double>(B * Hkv)),
                               layer.min_length(), layer.max_length());
  } else {
    kv = press->compress(inputs);
    // A scorer's scores too, for inspection. Most scorers keep the top n_kept of them; QSMPress and
    // CTRPress add forced tokens and adapt budgets, PyramidKVPress keeps its layer budget.
    if (const auto* scorer = dynamic_cast<const kvpress::ScorerPress*>(press.get())) scores = scorer->score(inputs);
  }
  if (!press->head_ragged()) {
    TORCH_CHECK(kv.keys.defined() && kv.values.defined() && kv.kept_indices.defined(), press->name(),
                ": compress() returned an incomplete result");
    // Copying back to the CPU synchronises, so the time covers the device work.
    out = {
        {"keys", kv.keys.to(at::kCPU).contiguous()},
        {"values", kv.values.to(at::kCPU).contiguous()},
        {"kept_indices", kv.kept_indices.to(at::kCPU, at::kLong).contiguous()},
    };
    if (scores.defined()) out["scores"] = scores.to(at::kCPU, at::kFloat).contiguous();
    n_kept = kv.kept_indices.size(-1);
    summary_kept = fmt::format("{} tokens per head", n_kept);
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  // Effective parameters (defaults overridden by --param), as text.
  nlohmann::json params = nlohmann::json::object();
  if (const auto* info = kvpress::find_press(args.press)) {
    for (const auto& p : info->params) params[p.name] = p.default_value;
  }
  for (const auto& [key, value] : args.params) params[key] = value;
  std::map<std::string, std::string> metadata = {
      {"press", press->name()},       {"ratio", fmt::format("{}", ratio)}, {"params", params.dump()},
      {"seq_len", std::to_string(S)}, {"n_kept", std::to_string(n_kept)},  {"kvpress_version", KVPRESS_VERSION},
  };
  if (press->head_ragged()) metadata["layout"] = "head_ragged";  // n_kept is then the total
  kvpress::io::save_safetensors(args.output, out, metadata);

  if (!args.quiet) {
    fmt::print("{}: ratio {}, {} -> {} (batch {}, {} KV heads) in {:.2f} ms on {}; wrote {}\n", press->name(), ratio, S,
               summary_kept, B, Hkv, ms, device.str(), args.output);
  }
  return 0;
}

// ---- calibrate ----------------------------------------------------------------------------

struct CalibrateArgs {
  std::string press;
  std::map<std::string, std::string> params;
  std::vector<std::string> inputs;  // one file per layer of the same context
  double tolerance = 0.05;
  int64_t observe = kvpress::calibration::kDefaultObservedQueries;
  double max_ratio = 0.95;
  std::string json;
};

CalibrateArgs parse_calibrate_args(const std::vector<std::string>& args) {
  CalibrateArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string value;
    const std::string& a = args[i];
    if (take_value(args, i, "--press", "", value)) {
      out.press = value;
    } else if (take_value(args, i, "--param", "", value)) {
      kvpress_cli::add_param(out.params, value);
    } else if (take_value(args, i, "--input", "-i", value)) {
      out.inputs.push_back(value);
    } else if (take_value(args, i, "--tolerance", "", value)) {
      const auto t = parse_double(value);
      if (!t || !std::isfinite(*t) || *t < 0) usage_error("--tolerance must be a number >= 0, got '{}'", value);
      out.tolerance = *t;
    } else if (take_value(args, i, "--observe", "", value)) {
      const auto n = parse_int(value);
      if (!n || *n < 1) usage_error("--observe must be an integer >= 1, got '{}'", value);
      out.observe = *n;
    } else if (take_value(args, i, "--max-ratio", "", value)) {
      const auto r = parse_double(value);
      if (!r || !(*r > 0.0 && *r < 1.0)) usage_error("--max-ratio must be a number in (0, 1), got '{}'", value);
      out.max_ratio = *r;
    } else if (take_value(args, i, "--json", "", value)) {
      out.json = value;
    } else {
      usage_error("calibrate: unknown option '{}' (see kvpress-cli --help)", a);
    }
  }
  if (out.press.empty()) usage_error("calibrate needs --press NAME (see kvpress-cli list)");
  if (out.inputs.empty()) usage_error("calibrate needs --input PATH (one per layer)");
  return out;
}

// Largest compression ratio whose attention-output quality stays within a tolerance, for one
// context given as one safetensors file per layer (kvpress::calibration::search_max_ratio).
int run_calibrate(const std::vector<std::string>& argv) {
  const CalibrateArgs args = parse_calibrate_args(argv);
  kvpress::make_press(args.press, 0.5, args.params);  // unknown press/parameter: fail before reading

  std::vector<kvpress::calibration::ObservedLayer> layers;
  for (const auto& path : args.inputs) {
    auto file = kvpress::io::load_safetensors(path);
    const kvpress::LayerInputs inputs = layer_inputs(file, path, /*allow_unknown=*/false);
    const at::Tensor& q = inputs.queries;
    TORCH_CHECK(q.defined(), "input ", path,
                ": calibrate needs queries [B, Hq, Sq, D] (the observation queries "
                "are their last --observe rows)");
    TORCH_CHECK(q.size(2) >= args.observe, "input ", path, ": queries must hold at least --observe (", args.observe,
                ") rows, got ", q.size(2));
    layers.push_back(kvpress::calibration::observe_last(inputs, args.observe));
  }
  kvpress::calibration::SearchOptions options;
  options.max_ratio = args.max_ratio;
  const auto make = [&](double ratio) { return kvpress::make_press(args.press, ratio, args.params); };
  const auto result = kvpress::calibration::search_max_ratio(layers, make, args.tolerance, options);

  fmt::print("{}: attention-output quality of the last {} queries, {} layer(s), tolerance {}\n", args.press,
             args.observe, layers.size(), args.tolerance);
  fmt::print("{:>8}  {:>8}\n", "ratio", "quality");
  for (const auto& [ratio, quality] : result.evaluations) fmt::print("{:>8.4f}  {:>8.4f}\n", ratio, quality);
  fmt::print("largest ratio within tolerance: {:.4f} (quality {:.4f}, {} evaluations)\n", result.ratio, result.quality,
             result.evaluations.size());
  if (!args.json.empty()) {
    nlohmann::json j = {{"press", args.press},
                        {"params", args.params},
                        {"tolerance", args.tolerance},
                        {"observe", args.observe},
                        {"ratio", result.ratio},
                        {"quality", result.quality},
                        {"evaluations", result.evaluations}};
    kvpress::io::write_text_atomically("--json", args.json, j.dump(2) + "\n");
  }
  return 0;
}

// ---- list -------------------------------------------------------------------------------

// A markdown table cell: pipes escaped, "" as a dash.
std::string markdown_cell(const std::string& text) {
  if (text.empty()) return "—";
  std::string out;
  for (char c : text) out += c == '|' ? std::string("\\|") : std::string(1, c);
  return out;
}

// docs/PRESS_PARAMETERS.md: every press's declared parameters (tests/cli/check_generated_doc.sh
// keeps the committed file equal to this).
std::string presses_markdown() {
  std::string out =
      "# Press parameters\n\n"
      "Generated from each press's declaration (its `Params` struct, kvpress/press_params.h) by\n"
      "`kvpress-cli list --markdown > docs/PRESS_PARAMETERS.md`; do not edit (the test\n"
      "`docs.press_parameters_current` fails when it differs). Names and defaults follow kvpress 0.5.5\n"
      "wherever kvpress has the parameter (`tests/python/test_package.py` compares them); the others\n"
      "(seeds of our CPU generators, files kvpress would download) and the presses kvpress lacks are\n"
      "ours. Every press also takes `compression_ratio` unless it says otherwise. What each press\n"
      "computes, and where it differs from kvpress: [PRESS_NOTES.md](PRESS_NOTES.md).\n";
  for (const auto& p : kvpress::list_presses()) {
    std::string summary = p.summary;
    if (!summary.empty()) summary[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(summary[0])));
    out += fmt::format("\n## {}\n\n{}. Kind: {}. Reads: {}.\n", p.name, summary, kvpress::press_kind_name(p.kind),
                       markdown_cell(kvpress::describe_inputs(p)));
    if (!p.no_ratio.empty()) out += fmt::format("No compression ratio: {}.\n", p.no_ratio);
    if (p.params.empty()) {
      out += "\nNo parameters.\n";
      continue;
    }
    out += "\n| parameter | type | default | accepts | meaning |\n|---|---|---|---|---|\n";
    for (const auto& q : p.params) {
      out += fmt::format("| `{}` | {} | {} | {} | {} |\n", q.name, q.type,
                         q.default_value.empty() ? "—" : "`" + q.default_value + "`", markdown_cell(q.accepts),
                         markdown_cell(q.help));
    }
  }
  return out;
}

// The plain listing: name, summary, kind, inputs and aligned parameter lines.
std::string presses_text() {
  const auto& presses = kvpress::list_presses();
  std::string out;
  for (size_t i = 0; i < presses.size(); ++i) {
    const auto& p = presses[i];
    if (i) out += "\n";
    out += fmt::format("{}\n  {}\n  kind: {}\n  needs: {}\n", p.name, p.summary, kvpress::press_kind_name(p.kind),
                       kvpress::describe_inputs(p));
    if (!p.no_ratio.empty()) out += fmt::format("  ratio: none, --ratio 0 ({})\n", p.no_ratio);
    if (p.params.empty()) {
      out += "  params: none\n";
      continue;
    }
    out += "  params:\n";
    size_t wn = 0, wt = 0, wd = 0;
    for (const auto& q : p.params) {
      wn = std::max(wn, q.name.size());
      wt = std::max(wt, q.type.size());
      wd = std::max(wd, q.default_value.size());
    }
    for (const auto& q : p.params) {
      const std::string accepts = q.accepts.empty() ? "" : fmt::format(" ({})", q.accepts);
      out += fmt::format("    {:<{}}  {:<{}}  default {:<{}}  {}{}\n", q.name, wn, q.type, wt, q.default_value, wd,
                         q.help, accepts);
    }
  }
  return out;
}

int run_list(const std::vector<std::string>& args) {
  enum class Format { kText, kNames, kJson, kMarkdown } format = Format::kText;
  for (const auto& a : args) {
    if (a == "--names") {
      format = Format::kNames;
    } else if (a == "--json") {
      format = Format::kJson;
    } else if (a == "--markdown") {
      format = Format::kMarkdown;
    } else {
      usage_error("list: unknown argument '{}' (see kvpress-cli --help)", a);
    }
  }
  switch (format) {
    case Format::kJson: fmt::print("{}\n", kvpress::registry_json()); break;
    case Format::kMarkdown: fmt::print("{}", presses_markdown()); break;
    case Format::kText: fmt::print("{}", presses_text()); break;
    case Format::kNames:
      for (const auto& p : kvpress::list_presses()) fmt::print("{}\n", p.name);
      break;
  }
  return 0;
}

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) usage_error("no command given (see kvpress-cli --help)");
  const std::string command = args.front();
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  const bool wants_help = std::find_if(rest.begin(), rest.end(),
                                       [](const std::string& a) { return a == "--help" || a == "-h"; }) != rest.end();
  if (command == "--help" || command == "-h" || command == "help" || wants_help) {
    fmt::print("{}", kHelp);
    return 0;
  }
  if (command == "--version" || command == "-V" || command == "version") {
    fmt::print("kvpress-cli {} (libtorch {})\n", KVPRESS_VERSION, TORCH_VERSION);
    return 0;
  }
  if (command == "compress") return run_compress(rest);
  if (command == "list") return run_list(rest);
  if (command == "calibrate") return run_calibrate(rest);
  if (command == "eval") return kvpress_cli::run_eval(rest);
  if (command == "bench") return kvpress_cli::run_bench(rest);
  if (command == "generate") return kvpress_cli::run_generate(rest);
  if (command == "ask") return kvpress_cli::run_ask(rest);
  if (command == "query-stats") return kvpress_cli::run_query_stats(rest);
  usage_error(
      "unknown command '{}' (commands: compress, calibrate, eval, generate, ask, bench, query-stats, list; see "
      "kvpress-cli --help)",
      command);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    fmt::print(stderr, "{}: error: {}\n", kProg, first_line(e.what()));
    return 2;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "{}: error: {}\n", kProg, first_line(e.what_without_backtrace()));
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: error: internal error: {}\n", kProg, first_line(e.what()));
    return 1;
  } catch (...) {
    fmt::print(stderr, "{}: error: internal error: unknown exception\n", kProg);
    return 1;
  }
}
