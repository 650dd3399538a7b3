// UTF-8 validity as Rust's str::from_utf8 judges it (the tokenizers library), and the lossy
// repair its String::from_utf8_lossy (and Python's bytes.decode("utf-8", "replace")) makes: the
// tokenizer's decoders, its encode of text that is not valid UTF-8, and its fuzz target's check of
// decode() share these definitions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvpress::llama {

// The length of the valid UTF-8 sequence at s[i] (i < s.size()), or 0 when it is invalid, with
// `invalid` set to the length of its maximal invalid subpart (Unicode's "substitution of maximal
// subparts": the longest prefix that could still have begun a valid sequence, at least one byte).
// Overlong encodings, surrogates and values past U+10FFFF are invalid.
inline size_t utf8_sequence_length(const std::string& s, size_t i, size_t& invalid) {
  const auto lead = static_cast<unsigned char>(s[i]);
  if (lead < 0x80) return 1;
  size_t n = 0;
  unsigned char second_lo = 0x80, second_hi = 0xBF;  // the second byte's range depends on the lead
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    if (lead == 0xE0) second_lo = 0xA0;  // no overlong
    if (lead == 0xED) second_hi = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    if (lead == 0xF0) second_lo = 0x90;  // no overlong
    if (lead == 0xF4) second_hi = 0x8F;  // nothing past U+10FFFF
  } else {
    invalid = 1;
    return 0;
  }
  for (size_t k = 1; k < n; ++k) {
    const bool in_range = i + k < s.size() && (k == 1 ? static_cast<unsigned char>(s[i + k]) >= second_lo &&
                                                            static_cast<unsigned char>(s[i + k]) <= second_hi
                                                      : (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80);
    if (!in_range) {
      invalid = k;
      return 0;
    }
  }
  return n;
}

// The code point of the valid UTF-8 sequence at s[i] of byte length n (utf8_sequence_length's).
inline uint32_t utf8_code_point(const std::string& s, size_t i, size_t n) {
  const auto c = static_cast<unsigned char>(s[i]);
  uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1Fu) : n == 3 ? (c & 0x0Fu) : (c & 0x07u);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3Fu);
  return cp;
}

inline bool valid_utf8(const std::string& s) {
  size_t invalid = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence_length(s, i, invalid);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

// `s` with each maximal invalid subpart replaced by U+FFFD (from_utf8_lossy); valid text unchanged.
inline std::string utf8_lossy(const std::string& s) {
  if (valid_utf8(s)) return s;
  std::string out;
  out.reserve(s.size() + 8);
  size_t invalid = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence_length(s, i, invalid);
    if (n > 0) {
      out.append(s, i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += invalid;
    }
  }
  return out;
}

}  // namespace kvpress::llama
