// Chat templates. A checkpoint's Jinja chat template is recognised, by its exact text, as one of the
// templates this library renders exactly as transformers' apply_chat_template does; any other
// template is refused with an error naming the known ones (never rendered by a guess).
//
//   const auto chat = kvpress::llama::ChatTemplate::recognize(checkpoint.chat_template, checkpoint.path);
//   std::string text = chat.apply({{"user", "Hello"}}, /*add_generation_prompt=*/true);
//   auto ids = checkpoint.tokenizer.encode(text, /*add_special_tokens=*/false);
//
// Known templates: "smollm2" (SmolLM2-135M-Instruct's: ChatML with a default system prompt when the
// conversation has none). Qwen2.5, Qwen3 and Llama 3.x templates are to come (issue 32).
#pragma once

#include <string>
#include <vector>

namespace kvpress::llama {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  // The known template whose text is `jinja`. Raises c10::Error "ChatTemplate::recognize: <origin>:
  // ..." for an empty or unknown template.
  static ChatTemplate recognize(const std::string& jinja, const std::string& origin);
  // The names of the known templates.
  static std::vector<std::string> known();

  const std::string& name() const { return name_; }
  // The conversation as apply_chat_template(messages, tokenize=False, add_generation_prompt=...)
  // renders it; encode the text without adding special tokens.
  std::string apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;

 private:
  ChatTemplate(std::string name, std::string default_system)
      : name_(std::move(name)), default_system_(std::move(default_system)) {}
  std::string name_;
  std::string default_system_;  // ChatML's system message when the conversation starts without one
};

}  // namespace kvpress::llama
