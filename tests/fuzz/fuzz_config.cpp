// libFuzzer target: kvpress::llama::LlamaConfig::from_json on arbitrary text. Every input either
// raises a c10::Error "LlamaConfig: fuzz: ..." or gives a config the runner can be built from.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "kvpress/llama/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  kvpress::fuzz::expect_success_or_error([&] {
    const kvpress::llama::LlamaConfig c = kvpress::llama::LlamaConfig::from_json(text, "fuzz");
    FUZZ_EXPECT(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 && c.num_layers > 0,
                "a size is not positive");
    FUZZ_EXPECT(c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0, "heads");
    FUZZ_EXPECT(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim " + std::to_string(c.head_dim));
    FUZZ_EXPECT(std::isfinite(c.rope_theta) && c.rope_theta > 0, "rope_theta " + std::to_string(c.rope_theta));
    FUZZ_EXPECT(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps >= 0, "rms_norm_eps " + std::to_string(c.rms_norm_eps));
    FUZZ_EXPECT(c.max_position_embeddings >= 0, "max_position_embeddings");
  });
  return 0;
}
