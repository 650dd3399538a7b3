// The bundled TinyStories-656K model and its tokenizer, loaded once per test process (the runner's,
// decoding, KVCompose and pipeline tests).
#pragma once

#include <string>

#include "kvpress/llama/llama.h"

namespace kvpress::testing {

inline const llama::LlamaModel& tiny_model() {
  static const llama::LlamaModel model = llama::LlamaModel::load(llama::resolve_model_dir("tinystories-656k"));
  return model;
}

inline const llama::Tokenizer& tiny_tokenizer() {
  static const llama::Tokenizer tok =
      llama::Tokenizer::load(llama::resolve_model_dir("tinystories-656k") + "/tokenizer.json");
  return tok;
}

}  // namespace kvpress::testing
