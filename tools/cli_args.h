// Command-line helpers shared by kvpress-cli's commands: the usage error (exit code 2), reading
// "--name VALUE" / "--name=VALUE", a press's --param KEY=VALUE list and --ratio.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvpress/registry.h"

namespace kvpress_cli {

// Bad command line: reported like a c10::Error, exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void usage_error(fmt::format_string<Args...> format, Args&&... args) {
  throw UsageError(fmt::format(format, std::forward<Args>(args)...));
}

// Reads "--name VALUE" or "--name=VALUE"; returns true and advances i if args[i] is `name`.
inline bool take_value(const std::vector<std::string>& args, size_t& i, std::string_view name,
                       std::string_view short_name, std::string& out) {
  const std::string& a = args[i];
  if (a == name || (!short_name.empty() && a == short_name)) {
    if (i + 1 >= args.size()) usage_error("option {} needs a value", a);
    out = args[++i];
    return true;
  }
  if (a.size() > name.size() && a.compare(0, name.size(), name) == 0 && a[name.size()] == '=') {
    out = a.substr(name.size() + 1);
    return true;
  }
  return false;
}

// An argument `command` does not take: an unknown option, or a stray word.
[[noreturn]] inline void reject_argument(std::string_view command, const std::string& arg) {
  if (!arg.empty() && arg[0] == '-') usage_error("{}: unknown option '{}' (see kvpress-cli --help)", command, arg);
  usage_error("{}: unexpected argument '{}' (see kvpress-cli --help)", command, arg);
}

// Adds one --param KEY=VALUE to `params`; a malformed or repeated key is a usage error.
inline void add_param(std::map<std::string, std::string>& params, const std::string& key_value) {
  const auto eq = key_value.find('=');
  if (eq == std::string::npos || eq == 0) usage_error("--param expects KEY=VALUE, got '{}'", key_value);
  const std::string key = key_value.substr(0, eq);
  if (!params.emplace(key, key_value.substr(eq + 1)).second) usage_error("--param {} given more than once", key);
}

// --ratio: a number in [0, 1).
inline double parse_ratio(const std::string& text) {
  const auto r = kvpress::parse_double(text);
  if (!r || !std::isfinite(*r) || *r < 0.0 || *r >= 1.0) {
    usage_error("--ratio must be a number in [0, 1), got '{}'", text);
  }
  return *r;
}

// --ratios (or `option`): comma-separated ratios in [0, 1), sorted, each once.
inline std::vector<double> parse_ratios(const std::string& text, std::string_view option = "--ratios") {
  std::optional<std::vector<double>> list = kvpress::parse_double_list(text);
  const bool ok = list && std::all_of(list->begin(), list->end(), [](double r) { return r >= 0.0 && r < 1.0; });
  TORCH_CHECK(ok, option, " must be a comma-separated list of numbers in [0, 1), got '", text, "'");
  std::vector<double> out = *list;
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// An integer option in [lo, hi].
inline int64_t parse_int_option(std::string_view option, const std::string& text, int64_t lo, int64_t hi) {
  const auto n = kvpress::parse_int(text);
  if (!n || *n < lo || *n > hi) usage_error("{} must be an integer in [{}, {}], got '{}'", option, lo, hi, text);
  return *n;
}

// --threads N: N intra-op threads. 0, every command's default, keeps torch's own (the machine's
// cores, or OMP_NUM_THREADS when set), as transformers and kvpress run.
inline void use_threads(int64_t threads) {
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));
}

// The options the model commands share (generate, ask): --model, --threads, --json, --chat, --quiet.
struct ModelRunArgs {
  std::string model = "tinystories-656k";
  int64_t threads = 0;  // 0: torch's default (use_threads)
  std::string json;     // where the results go as JSON; empty: nowhere
  bool chat = false;    // prompt through the model's chat template, as kvpress's pipeline does
  bool quiet = false;   // no text on stdout

  // Takes args[i] (and its value) when it is one of these options; advances i past them.
  bool take(const std::vector<std::string>& args, size_t& i) {
    std::string value;
    if (take_value(args, i, "--model", "", value)) {
      model = value;
    } else if (take_value(args, i, "--threads", "", value)) {
      threads = parse_int_option("--threads", value, 1, 1024);
    } else if (take_value(args, i, "--json", "", value)) {
      json = value;
    } else if (args[i] == "--chat") {
      chat = true;
    } else if (args[i] == "--quiet" || args[i] == "-q") {
      quiet = true;
    } else {
      return false;
    }
    return true;
  }
};

// A command's --press NAME, --ratio R and --param KEY=VALUE (generate, ask).
struct PressArgs {
  std::string name;  // empty: no press
  std::optional<double> ratio;
  std::map<std::string, std::string> params;

  // Takes args[i] (and its value) when it is one of the three options; advances i past them.
  bool take(const std::vector<std::string>& args, size_t& i) {
    std::string value;
    if (take_value(args, i, "--press", "", value)) {
      if (!name.empty()) usage_error("option --press given more than once");
      name = value;
    } else if (take_value(args, i, "--ratio", "", value)) {
      ratio = parse_ratio(value);
    } else if (take_value(args, i, "--param", "", value)) {
      add_param(params, value);
    } else {
      return false;
    }
    return true;
  }

  // The press (nullptr without --press). A press that drops tokens by a ratio needs --ratio; one
  // whose budget is its own (decoding, second-pass, per-layer) defaults to 0.
  std::unique_ptr<kvpress::BasePress> build(std::string_view command) const {
    if (name.empty()) {
      if (ratio || !params.empty())
        usage_error("{}: --ratio and --param apply to a --press, and none was given", command);
      return nullptr;
    }
    const kvpress::PressInfo* info = kvpress::find_press(name);
    const bool ratio_required =
        info != nullptr && (info->kind == kvpress::PressKind::kScorer || info->kind == kvpress::PressKind::kWrapper ||
                            info->kind == kvpress::PressKind::kQueryAware);
    if (ratio_required && !ratio) usage_error("{}: --press {} needs --ratio R, in [0, 1)", command, name);
    return kvpress::make_press(name, ratio.value_or(0.0), params);
  }
};

}  // namespace kvpress_cli
