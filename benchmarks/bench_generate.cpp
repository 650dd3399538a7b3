// kvpress_bench_generate: prefill and decode speed of the kvpress::llama runner on a checkpoint, with
// and without a press (benchmarks/compare_runner.py times transformers (+ kvpress) on the same model
// and ids and prints both sides; docs/PERFORMANCE.md, "Runner speed").
//
//   kvpress_bench_generate MODEL IDS.safetensors [--decode N] [--repeats R] [--threads T]
//                          [--press NAME --ratio R]
//
// MODEL: a name, folder or .gguf file (kvpress::llama::load_checkpoint). IDS.safetensors holds
// "input_ids" [1, S] int64. Each repeat prefills S tokens on a fresh cache (last position's logits,
// as a pipeline prefills) and then decodes N tokens greedily, one forward of one token each; the
// fastest prefill and the fastest decode are reported. --threads 0 (the default) keeps torch's
// (every core), what a user gets. With --press, each repeat also prefills with the press (then
// decodes over the compressed cache): press_prefill_s is that prefill, and press_s the time of the
// press's compression inside it (kvpress_bench::TimedPress). One JSON line:
//   {"seq": S, "threads": T, "prefill_s": ..., "decode_tokens": N, "decode_s": ..., "tokens": [...],
//    "press": NAME, "press_prefill_s": ..., "press_s": ..., "press_decode_s": ..., "press_tokens": [...]}
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/llama/checkpoint.h"
#include "kvpress/registry.h"

namespace {

namespace llama = kvpress::llama;
using Clock = std::chrono::steady_clock;

using kvpress_bench::seconds_since;

struct Timing {
  double prefill_s = std::numeric_limits<double>::infinity(), decode_s = prefill_s;
  double press_s = 0.0;         // the press's compression inside the fastest prefill
  std::vector<int64_t> tokens;  // the greedy tokens of the last repeat
};

// One repeat: the prefill of `ids` with `press` (nullptr: none; its compression timed), then
// `decode` greedy steps.
void time_once(const llama::LlamaModel& model, const at::Tensor& ids, const kvpress::BasePress* press, int64_t decode,
               Timing& best) {
  llama::KVCache cache = model.new_cache();
  llama::PrefillOptions prefill;
  prefill.last_logits_only = true;
  const std::unique_ptr<kvpress_bench::TimedPress> timed =
      press ? std::make_unique<kvpress_bench::TimedPress>(*press) : nullptr;
  prefill.press = timed.get();
  auto start = Clock::now();
  at::Tensor logits = model.prefill(ids, cache, prefill).logits;
  if (const double elapsed = seconds_since(start); elapsed < best.prefill_s) {
    best.prefill_s = elapsed;
    best.press_s = timed ? timed->seconds() : 0.0;
  }
  llama::ForwardOptions step;
  step.last_logits_only = true;
  best.tokens.clear();
  start = Clock::now();
  for (int64_t t = 0; t < decode; ++t) {
    const int64_t next = logits[0][-1].argmax().item<int64_t>();
    best.tokens.push_back(next);
    logits = model.forward(at::full({1, 1}, next, at::kLong), cache, step).logits;
  }
  best.decode_s = std::min(best.decode_s, seconds_since(start));
}

int run(int argc, char** argv) {
  TORCH_CHECK(argc >= 3,
              "usage: kvpress_bench_generate MODEL IDS.safetensors [--decode N] [--repeats R] [--threads T] "
              "[--press NAME --ratio R]");
  const std::string model_name = argv[1], ids_file = argv[2];
  int64_t decode = 32;
  int repeats = 2, threads = 0;
  std::string press_name;
  double ratio = 0.5;
  for (int i = 3; i < argc; i += 2) {
    const std::string option = argv[i];
    TORCH_CHECK(i + 1 < argc, "kvpress_bench_generate: ", option, " needs a value");
    const std::string value = argv[i + 1];
    if (option == "--decode")
      decode = std::stoll(value);
    else if (option == "--repeats")
      repeats = std::stoi(value);
    else if (option == "--threads")
      threads = std::stoi(value);
    else if (option == "--press")
      press_name = value;
    else if (option == "--ratio")
      ratio = std::stod(value);
    else
      TORCH_CHECK(false, "kvpress_bench_generate: unknown option ", option);
  }
  TORCH_CHECK(decode >= 1 && repeats >= 1 && threads >= 0,
              "kvpress_bench_generate: --decode and --repeats must be >= 1, --threads >= 0");
  if (threads > 0) at::set_num_threads(threads);
  c10::InferenceMode guard;
  const llama::Checkpoint checkpoint = llama::load_checkpoint(model_name);
  const llama::LlamaModel& model = checkpoint.model;
  const at::Tensor ids = kvpress::io::required_tensor(kvpress::io::load_safetensors(ids_file), "input_ids",
                                                      "kvpress_bench_generate: " + ids_file)
                             .to(at::kLong);
  const std::unique_ptr<kvpress::BasePress> press =
      press_name.empty() ? nullptr : kvpress::make_press(press_name, ratio);
  TORCH_CHECK(!press || !press->needs_second_pass(), "kvpress_bench_generate: ", press_name,
              " runs a second pass, whose time the wrapper cannot see (kvpress_bench_prefill takes it)");

  Timing plain, pressed;
  for (int r = 0; r < repeats; ++r) {  // alternating, so both see the same machine
    time_once(model, ids, nullptr, decode, plain);
    if (press) time_once(model, ids, press.get(), decode, pressed);
  }
  nlohmann::json out{{"seq", ids.size(1)},      {"threads", at::get_num_threads()}, {"prefill_s", plain.prefill_s},
                     {"decode_tokens", decode}, {"decode_s", plain.decode_s},       {"tokens", plain.tokens}};
  if (press) {
    out["press"] = press_name;
    out["ratio"] = ratio;
    out["press_prefill_s"] = pressed.prefill_s;
    out["press_s"] = pressed.press_s;
    out["press_decode_s"] = pressed.decode_s;
    out["press_tokens"] = pressed.tokens;
  }
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return kvpress_bench::guarded_main(run, argc, argv); }
