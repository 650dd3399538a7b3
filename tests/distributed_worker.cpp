// One rank of the distributed tests (tests/test_distributed.cpp starts 2 or 4 of them):
//
//   kvpress_distributed_worker STORE RANK WORLD SCENARIO PRESS RATIO OUT
//
// per_rank: compresses its share of testing::distributed_layer() with PRESS at RATIO and writes the
//           kept indices (int64) then the kept keys and values (float32) to OUT, or for a
//           head-ragged press its keep mask (bool); exit 0.
// global:   the same in global mode.
// die_mid:  global mode; rank 1 leaves after the setup, before the layer: the others' compression
//           (PRESS exchanges across ranks) must raise, not hang; exit 4 when it did.
// mismatch: rank 1 asks for ratio RATIO / 2: every rank's setup must raise; exit 3 when it did.
// die:      rank 1 leaves right after the group forms; the others' setup must raise (not hang);
//           exit 4 when it did.
// stall:    rank 1 sleeps 8 s (past the group's 5 s timeout) before its setup; every rank's setup
//           must raise; exit 4 when it did.
// An unexpected error prints it and exits 1.
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "distributed_layer.h"
#include "kvpress/distributed.h"
#include "kvpress/registry.h"

namespace {

void write_tensor(std::FILE* out, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::fwrite(c.data_ptr(), c.element_size(), static_cast<size_t>(c.numel()), out);
}

int run(int argc, char** argv) {
  using namespace kvpress;  // NOLINT(google-build-using-namespace)
  TORCH_CHECK(argc == 8, "usage: kvpress_distributed_worker STORE RANK WORLD SCENARIO PRESS RATIO OUT");
  const std::string store = argv[1], scenario = argv[4], press_name = argv[5], out_path = argv[7];
  const int rank = std::stoi(argv[2]), world = std::stoi(argv[3]);
  double ratio = std::stod(argv[6]);
  auto group = distributed::gloo_group(store, rank, world, std::chrono::milliseconds(5000));
  if (scenario == "mismatch" && rank == 1) ratio /= 2;
  if (scenario == "die" && rank == 1) std::_Exit(0);  // gone before the setup's all-gather
  if (scenario == "stall" && rank == 1) std::this_thread::sleep_for(std::chrono::seconds(8));
  std::shared_ptr<const BasePress> press = make_press(press_name, ratio);
  const bool global = scenario == "global" || scenario == "die_mid";
  try {
    const distributed::ShardedPress sharded(
        press, group, 4, global ? distributed::BudgetMode::kGlobal : distributed::BudgetMode::kPerRank);
    if (scenario == "die_mid" && rank == 1) std::_Exit(0);  // gone between the setup and the layer
    if (scenario != "per_rank" && scenario != "global" && scenario != "die_mid") return 1;
    const LayerInputs local = distributed::rank_share(testing::distributed_layer(), sharded.shard());
    std::FILE* out = std::fopen(out_path.c_str(), "wb");
    TORCH_CHECK(out != nullptr, "cannot write ", out_path);
    if (press->head_ragged()) {
      write_tensor(out, sharded.compress_ragged(local).keep_mask);
    } else {
      const KV kv = sharded.compress(local);
      write_tensor(out, kv.kept_indices);
      write_tensor(out, kv.keys);
      write_tensor(out, kv.values);
    }
    return std::fclose(out) == 0 ? 0 : 1;
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    std::cerr << "rank " << rank << ": " << what << "\n";
    if (scenario == "mismatch" && what.find("differs from: rank") != std::string::npos) return 3;
    if ((scenario == "die" || scenario == "stall") && what.find("the setup's all-gather failed") != std::string::npos)
      return 4;
    if (scenario == "die_mid" && what.find("an all-gather of per-head scores failed") != std::string::npos) return 4;
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
