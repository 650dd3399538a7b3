// Shared by the libFuzzer targets: what counts as a finding besides the sanitizers' reports.
//   * Any exception other than c10::Error escapes the target and aborts the process.
//   * A c10::Error must name what raised it: its message starts with "<name>: " (a function or
//     class name, as every message of the library does).
//   * FUZZ_EXPECT(cond, message): a property of a successful result; abort() when it is false.
#pragma once

#include <c10/util/Exception.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvpress::fuzz {

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "kvpress fuzz target: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

#define FUZZ_EXPECT(cond, what) \
  if (!(cond)) ::kvpress::fuzz::fail(std::string("expected ") + #cond + ": " + (what))

// "make_press: ...", "Tokenizer::id_to_token: ...": an identifier (letters, digits, '_', "::")
// then ": ".
inline bool names_its_function(const std::string& message) {
  size_t i = 0;
  while (i < message.size() && (std::isalnum(static_cast<unsigned char>(message[i])) || message[i] == '_' ||
                                message.compare(i, 2, "::") == 0))
    i += message.compare(i, 2, "::") == 0 ? 2 : 1;
  return i > 0 && message.compare(i, 2, ": ") == 0;
}

// Runs `fn`; a c10::Error is an accepted answer to a bad input if it names its function.
template <typename Fn>
void expect_success_or_error(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    FUZZ_EXPECT(names_its_function(message), "c10::Error message without its function's name: " + message);
  }
}

}  // namespace kvpress::fuzz
