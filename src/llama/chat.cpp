// Chat templates recognised by their text and rendered as transformers renders them
// (kvpress/llama/chat.h).
#include "kvpress/llama/chat.h"

#include <c10/util/Exception.h>

namespace kvpress::llama {
namespace {

// A template this library knows: its exact Jinja text, and what rendering it takes.
struct KnownTemplate {
  const char* name;
  const char* jinja;
  const char* default_system;  // ChatML: the system message a conversation without one gets
};

// SmolLM2-135M-Instruct's tokenizer.chat_template (its Jinja string literals hold real newlines): ChatML,
// "<|im_start|>{role}\n{content}<|im_end|>\n" per message, a default system message when the first
// message is not one, "<|im_start|>assistant\n" as the generation prompt.
constexpr KnownTemplate kSmolLM2{
    "smollm2",
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"};

constexpr const KnownTemplate* kKnown[] = {&kSmolLM2};

}  // namespace

std::vector<std::string> ChatTemplate::known() {
  std::vector<std::string> out;
  for (const KnownTemplate* t : kKnown) out.push_back(t->name);
  return out;
}

ChatTemplate ChatTemplate::recognize(const std::string& jinja, const std::string& origin) {
  TORCH_CHECK(!jinja.empty(), "ChatTemplate::recognize: ", origin, " has no chat template");
  for (const KnownTemplate* t : kKnown)
    if (jinja == t->jinja) return ChatTemplate(t->name, t->default_system);
  std::string names;
  for (const std::string& n : known()) names += (names.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, "ChatTemplate::recognize: ", origin, ": its chat template is not one this library renders (",
              names, "); rendering another would be a guess. Its first characters: ", jinja.substr(0, 80));
}

std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  std::string out;
  if (!messages.empty() && messages.front().role != "system" && !default_system_.empty())
    out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
  for (const ChatMessage& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace kvpress::llama
