#include "kvpress/io/atomic_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace kvpress::io {
namespace {

// Opens a new temporary file next to `path`; O_EXCL, so it never reuses an existing file.
std::FILE* open_temporary(const std::string& op, const std::string& path, std::string& temporary) {
  static std::atomic<unsigned> counter{0};
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  TORCH_CHECK(!name.empty(), op, ": ", path, ": the path names a directory, not a file");
  for (int attempt = 0; attempt < 100; ++attempt) {
    temporary = dir + "." + name + "." + std::to_string(::getpid()) + "." + std::to_string(counter++) + ".tmp";
    errno = 0;
    const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) {
      std::FILE* file = ::fdopen(fd, "wb");
      if (file != nullptr) return file;
      const int fdopen_errno = errno;
      ::close(fd);
      std::remove(temporary.c_str());
      TORCH_CHECK(false, op, ": ", path, ": cannot open a temporary file (", std::strerror(fdopen_errno), ")");
    }
    TORCH_CHECK(errno == EEXIST, op, ": ", path, ": cannot create a file next to it (", std::strerror(errno), ")");
  }
  TORCH_CHECK(false, op, ": ", path, ": cannot find a free temporary file name next to it");
}

}  // namespace

void write_file_atomically(const std::string& op, const std::string& path,
                           const std::function<bool(std::FILE*)>& write) {
  struct stat st {};
  TORCH_CHECK(!(::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)), op, ": ", path, ": is a directory");
  std::string temporary;
  std::FILE* file = open_temporary(op, path, temporary);
  bool ok = false;
  int error = 0;
  try {
    errno = 0;
    ok = write(file);
    error = errno;
    ok = std::fflush(file) == 0 && ok;
    if (error == 0) error = errno;
  } catch (...) {
    std::fclose(file);
    std::remove(temporary.c_str());
    throw;
  }
  const bool closed = std::fclose(file) == 0;
  if (error == 0) error = errno;
  if (!ok || !closed) {
    std::remove(temporary.c_str());
    TORCH_CHECK(false, op, ": ", path, ": write failed (", std::strerror(error), ")");
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int rename_errno = errno;
    std::remove(temporary.c_str());
    TORCH_CHECK(false, op, ": ", path, ": cannot move the written file into place (", std::strerror(rename_errno), ")");
  }
}

void write_text_atomically(const std::string& op, const std::string& path, const std::string& text) {
  write_file_atomically(op, path,
                        [&](std::FILE* file) { return std::fwrite(text.data(), 1, text.size(), file) == text.size(); });
}

}  // namespace kvpress::io
