// kvpress-cli ask: read a context, compress it once with a press, answer each question greedily
// from the same cache (or, query-aware, compress with each question in the prefill); docs/CLI.md.
#include "ask.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_args.h"
#include "kvpress/io/atomic_file.h"
#include "kvpress/llama/llama.h"

namespace kvpress_cli {
namespace {

namespace llama = kvpress::llama;

struct AskArgs {
  std::string model = "tinystories-656k";
  std::string context_file;
  std::vector<std::string> questions;
  PressArgs press;
  llama::PipelineOptions pipeline;  // press set once built
  int64_t threads = 1;
  std::string json;
  bool quiet = false;
};

AskArgs parse_ask_args(const std::vector<std::string>& args) {
  AskArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string value;
    const std::string& a = args[i];
    if (take_value(args, i, "--model", "", value)) {
      out.model = value;
    } else if (take_value(args, i, "--context", "", value)) {
      if (!out.context_file.empty()) usage_error("option --context given more than once");
      out.context_file = value;
    } else if (take_value(args, i, "--question", "", value)) {
      out.questions.push_back(value);
    } else if (out.press.take(args, i)) {
    } else if (take_value(args, i, "--max-new-tokens", "", value)) {
      out.pipeline.max_new_tokens = parse_int_option("--max-new-tokens", value, 1, 1 << 20);
    } else if (take_value(args, i, "--max-context-length", "", value)) {
      out.pipeline.max_context_length = parse_int_option("--max-context-length", value, 1, int64_t{1} << 40);
    } else if (take_value(args, i, "--answer-prefix", "", value)) {
      out.pipeline.answer_prefix = value;
    } else if (take_value(args, i, "--threads", "", value)) {
      out.threads = parse_int_option("--threads", value, 1, 1024);
    } else if (take_value(args, i, "--json", "", value)) {
      out.json = value;
    } else if (a == "--query-aware") {
      out.pipeline.query_aware = true;
    } else if (a == "--quiet" || a == "-q") {
      out.quiet = true;
    } else {
      reject_argument("ask", a);
    }
  }
  if (out.context_file.empty()) usage_error("ask needs --context FILE (the text the questions are about)");
  if (out.questions.empty()) usage_error("ask needs at least one --question TEXT");
  return out;
}

std::string read_context(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "ask: --context ", path, ": cannot open the file");
  std::ostringstream text;
  text << in.rdbuf();
  TORCH_CHECK(!in.bad(), "ask: --context ", path, ": read error");
  std::string context = text.str();
  while (!context.empty() && (context.back() == '\n' || context.back() == '\r')) context.pop_back();
  TORCH_CHECK(!context.empty(), "ask: --context ", path, ": the file is empty");
  return context;
}

// kvpress's pipeline applies a tokenizer's chat template when it has one; answer_questions follows
// its other branch only, so a model with a template is refused rather than answered differently.
void refuse_chat_template(const std::string& dir) {
  const std::filesystem::path config = std::filesystem::path(dir) / "tokenizer_config.json";
  std::ifstream in(config);
  if (!in.good()) return;
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(!j.is_discarded(), "ask: ", config.string(), ": not valid JSON");
  TORCH_CHECK(!j.contains("chat_template") || j["chat_template"].is_null(), "ask: ", config.string(),
              " has a chat_template; kvpress-cli ask prompts as kvpress's pipeline does for models without one");
}

}  // namespace

int run_ask(const std::vector<std::string>& argv) {
  AskArgs args = parse_ask_args(argv);
  // A bad press or context fails before the model loads.
  const std::unique_ptr<kvpress::BasePress> press = args.press.build("ask");
  args.pipeline.press = press.get();
  const std::string context = read_context(args.context_file);
  at::set_num_threads(static_cast<int>(args.threads));
  const std::string dir = llama::resolve_model_dir(args.model);
  refuse_chat_template(dir);
  const llama::LlamaModel model = llama::LlamaModel::load(dir);
  const llama::Tokenizer tokenizer = llama::Tokenizer::load(dir + "/tokenizer.json");
  const std::vector<llama::Answer> answers =
      llama::answer_questions(model, tokenizer, context, args.questions, args.pipeline);

  if (!args.quiet) {
    fmt::print("model: {}; press: {}{}\n", dir,
               press ? fmt::format("{} (compression_ratio {})", press->name(), args.press.ratio.value_or(0.0)) : "none",
               args.pipeline.query_aware ? "; query-aware" : "");
    for (size_t i = 0; i < answers.size(); ++i) {
      const llama::Answer& a = answers[i];
      fmt::print("[{}] Q: {}\n    A: {}\n    ({} tokens prefilled; cache after compression, per layer: {})\n", i,
                 args.questions[i], a.text, a.prefill_length, fmt::join(a.cache_lengths, ", "));
    }
  }
  if (!args.json.empty()) {
    nlohmann::json j;
    j["model"] = dir;
    j["press"] = press ? nlohmann::json(press->name()) : nlohmann::json(nullptr);
    j["compression_ratio"] = args.press.ratio ? nlohmann::json(*args.press.ratio) : nlohmann::json(nullptr);
    j["params"] = args.press.params;
    j["query_aware"] = args.pipeline.query_aware;
    j["max_new_tokens"] = args.pipeline.max_new_tokens;
    nlohmann::json items = nlohmann::json::array();
    for (size_t i = 0; i < answers.size(); ++i) {
      items.push_back({{"question", args.questions[i]},
                       {"answer", answers[i].text},
                       {"tokens", answers[i].tokens},
                       {"prefill_length", answers[i].prefill_length},
                       {"cache_lengths", answers[i].cache_lengths}});
    }
    j["answers"] = items;
    kvpress::io::write_text_atomically("ask: --json", args.json, j.dump(1) + "\n");
  }
  return 0;
}

}  // namespace kvpress_cli
