// A tokenizer.json (Hugging Face `tokenizers`) reader for the two BPE families Llama-style
// checkpoints use, with encode/decode equal to the Python `tokenizers` library (and so to
// transformers):
//   * SentencePiece-style BPE (TinyStories-656K, Llama 2, Mistral 7B): Prepend/Replace normalizers,
//     no pre-tokenizer, byte_fallback to <0xXX> tokens;
//   * byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2/Qwen3, Mistral-Nemo): a ByteLevel
//     pre-tokenizer (bytes mapped to printable characters, GPT-2's split regex or none), Split
//     pre-tokenizers with the families' Unicode regexes, Digits, NFC, the ByteLevel decoder.
//
//   normalizer      Sequence of Prepend, Replace(String) and NFC, or none
//   pre_tokenizer   Sequence of Split (Regex or String pattern, behavior Isolated, not inverted),
//                   Digits and ByteLevel (add_prefix_space, use_regex), or none (each normalized
//                   piece is one BPE "word", spaces included)
//   model           BPE: merges applied by rank (lowest first, leftmost on equal rank), byte_fallback
//                   to <0xXX> tokens when the vocabulary has them (else <unk>; a character outside
//                   a vocabulary without unk_token is dropped, as tokenizers drops it), fuse_unk,
//                   ignore_merges
//   added tokens    matched leftmost-longest, before normalization for normalized=false tokens and
//                   in the normalized text (against their normalized form) for normalized=true ones
//   post_processor  TemplateProcessing (single sequence; e.g. BOS first), ByteLevel (no change to
//                   the ids), a Sequence of them, or none
//   decoder         Sequence of Replace(String), ByteFallback, Fuse, Strip, ByteLevel
//
// Regexes are PCRE2's (UTF + Unicode properties) and NFC is utf8proc's, not hand-written tables
// (src/llama/unicode.h). Text that is not valid UTF-8 is encoded as the tokenizers library encodes
// Python's text.decode("utf-8", "replace"): each invalid sequence becomes U+FFFD.
// Any other component raises c10::Error "Tokenizer: <path>: unsupported ..." at load time rather
// than encoding differently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kvpress::llama {

class Tokenizer {
 public:
  // Reads `path` (a tokenizer.json file).
  static Tokenizer load(const std::string& path);
  // Parses tokenizer.json text; `origin` names it in error messages.
  static Tokenizer from_json(const std::string& json_text, const std::string& origin = "tokenizer.json");

  // UTF-8 text -> token ids. add_special_tokens applies the post_processor (BOS for Llama),
  // as tokenizer(text) does in transformers.
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = true) const;

  // Token ids -> UTF-8 text, as tokenizer.decode(ids, skip_special_tokens=...) does in
  // transformers (clean_up_tokenization_spaces=false). Unknown ids are dropped.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const;

  // Largest id + 1, added tokens included.
  int64_t vocab_size() const;
  std::optional<int64_t> token_to_id(const std::string& token) const;
  // The token's text ("▁the", "<0x0A>", "<|start_story|>"); raises on an id out of range.
  const std::string& id_to_token(int64_t id) const;
  bool is_special(int64_t id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace kvpress::llama
