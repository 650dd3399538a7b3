// kvpress_press_work: the floor model of benchmarks/press_work.h as JSON, for
// benchmarks/compare_kvpress.py (so the script and kvpress_bench use one definition):
//
//   kvpress_press_work --batch 1 --q-heads 32 --kv-heads 8 --head-dim 128 --seq 16384 --dtype float32
//                      --n-kept 8192 [--threads 2]
//   {"kernel_isa": "avx512", "fma_peak": FLOP/s, "read_bandwidth": B/s, "write_bandwidth": B/s,
//    "copy_bandwidth": B/s (read + written),
//    "presses": {"KnormPress": {"bytes_read": ..., "bytes_written": ..., "flops": ...,
//                               "floor_seconds": ..., "bound": "copy"}, ...}}
//
// The peaks (machine_peaks.h) are measured here, at --threads intra-op threads, right when the
// script asks, in the instruction set the library's kernels use.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <iostream>
#include <map>
#include <string>

#include "bench_util.h"
#include "kvpress/ops.h"
#include "kvpress/registry.h"
#include "press_work.h"

namespace {

int run(int argc, char** argv) {
  std::map<std::string, std::string> options{{"--batch", "1"},      {"--q-heads", "32"}, {"--kv-heads", "8"},
                                             {"--head-dim", "128"}, {"--seq", "16384"},  {"--dtype", "float32"},
                                             {"--n-kept", "-1"},    {"--threads", "0"}};
  for (int i = 1; i < argc; i += 2) {
    const std::string option = argv[i];
    TORCH_CHECK(options.count(option), "kvpress_press_work: unknown option ", option);
    TORCH_CHECK(i + 1 < argc, "kvpress_press_work: ", option, " needs a value");
    options[option] = argv[i + 1];
  }
  const auto integer = [&](const char* option) { return std::stoll(options.at(option)); };
  const std::string dtype_name = options.at("--dtype");
  TORCH_CHECK(dtype_name == "float32" || dtype_name == "bfloat16", "kvpress_press_work: --dtype must be float32 or ",
              "bfloat16, got ", dtype_name);
  const at::ScalarType dtype = dtype_name == "float32" ? at::kFloat : at::kBFloat16;
  if (integer("--threads") > 0) at::set_num_threads(static_cast<int>(integer("--threads")));
  kvpress_bench::LayerShape shape{integer("--batch"),    integer("--q-heads"), integer("--kv-heads"),
                                  integer("--head-dim"), integer("--seq"),     dtype == at::kFloat ? 4 : 2};
  const int64_t n_kept = integer("--n-kept") >= 0 ? integer("--n-kept") : kvpress::ops::n_kept(shape.seq, 0.5);
  const std::string isa = kvpress::ops::cpu_kernel_isa();
  // The bandwidths over the layer's K and V, the data every press reads (as warm as the benchmark's).
  const int64_t kv_bytes = 2 * shape.batch * shape.kv_heads * shape.seq * shape.head_dim * shape.element_size;
  const kvpress_bench::MachinePeaks peaks = kvpress_bench::measure_machine_peaks(isa, kv_bytes);
  nlohmann::json presses = nlohmann::json::object();
  for (const kvpress::PressInfo& info : kvpress::list_presses()) {
    if (const auto work = kvpress_bench::press_work(info.name, shape, n_kept)) {
      const kvpress_bench::Floor floor = kvpress_bench::press_floor(*work, peaks);
      presses[info.name] = {{"bytes_read", work->bytes_read},
                            {"bytes_written", work->bytes_written},
                            {"flops", work->flops},
                            {"floor_seconds", floor.seconds},
                            {"bound", floor.bound}};
    }
  }
  const nlohmann::json out{{"kernel_isa", isa},
                           {"fma_isa", peaks.isa},
                           {"fma_peak", peaks.fma_flops},
                           {"read_bandwidth", peaks.read_bytes},
                           {"write_bandwidth", peaks.write_bytes},
                           {"copy_bandwidth", peaks.copy_bytes},
                           {"presses", presses}};
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return kvpress_bench::guarded_main(run, argc, argv); }
