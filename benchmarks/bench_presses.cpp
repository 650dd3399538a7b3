// kvpress_bench: times every press of the registry, and selection+gather alone, at the shape of
// one Llama-3.1-8B layer (B=1, Hq=32, Hkv=8, D=128) for S in {4096, 16384, 32768}, float32 and
// bfloat16, compression ratio 0.5. See benchmarks/README.md.
//
// Extra flags (removed before Google Benchmark parses the rest):
//   --device=cpu|cuda        where the inputs live (default cpu; also env KVPRESS_BENCH_DEVICE)
//   --attn_budget_gib=X      largest [B,Hq,S,S] attention tensor to build for
//                            ObservedAttentionPress (default 2 GiB: S=4096 only)
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvpress/kvpress.h"
#include "press_work.h"

namespace {

constexpr int64_t kBatch = 1;
constexpr int64_t kQHeads = 32;
constexpr int64_t kKVHeads = 8;
constexpr int64_t kHeadDim = 128;
constexpr int64_t kHidden = kQHeads * kHeadDim;  // 4096
constexpr int64_t kWindow = 64;                  // post-RoPE queries handed to attention presses
constexpr double kRopeTheta = 500000.0;          // Llama-3.1
constexpr double kRatio = 0.5;
const int64_t kSeqLens[] = {4096, 16384, 32768};
const at::ScalarType kDTypes[] = {at::kFloat, at::kBFloat16};

at::Device g_device = at::kCPU;
double g_attn_budget_gib = 2.0;

const char* dtype_name(at::ScalarType t) { return t == at::kFloat ? "fp32" : "bf16"; }

int64_t nbytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

void sync() {
  if (g_device.is_cuda()) at::detail::getCUDAHooks().deviceSynchronize(g_device.index() < 0 ? 0 : g_device.index());
}

// Random inputs of one (S, dtype), built lazily and only once. Benchmarks are registered with the
// shape as the outer loop, so holding a single shape at a time keeps memory at one shape's worth.
struct ShapeData {
  int64_t S = -1;
  at::ScalarType dtype = at::kFloat;
  at::Tensor keys, values, queries, all_queries, attentions, hidden_states, q_proj, k_proj, cos, sin, scores;

  at::TensorOptions opts() const { return at::TensorOptions().dtype(dtype).device(g_device); }

  void ensure_kv() {
    if (keys.defined()) return;
    at::manual_seed(0);
    keys = at::randn({kBatch, kKVHeads, S, kHeadDim}, opts());
    values = at::randn({kBatch, kKVHeads, S, kHeadDim}, opts());
  }
  void ensure_queries() {
    if (!queries.defined()) queries = at::randn({kBatch, kQHeads, kWindow, kHeadDim}, opts());
  }
  // Post-RoPE queries of every position (NonCausalAttnPress, CompactorPress): [B, Hq, S, D],
  // 512 MiB at S=32768 in fp32.
  void ensure_all_queries() {
    if (!all_queries.defined()) all_queries = at::randn({kBatch, kQHeads, S, kHeadDim}, opts());
  }
  void ensure_rope() {
    if (cos.defined()) return;
    auto f = at::TensorOptions().dtype(at::kFloat).device(g_device);
    auto inv_freq = at::pow(kRopeTheta, -at::arange(0, kHeadDim, 2, f) / double(kHeadDim));
    auto angles = at::outer(at::arange(S, f), inv_freq);  // [S, D/2]
    auto emb = at::cat({angles, angles}, -1);             // [S, D] (HF layout)
    cos = emb.cos().to(dtype);
    sin = emb.sin().to(dtype);
  }
  void ensure_hidden() {
    if (hidden_states.defined()) return;
    hidden_states = at::randn({kBatch, S, kHidden}, opts());
    q_proj = at::randn({kQHeads * kHeadDim, kHidden}, opts()) / std::sqrt(double(kHidden));
    k_proj = at::randn({kKVHeads * kHeadDim, kHidden}, opts()) / std::sqrt(double(kHidden));
    ensure_rope();
  }
  // Causal rows of non-negative weights summing to 1, built in place (one S x S tensor of memory).
  void ensure_attentions() {
    if (attentions.defined()) return;
    attentions = at::empty({kBatch, kQHeads, S, S}, opts());
    attentions.uniform_();
    attentions.tril_();
    attentions.div_(attentions.sum(-1, /*keepdim=*/true));
  }
  void ensure_scores() {
    if (!scores.defined())
      scores = at::rand({kBatch, kKVHeads, S}, at::TensorOptions().dtype(at::kFloat).device(g_device));
  }
};

ShapeData g_data;

ShapeData& shape_data(int64_t S, at::ScalarType dtype) {
  ShapeData& data = g_data;
  if (data.S != S || data.dtype != dtype) {
    data = ShapeData{};  // frees the previous shape first
    data.S = S;
    data.dtype = dtype;
  }
  data.ensure_kv();
  return data;
}

// Which optional inputs a press gets, from its registry inputs (PressInfo::inputs). Preference:
// post-RoPE queries (what an engine has; of every position when the press needs them all, with
// cos/sin when it names them), then full attentions, then the hidden_states + projections path;
// presses whose first choice is cos+sin get only the RoPE tables.
enum class Feed { kNone, kQueries, kAllQueries, kRope, kAttentions, kHidden };

Feed feed_for(const kvpress::PressInfo& info) {
  const auto& alternatives = info.inputs.alternatives;
  const auto has = [](const kvpress::InputSet& set, const char* field) {
    return std::find(set.fields.begin(), set.fields.end(), field) != set.fields.end();
  };
  const auto any = [&](const char* field, bool all_positions) {
    return std::any_of(alternatives.begin(), alternatives.end(), [&](const kvpress::InputSet& set) {
      return has(set, field) && set.all_positions == all_positions;
    });
  };
  if (any("queries", true)) return Feed::kAllQueries;
  if (!alternatives.empty() && has(alternatives.front(), "cos") && !has(alternatives.front(), "hidden_states"))
    return Feed::kRope;
  if (any("queries", false)) return Feed::kQueries;
  if (any("attentions", false) || any("attentions", true)) return Feed::kAttentions;
  if (std::any_of(alternatives.begin(), alternatives.end(), [&](const auto& set) { return has(set, "hidden_states"); }))
    return Feed::kHidden;
  return Feed::kNone;
}

double attention_gib(int64_t S, at::ScalarType dtype) {
  return double(kBatch * kQHeads) * double(S) * double(S) * double(c10::elementSize(dtype)) /
         (1024.0 * 1024.0 * 1024.0);
}

// bytes: every input tensor read once (K, V and whatever else the press was given);
// items: cached tokens compressed.
void finish(benchmark::State& state, int64_t S, int64_t bytes_per_iter) {
  state.SetBytesProcessed(state.iterations() * bytes_per_iter);
  state.SetItemsProcessed(state.iterations() * kBatch * S);
}

// This machine's true limits (machine_peaks.h) over a layer's K and V of `kv_bytes`, measured once per
// size, at the first press that needs them, with the benchmarks' thread count and in the kernels'
// instruction set.
const kvpress_bench::MachinePeaks& machine_peaks(int64_t kv_bytes) {
  static std::map<int64_t, kvpress_bench::MachinePeaks> peaks;
  auto it = peaks.find(kv_bytes);
  if (it == peaks.end())
    it = peaks.emplace(kv_bytes, kvpress_bench::measure_machine_peaks(kvpress::ops::cpu_kernel_isa(), kv_bytes)).first;
  return it->second;
}

// With a floor model (press_work.h, CPU): bytes/s counts the bytes that must move and
// floor_fraction is the floor over the time per call (1 = at the physical limit); x_floor is its
// inverse. Without one, bytes/s counts the inputs read.
void finish_press(benchmark::State& state, const std::string& name, int64_t S, at::ScalarType dtype,
                  int64_t input_bytes, double seconds) {
  const kvpress_bench::LayerShape shape{
      kBatch, kQHeads, kKVHeads, kHeadDim, S, static_cast<int64_t>(at::elementSize(dtype)), kWindow};
  const auto work =
      g_device.is_cpu() ? kvpress_bench::press_work(name, shape, kvpress::ops::n_kept(S, kRatio)) : std::nullopt;
  if (!work) return finish(state, S, input_bytes);
  finish(state, S, static_cast<int64_t>(work->bytes()));
  const int64_t kv_bytes = 2 * kBatch * kKVHeads * S * kHeadDim * static_cast<int64_t>(at::elementSize(dtype));
  const double floor = kvpress_bench::press_floor(*work, machine_peaks(kv_bytes)).seconds;
  const double per_call = seconds / static_cast<double>(std::max<benchmark::IterationCount>(state.iterations(), 1));
  state.counters["floor_fraction"] = floor / per_call;
  state.counters["x_floor"] = per_call / floor;
}

void bench_press(benchmark::State& state, std::string name, Feed feed, int64_t S, at::ScalarType dtype) {
  ShapeData& d = shape_data(S, dtype);
  std::unique_ptr<kvpress::BasePress> press;
  try {
    press = kvpress::make_press(name, kvpress::ratio_for(*kvpress::find_press(name), kRatio));
  } catch (const c10::Error& e) {
    state.SkipWithError(e.what_without_backtrace());
    return;
  }

  kvpress::LayerInputs in;
  in.keys = d.keys;
  in.values = d.values;
  in.num_heads = kQHeads;
  in.layer_idx = 0;
  in.num_layers = 32;
  int64_t bytes = nbytes(d.keys) + nbytes(d.values);
  switch (feed) {
    case Feed::kNone: break;
    case Feed::kQueries:
      d.ensure_queries();
      in.queries = d.queries;
      bytes += nbytes(d.queries);
      break;
    case Feed::kAllQueries:
      d.ensure_all_queries();
      d.ensure_rope();
      in.queries = d.all_queries;
      in.cos = d.cos;
      in.sin = d.sin;
      bytes += nbytes(d.all_queries) + nbytes(d.cos) + nbytes(d.sin);
      break;
    case Feed::kRope:
      d.ensure_rope();
      in.cos = d.cos;
      in.sin = d.sin;
      bytes += nbytes(d.cos) + nbytes(d.sin);
      break;
    case Feed::kAttentions:
      d.ensure_attentions();
      in.attentions = d.attentions;
      bytes += nbytes(d.attentions);
      break;
    case Feed::kHidden:
      d.ensure_hidden();
      in.hidden_states = d.hidden_states;
      in.q_proj = d.q_proj;
      in.k_proj = d.k_proj;
      in.cos = d.cos;
      in.sin = d.sin;
      bytes += nbytes(d.hidden_states) + nbytes(d.q_proj) + nbytes(d.k_proj) + nbytes(d.cos) + nbytes(d.sin);
      break;
  }
  sync();

  const auto start = std::chrono::steady_clock::now();  // the loop's wall time, for the floor counters
  for (auto _ : state) {
    try {
      kvpress::KV kv = press->compress(in);
      sync();
      benchmark::DoNotOptimize(kv.keys.data_ptr());
    } catch (const c10::Error& e) {
      state.SkipWithError(e.what_without_backtrace());
      break;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!state.error_occurred()) finish_press(state, name, S, dtype, bytes, seconds);
}

void bench_selection_gather(benchmark::State& state, int64_t S, at::ScalarType dtype) {
  ShapeData& d = shape_data(S, dtype);
  d.ensure_scores();
  const int64_t k = kvpress::ops::n_kept(S, kRatio);
  sync();
  for (auto _ : state) {
    try {
      at::Tensor idx = kvpress::ops::topk_indices(d.scores, k);
      kvpress::KV kv = kvpress::ops::gather_kv(d.keys, d.values, idx);
      sync();
      benchmark::DoNotOptimize(kv.keys.data_ptr());
    } catch (const c10::Error& e) {
      state.SkipWithError(e.what_without_backtrace());
      break;
    }
  }
  if (!state.error_occurred()) finish(state, S, nbytes(d.keys) + nbytes(d.values) + nbytes(d.scores));
}

// Strips our own flags from argv (Google Benchmark rejects flags it does not know) and returns
// the arguments for Google Benchmark, with this suite's default timing flags unless given:
// 0.3 s per benchmark after a 0.05 s warm-up, so the whole suite takes a few minutes.
std::vector<char*> parse_own_flags(int argc, char** argv) {
  if (const char* env = std::getenv("KVPRESS_BENCH_DEVICE")) g_device = at::Device(env);
  static char min_time[] = "--benchmark_min_time=0.3";
  static char warmup[] = "--benchmark_min_warmup_time=0.05";
  std::vector<char*> out = {argv[0]};
  bool has_min_time = false, has_warmup = false;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    has_min_time |= std::strncmp(a, "--benchmark_min_time", 20) == 0;
    has_warmup |= std::strncmp(a, "--benchmark_min_warmup_time", 27) == 0;
    if (std::strncmp(a, "--device=", 9) == 0) {
      g_device = at::Device(std::string(a + 9));
    } else if (std::strncmp(a, "--attn_budget_gib=", 18) == 0) {
      g_attn_budget_gib = std::atof(a + 18);
    } else {
      out.push_back(argv[i]);
    }
  }
  if (!has_min_time) out.push_back(min_time);
  if (!has_warmup) out.push_back(warmup);
  out.push_back(nullptr);
  return out;
}

void register_all() {
  const auto& presses = kvpress::list_presses();
  std::vector<std::string> skipped, needs_a_file;
  for (int64_t S : kSeqLens) {
    for (at::ScalarType dtype : kDTypes) {
      const std::string suffix = std::string("/") + dtype_name(dtype) + "/S:" + std::to_string(S);
      for (const auto& info : presses) {
        if (info.kind == kvpress::PressKind::kSecondPass) continue;  // no layer-level compress (KVComposePress)
        if (kvpress::needs_file(info)) {  // QFilterPress: its filters come from a model's file
          needs_a_file.push_back(info.name + suffix);
          continue;
        }
        const Feed feed = feed_for(info);
        if (feed == Feed::kAttentions && attention_gib(S, dtype) > g_attn_budget_gib) {
          skipped.push_back(info.name + suffix);
          continue;
        }
        benchmark::RegisterBenchmark((info.name + suffix).c_str(), bench_press, info.name, feed, S, dtype)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
      benchmark::RegisterBenchmark(("SelectionGather" + suffix).c_str(), bench_selection_gather, S, dtype)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }

  benchmark::AddCustomContext("kvpress_version", KVPRESS_VERSION);
  benchmark::AddCustomContext("device", g_device.str());
  benchmark::AddCustomContext("torch_threads", std::to_string(at::get_num_threads()));
  benchmark::AddCustomContext(
      "shape",
      "B=1 Hq=32 Hkv=8 D=128 (Llama-3.1-8B layer), ratio 0.5, queries [1,32,64,128] "
      "(NonCausalAttnPress, CompactorPress: [1,32,S,128] + cos/sin; LeverageScorePress: cos/sin)");
  for (const auto& [key, names] :
       {std::pair{"not_run_attentions_over_budget", &skipped}, std::pair{"not_run_needs_a_file", &needs_a_file}}) {
    if (names->empty()) continue;
    std::string list;
    for (const auto& s : *names) list += (list.empty() ? "" : ", ") + s;
    benchmark::AddCustomContext(key, list);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  try {
    args = parse_own_flags(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "kvpress_bench: %s\n", e.what_without_backtrace());
    return 1;
  }
  int bench_argc = static_cast<int>(args.size()) - 1;
  if (g_device.is_cuda() && !at::detail::getCUDAHooks().hasCUDA()) {
    std::fprintf(stderr, "kvpress_bench: --device=cuda but no CUDA device is available\n");
    return 1;
  }
  register_all();
  benchmark::Initialize(&bench_argc, args.data());
  if (benchmark::ReportUnrecognizedArguments(bench_argc, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  g_data = ShapeData{};  // free device memory before the CUDA runtime shuts down
  benchmark::Shutdown();
  return 0;
}
