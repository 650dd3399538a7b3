// Runs scripts/plot.py for kvpress-cli: the charts are drawn by matplotlib, not by the CLI.
// Child processes are started with posix_spawn and an argv array (no shell, so paths given on the
// command line are never interpreted); their stderr is captured so that a failure is reported as
// one "kvpress-cli: error: ..." line.
#include "plot_runner.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

// Baked in by tools/CMakeLists.txt: the Python CMake was configured with (may be empty), the
// source tree's plot.py, and the installed plot.py relative to the installed executable's folder.
#ifndef KVPRESS_CLI_PYTHON
#define KVPRESS_CLI_PYTHON ""
#endif
#ifndef KVPRESS_CLI_PLOT_SOURCE
#define KVPRESS_CLI_PLOT_SOURCE ""
#endif
#ifndef KVPRESS_CLI_PLOT_INSTALLED
#define KVPRESS_CLI_PLOT_INSTALLED "../share/kvpress/plot.py"
#endif

namespace kvpress_cli {
namespace {

struct ProcessResult {
  std::string failure;  // empty: exit status 0; else "cannot be run (...)", "exited with status N", ...
  bool started = false;
  std::string stderr_text;
};

// Runs argv (argv[0] looked up in PATH when it has no '/'), stdin and stdout inherited, stderr
// captured.
ProcessResult run_process(const std::vector<std::string>& argv) {
  ProcessResult result;
  std::vector<char*> c_argv;
  for (const auto& a : argv) c_argv.push_back(const_cast<char*>(a.c_str()));
  c_argv.push_back(nullptr);

  int pipe_fds[2];
  TORCH_CHECK(pipe2(pipe_fds, O_CLOEXEC) == 0, "cannot create a pipe: ", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDERR_FILENO);
  // Our own buffered output first, so that it stays before the child's.
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = 0;
  const int spawn_error = posix_spawnp(&pid, c_argv[0], &actions, nullptr, c_argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  if (spawn_error != 0) {
    close(pipe_fds[0]);
    result.failure = fmt::format("cannot be run ({})", std::strerror(spawn_error));
    return result;
  }
  result.started = true;
  char buffer[4096];
  for (;;) {
    const ssize_t n = read(pipe_fds[0], buffer, sizeof buffer);
    if (n > 0) {
      result.stderr_text.append(buffer, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  close(pipe_fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      result.failure = fmt::format("could not be waited for ({})", std::strerror(errno));
      return result;
    }
  }
  if (WIFSIGNALED(status)) {
    result.failure = fmt::format("was killed by signal {}", WTERMSIG(status));
  } else if (WEXITSTATUS(status) != 0) {
    result.failure = fmt::format("exited with status {}", WEXITSTATUS(status));
  }
  return result;
}

// Last non-empty line of a child's stderr: its error message (or a traceback's last line).
std::string last_line(const std::string& text) {
  const size_t end = text.find_last_not_of(" \r\n");
  if (end == std::string::npos) return "";
  const size_t newline = text.rfind('\n', end);
  const size_t start = newline == std::string::npos ? 0 : newline + 1;
  return text.substr(start, end + 1 - start);
}

bool is_file(const std::string& path) {
  struct stat st;
  return !path.empty() && stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Folder of the running executable (Linux: /proc/self/exe), or "" if unknown.
std::string executable_dir() {
  std::vector<char> buffer(4096);
  const ssize_t n = readlink("/proc/self/exe", buffer.data(), buffer.size());
  if (n <= 0 || static_cast<size_t>(n) >= buffer.size()) return "";
  const std::string path(buffer.data(), static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}

}  // namespace

Plotter find_plotter(const std::string& option) {
  Plotter plotter;
  // plot.py: an installed copy first (share/kvpress next to bin/), then the source tree's.
  std::vector<std::string> candidates;
  const std::string exe_dir = executable_dir();
  if (!exe_dir.empty()) candidates.push_back(exe_dir + "/" + KVPRESS_CLI_PLOT_INSTALLED);
  if (*KVPRESS_CLI_PLOT_SOURCE) candidates.push_back(KVPRESS_CLI_PLOT_SOURCE);
  for (const auto& path : candidates) {
    if (is_file(path)) {
      plotter.script = path;
      break;
    }
  }
  std::string tried;
  for (const auto& path : candidates) tried += (tried.empty() ? "" : " nor ") + path;
  TORCH_CHECK(!plotter.script.empty(), option, " needs scripts/plot.py: not found at ", tried,
              " (reinstall kvpress-cli, or leave out ", option, ")");

  // The interpreter: $KVPRESS_PYTHON, else the one CMake was configured with, else python3.
  std::string origin;
  if (const char* env = std::getenv("KVPRESS_PYTHON"); env != nullptr && *env != '\0') {
    plotter.python = env;
    origin = "from KVPRESS_PYTHON";
  } else if (*KVPRESS_CLI_PYTHON && access(KVPRESS_CLI_PYTHON, X_OK) == 0) {
    plotter.python = KVPRESS_CLI_PYTHON;
    origin = "the Python kvpress-cli was built with";
  } else {
    plotter.python = "python3";
    origin = "from PATH";
  }
  const ProcessResult check = run_process({plotter.python, "-c", "import matplotlib"});
  TORCH_CHECK(check.failure.empty(), option, " needs Python with matplotlib: ", plotter.python, " (", origin, ") ",
              check.started ? "cannot import matplotlib (" + last_line(check.stderr_text) + ")" : check.failure,
              "; set KVPRESS_PYTHON to a Python that has it (the venv of scripts/setup.sh), or leave out ", option);
  return plotter;
}

void run_plotter(const Plotter& plotter, const std::vector<std::string>& args, const std::string& option) {
  std::vector<std::string> argv = {plotter.python, plotter.script};
  argv.insert(argv.end(), args.begin(), args.end());
  const ProcessResult run = run_process(argv);
  const std::string message = last_line(run.stderr_text);
  TORCH_CHECK(run.failure.empty(), option, ": ", plotter.script, " ", run.failure,
              message.empty() ? std::string() : ": " + message);
  // Success: pass on whatever it warned about.
  if (!run.stderr_text.empty()) std::fputs(run.stderr_text.c_str(), stderr);
}

}  // namespace kvpress_cli
