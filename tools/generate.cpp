// kvpress-cli generate: tokenize the prompts, run them through the Llama runner with a press, print
// each continuation and, in paged mode, what the page pool held (docs/CLI.md).
#include "generate.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_args.h"
#include "kvpress/io/atomic_file.h"
#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"

namespace kvpress_cli {
namespace {

namespace llama = kvpress::llama;

struct GenerateArgs {
  ModelRunArgs run;                  // --model, --threads, --json, --chat, --quiet
  std::vector<std::string> prompts;  // --prompt texts, then the --prompts file's lines
  std::string prompts_file;
  PressArgs press;
  int64_t max_new_tokens = 32;
  bool paged = false;
  int64_t page_size = kvpress::PagedCacheOptions::kDefaultPageSize;
  int64_t pages_per_layer = 0;  // 0: generate_paged sizes the pool for max_batch
  int64_t max_batch = 8;
  bool stop_at_eos = true;
};

GenerateArgs parse_generate_args(const std::vector<std::string>& args) {
  GenerateArgs out;
  constexpr int64_t kMax = int64_t{1} << 40;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string value;
    const std::string& a = args[i];
    if (out.run.take(args, i)) {
    } else if (take_value(args, i, "--prompt", "", value)) {
      out.prompts.push_back(value);
    } else if (take_value(args, i, "--prompts", "", value)) {
      if (!out.prompts_file.empty()) usage_error("option --prompts given more than once");
      out.prompts_file = value;
    } else if (out.press.take(args, i)) {
    } else if (take_value(args, i, "--max-new-tokens", "", value)) {
      out.max_new_tokens = parse_int_option("--max-new-tokens", value, 1, 1 << 20);
    } else if (take_value(args, i, "--page-size", "", value)) {
      out.page_size = parse_int_option("--page-size", value, 1, 1 << 16);
    } else if (take_value(args, i, "--pages-per-layer", "", value)) {
      out.pages_per_layer = parse_int_option("--pages-per-layer", value, 1, kMax);
    } else if (take_value(args, i, "--max-batch", "", value)) {
      out.max_batch = parse_int_option("--max-batch", value, 1, 1 << 16);
    } else if (a == "--paged") {
      out.paged = true;
    } else if (a == "--no-stop-at-eos") {
      out.stop_at_eos = false;
    } else {
      kvpress_cli::reject_argument("generate", a);
    }
  }
  if (out.prompts.empty() && out.prompts_file.empty()) {
    usage_error("generate needs --prompts FILE (one prompt per line) or --prompt TEXT");
  }
  if (!out.paged && (out.pages_per_layer > 0 || out.max_batch != 8 ||
                     out.page_size != kvpress::PagedCacheOptions::kDefaultPageSize)) {
    usage_error("generate: --page-size, --pages-per-layer and --max-batch need --paged");
  }
  return out;
}

// The file's non-blank lines, in order.
std::vector<std::string> read_prompt_lines(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "generate: --prompts ", path, ": cannot open the file");
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") != std::string::npos) out.push_back(line);
  }
  TORCH_CHECK(!in.bad(), "generate: --prompts ", path, ": read error");
  TORCH_CHECK(!out.empty(), "generate: --prompts ", path, ": no prompt (the file has no non-blank line)");
  return out;
}

nlohmann::json stats_json(const llama::PagedGenerationStats& s) {
  return {{"num_layers", s.num_layers},
          {"pages_per_layer", s.pages_per_layer},
          {"page_size", s.page_size},
          {"bytes_per_page", s.bytes_per_page},
          {"prompt_pages_uncompressed", s.prompt_pages_uncompressed},
          {"prompt_pages_stored", s.prompt_pages_stored},
          {"peak_pages_used", s.peak_pages_used},
          {"max_running", s.max_running},
          {"prefill_batches", s.prefill_batches},
          {"decode_steps", s.decode_steps}};
}

std::string mib(int64_t bytes) { return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / (1 << 20)); }

void print_pool(const llama::PagedGenerationStats& s, size_t prompts) {
  const int64_t pool = s.num_layers * s.pages_per_layer;
  fmt::print("paged cache: {} layers x {} pages of {} tokens ({} bytes each, keys and values): {}\n", s.num_layers,
             s.pages_per_layer, s.page_size, s.bytes_per_page, mib(pool * s.bytes_per_page));
  const double saved = s.prompt_pages_uncompressed > 0
                           ? 100.0 * (1.0 - static_cast<double>(s.prompt_pages_stored) /
                                                static_cast<double>(s.prompt_pages_uncompressed))
                           : 0.0;
  fmt::print("  prompts stored in {} pages ({}), {} uncompressed ({}): {:.1f}% saved\n", s.prompt_pages_stored,
             mib(s.prompt_pages_stored * s.bytes_per_page), s.prompt_pages_uncompressed,
             mib(s.prompt_pages_uncompressed * s.bytes_per_page), saved);
  fmt::print("  peak pages in use: {} of {} ({:.1f}%)\n", s.peak_pages_used, pool,
             pool > 0 ? 100.0 * static_cast<double>(s.peak_pages_used) / static_cast<double>(pool) : 0.0);
  fmt::print("  {} prompts, at most {} running at once; {} prefill batches, {} decode steps\n", prompts, s.max_running,
             s.prefill_batches, s.decode_steps);
}

}  // namespace

int run_generate(const std::vector<std::string>& argv) {
  GenerateArgs args = parse_generate_args(argv);
  // A bad press fails before the model loads.
  const std::unique_ptr<kvpress::BasePress> press = args.press.build("generate");
  if (!args.prompts_file.empty()) {
    for (std::string& p : read_prompt_lines(args.prompts_file)) args.prompts.push_back(std::move(p));
  }
  use_threads(args.run.threads);
  const llama::Checkpoint checkpoint = llama::load_checkpoint(args.run.model);
  const std::string& dir = checkpoint.path;
  const llama::LlamaModel& model = checkpoint.model;
  const llama::Tokenizer& tokenizer = checkpoint.tokenizer;
  std::vector<std::vector<int64_t>> prompts;
  if (args.run.chat) {
    // As apply_chat_template(..., add_generation_prompt=True): the template's text, no BOS added.
    const llama::ChatTemplate chat = llama::chat_template_of(checkpoint);
    for (const std::string& text : args.prompts)
      prompts.push_back(tokenizer.encode(chat.apply({{"user", text}}, /*add_generation_prompt=*/true), false));
  } else {
    for (const std::string& text : args.prompts) prompts.push_back(tokenizer.encode(text));
  }

  std::vector<llama::Generation> generations;
  std::optional<llama::PagedGenerationStats> stats;
  if (args.paged) {
    llama::PagedGenerationOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = args.max_new_tokens;
    opt.stop_at_eos = args.stop_at_eos;
    opt.page_size = args.page_size;
    opt.pages_per_layer = args.pages_per_layer;
    opt.max_batch = args.max_batch;
    llama::PagedGenerations run = llama::generate_paged(model, prompts, opt);
    generations = std::move(run.generations);
    stats = run.stats;
  } else {
    llama::GenerationOptions opt;
    opt.press = press.get();
    opt.tokenizer = &tokenizer;
    opt.max_new_tokens = args.max_new_tokens;
    opt.stop_at_eos = args.stop_at_eos;
    for (const auto& p : prompts) generations.push_back(llama::generate_greedy(model, p, {}, opt));
  }

  if (!args.run.quiet) {
    fmt::print("model: {}; press: {}; {} mode\n", dir,
               press ? fmt::format("{} (compression_ratio {})", press->name(), args.press.ratio.value_or(0.0)) : "none",
               args.paged ? "paged" : "dense");
    for (size_t i = 0; i < prompts.size(); ++i) {
      fmt::print("[{}] {} ({} tokens)\n    -> {}\n", i, args.prompts[i], prompts[i].size(),
                 tokenizer.decode(generations[i].tokens));
    }
    if (stats) print_pool(*stats, prompts.size());
  }
  if (!args.run.json.empty()) {
    nlohmann::json j;
    j["model"] = dir;
    j["press"] = press ? nlohmann::json(press->name()) : nlohmann::json(nullptr);
    j["compression_ratio"] = args.press.ratio ? nlohmann::json(*args.press.ratio) : nlohmann::json(nullptr);
    j["params"] = args.press.params;
    j["mode"] = args.paged ? "paged" : "dense";
    nlohmann::json items = nlohmann::json::array();
    for (size_t i = 0; i < prompts.size(); ++i) {
      items.push_back({{"prompt", args.prompts[i]},
                       {"prompt_tokens", prompts[i]},
                       {"tokens", generations[i].tokens},
                       {"text", tokenizer.decode(generations[i].tokens)},
                       {"cache_lengths", generations[i].cache_lengths},
                       {"final_cache_lengths", generations[i].final_cache_lengths}});
    }
    j["generations"] = items;
    j["pool"] = stats ? stats_json(*stats) : nlohmann::json(nullptr);
    kvpress::io::write_text_atomically("generate: --json", args.run.json, j.dump(1) + "\n");
  }
  return 0;
}

}  // namespace kvpress_cli
