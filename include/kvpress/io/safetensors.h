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

// Raises c10::Error "load_safetensors: <path>: <what is wrong>" on a missing or unreadable file,
// a malformed header (bad JSON, nesting deeper than 64 levels, unknown dtype, data_offsets out of
// range, not matching shape * itemsize, overlapping or leaving holes in the data buffer) or a
// truncated body. Reads the whole file; tensors own their memory.
SafetensorsFile load_safetensors(const std::string& path);

// The same reader on a file's bytes already in memory (one parser: load_safetensors reads the
// file through it). Raises c10::Error "parse_safetensors: <origin>: <what is wrong>" where
// load_safetensors would.
SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& origin = "<bytes>");

// file.tensors[key]; raises c10::Error "<where> holds no tensor '<key>'" when it is missing (where:
// who reads which file, e.g. "QFilterPress: filters.safetensors").
const at::Tensor& required_tensor(const SafetensorsFile& file, const std::string& key, const std::string& where);

// Writes every tensor (moved to CPU, made contiguous). Deterministic: header keys in name order,
// data widest dtype first then by name (every tensor aligned to its element size), header padded
// with spaces to a multiple of 8 bytes. Written to "<path>.tmp" and renamed into place, so a
// failure never leaves a partial file. Raises c10::Error "save_safetensors: <path>: ..." on an
// unsupported dtype, an undefined tensor, a reserved or empty name, or an I/O failure.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace kvpress::io
