// kvpress_demo (scripts/demo.sh): kvpress presses in the loop of real models, run by the
// kvpress::llama runner. No arguments needed.
//
//   0. SmolLM2-135M-Instruct (its GGUF file, installed by scripts/setup.sh) through its chat template,
//      as kvpress's pipeline prompts it: a 7-digit code hidden in the middle of about 2,400 tokens of
//      held-out stories, asked for with the full cache and with presses: answer, whether it holds the
//      code, the KV cache kept, the time.
//   1. On TinyStories-656K, a story continuation: the first tokens of a held-out story are prefilled, every layer's
//      cache is compressed right after its prefill attention (kvpress's protocol), and up to 60
//      tokens are generated greedily at the original positions; with the full cache and with two presses.
//   2. The quality table: the protocol of `kvpress-cli eval` (docs/EVAL.md) on the first held-out
//      stories for every press of the registry at ratios 0.25 / 0.5 / 0.75: prefill the first
//      half of each story, compress, teacher-force the rest; mean NLL of the continuation, its
//      increase over the full cache and the fraction of positions whose argmax is the full
//      cache's. `kvpress-cli eval` runs the same on all stories (with --json/--csv/--png).
//
// Usage: kvpress_demo [--model NAME|DIR] [--text FILE] [--stories N]   (--model: parts 1 and 2)
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"
#include "kvpress/version.h"

namespace {

namespace llama = kvpress::llama;

constexpr int kStory = 2;  // a 432-token held-out story
constexpr size_t kContextTokens = 200;
constexpr int64_t kNewTokens = 60;
constexpr int64_t kMinPrefix = 65;  // kvpress-cli eval's default (SnapKVPress observes 64 tokens)
const double kRatios[] = {0.25, 0.5, 0.75};

// The last `max_chars` bytes of `text`, cut at a space, with a leading ellipsis.
std::string tail(const std::string& text, size_t max_chars) {
  if (text.size() <= max_chars) return text;
  size_t cut = text.find(' ', text.size() - max_chars);
  if (cut == std::string::npos) cut = text.size() - max_chars;
  return "..." + text.substr(cut);
}

// Part 0: the needle, and where it goes.
constexpr const char* kNeedleModel = "smollm2-135m-instruct";
constexpr const char* kCode = "4829173";
constexpr size_t kHaystackChars = 7600;  // about 2,400 SmolLM2 tokens

// Held-out stories without digits joined to about kHaystackChars, the code's sentence in the middle.
std::string haystack(const std::vector<std::string>& stories) {
  std::vector<std::string> parts;
  size_t chars = 0;
  for (const std::string& s : stories) {
    if (chars >= kHaystackChars) break;
    if (s.find_first_of("0123456789") != std::string::npos) continue;
    parts.push_back(s);
    chars += s.size() + 1;
  }
  parts.insert(parts.begin() + static_cast<std::ptrdiff_t>(parts.size() / 2),
               std::string("The secret code to open the treasure chest is ") + kCode + ". Remember it.");
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "\n") + p;
  return out;
}

// The first line of `text`.
std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

void needle_demo(const std::vector<std::string>& stories) {
  // Every core: this model's matrices are large enough for threads to pay off.
  at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const auto start = std::chrono::steady_clock::now();
  const llama::Checkpoint smol = llama::load_checkpoint(kNeedleModel);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const llama::ChatTemplate chat = llama::chat_template_of(smol);
  const auto& c = smol.model.config();
  const std::string context = haystack(stories);
  const std::string question = "What is the secret code to open the treasure chest?";
  std::printf(
      "0. SmolLM2-135M-Instruct (%s: %lld layers, %lld query / %lld KV heads, Q4_1 weights dequantised to "
      "float32 in %.1f s), prompted through its chat template (%s) as kvpress's pipeline does.\n"
      "   A %zu-character document of held-out stories with one sentence in the middle giving a 7-digit code; "
      "question: \"%s\"\n\n",
      smol.path.c_str(), (long long)c.num_layers, (long long)c.num_heads, (long long)c.num_kv_heads, load_s,
      chat.name().c_str(), context.size(), question.c_str());
  std::printf("%-44s %-6s %10s %7s  %s\n", "press", "code?", "KV cache", "time", "answer");
  int64_t prefill_tokens = 0;
  struct Run {
    const char* press;
    double ratio;
    bool query_aware;
  };
  for (const Run& run :
       {Run{nullptr, 0.0, false}, Run{"KnormPress", 0.25, false}, Run{"StreamingLLMPress", 0.25, false},
        Run{"SnapKVPress", 0.25, false}, Run{"SnapKVPress", 0.25, true}, Run{"SnapKVPress", 0.5, true},
        Run{"ExpectedAttentionPress", 0.5, false}}) {
    const auto press = run.press ? kvpress::make_press(run.press, run.ratio) : nullptr;
    llama::PipelineOptions options;
    options.press = press.get();
    options.chat_template = &chat;
    options.query_aware = run.query_aware;
    options.max_new_tokens = 24;
    const auto t0 = std::chrono::steady_clock::now();
    const llama::Answer a = llama::answer_questions(smol.model, smol.tokenizer, context, {question}, options)[0];
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    prefill_tokens = a.prefill_length;
    int64_t tokens = 0;
    for (int64_t n : a.cache_lengths) tokens += n;
    const double mib = static_cast<double>(tokens * c.num_kv_heads * c.head_dim * 2 * 4) / (1 << 20);  // K + V, fp32
    const std::string label = run.press ? std::string(run.press) + " " + std::to_string(run.ratio).substr(0, 4) +
                                              (run.query_aware ? " (query-aware)" : "")
                                        : std::string("full cache");
    std::printf("%-44s %-6s %7.1f MiB %6.1fs  %s\n", label.c_str(),
                a.text.find(kCode) != std::string::npos ? "yes" : "no", mib, seconds, first_line(a.text).c_str());
  }
  std::printf(
      "\n   (time: the prefill of %lld tokens, its compression and the answer, on %d threads. A press scores "
      "the cache before it has seen the question unless query-aware: a 135M model then often loses the code.)\n\n",
      (long long)prefill_tokens, at::get_num_threads());
}

size_t common_prefix(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_name = "tinystories-656k", text_path;
  int max_stories = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc)
      model_name = argv[++i];
    else if (a == "--text" && i + 1 < argc)
      text_path = argv[++i];
    else if (a == "--stories" && i + 1 < argc)
      max_stories = std::max(1, std::atoi(argv[++i]));
    else {
      std::printf("usage: kvpress_demo [--model NAME|DIR] [--text FILE] [--stories N]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  at::manual_seed(0);  // presses without a seed draw from the global generator
  try {
    const auto start = std::chrono::steady_clock::now();
    if (text_path.empty()) text_path = llama::default_stories_path();
    const std::vector<std::string> stories = llama::read_stories(text_path);
    std::printf("kvpress %s demo: presses in the loop of real models (kvpress::llama runner, CPU)\n\n",
                KVPRESS_VERSION);
    needle_demo(stories);

    // One intra-op thread: TinyStories-656K's tensors are too small for threading to pay off.
    at::set_num_threads(1);
    const llama::Checkpoint checkpoint = llama::load_checkpoint(model_name);
    const std::string& dir = checkpoint.path;
    const llama::LlamaModel& model = checkpoint.model;
    const llama::Tokenizer& tokenizer = checkpoint.tokenizer;
    const auto& c = model.config();
    std::printf("TinyStories-656K: %s (%lld layers, %lld query / %lld KV heads, head_dim %lld, float32)\n", dir.c_str(),
                (long long)c.num_layers, (long long)c.num_heads, (long long)c.num_kv_heads, (long long)c.head_dim);

    // ---- 1. story continuation ----------------------------------------------------------------
    TORCH_CHECK(static_cast<int>(stories.size()) > kStory, text_path, ": needs more than ", kStory, " stories");
    std::vector<int64_t> context = tokenizer.encode(stories[kStory]);
    if (context.size() > kContextTokens) context.resize(kContextTokens);
    std::printf(
        "\n1. Story continuation: held-out story %d, its first %zu tokens prefilled, then up to %lld "
        "tokens generated greedily (a run stops at the end-of-story token)\n\n",
        kStory, context.size(), (long long)kNewTokens);
    std::printf("context: %s\n", tail(tokenizer.decode(context), 360).c_str());

    llama::GenerationOptions options;
    options.max_new_tokens = kNewTokens;
    options.tokenizer = &tokenizer;
    const llama::Generation full = llama::generate_greedy(model, context, {}, options);
    std::printf("\n[full cache, %lld tokens per layer]\n%s\n", (long long)full.cache_lengths[0],
                tokenizer.decode(full.tokens).c_str());
    for (const auto& [name, ratio] : {std::pair<const char*, double>{"SnapKVPress", 0.5}, {"KnormPress", 0.75}}) {
      const auto press = kvpress::make_press(name, ratio);
      options.press = press.get();
      const llama::Generation g = llama::generate_greedy(model, context, {}, options);
      std::printf(
          "\n[%s, compression ratio %g: %lld tokens per layer; same as the full cache for the first %zu of "
          "%zu tokens]\n%s\n",
          name, ratio, (long long)g.cache_lengths[0], common_prefix(g.tokens, full.tokens), full.tokens.size(),
          tokenizer.decode(g.tokens).c_str());
    }

    // ---- 2. quality table ---------------------------------------------------------------------
    struct Story {
      std::vector<int64_t> ids;
      int64_t prefix;
      llama::ContinuationScore full;
    };
    std::vector<Story> eval;
    for (const auto& text : stories) {
      if (static_cast<int>(eval.size()) >= max_stories) break;
      std::vector<int64_t> ids = tokenizer.encode(text);
      const int64_t prefix = llama::prefix_length(static_cast<int64_t>(ids.size()), 0, 0.5);
      if (prefix < kMinPrefix) continue;
      Story s{std::move(ids), prefix, {}};
      s.full = llama::score_continuation(model, s.ids, s.prefix);
      eval.push_back(std::move(s));
    }
    TORCH_CHECK(!eval.empty(), text_path, ": no story of at least ", 2 * kMinPrefix, " tokens");
    double full_nll = 0.0;
    for (const auto& s : eval) full_nll += s.full.mean_nll / static_cast<double>(eval.size());

    std::printf(
        "\n2. Quality under compression: the first %zu held-out stories of >= %lld tokens; the first half of "
        "each prefilled and compressed, the rest teacher-forced\n"
        "   NLL: mean over stories of the continuation's mean NLL (nats/token); dNLL: minus the full cache's; "
        "agree: fraction of positions whose argmax is the full cache's\n\n",
        eval.size(), (long long)(2 * kMinPrefix));
    std::printf("%-24s %6s %8s %8s %7s\n", "press", "ratio", "NLL", "dNLL", "agree");
    std::printf("%-24s %6s %8.4f %8s %7.3f\n", "full cache", "-", full_nll, "-", 1.0);
    for (const auto& info : kvpress::list_presses()) {
      // Wrappers and decoding presses need an inner press chosen by the caller; a query-aware press
      // (FinchPress) a question, which this protocol has not; SimLayerKVPress and DuoAttentionPress take
      // no ratio; QFilterPress, ExpectedAttentionStatsPress, KVzapPress, LUKVPress and DuoAttentionPress
      // read files made for a model.
      if (info.kind == kvpress::PressKind::kWrapper || info.kind == kvpress::PressKind::kDecoding ||
          info.kind == kvpress::PressKind::kQueryAware)
        continue;
      if (!info.no_ratio.empty() || kvpress::needs_file(info)) continue;
      for (double ratio : kRatios) {
        const auto press = kvpress::make_press(info.name, ratio);
        double nll = 0.0, agree = 0.0;
        for (const auto& s : eval) {
          const llama::ContinuationScore r = llama::score_continuation(model, s.ids, s.prefix, press.get(), &tokenizer);
          nll += r.mean_nll / static_cast<double>(eval.size());
          agree += llama::greedy_agreement(r, s.full) / static_cast<double>(eval.size());
        }
        std::printf("%-24s %6.2f %8.4f %+8.4f %7.3f\n", info.name.c_str(), ratio, nll, nll - full_nll, agree);
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("\n%.1f s. All %zu stories, other presses/ratios, JSON/CSV/PNG: kvpress-cli eval (docs/EVAL.md).\n",
                seconds, stories.size());
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "kvpress_demo: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
