// kvpress_bench_gpu: every registry press that compresses a layer on its own, run on CUDA tensors
// of one Llama-3.1-8B-shaped layer (B=1, Hq=32, Hkv=8, D=128), timed with device synchronisation.
//
//   kvpress_bench_gpu [--seq S] [--dtype fp32|bf16|fp16] [--repeats N]
//
// Defaults: S = 16384, fp32, 5 timed calls after 2 warm-ups (median). Inputs: keys, values, the
// post-RoPE queries of all positions, cos/sin and num_heads (ObservedAttentionPress also gets the
// attentions when they fit in 4 GiB, else it is skipped). The bandwidth floor is the time of a
// device copy of K + V plus a copy of the kept half, i.e. reading K and V once and writing what is
// kept. Exit status 1 when no CUDA device is present or a press fails.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kvpress/kvpress.h"
#include "kvpress/registry.h"

#include "bench_util.h"

namespace {

constexpr int64_t kQHeads = 32, kKVHeads = 8, kHeadDim = 128;

// Times with a device synchronisation after each call.
double median_ms(const std::function<void()>& fn, int warmup, int repeats) {
  return kvpress_bench::median_ms(fn, repeats, warmup, [] { torch::cuda::synchronize(); });
}

}  // namespace

int main(int argc, char** argv) {
  int64_t seq = 16384;
  int repeats = 5;
  std::string dtype_name = "fp32";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 < argc && a == "--seq")
      seq = std::atoll(argv[++i]);
    else if (i + 1 < argc && a == "--repeats")
      repeats = std::atoi(argv[++i]);
    else if (i + 1 < argc && a == "--dtype")
      dtype_name = argv[++i];
    else {
      std::fprintf(stderr, "usage: kvpress_bench_gpu [--seq S] [--dtype fp32|bf16|fp16] [--repeats N]\n");
      return 2;
    }
  }
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "kvpress_bench_gpu: no CUDA device\n");
    return 1;
  }
  const at::ScalarType dtype = dtype_name == "bf16" ? at::kBFloat16 : dtype_name == "fp16" ? at::kHalf : at::kFloat;
  const auto opts = at::TensorOptions().dtype(dtype).device(at::kCUDA);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  at::manual_seed(0);
  kvpress::LayerInputs in;
  in.keys = at::randn({1, kKVHeads, seq, kHeadDim}, opts);
  in.values = at::randn({1, kKVHeads, seq, kHeadDim}, opts);
  in.queries = at::randn({1, kQHeads, seq, kHeadDim}, opts);
  in.num_heads = kQHeads;
  const at::Tensor inv_freq = at::pow(500000.0, -at::arange(0, kHeadDim, 2, f32) / double(kHeadDim));
  const at::Tensor angles = at::outer(at::arange(seq, f32), inv_freq);
  in.cos = at::cat({angles, angles}, -1).cos().to(dtype);
  in.sin = at::cat({angles, angles}, -1).sin().to(dtype);
  const int64_t attn_bytes = kQHeads * seq * seq * static_cast<int64_t>(c10::elementSize(dtype));

  const at::Tensor kv = at::cat({in.keys, in.values});
  at::Tensor kv_copy = at::empty_like(kv), kept = at::empty_like(kv.narrow(2, 0, seq / 2));
  const double floor_ms = median_ms(
      [&] {
        kv_copy.copy_(kv);
        kept.copy_(kv.narrow(2, 0, seq / 2));
      },
      2, repeats);
  std::printf(
      "kvpress %s on CUDA: compress() of one layer B=1 Hq=%lld Hkv=%lld S=%lld D=%lld %s, ratio 0.5, "
      "median of %d\n",
      KVPRESS_VERSION, (long long)kQHeads, (long long)kKVHeads, (long long)seq, (long long)kHeadDim, dtype_name.c_str(),
      repeats);
  std::printf("bandwidth floor (copy K+V, then the kept half): %.3f ms\n\n", floor_ms);
  std::printf("%-36s %10s %10s\n", "press", "ms", "x floor");
  int status = 0;
  for (const auto& info : kvpress::list_presses()) {
    if (info.kind == kvpress::PressKind::kDecoding || info.kind == kvpress::PressKind::kSecondPass) continue;
    if (kvpress::needs_file(info)) continue;  // QFilterPress: its filters come from a model's file
    kvpress::LayerInputs layer = in;
    if (kvpress::needs_attentions(info.name)) {
      if (attn_bytes > (int64_t{4} << 30)) {
        std::printf("%-36s skipped: attentions [1, %lld, S, S] would take %.1f GiB\n", info.name.c_str(),
                    (long long)kQHeads, attn_bytes / double(int64_t{1} << 30));
        continue;
      }
      layer.attentions = at::softmax(at::randn({1, kQHeads, seq, seq}, f32), -1).tril_().to(dtype);
    }
    try {
      const auto press = kvpress::make_press(info.name, kvpress::ratio_for(info, 0.5), {});
      const double ms = median_ms([&] { (void)press->compress(layer); }, 2, repeats);
      std::printf("%-36s %10.3f %10.1f\n", info.name.c_str(), ms, ms / floor_ms);
    } catch (const c10::Error& e) {
      std::printf("%-36s failed: %s\n", info.name.c_str(), e.what_without_backtrace());
      status = 1;
    }
    std::fflush(stdout);
  }
  return status;
}
