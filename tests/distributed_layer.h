// The layer the distributed tests compress: the same on every rank and in the test process.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvpress/distributed.h"
#include "kvpress/types.h"

namespace kvpress::testing {

// A fresh folder under $TMPDIR (or /tmp) for a group's file store and the ranks' outputs, removed
// with its files when it goes. POSIX calls, not std::filesystem: in these binaries its symbols may
// resolve into libtorch's own copy, whose remove_all crashes now and then.
class TemporaryFolder {
 public:
  explicit TemporaryFolder(const std::string& prefix) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/" + prefix + "_XXXXXX";
    TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr, "TemporaryFolder: cannot make ", pattern);
    path_ = pattern;
  }
  ~TemporaryFolder() {
    if (DIR* dir = ::opendir(path_.c_str())) {
      while (const dirent* entry = ::readdir(dir))
        if (std::string(entry->d_name) != "." && std::string(entry->d_name) != "..")
          std::remove((path_ + "/" + entry->d_name).c_str());
      ::closedir(dir);
    }
    ::rmdir(path_.c_str());
  }
  TemporaryFolder(const TemporaryFolder&) = delete;
  TemporaryFolder& operator=(const TemporaryFolder&) = delete;

  // A file in the folder.
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// B = 1, Hkv = 4 (so 2 and 4 ranks divide it), Hq = 8, S = 96, D = 16; keys, values and the
// queries of every position, seeded. Head h's keys are scaled by 1 + h/2, so that presses setting
// budgets across heads (AdaKVPress over key norms) give the heads different ones.
inline LayerInputs distributed_layer(uint64_t seed = 7) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  LayerInputs in;
  in.keys = at::randn({1, 4, 96, 16}, generator) * (at::arange(4, at::kFloat) * 0.5 + 1).view({1, 4, 1, 1});
  in.values = at::randn({1, 4, 96, 16}, generator);
  in.queries = at::randn({1, 8, 96, 16}, generator);
  in.num_heads = 8;
  return in;
}

// The prompt of the prefill -> decode transfer tests (tests/transfer_worker.cpp): 150 token ids of
// tinystories-656k's vocabulary drawn from a fixed seed, BOS first; and the tokens generated.
inline std::vector<int64_t> transfer_prompt() {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor ids = at::randint(3, 2000, {150}, generator, at::kLong);
  std::vector<int64_t> prompt(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  prompt[0] = 1;
  return prompt;
}
constexpr int64_t kTransferNewTokens = 12;

}  // namespace kvpress::testing
