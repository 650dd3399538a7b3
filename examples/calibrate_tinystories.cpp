// Worked example of context-calibrated compression (Compactor, arXiv 2507.08143) on the real
// TinyStories-656K model: collect (retention, context NLL, quality) samples on some held-out
// stories, fit f(r) = (e^{b r - b} - e^{-b}) / (1 - e^{-b}), b = alpha * NLL(context) + beta, then
// predict per story how much cache the other stories need to keep quality >= tau, and compare
// with one fixed ratio. Figures are recorded in docs/CALIBRATION.md.
//
// Protocol per story (stories of >= 100 tokens): answer = its last 32 tokens, context = the rest
// (BOS included).
// quality(r) = NLL_full(answer) / NLL_compressed(answer) where the context cache is compressed by
// the press at compression ratio 1 - r after prefill (kvpress's protocol: the answer is
// teacher-forced over the compressed cache at the original positions).
//
// Usage: kvpress_calibrate_tinystories [--press NAME] [--tau T] [--train N] [--stories FILE]
//                                     [--overestimate-weight W]
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvpress/calibration.h"
#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"

namespace {

namespace cal = kvpress::calibration;
namespace llama = kvpress::llama;

constexpr size_t kAnswerTokens = 32;

struct Story {
  std::vector<int64_t> context, answer;
  double context_nll = 0.0;
  double full_answer_nll = 0.0;
};

at::Tensor ids_tensor(const std::vector<int64_t>& ids) {
  return at::tensor(ids, at::TensorOptions().dtype(at::kLong)).view({1, -1});
}

// Mean negative log-likelihood of `targets` under `logits` [n, vocab].
double mean_nll(const at::Tensor& logits, const std::vector<int64_t>& targets) {
  const at::Tensor logp = at::log_softmax(logits.to(at::kFloat), -1);
  return -logp.gather(1, ids_tensor(targets).view({-1, 1})).mean().item<double>();
}

// NLL of the answer after prefilling the context (compressed by `press` when given). The answer's
// first token is predicted by the prefill's last logits, the others teacher-forced over the cache.
double answer_nll(const llama::LlamaModel& model, const Story& s, const kvpress::BasePress* press,
                  double* context_nll = nullptr) {
  llama::KVCache cache = model.new_cache();
  llama::PrefillOptions options;
  options.press = press;
  const at::Tensor prefill_logits = model.prefill(ids_tensor(s.context), cache, options).logits[0];
  if (context_nll) {
    const std::vector<int64_t> next(s.context.begin() + 1, s.context.end());
    *context_nll = mean_nll(prefill_logits.narrow(0, 0, prefill_logits.size(0) - 1), next);
  }
  const std::vector<int64_t> fed(s.answer.begin(), s.answer.end() - 1);
  const at::Tensor rest = model.forward(ids_tensor(fed), cache).logits[0];
  return mean_nll(at::cat({prefill_logits.narrow(0, prefill_logits.size(0) - 1, 1), rest}), s.answer);
}

double quality(const llama::LlamaModel& model, const Story& s, const std::string& press_name, double retention) {
  if (retention >= 1.0) return 1.0;
  const auto press = kvpress::make_press(press_name, 1.0 - retention);
  return s.full_answer_nll / answer_nll(model, s, press.get());
}

}  // namespace

int main(int argc, char** argv) {
  std::string press_name = "CompactorPress", stories_path;
  double tau = 0.9;
  size_t n_train = 50;
  cal::FitOptions fit_options;
  bool bad_argument = false;
  const auto number = [&](auto parsed) {  // the library's parser: "0.9x" is refused
    bad_argument = bad_argument || !parsed;
    return parsed.value_or(0);
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--press")
      press_name = v;
    else if (k == "--tau")
      tau = number(kvpress::parse_double(v));
    else if (k == "--train")
      n_train = static_cast<size_t>(number(kvpress::parse_int(v)));
    else if (k == "--stories")
      stories_path = v;
    else if (k == "--overestimate-weight")
      fit_options.overestimate_weight = number(kvpress::parse_double(v));
    else
      bad_argument = true;
    if (bad_argument) {
      std::fprintf(stderr,
                   "usage: %s [--press NAME] [--tau T] [--train N] [--stories FILE] [--overestimate-weight W]\n",
                   argv[0]);
      return 2;
    }
  }
  try {
    kvpress::make_press(press_name, 0.5);  // fail early on an unknown press
    const llama::Checkpoint checkpoint = llama::load_checkpoint("tinystories-656k");
    const std::string& dir = checkpoint.path;
    const llama::LlamaModel& model = checkpoint.model;
    const llama::Tokenizer& tokenizer = checkpoint.tokenizer;
    if (stories_path.empty()) stories_path = llama::default_stories_path();
    const std::vector<std::string> texts = llama::read_stories(stories_path);

    std::vector<Story> stories;
    for (const auto& text : texts) {
      const std::vector<int64_t> ids = tokenizer.encode(text);
      if (ids.size() < 100) continue;  // contexts of >= 68 tokens (SnapKV observes 64)
      Story s;
      const size_t split = ids.size() - kAnswerTokens;
      s.context.assign(ids.begin(), ids.begin() + split);
      s.answer.assign(ids.begin() + split, ids.end());
      s.full_answer_nll = answer_nll(model, s, nullptr, &s.context_nll);
      stories.push_back(std::move(s));
    }
    TORCH_CHECK(stories.size() > n_train + 1, "need more than ", n_train + 1, " stories of >= 100 tokens, got ",
                stories.size());
    std::printf("model: TinyStories-656K; press: %s; tau: %.2f; %zu stories (train %zu, test %zu)\n",
                press_name.c_str(), tau, stories.size(), n_train, stories.size() - n_train);

    // 1. Samples on the training stories.
    const std::vector<double> grid = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9};
    std::vector<cal::CalibrationSample> samples;
    std::vector<std::vector<double>> train_quality(n_train);
    for (size_t i = 0; i < n_train; ++i)
      for (double r : grid) {
        const double q = quality(model, stories[i], press_name, r);
        samples.push_back({r, stories[i].context_nll, q});
        train_quality[i].push_back(q);
      }
    const cal::CalibrationFit fit = cal::fit_calibration(samples, fit_options);
    std::printf("fit: alpha %.4f, beta %.4f (asymmetric loss %.5f over %zu samples, over-estimate weight %g)\n",
                fit.alpha, fit.beta, fit.loss, samples.size(), fit_options.overestimate_weight);

    // 2. One fixed retention for comparison: the smallest grid retention meeting tau on at least
    // 90% of the training stories (what an operator would pick without calibration).
    double fixed = 1.0;
    for (size_t g = 0; g < grid.size(); ++g) {
      size_t met = 0;
      for (size_t i = 0; i < n_train; ++i) met += train_quality[i][g] >= tau;
      if (met >= 0.9 * n_train) {
        fixed = grid[g];
        break;
      }
    }

    // 3. Predict on the test stories and check.
    size_t met_calibrated = 0, met_fixed = 0;
    double kept_calibrated = 0.0;
    const size_t n_test = stories.size() - n_train;
    for (size_t i = n_train; i < stories.size(); ++i) {
      const double r = fit.predict_retention(stories[i].context_nll, tau);
      met_calibrated += quality(model, stories[i], press_name, r) >= tau;
      met_fixed += quality(model, stories[i], press_name, fixed) >= tau;
      kept_calibrated += r;
    }
    kept_calibrated /= static_cast<double>(n_test);
    std::printf("calibrated: mean retention %.3f, quality >= tau on %zu/%zu test stories (%.0f%%)\n", kept_calibrated,
                met_calibrated, n_test, 100.0 * met_calibrated / n_test);
    std::printf("fixed:      retention %.3f,      quality >= tau on %zu/%zu test stories (%.0f%%)\n", fixed, met_fixed,
                n_test, 100.0 * met_fixed / n_test);
    std::printf("cache kept by calibration relative to the fixed ratio: %.1f%% (%.1f%% saved)\n",
                100.0 * kept_calibrated / fixed, 100.0 * (1.0 - kept_calibrated / fixed));
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
