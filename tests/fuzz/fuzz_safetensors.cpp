// libFuzzer target: kvpress::io::parse_safetensors (the parser load_safetensors reads files with)
// on arbitrary bytes. Every input either parses into CPU tensors that tile the data buffer or
// raises a c10::Error "parse_safetensors: fuzz: ...".
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "kvpress/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  kvpress::fuzz::expect_success_or_error([&] {
    const kvpress::io::SafetensorsFile file = kvpress::io::parse_safetensors(bytes, "fuzz");
    uint64_t total_bytes = 0;
    for (const auto& [name, tensor] : file.tensors) {
      FUZZ_EXPECT(tensor.defined() && tensor.is_cpu() && tensor.is_contiguous(), name);
      total_bytes += tensor.nbytes();
      if (tensor.scalar_type() == at::kBool) {
        const auto* flags = static_cast<const uint8_t*>(tensor.data_ptr());
        for (int64_t i = 0; i < tensor.numel(); ++i) FUZZ_EXPECT(flags[i] <= 1, name);
      }
    }
    // The tensors tile the data buffer (the format's rule): a file cannot make the reader allocate
    // more than its own size.
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
    FUZZ_EXPECT(total_bytes == size - 8 - header_len, "tensor bytes differ from the data buffer's");
  });
  return 0;
}
