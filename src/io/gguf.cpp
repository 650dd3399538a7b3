// GGUF reader and dequantisation (include/kvpress/io/gguf.h).
//
// File layout (v2/v3, little-endian): "GGUF", uint32 version, uint64 tensor count, uint64 metadata
// count; the metadata (key string, uint32 value type, value); the tensor infos (name string,
// uint32 n_dims, uint64 dims[n_dims] contiguous first, uint32 ggml type, uint64 offset); padding to
// general.alignment (default 32); the data section. A string is a uint64 length and its bytes.
//
// The block formats follow ggml's (and the gguf package's numpy dequantize(), which is the
// reference): every block has float16 scales and packed integers, and each value is computed in
// float32 with the package's operations in its order. This file is compiled without fused
// multiply-add (CMakeLists.txt), so `d * q + m` rounds twice, as numpy does.
#include "kvpress/io/gguf.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the GGUF reader reads little-endian bytes in place");
#endif

namespace kvpress::io {
namespace {

// ggml type codes (ggml.h's enum ggml_type).
enum GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

// Block size (values) and bytes per block of every type the file format defines, so that a tensor
// of a type we cannot dequantize still has a checked extent.
struct TypeInfo {
  uint32_t code;
  const char* name;
  int64_t block;  // values per block
  int64_t bytes;  // bytes per block
  bool supported;
};
constexpr int64_t kQK_K = 256;
constexpr TypeInfo kTypes[] = {
    {0, "F32", 1, 4, true},
    {1, "F16", 1, 2, true},
    {2, "Q4_0", 32, 18, true},
    {3, "Q4_1", 32, 20, true},
    {6, "Q5_0", 32, 22, true},
    {7, "Q5_1", 32, 24, true},
    {8, "Q8_0", 32, 34, true},
    {9, "Q8_1", 32, 40, false},
    {10, "Q2_K", kQK_K, 84, false},
    {11, "Q3_K", kQK_K, 110, false},
    {12, "Q4_K", kQK_K, 144, true},
    {13, "Q5_K", kQK_K, 176, true},
    {14, "Q6_K", kQK_K, 210, true},
    {15, "Q8_K", kQK_K, 292, false},
    {16, "IQ2_XXS", kQK_K, 66, false},
    {17, "IQ2_XS", kQK_K, 74, false},
    {18, "IQ3_XXS", kQK_K, 98, false},
    {19, "IQ1_S", kQK_K, 50, false},
    {20, "IQ4_NL", 32, 18, false},
    {21, "IQ3_S", kQK_K, 110, false},
    {22, "IQ2_S", kQK_K, 82, false},
    {23, "IQ4_XS", kQK_K, 136, false},
    {24, "I8", 1, 1, false},
    {25, "I16", 1, 2, false},
    {26, "I32", 1, 4, false},
    {27, "I64", 1, 8, false},
    {28, "F64", 1, 8, false},
    {29, "IQ1_M", kQK_K, 56, false},
    {30, "BF16", 1, 2, true},
    {34, "TQ1_0", kQK_K, 54, false},
    {35, "TQ2_0", kQK_K, 66, false},
};

const TypeInfo* type_info(uint32_t code) {
  for (const TypeInfo& t : kTypes)
    if (t.code == code) return &t;
  return nullptr;
}

std::string supported_types() {
  std::string out;
  for (const TypeInfo& t : kTypes) {
    if (!t.supported) continue;
    if (!out.empty()) out += ", ";
    out += t.name;
  }
  return out;
}

// GGUF metadata value types.
enum ValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
// The fewest bytes one value of the type takes (an empty string or array still has its length).
uint64_t min_value_bytes(uint32_t type) {
  switch (type) {
    case kUint8:
    case kInt8:
    case kBool: return 1;
    case kUint16:
    case kInt16: return 2;
    case kUint32:
    case kInt32:
    case kFloat32: return 4;
    case kUint64:
    case kInt64:
    case kFloat64:
    case kString: return 8;
    case kArray: return 12;
    default: return 0;
  }
}

constexpr int kMaxArrayDepth = 8;  // arrays of arrays; real files nest at most once
constexpr uint32_t kMaxDims = 4;   // GGML_MAX_DIMS

float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

}  // namespace

std::string gguf_type_name(uint32_t type) {
  const TypeInfo* t = type_info(type);
  return t ? t->name : "type " + std::to_string(type);
}

// Reads the file's structure from [data, data + size) with every read bounds-checked.
struct GgufParser {
  const uint8_t* data;
  uint64_t size;
  uint64_t pos = 0;
  std::string function, origin;

  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    TORCH_CHECK(false, function, ": ", origin, ": ", args...);
  }
  void need(uint64_t n, const char* what) const {
    if (n > size - pos)
      fail("truncated: ", what, " needs ", n, " bytes at offset ", pos, ", the file has ", size - pos);
  }
  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, data + pos, sizeof(T));
    pos += sizeof(T);
    return value;
  }
  std::string read_string(const char* what) {
    const uint64_t length = read<uint64_t>(what);
    need(length, what);
    std::string out(reinterpret_cast<const char*>(data + pos), length);
    pos += length;
    return out;
  }

  GgufValue read_value(uint32_t type, const std::string& key, int depth) {
    GgufValue v;
    switch (type) {
      case kUint8: v.int_value = read<uint8_t>("a value"); break;
      case kInt8: v.int_value = read<int8_t>("a value"); break;
      case kUint16: v.int_value = read<uint16_t>("a value"); break;
      case kInt16: v.int_value = read<int16_t>("a value"); break;
      case kUint32: v.int_value = read<uint32_t>("a value"); break;
      case kInt32: v.int_value = read<int32_t>("a value"); break;
      case kInt64: v.int_value = read<int64_t>("a value"); break;
      case kUint64: {
        const uint64_t u = read<uint64_t>("a value");
        if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          fail("metadata ", key, ": UINT64 value ", u, " exceeds INT64_MAX");
        v.int_value = static_cast<int64_t>(u);
        break;
      }
      case kFloat32:
        v.kind = GgufValue::Kind::kFloat;
        v.float_value = read<float>("a value");
        break;
      case kFloat64:
        v.kind = GgufValue::Kind::kFloat;
        v.float_value = read<double>("a value");
        break;
      case kBool: {
        const uint8_t b = read<uint8_t>("a value");
        if (b > 1) fail("metadata ", key, ": a BOOL must be 0 or 1, got ", static_cast<int>(b));
        v.kind = GgufValue::Kind::kBool;
        v.bool_value = b == 1;
        break;
      }
      case kString:
        v.kind = GgufValue::Kind::kString;
        v.string_value = read_string("a string value");
        break;
      case kArray: {
        if (depth >= kMaxArrayDepth) fail("metadata ", key, ": arrays nested deeper than ", kMaxArrayDepth);
        const uint32_t element_type = read<uint32_t>("an array's element type");
        const uint64_t count = read<uint64_t>("an array's length");
        const uint64_t min_bytes = min_value_bytes(element_type);
        if (min_bytes == 0) fail("metadata ", key, ": unknown array element type ", element_type);
        // Bounded before anything is allocated: each element takes at least min_bytes.
        if (count > (size - pos) / min_bytes)
          fail("metadata ", key, ": an array of ", count, " elements cannot fit in the ", size - pos, " bytes left");
        v.kind = GgufValue::Kind::kArray;
        v.array.reserve(count);
        for (uint64_t i = 0; i < count; ++i) v.array.push_back(read_value(element_type, key, depth + 1));
        break;
      }
      default: fail("metadata ", key, ": unknown value type ", type);
    }
    return v;
  }

  GgufFile parse(std::shared_ptr<const void> owner) {
    GgufFile file;
    file.origin_ = origin;
    file.owner_ = std::move(owner);
    need(4, "the magic");
    if (std::memcmp(data, "GGUF", 4) != 0) fail("not a GGUF file (the first 4 bytes are not \"GGUF\")");
    pos = 4;
    file.version_ = read<uint32_t>("the version");
    if (file.version_ != 2 && file.version_ != 3) fail("unsupported GGUF version ", file.version_, " (only 2 and 3)");
    const uint64_t n_tensors = read<uint64_t>("the tensor count");
    const uint64_t n_metadata = read<uint64_t>("the metadata count");
    // A metadata entry takes at least 12 bytes (key length, value type), a tensor info 24.
    if (n_metadata > (size - pos) / 12) fail("metadata count ", n_metadata, " cannot fit in the file");
    for (uint64_t i = 0; i < n_metadata; ++i) {
      std::string key = read_string("a metadata key");
      const uint32_t type = read<uint32_t>("a metadata value type");
      GgufValue value = read_value(type, key, 0);
      if (file.metadata_.count(key)) fail("metadata key ", key, " appears twice");
      file.metadata_.emplace(std::move(key), std::move(value));
    }
    if (n_tensors > (size - pos) / 24) fail("tensor count ", n_tensors, " cannot fit in the file");
    uint64_t alignment = 32;
    if (const GgufValue* a = file.find("general.alignment")) {
      if (a->kind != GgufValue::Kind::kInt || a->int_value <= 0 || (a->int_value & (a->int_value - 1)) != 0)
        fail("general.alignment must be a positive power of 2");
      alignment = static_cast<uint64_t>(a->int_value);
    }
    file.tensors_.reserve(n_tensors);
    for (uint64_t i = 0; i < n_tensors; ++i) {
      GgufTensorInfo t;
      t.name = read_string("a tensor name");
      const uint32_t n_dims = read<uint32_t>("a tensor's dimension count");
      if (n_dims < 1 || n_dims > kMaxDims)
        fail("tensor '", t.name, "' has ", n_dims, " dimensions (1 to ", kMaxDims, ")");
      std::vector<int64_t> dims;
      uint64_t elements = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        const uint64_t dim = read<uint64_t>("a tensor dimension");
        if (dim == 0 || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
            elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dim)
          fail("tensor '", t.name, "' has a dimension of ", dim, " (each must be >= 1, the product below 2^63)");
        elements *= dim;
        dims.push_back(static_cast<int64_t>(dim));
      }
      t.shape.assign(dims.rbegin(), dims.rend());
      t.type = read<uint32_t>("a tensor type");
      t.offset = read<uint64_t>("a tensor offset");
      const TypeInfo* info = type_info(t.type);
      if (!info) fail("tensor '", t.name, "' has unknown ggml type ", t.type);
      if (dims[0] % info->block != 0)
        fail("tensor '", t.name, "' of type ", info->name, " has a first dimension of ", dims[0],
             ", not a multiple of its block of ", info->block);
      // Stored bytes = blocks x block bytes, which must not wrap around (a wrapped size would pass the
      // bounds check below and leave the dequantisation to allocate for the true element count).
      const uint64_t blocks = elements / static_cast<uint64_t>(info->block);
      if (blocks > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(info->bytes))
        fail("tensor '", t.name, "' (", elements, " elements of type ", info->name, ") would take 2^64 bytes or more");
      t.bytes = blocks * static_cast<uint64_t>(info->bytes);
      if (t.offset % alignment != 0)
        fail("tensor '", t.name, "' offset ", t.offset, " is not a multiple of ", alignment);
      if (file.tensor_index_.count(t.name)) fail("tensor name '", t.name, "' appears twice");
      file.tensor_index_.emplace(t.name, file.tensors_.size());
      file.tensors_.push_back(std::move(t));
    }
    const uint64_t data_start = (pos + alignment - 1) / alignment * alignment;
    if (data_start > size && !file.tensors_.empty()) fail("truncated: the data section would start at ", data_start);
    file.data_ = data + std::min(data_start, size);
    file.data_size_ = size - std::min(data_start, size);
    for (const GgufTensorInfo& t : file.tensors_)
      if (t.offset > file.data_size_ || t.bytes > file.data_size_ - t.offset)
        fail("tensor '", t.name, "' (", t.bytes, " bytes at offset ", t.offset, ") lies beyond the data section (",
             file.data_size_, " bytes)");
    return file;
  }
};

namespace {

// ---- dequantisation: one block of `block` values from `src` into `dst` ----------------------------

// Q4_0 / Q4_1 / Q5_0 / Q5_1: value i < 16 is the low nibble of byte i, value 16 + i its high nibble;
// Q5 adds bit i of the 32-bit qh as the fifth bit.
void dequantize_q4_0(const uint8_t* b, float* out) {
  const float d = half_to_float(b);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>(static_cast<int>(b[2 + i] & 0x0F) - 8);
    out[i + 16] = d * static_cast<float>(static_cast<int>(b[2 + i] >> 4) - 8);
  }
}
void dequantize_q4_1(const uint8_t* b, float* out) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>(b[4 + i] & 0x0F) + m;
    out[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
  }
}
uint32_t read_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
void dequantize_q5_0(const uint8_t* b, float* out) {
  const float d = half_to_float(b);
  const uint32_t qh = read_u32(b + 2);
  for (int i = 0; i < 16; ++i) {
    const int lo = (b[6 + i] & 0x0F) | (((qh >> i) & 1) << 4);
    const int hi = (b[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    out[i] = d * static_cast<float>(lo - 16);
    out[i + 16] = d * static_cast<float>(hi - 16);
  }
}
void dequantize_q5_1(const uint8_t* b, float* out) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  const uint32_t qh = read_u32(b + 4);
  for (int i = 0; i < 16; ++i) {
    const int lo = (b[8 + i] & 0x0F) | (((qh >> i) & 1) << 4);
    const int hi = (b[8 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    out[i] = d * static_cast<float>(lo) + m;
    out[i + 16] = d * static_cast<float>(hi) + m;
  }
}
void dequantize_q8_0(const uint8_t* b, float* out) {
  const float d = half_to_float(b);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
}

// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes (ggml's
// get_scale_min_k4): sub-block j < 4 takes the low 6 bits of bytes j and 4 + j; j >= 4 takes the
// nibbles of byte 4 + j with the top 2 bits of bytes j - 4 and j.
void k_scales(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 0x3F;
    min = s[j + 4] & 0x3F;
  } else {
    scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}
// Sub-block j's 32 values: nibble j % 2 of bytes 32 * (j / 2) .. + 31 of qs (+ bit j of qh[i] for Q5_K).
void dequantize_qk(const uint8_t* b, float* out, bool five_bits) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = five_bits ? b + 48 : b + 16;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    k_scales(scales, j, sc, mn);
    const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; ++i) {
      int v = (q[i] >> shift) & 0x0F;
      if (five_bits) v |= ((qh[i] >> j) & 1) << 4;
      out[32 * j + i] = dj * static_cast<float>(v) - mj;
    }
  }
}
// Q6_K: 256 values in two halves of 128; in half h, value r takes the low 4 bits from byte
// ql[64 h + r % 64] (nibble r / 64) and the high 2 bits from qh[32 h + r % 32] (bits 2 (r / 32)),
// minus 32, times d * scales[value / 16].
void dequantize_q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int f = 0; f < 256; ++f) {
    const int h = f / 128, r = f % 128;
    const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
    const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
    const float dg = d * static_cast<float>(scales[f / 16]);
    out[f] = dg * static_cast<float>((low | (high << 4)) - 32);
  }
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

}  // namespace

// ---- GgufFile -------------------------------------------------------------------------------------

const GgufValue* GgufFile::find(const std::string& key) const {
  const auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {
const char* kind_name(GgufValue::Kind kind) {
  switch (kind) {
    case GgufValue::Kind::kInt: return "an integer";
    case GgufValue::Kind::kFloat: return "a float";
    case GgufValue::Kind::kBool: return "a bool";
    case GgufValue::Kind::kString: return "a string";
    case GgufValue::Kind::kArray: return "an array";
  }
  return "?";
}
const GgufValue& required(const GgufFile& f, const std::string& key, GgufValue::Kind kind, bool float_ok = false) {
  const GgufValue* v = f.find(key);
  TORCH_CHECK(v != nullptr, "GgufFile: ", f.origin(), ": metadata ", key, " is missing");
  const bool ok = v->kind == kind || (float_ok && v->kind == GgufValue::Kind::kInt);
  TORCH_CHECK(ok, "GgufFile: ", f.origin(), ": metadata ", key, " must be ", kind_name(kind), ", got ",
              kind_name(v->kind));
  return *v;
}
}  // namespace

int64_t GgufFile::get_int(const std::string& key) const {
  return required(*this, key, GgufValue::Kind::kInt).int_value;
}
double GgufFile::get_float(const std::string& key) const {
  const GgufValue& v = required(*this, key, GgufValue::Kind::kFloat, /*float_ok=*/true);
  return v.kind == GgufValue::Kind::kInt ? static_cast<double>(v.int_value) : v.float_value;
}
bool GgufFile::get_bool(const std::string& key) const {
  return required(*this, key, GgufValue::Kind::kBool).bool_value;
}
const std::string& GgufFile::get_string(const std::string& key) const {
  return required(*this, key, GgufValue::Kind::kString).string_value;
}
std::vector<std::string> GgufFile::get_strings(const std::string& key) const {
  std::vector<std::string> out;
  for (const GgufValue& e : required(*this, key, GgufValue::Kind::kArray).array) {
    TORCH_CHECK(e.kind == GgufValue::Kind::kString, "GgufFile: ", origin_, ": metadata ", key,
                " must be an array of strings, got ", kind_name(e.kind), " elements");
    out.push_back(e.string_value);
  }
  return out;
}
std::vector<int64_t> GgufFile::get_ints(const std::string& key) const {
  std::vector<int64_t> out;
  for (const GgufValue& e : required(*this, key, GgufValue::Kind::kArray).array) {
    TORCH_CHECK(e.kind == GgufValue::Kind::kInt, "GgufFile: ", origin_, ": metadata ", key,
                " must be an array of integers, got ", kind_name(e.kind), " elements");
    out.push_back(e.int_value);
  }
  return out;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

at::Tensor GgufFile::dequantize(const std::string& name) const {
  const GgufTensorInfo* t = find_tensor(name);
  TORCH_CHECK(t != nullptr, "GgufFile::dequantize: ", origin_, " holds no tensor '", name, "'");
  const TypeInfo* info = type_info(t->type);
  TORCH_CHECK(info && info->supported, "GgufFile::dequantize: ", origin_, ": tensor '", name, "' has type ",
              gguf_type_name(t->type), ", which this reader cannot dequantize (supported: ", supported_types(), ")");
  at::Tensor out = at::empty(t->shape, at::kFloat);
  float* dst = out.data_ptr<float>();
  const uint8_t* src = data_ + t->offset;
  const int64_t n = out.numel(), blocks = n / info->block;
  const auto each_block = [&](void (*fn)(const uint8_t*, float*)) {
    at::parallel_for(0, blocks, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) fn(src + i * info->bytes, dst + i * info->block);
    });
  };
  switch (t->type) {
    case kF32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); break;
    case kF16:
      at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) dst[i] = half_to_float(src + 2 * i);
      });
      break;
    case kBF16:  // the upper half of a float32
      at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          uint16_t h;
          std::memcpy(&h, src + 2 * i, 2);
          const uint32_t bits = static_cast<uint32_t>(h) << 16;
          std::memcpy(dst + i, &bits, 4);
        }
      });
      break;
    case kQ4_0: each_block(dequantize_q4_0); break;
    case kQ4_1: each_block(dequantize_q4_1); break;
    case kQ5_0: each_block(dequantize_q5_0); break;
    case kQ5_1: each_block(dequantize_q5_1); break;
    case kQ8_0: each_block(dequantize_q8_0); break;
    case kQ4_K: each_block([](const uint8_t* b, float* o) { dequantize_qk(b, o, false); }); break;
    case kQ5_K: each_block([](const uint8_t* b, float* o) { dequantize_qk(b, o, true); }); break;
    case kQ6_K: each_block(dequantize_q6_k); break;
    default: TORCH_CHECK(false, "GgufFile::dequantize: unhandled type ", info->name, " for ", shape_str(t->shape));
  }
  return out;
}

// ---- loading --------------------------------------------------------------------------------------

GgufFile load_gguf(const std::string& path) {
  const auto fail = [&](const std::string& what) { TORCH_CHECK(false, "load_gguf: ", path, ": ", what); };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail(std::string("cannot open file (") + std::strerror(errno) + ")");
  if (S_ISDIR(st.st_mode)) fail("is a directory, not a GGUF file");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(std::string("cannot open file (") + std::strerror(errno) + ")");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  void* mapped = size == 0 ? nullptr : ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);
  if (size > 0 && mapped == MAP_FAILED) fail(std::string("cannot map file (") + std::strerror(mmap_errno) + ")");
  // The mapping lives as long as the GgufFile (or a copy of it) does.
  std::shared_ptr<const void> owner(mapped, [size](const void* p) {
    if (p) ::munmap(const_cast<void*>(p), size);
  });
  GgufParser parser{static_cast<const uint8_t*>(mapped), size, 0, "load_gguf", path};
  return parser.parse(std::move(owner));
}

GgufFile parse_gguf(std::string bytes, const std::string& origin) {
  auto owned = std::make_shared<const std::string>(std::move(bytes));
  GgufParser parser{reinterpret_cast<const uint8_t*>(owned->data()), owned->size(), 0, "parse_gguf", origin};
  return parser.parse(std::move(owned));
}

}  // namespace kvpress::io
