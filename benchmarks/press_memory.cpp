// kvpress_memory: peak extra host memory of a press's score() on one Llama-3.1-8B-shaped layer
// (B=1, Hq=32, Hkv=8, D=128), compared with the size of the layer's keys.
//
//   kvpress_memory [--seq S] [--dtype fp32|bf16] [--press NAME]... [--hidden]
//   kvpress_memory --all [--seq S] [--dtype fp32|bf16]
//
// Defaults: S = 32768, fp32, NonCausalAttnPress (given the post-RoPE queries of every position),
// LeverageScorePress and CompactorPress (queries + cos/sin). --hidden adds NonCausalAttnPress with
// queries recomputed from hidden_states + q_proj (slow on a small CPU: 1.1 TFLOP of projection).
// --all measures compress() (scores, top-k and the gather of the kept K/V; compress_ragged() for
// presses whose heads keep different numbers of tokens) of every registry press
// that compresses a layer on its own (not the decoding presses, not KVComposePress), given keys,
// values, the post-RoPE queries of all positions, cos/sin and, for ObservedAttentionPress, the
// attentions when they fit in 2 GiB; default S = 16384 there (issue 7's shape). Its table gives the
// peak and the output (kept K/V + indices, part of the peak); the peak must not
// exceed K + V (issue 7 item 4) even with the returned kept K/V counted; exit status 1 otherwise.
//
// Each measurement runs in a fresh process (this binary re-executes itself), so memory freed by
// an earlier measurement cannot hide a later one. Two figures, both "above the inputs":
//   * allocator: peak of the bytes live in libtorch's CPU allocator (a counting wrapper installed
//     with c10::SetCPUAllocator) minus the bytes live before score(); exact for ATen tensors,
//     blind to memory BLAS or OpenMP take with malloc themselves;
//   * RSS: the process's resident high-water mark (VmHWM, reset through /proc/self/clear_refs)
//     minus VmRSS before score(), with glibc told to mmap every block >= 64 KiB and trimmed after a
//     warm-up, so freed blocks go back to the OS and do not hide new ones.
// The press runs once at S = 1024 first (warm-up: BLAS buffers, thread pools), then on S.
// Exit status 1 when NonCausalAttnPress's peak is not below the keys' size.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <malloc.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvpress/kvpress.h"
#include "kvpress/registry.h"

extern char** environ;

namespace {

constexpr int64_t kQHeads = 32, kKVHeads = 8, kHeadDim = 128, kHidden = kQHeads * kHeadDim;
constexpr double kMiB = 1024.0 * 1024.0;

// Counts the bytes live in the CPU allocator and their peak. Its data pointers are "simple"
// (context == data, freed by a raw deleter) like the default allocator's, because oneDNN's
// raw_allocate() requires that.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base), base_deleter_(base->raw_deleter()) {
    TORCH_CHECK(base_deleter_ != nullptr, "kvpress_memory: the CPU allocator has no raw deleter");
    instance_ = this;
  }

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    TORCH_CHECK(inner.get() == inner.get_context(), "kvpress_memory: the CPU allocator's pointers are not simple");
    void* data = inner.release_context();
    const int64_t now = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    if (data) {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = n;
    }
    return {data, data, &CountingAllocator::release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  static void release(void* data) {
    if (!data) return;
    CountingAllocator* self = instance_;
    size_t n = 0;
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      const auto it = self->sizes_.find(data);
      if (it != self->sizes_.end()) {
        n = it->second;
        self->sizes_.erase(it);
      }
    }
    self->live_.fetch_sub(static_cast<int64_t>(n));
    self->base_deleter_(data);
  }

  static inline CountingAllocator* instance_ = nullptr;
  c10::Allocator* base_;
  c10::DeleterFnPtr base_deleter_;
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;
};

// A field of /proc/self/status in kB, as bytes (-1 if absent).
int64_t proc_status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t len = std::strlen(field);
  while (std::getline(in, line))
    if (line.compare(0, len, field) == 0 && line.size() > len && line[len] == ':')
      return std::atoll(line.c_str() + len + 1) * 1024;
  return -1;
}

bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

struct Config {
  std::string press;
  bool hidden = false;      // recompute queries from hidden states instead of giving them
  bool compress = false;    // --all: time compress() and give every input a press may read
  bool attentions = false;  // --all: give the full attentions (ObservedAttentionPress)
};

std::string label(const Config& c) {
  return c.press + (c.press == "LeverageScorePress" ? " (cos/sin)"
                    : c.hidden                      ? " (hidden_states + q_proj + cos/sin)"
                                                    : " (queries of all S positions + cos/sin)");
}

kvpress::LayerInputs make_inputs(const Config& c, int64_t seq, at::ScalarType dtype) {
  at::manual_seed(0);
  const auto opts = at::TensorOptions().dtype(dtype);
  kvpress::LayerInputs in;
  in.keys = at::randn({1, kKVHeads, seq, kHeadDim}, opts);
  in.values = at::randn({1, kKVHeads, seq, kHeadDim}, opts);
  in.num_heads = kQHeads;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor inv_freq = at::pow(500000.0, -at::arange(0, kHeadDim, 2, f32) / double(kHeadDim));
  const at::Tensor angles = at::outer(at::arange(seq, f32), inv_freq);
  in.cos = at::cat({angles, angles}, -1).cos().to(dtype);
  in.sin = at::cat({angles, angles}, -1).sin().to(dtype);
  if (c.press == "LeverageScorePress" && !c.compress) return in;
  // CriticalKVPress / CriticalAdaKVPress project the values through the layer's o_proj.
  in.o_proj = at::randn({kHidden, kQHeads * kHeadDim}, opts).div_(std::sqrt(double(kQHeads * kHeadDim)));
  if (c.attentions) {
    in.attentions = at::softmax(at::randn({1, kQHeads, seq, seq}, f32), -1).tril_().to(dtype);
  }
  if (c.hidden) {
    in.hidden_states = at::randn({1, seq, kHidden}, opts);
    in.q_proj = at::randn({kQHeads * kHeadDim, kHidden}, opts).div_(std::sqrt(double(kHidden)));
  } else {
    in.queries = at::randn({1, kQHeads, seq, kHeadDim}, opts).div_(std::sqrt(double(kHeadDim)));
  }
  return in;
}

// One measurement (in its own process). Prints one machine-readable line.
int measure(const Config& c, int64_t seq, at::ScalarType dtype) {
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);  // fixed: large blocks are mmapped and unmapped on free
  auto* counting = new CountingAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(counting, /*priority=*/100);
  auto press = kvpress::make_press(c.press, kvpress::ratio_for(*kvpress::find_press(c.press), 0.5), {});
  auto* scorer = dynamic_cast<kvpress::ScorerPress*>(press.get());
  TORCH_CHECK(c.compress || scorer != nullptr, "kvpress_memory: ", c.press, " is not a ScorerPress (use --all)");
  // --all: compress(), whose result (the kept K/V) is counted apart; otherwise score().
  const auto run = [&](const kvpress::LayerInputs& in, int64_t* output_bytes) {
    if (!c.compress) return scorer->score(in).numel();
    if (press->head_ragged()) {  // heads keep different numbers of tokens
      const kvpress::RaggedKV r = press->compress_ragged(in);
      int64_t bytes = r.keep_mask.defined() ? static_cast<int64_t>(r.keep_mask.nbytes()) : 0, numel = 0;
      for (const auto& h : r.heads) {
        bytes += static_cast<int64_t>(h.keys.nbytes() + h.values.nbytes() + h.kept_indices.nbytes());
        numel += h.keys.numel();
      }
      *output_bytes = bytes;
      return numel;
    }
    const kvpress::KV kv = press->compress(in);
    *output_bytes = static_cast<int64_t>(kv.keys.nbytes() + kv.values.nbytes() +
                                         (kv.kept_indices.defined() ? kv.kept_indices.nbytes() : 0));
    return kv.keys.numel();
  };
  int64_t output_bytes = 0;
  {
    const kvpress::LayerInputs warm = make_inputs(c, 1024, dtype);
    (void)run(warm, &output_bytes);
  }
  malloc_trim(0);
  const kvpress::LayerInputs in = make_inputs(c, seq, dtype);
  const int64_t live_before = counting->live();
  counting->reset_peak();
  const bool rss_ok = reset_peak_rss();
  const int64_t rss_before = proc_status_bytes("VmRSS");
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t numel = run(in, &output_bytes);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t hwm = proc_status_bytes("VmHWM");
  const int64_t alloc_extra = counting->peak() - live_before;
  const int64_t rss_extra = rss_ok && hwm >= 0 && rss_before >= 0 ? hwm - rss_before : -1;
  std::printf("RESULT %lld %lld %.3f %lld %lld\n", static_cast<long long>(alloc_extra),
              static_cast<long long>(rss_extra), secs, static_cast<long long>(numel),
              static_cast<long long>(output_bytes));
  return 0;
}

// Runs `self --one ...` and parses its RESULT line.
bool run_child(const std::string& self, const Config& c, int64_t seq, const std::string& dtype, int64_t* alloc,
               int64_t* rss, double* secs, int64_t* output_bytes) {
  std::vector<std::string> args = {self, "--one", c.press, "--seq", std::to_string(seq), "--dtype", dtype};
  if (c.hidden) args.push_back("--hidden");
  if (c.compress) args.push_back("--compress");
  if (c.attentions) args.push_back("--attentions");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int pipefd[2];
  if (pipe(pipefd) != 0) return false;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, pipefd[0]);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, self.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipefd[1]);
  if (rc != 0) {
    close(pipefd[0]);
    return false;
  }
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(pipefd[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const size_t at = out.find("RESULT ");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || at == std::string::npos) {
    std::fprintf(stderr, "%s", out.c_str());
    return false;
  }
  long long a = 0, r = 0, numel = 0, o = 0;
  return std::sscanf(out.c_str() + at, "RESULT %lld %lld %lf %lld %lld", &a, &r, secs, &numel, &o) == 5 &&
         ((*alloc = a), (*rss = r), (*output_bytes = o), true);
}

std::string mib(int64_t bytes) {
  if (bytes < 0) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / kMiB);
  return buf;
}

std::string self_path(const char* argv0) {
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  return len > 0 ? std::string(exe, static_cast<size_t>(len)) : std::string(argv0);
}

// --all: compress() of every registry press that compresses a layer on its own.
int measure_all(int64_t seq, const std::string& dtype_name, int64_t elem) {
  const int64_t kv_bytes = 2 * kKVHeads * seq * kHeadDim * elem;
  std::printf(
      "kvpress %s: peak extra host memory of compress(), one layer B=1 Hq=%lld Hkv=%lld S=%lld D=%lld %s, "
      "ratio 0.5, %d torch threads\n",
      KVPRESS_VERSION, (long long)kQHeads, (long long)kKVHeads, (long long)seq, (long long)kHeadDim, dtype_name.c_str(),
      at::get_num_threads());
  std::printf("inputs: keys, values, queries of all positions, cos/sin (not counted); K + V = %s\n\n",
              mib(kv_bytes).c_str());
  std::printf("%-36s %12s %12s %12s %8s  %s\n", "press", "peak", "output", "peak RSS", "time s", "peak <= K+V?");
  int status = 0;
  const std::string path = self_path("kvpress_memory");
  for (const auto& info : kvpress::list_presses()) {
    if (info.kind == kvpress::PressKind::kDecoding || info.kind == kvpress::PressKind::kSecondPass) continue;
    if (kvpress::needs_file(info)) {
      std::printf("%-36s skipped: reads a file made for a model (its \"path\" parameter)\n", info.name.c_str());
      continue;
    }
    // Attentions only for presses that take nothing else (ObservedAttentionPress).
    Config c{info.name, false, true, kvpress::needs_attentions(info.name)};
    if (c.attentions && kQHeads * seq * seq * elem > (int64_t{2} << 30)) {
      std::printf("%-36s skipped: its attentions [1, %lld, S, S] take %s (> 2 GiB); rerun with a smaller --seq\n",
                  info.name.c_str(), (long long)kQHeads, mib(kQHeads * seq * seq * elem).c_str());
      continue;
    }
    int64_t alloc = -1, rss = -1, output = 0;
    double secs = 0.0;
    if (!run_child(path, c, seq, dtype_name, &alloc, &rss, &secs, &output)) {
      std::printf("%-36s failed (see above)\n", info.name.c_str());
      status = 1;
      continue;
    }
    const bool ok = alloc <= kv_bytes;
    std::printf("%-36s %12s %12s %12s %8.2f  %s\n", info.name.c_str(), mib(alloc).c_str(), mib(output).c_str(),
                mib(rss).c_str(), secs, ok ? "yes" : "NO");
    if (!ok) status = 1;
    std::fflush(stdout);
  }
  std::printf(
      "\npeak: bytes live in libtorch's CPU allocator during compress() minus those live before, the\n"
      "returned kept keys/values included (output: their size with the indices); peak RSS: VmHWM minus\n"
      "VmRSS before (also counts memory BLAS/OpenMP take outside the allocator).\n");
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t seq = -1;  // 32768, or 16384 with --all
  std::string dtype_name = "fp32";
  bool one = false, hidden = false, all = false, compress = false, attentions = false;
  std::vector<std::string> presses;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kvpress_memory: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--seq") {
      seq = std::atoll(next().c_str());
    } else if (a == "--dtype") {
      dtype_name = next();
    } else if (a == "--press") {
      presses.push_back(next());
    } else if (a == "--one") {
      one = true;
      presses = {next()};
    } else if (a == "--hidden") {
      hidden = true;
    } else if (a == "--all") {
      all = true;
    } else if (a == "--compress") {  // internal (child of --all)
      compress = true;
    } else if (a == "--attentions") {  // internal (child of --all)
      attentions = true;
    } else if (a == "-h" || a == "--help") {
      std::printf(
          "usage: kvpress_memory [--seq S] [--dtype fp32|bf16] [--press NAME]... [--hidden]\n"
          "       kvpress_memory --all [--seq S] [--dtype fp32|bf16]\n");
      return 0;
    } else {
      std::fprintf(stderr, "kvpress_memory: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (seq < 0) seq = all ? 16384 : 32768;
  if (seq < 2048 || (dtype_name != "fp32" && dtype_name != "bf16")) {
    std::fprintf(stderr, "kvpress_memory: --seq must be >= 2048 and --dtype fp32 or bf16\n");
    return 2;
  }
  const at::ScalarType dtype = dtype_name == "fp32" ? at::kFloat : at::kBFloat16;
  try {
    if (one) return measure(Config{presses[0], hidden, compress, attentions}, seq, dtype);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "kvpress_memory: %s\n", e.what_without_backtrace());
    return 1;
  }

  std::vector<Config> configs;
  if (presses.empty()) {
    configs = {{"NonCausalAttnPress", false}, {"LeverageScorePress", false}, {"CompactorPress", false}};
    if (hidden) configs.push_back({"NonCausalAttnPress", true});
  } else {
    for (const auto& p : presses) configs.push_back({p, hidden});
  }

  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  if (all) return measure_all(seq, dtype_name, elem);
  const int64_t keys_bytes = kKVHeads * seq * kHeadDim * elem;
  const int64_t chunk = 256;
  const int64_t padded = (seq + chunk - 1) / chunk * chunk;
  std::printf(
      "kvpress %s: peak extra host memory of score(), one layer B=1 Hq=%lld Hkv=%lld S=%lld D=%lld %s, "
      "%d torch threads\n",
      KVPRESS_VERSION, (long long)kQHeads, (long long)kKVHeads, (long long)seq, (long long)kHeadDim, dtype_name.c_str(),
      at::get_num_threads());
  std::printf("layer keys Hkv*S*D*%lld B: %s\n", (long long)elem, mib(keys_bytes).c_str());
  std::printf(
      "for comparison, kvpress 0.5.5's NonCausalAttnPress materialises its logits for all chunks at once,\n"
      "[B, Hq, S_pad, chunk] in the cache dtype plus a float32 softmax copy: %s + %s, and repeat_kv keys %s\n\n",
      mib(kQHeads * padded * chunk * elem).c_str(), mib(kQHeads * padded * chunk * 4).c_str(),
      mib(kQHeads * seq * kHeadDim * elem).c_str());
  const std::string self = "/proc/self/exe";
  char exe[4096];
  const ssize_t len = readlink(self.c_str(), exe, sizeof exe - 1);
  const std::string path = len > 0 ? std::string(exe, static_cast<size_t>(len)) : std::string(argv[0]);
  int status = 0;
  std::printf("%-62s %14s %14s %9s  %s\n", "press (inputs)", "allocator", "peak RSS", "time s", "below keys?");
  for (const auto& c : configs) {
    int64_t alloc = -1, rss = -1;
    double secs = 0.0;
    int64_t output_bytes = 0;
    if (!run_child(path, c, seq, dtype_name, &alloc, &rss, &secs, &output_bytes)) {
      std::printf("%-62s failed (see above)\n", label(c).c_str());
      status = 1;
      continue;
    }
    const bool below = alloc >= 0 && alloc < keys_bytes && (rss < 0 || rss < keys_bytes);
    std::printf("%-62s %14s %14s %9.2f  %s\n", label(c).c_str(), mib(alloc).c_str(), mib(rss).c_str(), secs,
                below ? "yes" : "no");
    if (c.press == "NonCausalAttnPress" && !below) status = 1;
  }
  std::printf(
      "\nallocator: peak bytes live in libtorch's CPU allocator during score(), minus those live before;\n"
      "peak RSS: VmHWM during score() minus VmRSS before (each in a fresh process after a warm-up).\n"
      "Only NonCausalAttnPress is required to stay below the keys (issue 3). LeverageScorePress holds the\n"
      "float32 sketch X [B, Hkv, S, 48] and per-chunk partial Gram matrices (its CPU kernel; the composite\n"
      "holds one KV head's float32 pre-RoPE keys and RoPE temporaries instead).\n");
  return status;
}
