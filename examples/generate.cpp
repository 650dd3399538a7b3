// Story continuation with and without KV-cache compression, on a real model.
//
//   kvpress_generate                                   # SnapKVPress at 0.5 on a held-out story
//   kvpress_generate --press KnormPress --ratio 0.75 --max-new-tokens 40
//   kvpress_generate --prompt "Once upon a time, a little dog" --press StreamingLLMPress --param n_sink=8
//
// The context is prefilled once per run; with a press, every layer's cache is compressed right
// after that layer's prefill attention (kvpress's protocol), then tokens are generated greedily at
// the original positions over the compressed cache.
#include <c10/util/Exception.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"

namespace {

struct Args {
  std::string model = "tinystories-656k";
  std::string text;  // stories file; default <models>/../data/tinystories_valid_100.txt
  std::string prompt;
  int story = 2;
  int prefix_tokens = 200;
  std::string press = "SnapKVPress";
  double ratio = 0.5;
  std::map<std::string, std::string> params;
  int max_new_tokens = 60;
};

void usage() {
  std::cout << "usage: kvpress_generate [--model NAME|DIR] [--press NAME] [--ratio R] [--param KEY=VALUE]...\n"
               "                        [--prompt TEXT | --text FILE --story N --prefix-tokens P]\n"
               "                        [--max-new-tokens N]\n"
               "presses:";
  for (const auto& p : kvpress::list_presses()) std::cout << " " << p.name;
  std::cout << "\n";
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "kvpress_generate: " << k << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    // Numbers through the library's parser (kvpress/registry.h), so "0.5x" is refused.
    auto number = [&](auto parsed) {
      if (!parsed) {
        std::cerr << "kvpress_generate: " << k << " wants a number, got " << argv[i] << "\n";
        std::exit(2);
      }
      return *parsed;
    };
    if (k == "--model")
      a.model = value();
    else if (k == "--text")
      a.text = value();
    else if (k == "--prompt")
      a.prompt = value();
    else if (k == "--story")
      a.story = static_cast<int>(number(kvpress::parse_int(value())));
    else if (k == "--prefix-tokens")
      a.prefix_tokens = static_cast<int>(number(kvpress::parse_int(value())));
    else if (k == "--press")
      a.press = value();
    else if (k == "--ratio")
      a.ratio = number(kvpress::parse_double(value()));
    else if (k == "--max-new-tokens")
      a.max_new_tokens = static_cast<int>(number(kvpress::parse_int(value())));
    else if (k == "--param") {
      const std::string kv = value();
      const size_t eq = kv.find('=');
      if (eq == std::string::npos) {
        std::cerr << "kvpress_generate: --param wants KEY=VALUE, got " << kv << "\n";
        std::exit(2);
      }
      a.params[kv.substr(0, eq)] = kv.substr(eq + 1);
    } else if (k == "-h" || k == "--help") {
      usage();
      std::exit(0);
    } else {
      std::cerr << "kvpress_generate: unknown argument " << k << "\n";
      usage();
      std::exit(2);
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  try {
    // The press first, so that a bad name or parameter fails before any work.
    const auto press = kvpress::make_press(args.press, args.ratio, args.params);

    // 1. Model and tokenizer from a Hugging Face checkpoint folder or a GGUF file.
    const kvpress::llama::Checkpoint checkpoint = kvpress::llama::load_checkpoint(args.model);
    const std::string& dir = checkpoint.path;
    const auto& model = checkpoint.model;
    const auto& tokenizer = checkpoint.tokenizer;
    const auto& c = model.config();
    std::cout << "model: " << dir << " (" << c.num_layers << " layers, " << c.num_heads << " query / " << c.num_kv_heads
              << " KV heads, head_dim " << c.head_dim << ")\n";

    // 2. The context: a prompt, or the first tokens of a held-out story.
    std::vector<int64_t> context;
    if (!args.prompt.empty()) {
      context = tokenizer.encode(args.prompt);
    } else {
      const std::string text = args.text.empty() ? kvpress::llama::default_stories_path() : args.text;
      const std::vector<std::string> stories = kvpress::llama::read_stories(text);
      TORCH_CHECK(args.story >= 0 && args.story < static_cast<int>(stories.size()), "--story must be in [0, ",
                  stories.size(), ")");
      context = tokenizer.encode(stories[args.story]);
      if (static_cast<int>(context.size()) > args.prefix_tokens) context.resize(args.prefix_tokens);
    }
    std::cout << "\ncontext (" << context.size() << " tokens):\n" << tokenizer.decode(context) << "\n";

    // 3. Greedy continuation with the full cache, then with the press.
    kvpress::llama::GenerationOptions options;
    options.max_new_tokens = args.max_new_tokens;
    const auto full = kvpress::llama::generate_greedy(model, context, {}, options);

    options.press = press.get();
    const auto compressed = kvpress::llama::generate_greedy(model, context, {}, options);

    std::cout << "\n--- full cache (" << full.cache_lengths[0] << " tokens per layer) ---\n"
              << tokenizer.decode(full.tokens) << "\n";
    std::cout << "\n--- " << press->name() << ", compression_ratio " << args.ratio << " ("
              << compressed.cache_lengths[0] << " tokens per layer) ---\n"
              << tokenizer.decode(compressed.tokens) << "\n";

    size_t same = 0;
    while (same < full.tokens.size() && same < compressed.tokens.size() && full.tokens[same] == compressed.tokens[same])
      ++same;
    std::cout << "\nthe compressed continuation follows the full-cache one for " << same << " of " << full.tokens.size()
              << " tokens\n";
  } catch (const c10::Error& e) {
    std::cerr << "kvpress_generate: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
