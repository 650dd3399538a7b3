// kvpress-cli generate: tokenize the prompts, run them through the Llama runner with a press, print
// each continuation and, in paged mode, what the page pool held (docs/CLI.md). With --tp N, the
// paged mode over N tensor-parallel ranks: this process is rank 0 and starts ranks 1 .. N-1 as
// copies of itself (--tp-rank, --tp-store), a Gloo group on this machine.
#include "generate.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_args.h"
#include "kvpress/io/atomic_file.h"
#include "kvpress/llama/llama.h"
#include "kvpress/llama/tensor_parallel.h"
#include "kvpress/registry.h"

extern char** environ;

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
  kvpress::KVFormat kv_format = kvpress::KVFormat::kFull;  // --kv-dtype
  int64_t pages_per_layer = 0;                             // 0: generate_paged sizes the pool for max_batch
  int64_t max_batch = 8;
  bool stop_at_eos = true;
  int64_t tp = 1;  // tensor-parallel ranks (paged mode)
  kvpress::distributed::BudgetMode budgets = kvpress::distributed::BudgetMode::kGlobal;
  // Set by rank 0 for the ranks it starts: the rank and the group's file store.
  int64_t tp_rank = 0;
  std::string tp_store;
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
    } else if (take_value(args, i, "--kv-dtype", "", value)) {
      try {
        out.kv_format = kvpress::parse_kv_format(value, "--kv-dtype");
      } catch (const c10::Error& e) {
        usage_error("{}", e.msg());
      }
    } else if (take_value(args, i, "--pages-per-layer", "", value)) {
      out.pages_per_layer = parse_int_option("--pages-per-layer", value, 1, kMax);
    } else if (take_value(args, i, "--max-batch", "", value)) {
      out.max_batch = parse_int_option("--max-batch", value, 1, 1 << 16);
    } else if (take_value(args, i, "--tp", "", value)) {
      out.tp = parse_int_option("--tp", value, 1, 64);
    } else if (take_value(args, i, "--budgets", "", value)) {
      if (value != "global" && value != "per_rank")
        usage_error("--budgets must be global or per_rank, got '{}'", value);
      out.budgets =
          value == "global" ? kvpress::distributed::BudgetMode::kGlobal : kvpress::distributed::BudgetMode::kPerRank;
    } else if (take_value(args, i, "--tp-rank", "", value)) {
      out.tp_rank = parse_int_option("--tp-rank", value, 1, 63);
    } else if (take_value(args, i, "--tp-store", "", value)) {
      out.tp_store = value;
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
  if (out.tp > 1) out.paged = true;  // tensor parallelism runs the paged mode
  if (out.tp == 1 && (out.budgets != kvpress::distributed::BudgetMode::kGlobal || out.tp_rank > 0)) {
    usage_error("generate: --budgets needs --tp N with N > 1");
  }
  if (!out.paged && (out.pages_per_layer > 0 || out.max_batch != 8 || out.kv_format != kvpress::KVFormat::kFull ||
                     out.page_size != kvpress::PagedCacheOptions::kDefaultPageSize)) {
    usage_error("generate: --page-size, --kv-dtype, --pages-per-layer and --max-batch need --paged");
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
          {"kv_format", kvpress::kv_format_name(s.kv_format)},
          {"bytes_per_page", s.bytes_per_page},
          {"residual_bytes", s.residual_bytes},
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
  fmt::print("paged cache: {} layers x {} pages of {} tokens ({} bytes each, keys and values, {}): {}\n", s.num_layers,
             s.pages_per_layer, s.page_size, s.bytes_per_page, kvpress::kv_format_name(s.kv_format),
             mib(pool * s.bytes_per_page));
  if (s.residual_bytes > 0)
    fmt::print("residual rows (each head's page that is not full yet, unquantized): {}\n", mib(s.residual_bytes));
  if (s.kv_format != kvpress::KVFormat::kFull) {
    // A quantized cache pages only full pages (the rest are residual rows), so its page count is not
    // comparable with the uncompressed one: no percentage.
    fmt::print("  prompts stored in {} full {} pages ({}) plus each head's residual rows; {} pages uncompressed\n",
               s.prompt_pages_stored, kvpress::kv_format_name(s.kv_format),
               mib(s.prompt_pages_stored * s.bytes_per_page), s.prompt_pages_uncompressed);
  } else {
    const double saved = s.prompt_pages_uncompressed > 0
                             ? 100.0 * (1.0 - static_cast<double>(s.prompt_pages_stored) /
                                                  static_cast<double>(s.prompt_pages_uncompressed))
                             : 0.0;
    fmt::print("  prompts stored in {} pages ({}), {} uncompressed ({}): {:.1f}% saved\n", s.prompt_pages_stored,
               mib(s.prompt_pages_stored * s.bytes_per_page), s.prompt_pages_uncompressed,
               mib(s.prompt_pages_uncompressed * s.bytes_per_page), saved);
  }
  fmt::print("  peak pages in use: {} of {} ({:.1f}%)\n", s.peak_pages_used, pool,
             pool > 0 ? 100.0 * static_cast<double>(s.peak_pages_used) / static_cast<double>(pool) : 0.0);
  fmt::print("  {} prompts, at most {} running at once; {} prefill batches, {} decode steps\n", prompts, s.max_running,
             s.prefill_batches, s.decode_steps);
}

// Ranks 1 .. tp - 1 of a --tp run: copies of this command (quiet, without --json) with --tp-rank
// and --tp-store, started by rank 0 in a fresh folder that holds the group's file store and each
// rank's stderr (rank 0 reports: its own error, or the first line of a failed rank's).
class TensorParallelRanks {
 public:
  TensorParallelRanks(const std::vector<std::string>& argv, int64_t tp) {
    char folder[] = "/tmp/kvpress_tp_XXXXXX";
    TORCH_CHECK(::mkdtemp(folder) != nullptr, "generate --tp: cannot make a temporary folder in /tmp");
    folder_ = folder;
    char self[4096] = {0};
    TORCH_CHECK(::readlink("/proc/self/exe", self, sizeof self - 1) > 0, "generate --tp: cannot find kvpress-cli");
    for (int64_t rank = 1; rank < tp; ++rank) {
      std::vector<std::string> args{self, "generate"};
      for (size_t i = 0; i < argv.size(); ++i) {
        if (argv[i] == "--json") {
          ++i;  // and its value: rank 0 writes the results
        } else if (argv[i].rfind("--json=", 0) != 0) {
          args.push_back(argv[i]);
        }
      }
      for (const std::string& a :
           {std::string("--quiet"), std::string("--tp-rank"), std::to_string(rank), std::string("--tp-store"), store()})
        args.push_back(a);
      std::vector<char*> c_args;
      for (std::string& a : args) c_args.push_back(a.data());
      c_args.push_back(nullptr);
      posix_spawn_file_actions_t stderr_to_log;
      posix_spawn_file_actions_init(&stderr_to_log);
      posix_spawn_file_actions_addopen(&stderr_to_log, 2, log(rank).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      pid_t pid = 0;
      const int started = posix_spawn(&pid, self, &stderr_to_log, nullptr, c_args.data(), environ);
      posix_spawn_file_actions_destroy(&stderr_to_log);
      TORCH_CHECK(started == 0, "generate --tp: cannot start rank ", rank);
      pids_.push_back(pid);
      ranks_ = pids_.size();
    }
  }
  ~TensorParallelRanks() {
    for (pid_t pid : pids_) {  // rank 0 failed before wait(): the others would only time out
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    std::remove(store().c_str());
    for (size_t rank = 1; rank <= ranks_; ++rank) std::remove(log(static_cast<int64_t>(rank)).c_str());
    ::rmdir(folder_.c_str());
  }
  TensorParallelRanks(const TensorParallelRanks&) = delete;
  TensorParallelRanks& operator=(const TensorParallelRanks&) = delete;

  std::string store() const { return folder_ + "/store"; }
  // Waits for every rank; raises with the first failed rank's error.
  void wait() {
    std::vector<pid_t> pids;
    std::swap(pids, pids_);
    for (size_t i = 0; i < pids.size(); ++i) {
      int status = 0;
      ::waitpid(pids[i], &status, 0);
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      std::ifstream in(log(static_cast<int64_t>(i + 1)));
      std::string line;
      std::getline(in, line);
      TORCH_CHECK(false, "generate --tp: rank ", i + 1, " failed: ", line.empty() ? "(no message)" : line);
    }
  }

 private:
  std::string log(int64_t rank) const { return folder_ + "/rank" + std::to_string(rank) + ".log"; }

  std::string folder_;
  size_t ranks_ = 0;  // started
  std::vector<pid_t> pids_;
};

}  // namespace

namespace {

// The results as --json writes them.
nlohmann::json results_json(const GenerateArgs& args, const std::string& dir, const kvpress::BasePress* press,
                            const llama::Tokenizer& tokenizer, const std::vector<std::vector<int64_t>>& prompts,
                            const std::vector<llama::Generation>& generations,
                            const std::optional<llama::PagedGenerationStats>& stats) {
  nlohmann::json j;
  j["model"] = dir;
  j["press"] = press ? nlohmann::json(press->name()) : nlohmann::json(nullptr);
  j["compression_ratio"] = args.press.ratio ? nlohmann::json(*args.press.ratio) : nlohmann::json(nullptr);
  j["params"] = args.press.params;
  j["mode"] = args.paged ? "paged" : "dense";
  j["tensor_parallel"] = args.tp > 1 ? nlohmann::json{{"ranks", args.tp},
                                                      {"budgets", kvpress::distributed::budget_mode_name(args.budgets)}}
                                     : nlohmann::json(nullptr);
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
  j["pool"] = stats ? stats_json(*stats) : nlohmann::json(nullptr);  // rank 0's with --tp: its heads
  return j;
}

std::vector<std::vector<int64_t>> encode_prompts(const GenerateArgs& args, const llama::Checkpoint& checkpoint) {
  std::vector<std::vector<int64_t>> prompts;
  if (args.run.chat) {
    // As apply_chat_template(..., add_generation_prompt=True): the template's text, no BOS added.
    const llama::ChatTemplate chat = llama::chat_template_of(checkpoint);
    for (const std::string& text : args.prompts)
      prompts.push_back(
          checkpoint.tokenizer.encode(chat.apply({{"user", text}}, /*add_generation_prompt=*/true), false));
  } else {
    for (const std::string& text : args.prompts) prompts.push_back(checkpoint.tokenizer.encode(text));
  }
  return prompts;
}

}  // namespace

int run_generate(const std::vector<std::string>& argv) {
  GenerateArgs args = parse_generate_args(argv);
  // A bad press fails before the model loads.
  const std::unique_ptr<kvpress::BasePress> press = args.press.build("generate");
  if (!args.prompts_file.empty()) {
    for (std::string& p : read_prompt_lines(args.prompts_file)) args.prompts.push_back(std::move(p));
  }
  // --tp N: rank 0 starts the others; every rank shares the cores.
  std::optional<TensorParallelRanks> ranks;
  if (args.tp > 1 && args.tp_rank == 0) ranks.emplace(argv, args.tp);
  use_threads(args.run.threads > 0 || args.tp == 1
                  ? args.run.threads
                  : std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()) / args.tp));
  const llama::Checkpoint checkpoint = llama::load_checkpoint(args.run.model);
  const std::string& dir = checkpoint.path;
  std::optional<llama::LlamaModel> shard;
  if (args.tp > 1) {
    auto group =
        kvpress::distributed::gloo_group(ranks ? ranks->store() : args.tp_store, static_cast<int>(args.tp_rank),
                                         static_cast<int>(args.tp), std::chrono::seconds(120));
    shard = llama::tensor_parallel_shard(checkpoint.model, group, args.budgets);
  }
  const llama::LlamaModel& model = shard ? *shard : checkpoint.model;
  const llama::Tokenizer& tokenizer = checkpoint.tokenizer;
  const std::vector<std::vector<int64_t>> prompts = encode_prompts(args, checkpoint);

  std::vector<llama::Generation> generations;
  std::optional<llama::PagedGenerationStats> stats;
  if (args.paged) {
    llama::PagedGenerationOptions opt;
    opt.press = press.get();
    opt.max_new_tokens = args.max_new_tokens;
    opt.stop_at_eos = args.stop_at_eos;
    opt.page_size = args.page_size;
    opt.kv_format = args.kv_format;
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
  if (ranks) ranks->wait();
  if (args.tp_rank > 0) return 0;  // rank 0 reports

  if (!args.run.quiet) {
    const std::string over = args.tp > 1 ? fmt::format(" over {} tensor-parallel ranks ({} budgets)", args.tp,
                                                       kvpress::distributed::budget_mode_name(args.budgets))
                                         : "";
    fmt::print("model: {}; press: {}; {} mode{}\n", dir,
               press ? fmt::format("{} (compression_ratio {})", press->name(), args.press.ratio.value_or(0.0)) : "none",
               args.paged ? "paged" : "dense", over);
    for (size_t i = 0; i < prompts.size(); ++i) {
      fmt::print("[{}] {} ({} tokens)\n    -> {}\n", i, args.prompts[i], prompts[i].size(),
                 tokenizer.decode(generations[i].tokens));
    }
    if (stats) {
      if (args.tp > 1)
        fmt::print("rank 0's cache (its {} of {} KV heads):\n", model.config().num_kv_heads,
                   checkpoint.model.config().num_kv_heads);
      print_pool(*stats, prompts.size());
    }
  }
  if (!args.run.json.empty()) {
    const nlohmann::json j = results_json(args, dir, press.get(), tokenizer, prompts, generations, stats);
    kvpress::io::write_text_atomically("generate: --json", args.run.json, j.dump(1) + "\n");
  }
  return 0;
}

}  // namespace kvpress_cli
