// Chat templates recognised by their text and rendered as transformers renders them
// (kvpress/llama/chat.h). Each family's rendering below follows its Jinja templates for
// conversations of system, user and assistant text messages; tests/test_chat.cpp compares it with
// transformers on every recognised text (tests/data/chat_templates).
#include "kvpress/llama/chat.h"

#include <c10/util/Exception.h>
#include <utf8proc.h>

#include <cstdint>
#include <ctime>

#include "utf8.h"

namespace kvpress::llama {
namespace {

constexpr const char* kOp = "ChatTemplate::recognize";

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Python's str.isspace() for one code point (CPython's rule: bidirectional class WS, B or S, or
// category Zs), which Jinja's trim filter and str.strip() use.
bool python_space(uint32_t cp) {
  const utf8proc_property_t* p = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
  return p->category == UTF8PROC_CATEGORY_ZS || p->bidi_class == UTF8PROC_BIDI_CLASS_WS ||
         p->bidi_class == UTF8PROC_BIDI_CLASS_B || p->bidi_class == UTF8PROC_BIDI_CLASS_S;
}

// Jinja's `trim` (Python's str.strip()): leading and trailing Unicode whitespace removed. Bytes that
// are not valid UTF-8 count as text.
std::string trim(const std::string& s) {
  size_t begin = 0, end = 0;  // [begin, end): from the first to the last non-space character
  bool seen = false;
  for (size_t i = 0; i < s.size();) {
    size_t invalid = 0;
    const size_t n = utf8_sequence_length(s, i, invalid);
    const size_t len = n > 0 ? n : invalid;
    if (n == 0 || !python_space(utf8_code_point(s, i, n))) {
      if (!seen) begin = i;
      seen = true;
      end = i + len;
    }
    i += len;
  }
  return seen ? s.substr(begin, end - begin) : std::string();
}

// Python's str.strip / lstrip / rstrip of one character.
std::string lstrip(const std::string& s, char c) {
  const size_t b = s.find_first_not_of(c);
  return b == std::string::npos ? std::string() : s.substr(b);
}
std::string rstrip(const std::string& s, char c) {
  const size_t e = s.find_last_not_of(c);
  return e == std::string::npos ? std::string() : s.substr(0, e + 1);
}
std::string strip(const std::string& s, char c) { return lstrip(rstrip(s, c), c); }
bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// transformers' strftime_now("%d %b %Y"): datetime.now() (local time) in the C locale.
std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%d %b %Y", &local);
  return buffer;
}

}  // namespace

// The known texts, by byte length and 64-bit FNV-1a digest (the texts themselves are test data:
// tests/data/chat_templates/<file>). Versions of one family that differ only in what this library
// does not render (tools, non-text content) share a variant; those that differ in what it renders
// have their own.
struct ChatTemplateTable {
  using Family = ChatTemplate::Family;
  using Variant = ChatTemplate::Variant;
  struct Known {
    const char* file;  // under tests/data/chat_templates
    size_t length;
    uint64_t fnv1a;
    const Variant& variant;
  };
  static constexpr Variant kSmolLM2{
      "smollm2", Family::kChatML, "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
      false,     false,           false};
  static constexpr Variant kQwen25{
      "qwen2.5", Family::kChatML, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
      false,     false,           false};
  static constexpr Variant kQwen3{"qwen3", Family::kQwen3, "", false, false, false};
  static constexpr Variant kQwen3ThinkHistory{"qwen3", Family::kQwen3, "", true, false, false};
  static constexpr Variant kLlama3{"llama3", Family::kLlama3, "", false, false, false};
  static constexpr Variant kLlama3AlwaysPrompt{"llama3", Family::kLlama3, "", false, true, false};
  static constexpr Variant kLlama31{"llama3.1", Family::kLlama31, "", false, false, false};
  static constexpr Variant kLlama32{"llama3.2", Family::kLlama31, "", false, false, true};
  static const std::vector<Known>& all() {
    static const std::vector<Known> known = {
        {"smollm2.jinja", 368, 0x45ec583d4d25bc3aull, kSmolLM2},
        {"qwen2_5.jinja", 2507, 0xc2b27ee60f1b8775ull, kQwen25},
        {"qwen3.jinja", 4116, 0x2bfdb7aa9754484eull, kQwen3},
        {"qwen3_string_content.jinja", 4168, 0x959a4551391a6549ull, kQwen3},
        {"qwen3_think_history.jinja", 4137, 0xe01a1262938cdcddull, kQwen3ThinkHistory},
        {"llama3.jinja", 389, 0x0e60067a5537498eull, kLlama3},
        {"llama3_always_prompt.jinja", 348, 0x74891e390e614ae2ull, kLlama3AlwaysPrompt},
        {"llama3_1.jinja", 4614, 0x60848a05837ce656ull, kLlama31},
        {"llama3_1_initial.jinja", 4542, 0x104a4b13144daee3ull, kLlama31},
        {"llama3_2.jinja", 3827, 0x0ac29b9538e2befaull, kLlama32},
    };
    return known;
  }
};

std::vector<std::string> ChatTemplate::known() {
  std::vector<std::string> out;
  for (const ChatTemplateTable::Known& k : ChatTemplateTable::all())
    if (out.empty() || out.back() != k.variant.name) out.push_back(k.variant.name);
  return out;
}

ChatTemplate ChatTemplate::recognize(const std::string& jinja, const std::string& origin,
                                     const std::string& bos_token) {
  TORCH_CHECK(!jinja.empty(), kOp, ": ", origin, " has no chat template");
  const uint64_t digest = fnv1a(jinja);
  for (const ChatTemplateTable::Known& k : ChatTemplateTable::all()) {
    if (jinja.size() != k.length || digest != k.fnv1a) continue;
    const Family family = k.variant.family;
    TORCH_CHECK((family != Family::kLlama3 && family != Family::kLlama31) || !bos_token.empty(), kOp, ": ", origin,
                ": the ", k.variant.name, " chat template writes the BOS token first; pass bos_token (got \"\")");
    return ChatTemplate(k.variant, bos_token);
  }
  std::string names;
  for (const std::string& n : known()) names += (names.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, kOp, ": ", origin, ": its chat template is not one this library renders (", names,
              "); rendering another would be a guess. Its first characters: ", jinja.substr(0, 80));
}

std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                const ChatOptions& options) const {
  TORCH_CHECK(!messages.empty(), "ChatTemplate::apply: messages must hold at least one message, got none");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    TORCH_CHECK(role == "system" || role == "user" || role == "assistant", "ChatTemplate::apply: messages[", i,
                "].role must be system, user or assistant, got \"", role, "\"");
  }
  const bool first_is_system = messages.front().role == "system";
  std::string out;
  const Variant& v = *variant_;
  switch (v.family) {
    case Family::kChatML:
      if (!first_is_system && *v.default_system)
        out += "<|im_start|>system\n" + std::string(v.default_system) + "<|im_end|>\n";
      for (const ChatMessage& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      return out;

    case Family::kQwen3: {
      // The last user message that is not a tool response: assistant turns after it keep their thinking.
      int64_t last_query = static_cast<int64_t>(messages.size()) - 1;
      for (int64_t i = last_query; i >= 0; --i) {
        const ChatMessage& m = messages[static_cast<size_t>(i)];
        if (m.role == "user" &&
            !(starts_with(m.content, "<tool_response>") && ends_with(m.content, "</tool_response>"))) {
          last_query = i;
          break;
        }
      }
      for (size_t i = 0; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role != "assistant") {
          out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
          continue;
        }
        std::string content = m.content, reasoning;
        if (const size_t close = content.find("</think>"); close != std::string::npos) {
          const std::string before = rstrip(content.substr(0, close), '\n');
          const size_t open = before.rfind("<think>");
          reasoning = lstrip(open == std::string::npos ? before : before.substr(open + 7), '\n');
          content = lstrip(content.substr(content.rfind("</think>") + 8), '\n');
        }
        const bool after_query = static_cast<int64_t>(i) > last_query || (v.think_in_history && !reasoning.empty());
        if (after_query && (i + 1 == messages.size() || !reasoning.empty()))
          out += "<|im_start|>assistant\n<think>\n" + strip(reasoning, '\n') + "\n</think>\n\n" + lstrip(content, '\n');
        else
          out += "<|im_start|>assistant\n" + content;
        out += "<|im_end|>\n";
      }
      if (add_generation_prompt) {
        out += "<|im_start|>assistant\n";
        if (!options.enable_thinking) out += "<think>\n\n</think>\n\n";
      }
      return out;
    }

    case Family::kLlama3:
      for (size_t i = 0; i < messages.size(); ++i)
        out += (i == 0 ? bos_token_ : std::string()) + "<|start_header_id|>" + messages[i].role +
               "<|end_header_id|>\n\n" + trim(messages[i].content) + "<|eot_id|>";
      if (add_generation_prompt || v.always_generation_prompt)
        out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      return out;

    case Family::kLlama31: {
      const std::string date = options.date_string  ? *options.date_string
                               : v.today_by_default ? today()
                                                    : "26 Jul 2024";
      out +=
          bos_token_ +
          "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: " + date +
          "\n\n" + (first_is_system ? trim(messages.front().content) : std::string()) + "<|eot_id|>";
      for (size_t i = first_is_system ? 1 : 0; i < messages.size(); ++i)
        out += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" + trim(messages[i].content) +
               "<|eot_id|>";
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      return out;
    }
  }
  return out;
}

std::pair<std::string, std::string> ChatTemplate::split_user_turn(const std::string& message,
                                                                  const std::string& separator,
                                                                  const ChatOptions& options, const char* op) const {
  const std::string rendered = apply({{"user", message + separator}}, /*add_generation_prompt=*/true, options);
  const size_t at = rendered.find(separator);
  TORCH_CHECK(at != std::string::npos && rendered.find(separator, at + 1) == std::string::npos, op,
              ": the chat template ", name_, " must render the user message once");
  return {rendered.substr(0, at), rendered.substr(at + separator.size())};
}

}  // namespace kvpress::llama
