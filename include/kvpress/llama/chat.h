// Chat templates. A checkpoint's Jinja chat template is recognised, by its exact text, as one of the
// templates this library renders exactly as transformers' apply_chat_template does; any other
// template is refused with an error naming the known ones (never rendered by a guess).
//
//   const auto chat = kvpress::llama::ChatTemplate::recognize(checkpoint.chat_template, checkpoint.path,
//                                                             bos_token);  // Llama 3's templates use it
//   std::string text = chat.apply({{"user", "Hello"}}, /*add_generation_prompt=*/true);
//   auto ids = checkpoint.tokenizer.encode(text, /*add_special_tokens=*/false);
//
// Known templates (family: the published versions recognised; tests/data/chat_templates holds each
// text, tests/test_chat.cpp renders them against transformers):
//   smollm2   SmolLM2-Instruct's ChatML, a default system message when the conversation has none
//   qwen2.5   Qwen2.5-Instruct's ChatML, default system "You are Qwen, created by Alibaba Cloud. ..."
//   qwen3     Qwen3's ChatML with thinking (three published versions): no default system message; the
//             last assistant turn after the last user message keeps its <think> block, earlier ones
//             lose it; ChatOptions::enable_thinking = false adds an empty think block to the prompt
//   llama3    Llama 3's header format (two versions: one always adds the generation prompt)
//   llama3.1  Llama 3.1's: a system header with the knowledge cutoff and ChatOptions::date_string
//             (default "26 Jul 2024"); two versions
//   llama3.2  Llama 3.2's: the same, with today's date ("%d %b %Y", local time) by default
// Only conversations of system, user and assistant messages with text content are rendered; tools
// and tool calls (which the Qwen and Llama 3.1+ templates also define) are not supported.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kvpress::llama {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

// The variables transformers' apply_chat_template passes to a template on request.
struct ChatOptions {
  // Qwen3: false renders an empty think block after the generation prompt (no reasoning).
  bool enable_thinking = true;
  // Llama 3.1/3.2: the "Today Date" of the system header; unset: the template's default.
  std::optional<std::string> date_string;
};

class ChatTemplate {
 public:
  // The known template whose text is `jinja`. `bos_token`: the tokenizer's BOS token text, which the
  // Llama 3 templates write first (transformers passes the tokenizer's bos_token); required by them.
  // Raises c10::Error "ChatTemplate::recognize: <origin>: ..." for an empty or unknown template.
  static ChatTemplate recognize(const std::string& jinja, const std::string& origin, const std::string& bos_token = "");
  // The names of the known template families.
  static std::vector<std::string> known();

  const std::string& name() const { return name_; }  // the family, e.g. "qwen3"
  // The conversation as apply_chat_template(messages, tokenize=False, add_generation_prompt=...,
  // **options) renders it; encode the text without adding special tokens. Raises c10::Error for an
  // empty conversation or a role other than system, user and assistant.
  std::string apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                    const ChatOptions& options = {}) const;
  // The conversation of one user message, `message` + `separator`, rendered with the generation
  // prompt and cut around the separator: {the text before it, the text after it} (kvpress's probes
  // of a template: the pipeline's framing of a context, KVzip's replay frame). Raises c10::Error
  // "<op>: the chat template <name> must render the user message once" unless the separator appears
  // exactly once.
  std::pair<std::string, std::string> split_user_turn(const std::string& message, const std::string& separator,
                                                      const ChatOptions& options, const char* op) const;

 private:
  friend struct ChatTemplateTable;  // src/llama/chat.cpp: the known texts
  enum class Family { kChatML, kQwen3, kLlama3, kLlama31 };
  // How a recognised text renders; one per published version (src/llama/chat.cpp).
  struct Variant {
    const char* name;
    Family family;
    const char* default_system;     // ChatML: the system message a conversation without one gets ("": none)
    bool think_in_history;          // Qwen3: earlier assistant turns with reasoning keep it
    bool always_generation_prompt;  // Llama 3: the first release adds the prompt regardless
    bool today_by_default;          // Llama 3.2: date_string defaults to today
  };
  ChatTemplate(const Variant& variant, std::string bos_token)
      : variant_(&variant), name_(variant.name), bos_token_(std::move(bos_token)) {}
  const Variant* variant_;
  std::string name_;
  std::string bos_token_;
};

}  // namespace kvpress::llama
