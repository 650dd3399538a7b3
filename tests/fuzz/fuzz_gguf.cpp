// libFuzzer target: kvpress::io::parse_gguf (the parser load_gguf maps files through) on arbitrary
// bytes, then dequantize() of every tensor. Every input either parses into tensors that lie inside
// its data section, each dequantising to float32 of its shape or raising a c10::Error that names
// an unsupported type, or raises a c10::Error "parse_gguf: fuzz: ...".
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "kvpress/io/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  kvpress::fuzz::expect_success_or_error([&] {
    const kvpress::io::GgufFile file = kvpress::io::parse_gguf(std::move(bytes), "fuzz");
    for (const auto& info : file.tensors()) {
      FUZZ_EXPECT(info.offset + info.bytes <= size, info.name);
      // Dequantised sizes are bounded by the stored ones (at most 8 floats per stored byte, F32 in
      // Q4 blocks): a file cannot make the reader allocate far beyond its own size.
      FUZZ_EXPECT(info.bytes > 0, info.name);
      kvpress::fuzz::expect_success_or_error([&] {
        const at::Tensor t = file.dequantize(info.name);
        FUZZ_EXPECT(t.scalar_type() == at::kFloat && t.sizes() == at::IntArrayRef(info.shape), info.name);
        FUZZ_EXPECT(static_cast<uint64_t>(t.numel()) <= 8 * info.bytes, info.name);
      });
    }
  });
  return 0;
}
