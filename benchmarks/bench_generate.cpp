// kvpress_bench_generate: prefill and decode speed of the kvpress::llama runner on a checkpoint,
// without a press (benchmarks/compare_runner.py times transformers on the same model and ids and
// prints both sides; docs/PERFORMANCE.md, "Runner speed on a real model").
//
//   kvpress_bench_generate MODEL IDS.safetensors [--decode N] [--repeats R] [--threads T]
//
// MODEL: a name, folder or .gguf file (kvpress::llama::load_checkpoint). IDS.safetensors holds
// "input_ids" [1, S] int64. Each repeat prefills S tokens on a fresh cache (last position's logits,
// as a pipeline prefills) and then decodes N tokens greedily, one forward of one token each; the
// fastest prefill and the fastest decode are reported. One JSON line:
//   {"seq": S, "prefill_s": ..., "decode_tokens": N, "decode_s": ..., "tokens": [the N greedy ids]}
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/llama/checkpoint.h"

namespace {

namespace llama = kvpress::llama;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

int run(int argc, char** argv) {
  TORCH_CHECK(argc >= 3,
              "usage: kvpress_bench_generate MODEL IDS.safetensors [--decode N] [--repeats R] [--threads T]");
  const std::string model_name = argv[1], ids_file = argv[2];
  int64_t decode = 32;
  int repeats = 2, threads = 2;
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
    else
      TORCH_CHECK(false, "kvpress_bench_generate: unknown option ", option);
  }
  TORCH_CHECK(decode >= 1 && repeats >= 1 && threads >= 1,
              "kvpress_bench_generate: --decode, --repeats and --threads must be >= 1");
  at::set_num_threads(threads);
  c10::InferenceMode guard;
  const llama::Checkpoint checkpoint = llama::load_checkpoint(model_name);
  const llama::LlamaModel& model = checkpoint.model;
  const at::Tensor ids = kvpress::io::required_tensor(kvpress::io::load_safetensors(ids_file), "input_ids",
                                                      "kvpress_bench_generate: " + ids_file)
                             .to(at::kLong);

  double best_prefill = std::numeric_limits<double>::infinity(), best_decode = best_prefill;
  std::vector<int64_t> tokens;
  for (int r = 0; r < repeats; ++r) {
    llama::KVCache cache = model.new_cache();
    llama::PrefillOptions prefill;
    prefill.last_logits_only = true;
    auto start = Clock::now();
    at::Tensor logits = model.prefill(ids, cache, prefill).logits;
    best_prefill = std::min(best_prefill, seconds_since(start));
    llama::ForwardOptions step;
    step.last_logits_only = true;
    tokens.clear();
    start = Clock::now();
    for (int64_t t = 0; t < decode; ++t) {
      const int64_t next = logits[0][-1].argmax().item<int64_t>();
      tokens.push_back(next);
      logits = model.forward(at::full({1, 1}, next, at::kLong), cache, step).logits;
    }
    best_decode = std::min(best_decode, seconds_since(start));
  }
  std::cout << nlohmann::json{{"seq", ids.size(1)},
                              {"prefill_s", best_prefill},
                              {"decode_tokens", decode},
                              {"decode_s", best_decode},
                              {"tokens", tokens}}
                   .dump()
            << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return kvpress_bench::guarded_main(run, argc, argv); }
