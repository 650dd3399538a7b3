// kvpress_bench_gpu: every registry press that compresses a layer on its own, run on the tensors of
// one Llama-3.1-8B-shaped layer (B=1, Hq=32, Hkv=8, D=128) on a CUDA device (or, to rehearse the
// run where there is none, on the CPU: --device cpu), timed with device synchronisation.
//
//   kvpress_bench_gpu [--seq S] [--dtype fp32|bf16|fp16] [--repeats N] [--device cuda|cpu]
//
// Defaults: S = 16384, fp32, 5 timed calls after 2 warm-ups (median), cuda. Inputs: keys, values,
// the post-RoPE queries of all positions, cos/sin, num_heads, o_proj (CriticalKV) and, for the
// query-aware FinchPress, a question of the last 64 positions; ObservedAttentionPress also gets the
// attentions when they fit in 4 GiB, else it is skipped. Presses whose heads keep different counts
// run through compress_ragged, the others through compress.
//
// The floor of each press is the bytes it must move (benchmarks/press_work.h: what it reads to score
// plus reading and writing the kept rows; for presses without a model there, at least reading K and
// V once and writing the kept half) at the device's copy bandwidth, measured here as one large
// device-to-device copy (bytes read + bytes written over its time). A press that fails is reported
// and the others still run; the exit status is then 1 (also without a CUDA device for --device cuda).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/cuda.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "bench_util.h"
#include "kvpress/kvpress.h"
#include "kvpress/registry.h"
#include "press_work.h"

namespace {

constexpr int64_t kQHeads = 32, kKVHeads = 8, kHeadDim = 128, kHidden = 4096, kQuestion = 64;

struct Options {
  int64_t seq = 16384;
  int repeats = 5;
  std::string dtype = "fp32";
  std::string device = "cuda";
};

kvpress::LayerInputs layer_inputs(int64_t seq, const at::TensorOptions& opts) {
  const auto f32 = opts.dtype(at::kFloat);
  at::manual_seed(0);
  kvpress::LayerInputs in;
  in.keys = at::randn({1, kKVHeads, seq, kHeadDim}, opts);
  in.values = at::randn({1, kKVHeads, seq, kHeadDim}, opts);
  in.queries = at::randn({1, kQHeads, seq, kHeadDim}, opts);
  in.num_heads = kQHeads;
  const at::Tensor inv_freq = at::pow(500000.0, -at::arange(0, kHeadDim, 2, f32) / double(kHeadDim));
  const at::Tensor angles = at::outer(at::arange(seq, f32), inv_freq);
  in.cos = at::cat({angles, angles}, -1).cos().to(opts.dtype());
  in.sin = at::cat({angles, angles}, -1).sin().to(opts.dtype());
  // CriticalKVPress / CriticalAdaKVPress project the values through the layer's o_proj.
  in.o_proj = at::randn({kHidden, kQHeads * kHeadDim}, opts).div_(std::sqrt(double(kQHeads * kHeadDim)));
  return in;
}

int run(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 < argc && a == "--seq")
      o.seq = std::atoll(argv[++i]);
    else if (i + 1 < argc && a == "--repeats")
      o.repeats = std::atoi(argv[++i]);
    else if (i + 1 < argc && a == "--dtype")
      o.dtype = argv[++i];
    else if (i + 1 < argc && a == "--device")
      o.device = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: kvpress_bench_gpu [--seq S] [--dtype fp32|bf16|fp16] [--repeats N] [--device cuda|cpu]\n");
      return 2;
    }
  }
  TORCH_CHECK(o.seq > 2 * kQuestion, "kvpress_bench_gpu: --seq must be > ", 2 * kQuestion, ", got ", o.seq);
  TORCH_CHECK(o.repeats > 0, "kvpress_bench_gpu: --repeats must be > 0, got ", o.repeats);
  TORCH_CHECK(o.dtype == "fp32" || o.dtype == "bf16" || o.dtype == "fp16",
              "kvpress_bench_gpu: --dtype must be fp32, bf16 or fp16, got ", o.dtype);
  TORCH_CHECK(o.device == "cuda" || o.device == "cpu", "kvpress_bench_gpu: --device must be cuda or cpu, got ",
              o.device);
  const bool cuda = o.device == "cuda";
  if (cuda && !at::hasCUDA()) {
    std::fprintf(stderr, "kvpress_bench_gpu: no CUDA device (--device cpu rehearses the run on the CPU)\n");
    return 1;
  }
  const at::ScalarType dtype = o.dtype == "bf16" ? at::kBFloat16 : o.dtype == "fp16" ? at::kHalf : at::kFloat;
  const auto opts = at::TensorOptions().dtype(dtype).device(cuda ? at::kCUDA : at::kCPU);
  const auto sync = [cuda] {
    if (cuda) torch::cuda::synchronize();
  };
  const auto median_ms = [&](const std::function<void()>& fn) {
    return kvpress_bench::median_ms(fn, o.repeats, 2, sync);
  };
  const kvpress::LayerInputs in = layer_inputs(o.seq, opts);
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  const kvpress_bench::LayerShape shape{1, kQHeads, kKVHeads, kHeadDim, o.seq, element};
  const int64_t attn_bytes = kQHeads * o.seq * o.seq * element;

  // The device's copy bandwidth: K and V (2 * kv bytes) read and written once.
  const at::Tensor kv = at::cat({in.keys, in.values});
  at::Tensor kv_copy = at::empty_like(kv);
  const double copy_ms = median_ms([&] { kv_copy.copy_(kv); });
  const double bytes_per_ms = 2.0 * static_cast<double>(kv.nbytes()) / copy_ms;
  std::printf(
      "kvpress %s on %s: compress() of one layer B=1 Hq=%lld Hkv=%lld S=%lld D=%lld %s, ratio 0.5, median of %d\n",
      KVPRESS_VERSION, cuda ? "CUDA" : "the CPU (rehearsal)", (long long)kQHeads, (long long)kKVHeads, (long long)o.seq,
      (long long)kHeadDim, o.dtype.c_str(), o.repeats);
  std::printf("copy bandwidth: %.1f GB/s (a %.1f MiB device copy, read + write)\n\n", bytes_per_ms / 1e6,
              kv.nbytes() / double(1 << 20));
  std::printf("%-36s %10s %10s %9s  %s\n", "press", "ms", "floor ms", "x floor", "floor from");
  int status = 0;
  for (const auto& info : kvpress::list_presses()) {
    if (info.kind == kvpress::PressKind::kDecoding || info.kind == kvpress::PressKind::kSecondPass) continue;
    if (kvpress::needs_file(info)) continue;  // QFilter, ExpectedAttentionStats, KVzap: a model's files
    kvpress::LayerInputs layer = in;
    if (info.kind == kvpress::PressKind::kQueryAware) layer.question_length = kQuestion;
    if (kvpress::needs_attentions(info.name)) {
      if (attn_bytes > (int64_t{4} << 30)) {
        std::printf("%-36s skipped: attentions [1, %lld, S, S] would take %.1f GiB\n", info.name.c_str(),
                    (long long)kQHeads, attn_bytes / double(int64_t{1} << 30));
        continue;
      }
      layer.attentions =
          at::softmax(at::randn({1, kQHeads, o.seq, o.seq}, opts.dtype(at::kFloat)), -1).tril_().to(dtype);
    }
    const std::optional<kvpress_bench::PressWork> work = kvpress_bench::press_work(info.name, shape, o.seq / 2);
    // Without a model: read K and V once, write the kept half.
    const double floor_bytes = work ? work->bytes() : 3.0 * static_cast<double>(in.keys.nbytes());
    const double floor_ms = floor_bytes / bytes_per_ms;
    try {
      // DMSPress has no default threshold; -sqrt(D) is about the median of KnormPress's scores (minus
      // the key norm) on these random keys, so it keeps about half.
      std::map<std::string, std::string> params;
      if (info.name == "DMSPress") params["threshold"] = std::to_string(-std::sqrt(static_cast<double>(kHeadDim)));
      const auto press = kvpress::make_press(info.name, kvpress::ratio_for(info, 0.5), params);
      const double ms = press->head_ragged() ? median_ms([&] { (void)press->compress_ragged(layer); })
                                             : median_ms([&] { (void)press->compress(layer); });
      std::printf("%-36s %10.3f %10.3f %9.1f  %s\n", info.name.c_str(), ms, floor_ms, ms / floor_ms,
                  work ? "press_work.h" : "K+V read, kept half written");
    } catch (const c10::Error& e) {
      std::printf("%-36s failed: %s\n", info.name.c_str(), e.what_without_backtrace());
      status = 1;
    }
    std::fflush(stdout);
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) { return kvpress_bench::guarded_main(run, argc, argv); }
