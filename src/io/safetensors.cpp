// safetensors reader/writer: 8-byte little-endian header length N, N bytes of JSON header,
// then the byte buffer. See include/kvpress/io/safetensors.h.
#include "kvpress/io/safetensors.h"

#include "kvpress/io/atomic_file.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <sys/stat.h>
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/json_text.h"

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "kvpress safetensors I/O copies raw little-endian bytes; big-endian hosts are unsupported");
#endif

namespace kvpress::io {
namespace {

using json = nlohmann::json;

// Same limit as the reference implementation: a header larger than this is rejected before
// anything is allocated for it.
constexpr uint64_t kMaxHeaderSize = 100'000'000;

struct DtypeInfo {
  const char* name;
  at::ScalarType type;
};

constexpr DtypeInfo kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16}, {"I64", at::kLong},
    {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},  {"U8", at::kByte},       {"BOOL", at::kBool},
};

std::string supported_dtypes() {
  std::string out;
  for (const auto& d : kDtypes) {
    if (!out.empty()) out += ", ";
    out += d.name;
  }
  return out;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

struct FileCloser {
  void operator()(std::FILE* f) const {
    if (f) std::fclose(f);
  }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

// Throws c10::Error "<function>: <path or origin>: <what>".
#define ST_LOAD_CHECK(cond, ...) TORCH_CHECK(cond, where.function, ": ", where.origin, ": ", __VA_ARGS__)
#define ST_SAVE_CHECK(cond, ...) TORCH_CHECK(cond, "save_safetensors: ", path, ": ", __VA_ARGS__)

// Who reads what, for error messages: load_safetensors and a path, or parse_safetensors and an origin.
struct Where {
  const char* function;
  const std::string& origin;
};

// The bytes the parser reads: a file read piecewise (a checkpoint is never held twice in memory) or
// a string.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  // Copies the n bytes at `offset` (inside size(), checked by the parser) to dst; `what` names them.
  virtual void read(uint64_t offset, void* dst, uint64_t n, const std::string& what) = 0;
};

class FileSource : public ByteSource {
 public:
  FileSource(std::FILE* f, uint64_t size, const Where& where) : f_(f), size_(size), where_(where) {}
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, void* dst, uint64_t n, const std::string& what) override {
    const Where& where = where_;
    ST_LOAD_CHECK(fseeko(f_, static_cast<off_t>(offset), SEEK_SET) == 0, "cannot seek to ", what, " (",
                  std::strerror(errno), ")");
    uint8_t* p = static_cast<uint8_t*>(dst);
    while (n > 0) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
      const size_t got = std::fread(p, 1, chunk, f_);
      ST_LOAD_CHECK(got == chunk, "truncated file: could not read ", what,
                    std::ferror(f_) ? std::string(" (") + std::strerror(errno) + ")" : std::string());
      p += got;
      n -= got;
    }
  }

 private:
  std::FILE* f_;
  uint64_t size_;
  const Where& where_;
};

class StringSource : public ByteSource {
 public:
  explicit StringSource(const std::string& bytes) : bytes_(bytes) {}
  uint64_t size() const override { return bytes_.size(); }
  void read(uint64_t offset, void* dst, uint64_t n, const std::string& what) override {
    TORCH_INTERNAL_ASSERT(offset <= bytes_.size() && n <= bytes_.size() - offset, "parse_safetensors: reading ", what,
                          " at ", offset, " + ", n, " past the ", bytes_.size(), " bytes");
    if (n > 0) std::memcpy(dst, bytes_.data() + offset, static_cast<size_t>(n));
  }

 private:
  const std::string& bytes_;
};

int64_t json_int(const json& v, const Where& where, const std::string& what) {
  ST_LOAD_CHECK(v.is_number_integer(), what, " must be an integer, got ", v.dump());
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    ST_LOAD_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), what, " is too large: ", u);
    return static_cast<int64_t>(u);
  }
  return v.get<int64_t>();
}

// stat(), not std::filesystem: the torch wheel's libtorch exports std::filesystem symbols of its
// own that can bind in place of libstdc++'s and crash.
bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// A header entry: where a tensor's bytes lie in the data buffer.
struct TensorEntry {
  std::string name;
  const DtypeInfo* dtype;
  std::vector<int64_t> shape;
  uint64_t begin, nbytes;
};

std::string offsets_str(const TensorEntry& t) {
  return "[" + std::to_string(t.begin) + ", " + std::to_string(t.begin + t.nbytes) + "]";
}

// The JSON header and where the data buffer lies: [body_start, body_start + body_size).
struct Header {
  json doc;
  uint64_t body_start, body_size;
};

Header read_header(ByteSource& source, const Where& where) {
  const uint64_t file_size = source.size();
  ST_LOAD_CHECK(file_size >= 8, "truncated file: ", file_size, " bytes, too short for the 8-byte header length");
  uint8_t len_bytes[8];
  source.read(0, len_bytes, 8, "the header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  ST_LOAD_CHECK(header_len <= kMaxHeaderSize, "header length ", header_len, " exceeds the limit of ", kMaxHeaderSize,
                " bytes (not a safetensors file?)");
  ST_LOAD_CHECK(header_len <= file_size - 8, "truncated file: header length ", header_len, " but only ", file_size - 8,
                " bytes follow");
  ST_LOAD_CHECK(header_len >= 2, "header length ", header_len, " is too short for a JSON object");

  std::string text(static_cast<size_t>(header_len), '\0');
  source.read(8, text.data(), header_len, "the header");
  Header out{parse_json(text, std::string(where.function) + ": " + where.origin, "header"), 8 + header_len,
             file_size - 8 - header_len};
  ST_LOAD_CHECK(out.doc.is_object(), "header must be a JSON object, got ", out.doc.type_name());
  return out;
}

// One tensor's header entry, checked against itself and the data buffer's size.
TensorEntry parse_entry(const std::string& name, const json& entry, uint64_t body_size, const Where& where) {
  const std::string what = "tensor '" + name + "'";
  ST_LOAD_CHECK(entry.is_object(), what, " must be an object with dtype, shape and data_offsets");
  ST_LOAD_CHECK(entry.contains("dtype") && entry["dtype"].is_string(), what, " needs a string 'dtype'");
  ST_LOAD_CHECK(entry.contains("shape") && entry["shape"].is_array(), what, " needs an array 'shape'");
  ST_LOAD_CHECK(entry.contains("data_offsets") && entry["data_offsets"].is_array() && entry["data_offsets"].size() == 2,
                what, " needs 'data_offsets' [begin, end]");

  const std::string dtype_name = entry["dtype"].get<std::string>();
  const DtypeInfo* dtype = nullptr;
  for (const auto& d : kDtypes) {
    if (dtype_name == d.name) dtype = &d;
  }
  ST_LOAD_CHECK(dtype != nullptr, what, " has unsupported dtype '", dtype_name, "' (supported: ", supported_dtypes(),
                ")");

  std::vector<int64_t> shape;
  uint64_t numel = 1;
  bool overflow = false;
  for (const auto& dim : entry["shape"]) {
    const int64_t d = json_int(dim, where, what + " shape entry");
    ST_LOAD_CHECK(d >= 0, what, " has a negative dimension in shape ", entry["shape"].dump());
    shape.push_back(d);
    if (d != 0 && numel > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) {
      overflow = true;
    }
    numel *= static_cast<uint64_t>(d);
  }
  const uint64_t itemsize = c10::elementSize(dtype->type);
  overflow = overflow || (numel != 0 && numel > std::numeric_limits<uint64_t>::max() / itemsize);
  ST_LOAD_CHECK(!overflow, what, " shape ", shape_str(shape), " is too large");
  const uint64_t nbytes = numel * itemsize;

  const int64_t begin = json_int(entry["data_offsets"][0], where, what + " data_offsets begin");
  const int64_t end_off = json_int(entry["data_offsets"][1], where, what + " data_offsets end");
  const std::string offsets = "[" + std::to_string(begin) + ", " + std::to_string(end_off) + "]";
  ST_LOAD_CHECK(begin >= 0 && begin <= end_off, what, " data_offsets ", offsets,
                " are not an ordered pair of non-negative offsets");
  ST_LOAD_CHECK(static_cast<uint64_t>(end_off) <= body_size, what, " data_offsets ", offsets, " lie outside the ",
                body_size, "-byte data buffer (truncated file?)");
  ST_LOAD_CHECK(static_cast<uint64_t>(end_off - begin) == nbytes, what, " data_offsets ", offsets,
                " do not match shape ", shape_str(shape), " of ", dtype->name, " (", nbytes, " bytes)");
  return {name, dtype, std::move(shape), static_cast<uint64_t>(begin), nbytes};
}

// The format's rule, checked before anything is allocated: the tensors tile the data buffer, no
// overlaps (tensors sharing bytes would let a small file claim many times its size) and no holes.
void check_tiling(const std::vector<TensorEntry>& tensors, uint64_t body_size, const Where& where) {
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return std::make_pair(a->begin, a->nbytes) < std::make_pair(b->begin, b->nbytes);
  });
  uint64_t covered = 0;  // bytes [0, covered) belong to the tensors seen so far
  const TensorEntry* previous = nullptr;
  for (const TensorEntry* t : by_offset) {
    ST_LOAD_CHECK(t->begin >= covered, "tensor '", t->name, "' data_offsets ", offsets_str(*t), " overlap tensor '",
                  previous ? previous->name : "", "' ", previous ? offsets_str(*previous) : "",
                  " (tensors may not share bytes)");
    ST_LOAD_CHECK(t->begin == covered, "data buffer bytes [", covered, ", ", t->begin,
                  ") belong to no tensor (the format allows no holes)");
    covered = t->begin + t->nbytes;
    previous = t;
  }
  ST_LOAD_CHECK(covered == body_size, "data buffer bytes [", covered, ", ", body_size,
                ") belong to no tensor (the format allows no holes)");
}

// The one safetensors parser, for files and bytes alike.
SafetensorsFile parse(ByteSource& source, const Where& where) {
  const Header header = read_header(source, where);
  SafetensorsFile out;
  std::vector<TensorEntry> tensors;  // validated entries, read once the layout is known to be sound
  for (const auto& [name, entry] : header.doc.items()) {
    if (name == "__metadata__") {
      ST_LOAD_CHECK(entry.is_object(), "__metadata__ must be an object of strings, got ", entry.type_name());
      for (const auto& [key, value] : entry.items()) {
        ST_LOAD_CHECK(value.is_string(), "__metadata__ value of '", key, "' must be a string, got ", value.dump());
        out.metadata.emplace(key, value.get<std::string>());
      }
      continue;
    }
    tensors.push_back(parse_entry(name, entry, header.body_size, where));
  }
  check_tiling(tensors, header.body_size, where);

  for (const TensorEntry& entry : tensors) {
    const std::string what = "tensor '" + entry.name + "'";
    at::Tensor t = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype->type));
    if (entry.nbytes > 0) source.read(header.body_start + entry.begin, t.data_ptr(), entry.nbytes, what);
    if (entry.dtype->type == at::kBool) {
      const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
      for (uint64_t i = 0; i < entry.nbytes; ++i) {
        ST_LOAD_CHECK(bytes[i] <= 1, what, " is BOOL but byte ", i, " holds ", static_cast<int>(bytes[i]),
                      " (must be 0 or 1)");
      }
    }
    out.tensors.emplace(entry.name, std::move(t));
  }
  return out;
}

}  // namespace

const at::Tensor& required_tensor(const SafetensorsFile& file, const std::string& key, const std::string& where) {
  const auto it = file.tensors.find(key);
  TORCH_CHECK(it != file.tensors.end(), where, " holds no tensor '", key, "'");
  return it->second;
}

SafetensorsFile load_safetensors(const std::string& path) {
  const Where where{"load_safetensors", path};
  ST_LOAD_CHECK(!is_directory(path), "is a directory, not a safetensors file");

  errno = 0;
  File file(std::fopen(path.c_str(), "rb"));
  ST_LOAD_CHECK(file != nullptr, "cannot open file (", std::strerror(errno), ")");
  std::FILE* f = file.get();

  ST_LOAD_CHECK(fseeko(f, 0, SEEK_END) == 0, "cannot seek (", std::strerror(errno), ")");
  const off_t end = ftello(f);
  ST_LOAD_CHECK(end >= 0, "cannot tell file size (", std::strerror(errno), ")");
  FileSource source(f, static_cast<uint64_t>(end), where);
  return parse(source, where);
}

SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& origin) {
  StringSource source(bytes);
  return parse(source, Where{"parse_safetensors", origin});
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  struct Item {
    const std::string* name;
    const DtypeInfo* dtype;
    at::Tensor tensor;  // CPU, contiguous
  };
  std::vector<Item> items;
  items.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    ST_SAVE_CHECK(!name.empty(), "tensor names must not be empty");
    ST_SAVE_CHECK(name != "__metadata__", "'__metadata__' is reserved and cannot name a tensor");
    ST_SAVE_CHECK(tensor.defined(), "tensor '", name, "' is undefined");
    const DtypeInfo* dtype = nullptr;
    for (const auto& d : kDtypes) {
      if (tensor.scalar_type() == d.type) dtype = &d;
    }
    ST_SAVE_CHECK(dtype != nullptr, "tensor '", name, "' has unsupported dtype ", tensor.scalar_type(),
                  " (supported: ", supported_dtypes(), ")");
    items.push_back({&name, dtype, tensor.to(at::kCPU).contiguous()});
  }
  // Data layout as the reference writer does it: wider dtypes first, then by name. With the
  // header padded to 8 bytes every tensor's data is aligned to its element size. The result
  // depends only on the names, dtypes and shapes, so equal inputs give identical files.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.tensor.element_size() > b.tensor.element_size(); });
  json header = json::object();  // keys sorted by name
  uint64_t offset = 0;
  for (const auto& item : items) {
    const uint64_t nbytes = static_cast<uint64_t>(item.tensor.numel()) * item.tensor.element_size();
    json entry = json::object();
    entry["dtype"] = item.dtype->name;
    entry["shape"] = item.tensor.sizes().vec();
    entry["data_offsets"] = {offset, offset + nbytes};
    header[*item.name] = std::move(entry);
    offset += nbytes;
  }
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header["__metadata__"] = std::move(meta);
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    ST_SAVE_CHECK(false, "cannot encode the header: ", e.what(), " (names and metadata must be valid UTF-8)");
  }
  // The spec allows trailing spaces; padding to a multiple of 8 keeps the data aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_len = text.size();
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(header_len >> (8 * i));

  write_file_atomically("save_safetensors", path, [&](std::FILE* f) {
    bool ok = std::fwrite(len_bytes, 1, 8, f) == 8 && std::fwrite(text.data(), 1, text.size(), f) == text.size();
    for (const auto& item : items) {
      if (!ok) break;
      const auto& t = item.tensor;
      const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
      if (n > 0) ok = std::fwrite(t.data_ptr(), 1, n, f) == n;
    }
    return ok;
  });
}

#undef ST_LOAD_CHECK
#undef ST_SAVE_CHECK

}  // namespace kvpress::io
