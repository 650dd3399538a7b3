// The runner on the configurations real checkpoints use, against transformers.
//
// ArchitectureParity.*  against tests/reference/make_architecture_fixtures.py: random-weight models
//                saved by transformers (Llama 3.1's llama3 RoPE scaling, linear RoPE scaling, Mistral
//                without a sliding window, Llama with attention biases, Qwen2's q/k/v biases,
//                Qwen3's q/k norms with tied embeddings), loaded from their folders; the prefill
//                logits of 1, 100 and 4096 random tokens must be within 1e-4 of transformers'
//                float32 eager logits, and each model's feature must move transformers' own logits
//                by far more than that (a RoPE scaling at 4096 tokens; biases and norms against
//                LlamaForCausalLM on the same weights without them), so a runner that ignored it
//                could not pass.
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
  // Each model, and transformers' logits without its feature at the length where it must matter
  // (n = 0: Mistral is Llama's computation, no control).
  const struct {
    const char* name;
    int control_length;
    const char* control;
  } models[] = {{"llama3_rope", 4096, "logits_4096_unscaled"},
                {"linear_rope", 4096, "logits_4096_unscaled"},
                {"mistral", 0, ""},
                {"llama_bias", 100, "logits_100_as_llama"},
                {"qwen2", 100, "logits_100_as_llama"},
                {"qwen3", 100, "logits_100_as_llama"}};
  for (const auto& [name, control_length, control] : models) {
    SCOPED_TRACE(name);
    const std::string folder = dir + "/architectures/" + std::string(name);
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
      if (n == control_length)
        EXPECT_GT((kvpress::testing::fixture_tensor(ref, control, path) - expected).abs().max().item<double>(),
                  100 * kLogitTolerance)
            << name << ": " << control << " should differ from the logits (the feature must matter)";
    }
  }
}

}  // namespace
