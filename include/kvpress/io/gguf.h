// GGUF reader: llama.cpp's single-file model format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md),
// versions 2 and 3, little-endian. A file holds typed metadata (the model's hyper-parameters, its
// tokenizer, its chat template) and tensors, many of them block-quantised; a tensor is dequantised
// to float32 on request, exactly as the `gguf` Python package's dequantize() computes it (the
// reference transformers uses when it loads a GGUF file).
//
// Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. Any other type is
// reported by dequantize() with its name (the file still opens: its other tensors stay readable).
//
// Parsing is bounded by the file: every count, length and offset is checked against the bytes that
// remain before anything is allocated for it, so a corrupt or hostile file raises a c10::Error
// "<function>: <path or origin>: <what>" (tests/fuzz/fuzz_gguf.cpp), never reads out of bounds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace kvpress::io {

// One metadata value. GGUF's integer types (UINT8 .. INT64) read as kInt (a UINT64 above INT64_MAX is
// refused), FLOAT32/FLOAT64 as kFloat.
struct GgufValue {
  enum class Kind { kInt, kFloat, kBool, kString, kArray };
  Kind kind = Kind::kInt;
  int64_t int_value = 0;
  double float_value = 0.0;
  bool bool_value = false;
  std::string string_value;
  std::vector<GgufValue> array;  // kArray: the elements (all of one kind)
};

// A tensor's entry in the file. `shape` is in torch's order (outermost first): GGUF lists the
// contiguous dimension first, so a GGUF [576, 49152] matrix is [49152, 576] here.
struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  uint32_t type = 0;    // ggml type code (0 F32, 1 F16, 2 Q4_0, ...)
  uint64_t offset = 0;  // from the start of the data section
  uint64_t bytes = 0;   // stored size
};

// The name of a ggml type code ("Q4_1", or "type 99" for a code this reader does not know).
std::string gguf_type_name(uint32_t type);

class GgufFile {
 public:
  uint32_t version() const { return version_; }
  const std::string& origin() const { return origin_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  // The metadata value, or nullptr when the file has none under `key`.
  const GgufValue* find(const std::string& key) const;
  // Typed metadata reads: c10::Error "GgufFile: <origin>: metadata <key> is missing" or "... must be
  // <kind>".
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;  // an integer value reads as a float too
  bool get_bool(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;
  // An array of strings (tokenizer.ggml.tokens) or of integers (tokenizer.ggml.token_type).
  std::vector<std::string> get_strings(const std::string& key) const;
  std::vector<int64_t> get_ints(const std::string& key) const;

  // The tensor's entry, or nullptr.
  const GgufTensorInfo* find_tensor(const std::string& name) const;
  // The tensor as float32 [shape] (CPU, owning its memory). Raises for an unknown name or an
  // unsupported type ("... tensor '<name>' has type IQ2_XXS, which this reader cannot dequantize
  // (supported: ...)").
  at::Tensor dequantize(const std::string& name) const;

 private:
  friend struct GgufParser;  // src/io/gguf.cpp
  uint32_t version_ = 0;
  std::string origin_;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
  std::shared_ptr<const void> owner_;  // keeps the bytes alive (a mapping or a string)
  const uint8_t* data_ = nullptr;      // the data section
  uint64_t data_size_ = 0;
};

// Maps `path` read-only and parses it; tensors are read from the mapping when dequantised.
// Raises c10::Error "load_gguf: <path>: <what is wrong>".
GgufFile load_gguf(const std::string& path);

// The same parser on bytes in memory (the fuzzer's entry). Raises "parse_gguf: <origin>: ...".
GgufFile parse_gguf(std::string bytes, const std::string& origin = "<bytes>");

}  // namespace kvpress::io
