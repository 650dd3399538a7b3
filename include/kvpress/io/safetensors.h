// Minimal safetensors reader/writer (https://huggingface.co/docs/safetensors): the file format of
// kvpress-cli and of the parity fixtures. Supports F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace kvpress::io {

struct SafetensorsFile {
  std::map<std::string, at::Tensor> tensors;    // CPU, contiguous
  std::map<std::string, std::string> metadata;  // the optional "__metadata__" string map
};

// Raises c10::Error naming the file on a missing file, a malformed header or a truncated body.
SafetensorsFile load_safetensors(const std::string& path);

// Writes every tensor (moved to CPU, made contiguous) in name order.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace kvpress::io
