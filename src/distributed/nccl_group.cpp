// distributed::nccl_group (kvpress/distributed.h): a c10d process group with torch's NCCL backend for
// CUDA tensors. Compiled with the CUDA build only (USE_C10D_NCCL, NCCL's header from the torch
// wheel's nvidia-nccl package); it declares, libtorch_cuda defines. It has run on no GPU yet: the
// GPU check runs it (benchmarks/gpu_check.sh, DistributedCuda tests).
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "kvpress/distributed.h"

namespace kvpress::distributed {

c10::intrusive_ptr<c10d::ProcessGroup> nccl_group(const std::string& store_path, int rank, int world,
                                                  std::chrono::milliseconds timeout) {
  TORCH_CHECK(world > 0 && rank >= 0 && rank < world, "nccl_group: rank must be in [0, world), got rank ", rank,
              " of world ", world);
  TORCH_CHECK(timeout.count() > 0, "nccl_group: timeout must be > 0 ms, got ", timeout.count());
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world);
  store->setTimeout(timeout);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  return group;
}

}  // namespace kvpress::distributed
