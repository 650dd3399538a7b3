// Helpers the stand-alone benchmark programs share: the timing rule and option lists.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kvpress/presses/base_press.h"
#include "kvpress/registry.h"

namespace kvpress_bench {

// Median wall time of `repeats` calls of fn after `warmup` calls, in milliseconds. `sync`, when
// given, runs after the warm-up and after each call (a device synchronisation), inside the timing.
inline double median_ms(const std::function<void()>& fn, int repeats, int warmup = 1,
                        const std::function<void()>& sync = {}) {
  TORCH_CHECK(repeats > 0, "median_ms: repeats must be > 0, got ", repeats);
  for (int i = 0; i < warmup; ++i) fn();
  if (sync) sync();
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    if (sync) sync();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// A comma-separated list of numbers given to `option` (kvpress::parse_double_list).
inline std::vector<double> number_list(const std::string& option, const std::string& text) {
  const auto list = kvpress::parse_double_list(text);
  TORCH_CHECK(list && !list->empty(), option, ": expected comma-separated numbers, got '", text, "'");
  return *list;
}

// The "--name VALUE" options of a small benchmark program: each declared option fills its target.
//   Options().list("--seq-lens", seq_lens).integer("--repeats", repeats).parse(argc, argv, usage)
// parse() prints "usage: PROGRAM <usage>" and returns false for an unknown option, an option without
// its value, or a value that is not what the option takes (numbers; a whole integer).
class Options {
 public:
  Options& list(const char* name, std::vector<double>& target) {
    options_.push_back({name, [name, &target](const std::string& text) {
                          const auto values = kvpress::parse_double_list(text);
                          if (!values || values->empty()) return why(name, "comma-separated numbers", text);
                          target = *values;
                          return true;
                        }});
    return *this;
  }
  template <typename Int>
  Options& integer(const char* name, Int& target) {
    options_.push_back({name, [name, &target](const std::string& text) {
                          char* end = nullptr;
                          const long long value = std::strtoll(text.c_str(), &end, 10);
                          if (text.empty() || *end != '\0') return why(name, "an integer", text);
                          target = static_cast<Int>(value);
                          return true;
                        }});
    return *this;
  }
  bool parse(int argc, char** argv, const std::string& usage) const {
    for (int i = 1; i < argc; i += 2) {
      const auto option =
          std::find_if(options_.begin(), options_.end(), [&](const auto& o) { return o.first == argv[i]; });
      if (option == options_.end() || i + 1 >= argc || !option->second(argv[i + 1])) {
        if (option == options_.end()) std::cerr << "unknown option '" << argv[i] << "'\n";
        if (option != options_.end() && i + 1 >= argc) std::cerr << argv[i] << " needs a value\n";
        std::cerr << "usage: " << argv[0] << " " << usage << "\n";
        return false;
      }
    }
    return true;
  }

 private:
  static bool why(const char* name, const char* expected, const std::string& text) {
    std::cerr << name << ": expected " << expected << ", got '" << text << "'\n";
    return false;
  }
  std::vector<std::pair<std::string, std::function<bool(const std::string&)>>> options_;
};

// The Llama runner's dense decode attention (src/llama/model.cpp): matmul, float32 softmax, matmul,
// GQA folded into the matmul rows; keep_mask (optional, [B, Hkv, L] bool) masks with -inf, which is
// how kvpress applies per-head budgets.
inline at::Tensor aten_decode_attention(const at::Tensor& queries,  // [B, Hq, 1, D]
                                        const at::Tensor& keys,     // [B, Hkv, L, D]
                                        const at::Tensor& values,   // [B, Hkv, L, D]
                                        const at::Tensor& keep_mask = {}) {
  const int64_t batch = queries.size(0), q_heads = queries.size(1), dim = queries.size(3);
  const int64_t kv_heads = keys.size(1), groups = q_heads / kv_heads;
  const at::Tensor qg = queries.reshape({batch, kv_heads, groups, dim});
  at::Tensor scores = at::matmul(qg, keys.transpose(2, 3)) * (1.0 / std::sqrt(static_cast<double>(dim)));
  if (keep_mask.defined())
    scores = scores.masked_fill(keep_mask.logical_not().unsqueeze(2), -std::numeric_limits<double>::infinity());
  const at::Tensor weights = at::softmax(scores, -1, at::kFloat);
  return at::matmul(weights, values).view({batch, q_heads, 1, dim});
}

// Seconds since `start` on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Forwards every call to the wrapped press and adds up the time spent in its compression (the
// press's own cost inside a prefill: kvpress_bench_prefill, kvpress_bench_generate). Not for a press
// that needs_second_pass(): its time is the prefill's difference to none.
class TimedPress final : public kvpress::BasePress {
 public:
  explicit TimedPress(const kvpress::BasePress& inner) : inner_(inner) {}
  std::string name() const override { return inner_.name(); }
  kvpress::KV compress(const kvpress::LayerInputs& inputs) const override {
    return timed([&] { return inner_.compress(inputs); });
  }
  bool head_ragged() const override { return inner_.head_ragged(); }
  at::Tensor keep_mask(const kvpress::LayerInputs& inputs) const override { return inner_.keep_mask(inputs); }
  kvpress::RaggedKV compress_ragged(const kvpress::LayerInputs& inputs) const override {
    return timed([&] { return inner_.compress_ragged(inputs); });
  }
  bool rerotates_keys() const override { return inner_.rerotates_keys(); }
  double compression_ratio() const override { return inner_.compression_ratio(); }
  double seconds() const { return seconds_; }

 private:
  template <typename Fn>
  auto timed(Fn&& fn) const -> decltype(fn()) {
    const auto start = std::chrono::steady_clock::now();
    auto result = fn();
    seconds_ += seconds_since(start);
    return result;
  }

  const kvpress::BasePress& inner_;
  mutable double seconds_ = 0.0;  // one thread at a time, as every press
};

// main() of a stand-alone benchmark program: run(argc, argv); an error is one line on stderr (a
// c10::Error without its backtrace) and exit code 2.
inline int guarded_main(int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
  }
  return 2;
}

}  // namespace kvpress_bench
