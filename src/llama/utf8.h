// UTF-8 validity as Rust's str::from_utf8 judges it (the tokenizers library): the tokenizer's
// byte-fallback decoding and its fuzz target's check of decode() share this one definition.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvpress::llama {

inline bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c >> 5) == 0x6) {
      n = 2, cp = c & 0x1F;
    } else if ((c >> 4) == 0xE) {
      n = 3, cp = c & 0x0F;
    } else if ((c >> 3) == 0x1E) {
      n = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong encodings, surrogates and values past U+10FFFF are invalid (Rust's from_utf8).
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n;
  }
  return true;
}

}  // namespace kvpress::llama
