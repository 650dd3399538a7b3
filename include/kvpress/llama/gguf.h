// A Llama-family checkpoint in one GGUF file (llama.cpp's format), as the runner's three inputs:
// a config.json, a tokenizer.json and Hugging Face-named weights.
//
//   const auto ckpt = kvpress::llama::read_gguf_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf");
//   LlamaModel model(LlamaConfig::from_json(ckpt.config_json, path), ckpt.weights);
//   Tokenizer tokenizer = Tokenizer::from_json(ckpt.tokenizer_json, path);
//
// (kvpress::llama::load_checkpoint does this for a .gguf path or name.) Supported:
//   general.architecture  llama (Llama 2/3, SmolLM2, Mistral), qwen2, qwen3
//   tensors               every type kvpress::io::GgufFile dequantises, to float32 once at load;
//                         llama's q/k projections are un-permuted (llama.cpp's converter
//                         interleaves their RoPE halves; transformers undoes it the same way)
//   tokenizer.ggml.model  gpt2 (byte-level BPE) with tokenizer.ggml.pre smollm, gpt-2, llama-bpe or
//                         qwen2: the pre-tokenizer llama.cpp runs for that name, written as the
//                         model family's tokenizer.json writes it (transformers' own GGUF
//                         conversion drops the pre-tokenizer's Digits and Split steps; we do not)
// Anything else (an architecture, a tensor the architecture does not use, Llama 3.1's
// rope_freqs.weight, a SentencePiece tokenizer, another pre-tokenizer) raises a c10::Error
// "read_gguf_checkpoint: <path>: ..." naming it.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace kvpress::llama {

struct GgufCheckpoint {
  std::string config_json;                    // config.json text for LlamaConfig::from_json
  std::string tokenizer_json;                 // tokenizer.json text for Tokenizer::from_json
  std::string chat_template;                  // tokenizer.chat_template (Jinja), "" when the file has none
  std::map<std::string, at::Tensor> weights;  // float32, named as in a Hugging Face checkpoint
};

GgufCheckpoint read_gguf_checkpoint(const std::string& path);

}  // namespace kvpress::llama
