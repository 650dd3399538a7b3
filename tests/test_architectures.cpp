// The runner on the configurations real checkpoints use, against transformers.
//
// ArchitectureParity.*  against tests/reference/make_architecture_fixtures.py: random-weight models
//                saved by transformers (Llama 3.1's llama3 RoPE scaling, linear RoPE scaling, Mistral
//                without a sliding window), loaded
//                from their folders; the prefill logits of 1, 100 and 4096 random tokens must be
//                within 1e-4 of transformers' float32 eager logits, and at 4096 tokens a scaling
//                must move transformers' own logits by far more than that (so a runner that ignored
//                it could not pass).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <string>

#include "fixtures.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/llama/model.h"

namespace {

using kvpress::llama::KVCache;
using kvpress::llama::LlamaModel;

constexpr double kLogitTolerance = 1e-4;  // issue 32: logits within 1e-4 of transformers

TEST(ArchitectureParity, LogitsMatchTransformers) {
  const std::string dir = kvpress::testing::fixtures_dir();
  ASSERT_FALSE(dir.empty()) << "KVPRESS_FIXTURES is not set; " << kvpress::testing::fixtures_howto();
  for (const std::string name : {"llama3_rope", "linear_rope", "mistral"}) {
    const bool scaled = name != "mistral";
    SCOPED_TRACE(name);
    const std::string folder = dir + "/architectures/" + name;
    const LlamaModel model = LlamaModel::load(folder);
    const std::string path = folder + "/logits.safetensors";
    const kvpress::io::SafetensorsFile& ref = kvpress::testing::load_fixture_file(path);
    for (int n : {1, 100, 4096}) {
      const at::Tensor ids = kvpress::testing::fixture_tensor(ref, "ids_" + std::to_string(n), path);
      const at::Tensor expected = kvpress::testing::fixture_tensor(ref, "logits_" + std::to_string(n), path);
      KVCache cache = model.new_cache();
      const at::Tensor logits = model.prefill(ids, cache).logits;
      ASSERT_EQ(logits.sizes(), expected.sizes()) << n << " tokens";
      const double diff = (logits - expected).abs().max().item<double>();
      EXPECT_LE(diff, kLogitTolerance) << name << ", " << n << " tokens: max |ours - transformers| " << diff;
      std::cout << name << ", " << n << " tokens: max |ours - transformers| " << diff << "\n";
      if (n == 4096 && scaled) {
        const at::Tensor unscaled = kvpress::testing::fixture_tensor(ref, "logits_4096_unscaled", path);
        EXPECT_GT((unscaled - expected).abs().max().item<double>(), 100 * kLogitTolerance)
            << name << ": the RoPE scaling should change the logits at 4096 tokens";
      }
    }
  }
}

}  // namespace
