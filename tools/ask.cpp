// kvpress-cli ask: read a context, compress it once with a press, answer each question greedily
// from the same cache (or, query-aware, compress with each question in the prefill); docs/CLI.md.
#include "ask.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <fmt/ranges.h>

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
  ModelRunArgs run;  // --model, --threads, --json, --chat, --quiet
  std::string context_file;
  std::vector<std::string> questions;
  PressArgs press;
  llama::PipelineOptions pipeline;  // press set once built
};

AskArgs parse_ask_args(const std::vector<std::string>& args) {
  AskArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string value;
    const std::string& a = args[i];
    if (out.run.take(args, i)) {
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
    } else if (a == "--query-aware") {
      out.pipeline.query_aware = true;
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

// kvpress's pipeline applies a tokenizer's chat template when it has one, so a model with one is
// prompted through it, which --chat asks for (rather than answered differently without a word).
std::optional<llama::ChatTemplate> chat_template(const llama::Checkpoint& checkpoint, bool chat) {
  if (!chat) {
    TORCH_CHECK(checkpoint.chat_template.empty(), "ask: ", checkpoint.path,
                " has a chat template, which kvpress's pipeline prompts through: pass --chat");
    return std::nullopt;
  }
  return llama::chat_template_of(checkpoint);
}

}  // namespace

int run_ask(const std::vector<std::string>& argv) {
  AskArgs args = parse_ask_args(argv);
  // A bad press or context fails before the model loads.
  const std::unique_ptr<kvpress::BasePress> press = args.press.build("ask");
  args.pipeline.press = press.get();
  const std::string context = read_context(args.context_file);
  use_threads(args.run.threads);
  const llama::Checkpoint checkpoint = llama::load_checkpoint(args.run.model);
  const std::string& dir = checkpoint.path;
  const std::optional<llama::ChatTemplate> chat = chat_template(checkpoint, args.run.chat);
  args.pipeline.chat_template = chat ? &*chat : nullptr;
  const llama::LlamaModel& model = checkpoint.model;
  const llama::Tokenizer& tokenizer = checkpoint.tokenizer;
  const std::vector<llama::Answer> answers =
      llama::answer_questions(model, tokenizer, context, args.questions, args.pipeline);

  if (!args.run.quiet) {
    fmt::print("model: {}; press: {}{}{}\n", dir,
               press ? fmt::format("{} (compression_ratio {})", press->name(), args.press.ratio.value_or(0.0)) : "none",
               args.pipeline.query_aware ? "; query-aware" : "", chat ? "; chat template " + chat->name() : "");
    for (size_t i = 0; i < answers.size(); ++i) {
      const llama::Answer& a = answers[i];
      fmt::print("[{}] Q: {}\n    A: {}\n    ({} tokens prefilled; cache after compression, per layer: {})\n", i,
                 args.questions[i], a.text, a.prefill_length, fmt::join(a.cache_lengths, ", "));
    }
  }
  if (!args.run.json.empty()) {
    nlohmann::json j;
    j["model"] = dir;
    j["press"] = press ? nlohmann::json(press->name()) : nlohmann::json(nullptr);
    j["compression_ratio"] = args.press.ratio ? nlohmann::json(*args.press.ratio) : nlohmann::json(nullptr);
    j["params"] = args.press.params;
    j["query_aware"] = args.pipeline.query_aware;
    j["chat_template"] = chat ? nlohmann::json(chat->name()) : nlohmann::json(nullptr);
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
    kvpress::io::write_text_atomically("ask: --json", args.run.json, j.dump(1) + "\n");
  }
  return 0;
}

}  // namespace kvpress_cli
