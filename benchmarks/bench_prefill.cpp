// kvpress_bench_prefill: prefill + compression time of the kvpress::llama runner, one press at a
// time, on a model folder and token ids written by benchmarks/compare_prefill.py (which times
// transformers + kvpress on the same model and ids and prints both sides; docs/PERFORMANCE.md,
// "Runner prefill").
//
//   kvpress_bench_prefill MODEL_DIR IDS.safetensors --presses none,KnormPress,... --ratio 0.5
//                         [--repeats 2] [--threads 2]
//
// A press is NAME or NAME:param=value:param=value (AdaKVPress:press=SnapKVPress).
// IDS.safetensors holds "input_ids" [1, S] int64. For each press (and "none": prefill without a
// press), the prefill runs `repeats` times on a fresh cache, last position's logits only (as
// kvpress's pipeline prefills the context); the fastest run is reported. The press's own time
// (score + selection + gather, every layer) is measured by wrapping it, except where the runner
// runs a second pass (BasePress::needs_second_pass: KVComposePress, KVzipPress, whose extra model
// passes are part of their compression): there it is the prefill's time minus the time without a
// press. KVzipPress needs MODEL_DIR/tokenizer.json for its repeat prompt. One JSON object per line:
//   {"press": ..., "seq": S, "prefill_s": ..., "compress_s": ..., "compress_measured": "wrapped"|"difference"}
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"

namespace {

namespace llama = kvpress::llama;
using Clock = std::chrono::steady_clock;

using kvpress_bench::seconds_since;

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, separator);)
    if (!item.empty()) out.push_back(item);
  return out;
}

// "NAME" or "NAME:param=value:param=value" (kvpress-cli's parameters; wrappers name press=...).
std::unique_ptr<kvpress::BasePress> press_from_spec(const std::string& spec, double ratio) {
  const std::vector<std::string> parts = split(spec, ':');
  std::map<std::string, std::string> params;
  for (size_t i = 1; i < parts.size(); ++i) {
    const size_t eq = parts[i].find('=');
    TORCH_CHECK(eq != std::string::npos, "kvpress_bench_prefill: expected param=value in '", spec, "', got '", parts[i],
                "'");
    params[parts[i].substr(0, eq)] = parts[i].substr(eq + 1);
  }
  return kvpress::make_press(parts.at(0), ratio, params);
}

int run(int argc, char** argv) {
  TORCH_CHECK(argc >= 3, "usage: kvpress_bench_prefill MODEL_DIR IDS.safetensors --presses none,A,B --ratio R ",
              "[--repeats N] [--threads T]");
  const std::string model_dir = argv[1], ids_file = argv[2];
  std::vector<std::string> presses{"none"};
  double ratio = 0.5;
  int repeats = 2, threads = 2;
  for (int i = 3; i < argc; i += 2) {
    const std::string option = argv[i];
    TORCH_CHECK(i + 1 < argc, "kvpress_bench_prefill: ", option, " needs a value");
    const std::string value = argv[i + 1];
    if (option == "--presses")
      presses = split(value, ',');
    else if (option == "--ratio")
      ratio = std::stod(value);
    else if (option == "--repeats")
      repeats = std::stoi(value);
    else if (option == "--threads")
      threads = std::stoi(value);
    else
      TORCH_CHECK(false, "kvpress_bench_prefill: unknown option ", option);
  }
  TORCH_CHECK(repeats >= 1 && threads >= 1, "kvpress_bench_prefill: --repeats and --threads must be >= 1");
  at::set_num_threads(threads);
  c10::InferenceMode guard;

  const llama::LlamaModel model = llama::LlamaModel::load(model_dir);
  // A random-weight model (compare_prefill.py's) has no tokenizer; only KVzipPress asks for one.
  const std::string tokenizer_path = model_dir + "/tokenizer.json";
  const std::optional<llama::Tokenizer> tokenizer =
      std::ifstream(tokenizer_path).good() ? std::optional<llama::Tokenizer>(llama::Tokenizer::load(tokenizer_path))
                                           : std::nullopt;
  const auto ids_tensors = kvpress::io::load_safetensors(ids_file).tensors;
  const auto found = ids_tensors.find("input_ids");
  TORCH_CHECK(found != ids_tensors.end(), "kvpress_bench_prefill: ", ids_file, " has no tensor 'input_ids'");
  const at::Tensor input_ids = found->second.to(at::kLong);
  const int64_t seq = input_ids.size(1);

  double baseline = std::numeric_limits<double>::quiet_NaN();
  for (const std::string& name : presses) {
    const std::unique_ptr<kvpress::BasePress> press = name == "none" ? nullptr : press_from_spec(name, ratio);
    const bool wrappable = press && !press->needs_second_pass();
    double best = std::numeric_limits<double>::infinity(), best_compress = 0.0;
    for (int r = 0; r < repeats; ++r) {
      std::unique_ptr<kvpress_bench::TimedPress> timed =
          wrappable ? std::make_unique<kvpress_bench::TimedPress>(*press) : nullptr;
      llama::PrefillOptions options;
      options.last_logits_only = true;
      options.press = timed ? timed.get() : press.get();
      options.tokenizer = tokenizer ? &*tokenizer : nullptr;
      llama::KVCache cache = model.new_cache();
      const auto start = Clock::now();
      const at::Tensor logits = model.prefill(input_ids, cache, options).logits;
      const double elapsed = seconds_since(start);
      TORCH_CHECK(logits.isfinite().all().item<bool>(), "kvpress_bench_prefill: non-finite logits with ", name);
      if (elapsed < best) best = elapsed, best_compress = timed ? timed->seconds() : 0.0;
    }
    if (!press) baseline = best;
    nlohmann::json row{{"press", name}, {"seq", seq}, {"prefill_s", best}};
    if (press) {
      row["compress_s"] = wrappable ? best_compress : best - baseline;
      row["compress_measured"] = wrappable ? "wrapped" : "difference";
    }
    std::cout << row.dump() << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return kvpress_bench::guarded_main(run, argc, argv); }
