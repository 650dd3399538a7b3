// Writing a file so that it appears whole or not at all: the content goes to a temporary file in
// the same directory, which is renamed onto the target only once it is complete. A failed or
// interrupted write never leaves a partial file under the target's name and never clobbers an
// existing one (rename is atomic within a file system).
#pragma once

#include <cstdio>
#include <functional>
#include <string>

namespace kvpress::io {

// Calls write(file) on a fresh temporary file next to `path` ("<dir>/.<name>.<pid>.<n>.tmp",
// created with the usual permissions), then flushes, closes and renames it onto `path`. When
// `write` returns false or throws, or a step fails, the temporary file is removed and `path` is
// left as it was. Raises c10::Error "<op>: <path>: <what failed> (<errno text>)".
void write_file_atomically(const std::string& op, const std::string& path,
                           const std::function<bool(std::FILE*)>& write);

// The same for a text.
void write_text_atomically(const std::string& op, const std::string& path, const std::string& text);

}  // namespace kvpress::io
