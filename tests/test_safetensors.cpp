// safetensors reader/writer: round trips, files written by Python's safetensors, and every
// error path with its message.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "kvpress/io/atomic_file.h"
#include "kvpress/io/safetensors.h"

using kvpress::io::load_safetensors;
using kvpress::io::parse_safetensors;
using kvpress::io::save_safetensors;

namespace {

// POSIX file helpers: std::filesystem calls can bind to the copies the torch wheel's libtorch
// exports and crash (seen with remove_all).
bool file_exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

void remove_tree(const std::string& dir) {
  ::nftw(
      dir.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

// A fresh directory per test, removed afterwards.
class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = "/tmp/kvpress_st_XXXXXX";
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override { remove_tree(dir_); }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // The names in the directory, sorted.
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    if (DIR* d = ::opendir(dir_.c_str())) {
      while (const dirent* e = ::readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") names.push_back(e->d_name);
      ::closedir(d);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // Writes an 8-byte length + `header` + `body` file and returns its path.
  std::string write_raw(const std::string& name, const std::string& header, const std::string& body = "",
                        int64_t declared_len = -1) const {
    const std::string p = path(name);
    std::ofstream out(p, std::ios::binary);
    uint64_t n = declared_len < 0 ? header.size() : static_cast<uint64_t>(declared_len);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
    out << header << body;
    return p;
  }

  std::string dir_;
};

std::string read_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs fn, which must throw c10::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& part : parts) {
      EXPECT_NE(msg.find(part), std::string::npos) << "message: " << msg << "\nmissing: " << part;
    }
    return;
  }
  ADD_FAILURE() << "expected a c10::Error containing '" << parts.at(0) << "'";
}

at::Tensor sample(at::ScalarType dtype, at::IntArrayRef shape) {
  at::manual_seed(0);
  if (dtype == at::kBool) return at::randint(0, 2, shape, at::kLong).to(at::kBool);
  if (at::isFloatingType(dtype)) return at::randn(shape, at::kDouble).to(dtype);
  if (dtype == at::kByte) return at::randint(0, 256, shape, at::kLong).to(dtype);
  return at::randint(-100, 100, shape, at::kLong).to(dtype);
}

}  // namespace

TEST_F(Safetensors, RoundTripsEveryDtype) {
  const std::vector<at::ScalarType> dtypes = {at::kDouble, at::kFloat, at::kHalf, at::kBFloat16, at::kLong,
                                              at::kInt,    at::kShort, at::kChar, at::kByte,     at::kBool};
  std::map<std::string, at::Tensor> tensors;
  for (auto dtype : dtypes) {
    tensors[std::string("t_") + c10::toString(dtype)] = sample(dtype, {2, 3, 5});
  }
  const std::string p = path("all.safetensors");
  save_safetensors(p, tensors);
  const auto loaded = load_safetensors(p);
  ASSERT_EQ(loaded.tensors.size(), tensors.size());
  EXPECT_TRUE(loaded.metadata.empty());
  for (const auto& [name, t] : tensors) {
    ASSERT_EQ(loaded.tensors.count(name), 1u) << name;
    const auto& u = loaded.tensors.at(name);
    EXPECT_EQ(u.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(u.sizes(), t.sizes()) << name;
    EXPECT_TRUE(u.is_contiguous()) << name;
    EXPECT_TRUE(at::equal(u, t)) << name;
  }
}

TEST_F(Safetensors, RoundTripsScalarsEmptyAndNonContiguous) {
  const at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  std::map<std::string, at::Tensor> tensors = {
      {"scalar", at::scalar_tensor(2.5, at::kFloat)},
      {"empty", at::empty({0, 4}, at::kHalf)},
      {"transposed", base.t()},
      {"sliced", base.slice(1, 1, 3)},
  };
  const std::string p = path("shapes.safetensors");
  save_safetensors(p, tensors);
  const auto loaded = load_safetensors(p);
  EXPECT_EQ(loaded.tensors.at("scalar").dim(), 0);
  EXPECT_EQ(loaded.tensors.at("scalar").item<float>(), 2.5f);
  EXPECT_EQ(loaded.tensors.at("empty").sizes(), at::IntArrayRef({0, 4}));
  EXPECT_EQ(loaded.tensors.at("empty").scalar_type(), at::kHalf);
  EXPECT_TRUE(at::equal(loaded.tensors.at("transposed"), base.t()));
  EXPECT_TRUE(at::equal(loaded.tensors.at("sliced"), base.slice(1, 1, 3)));
}

TEST_F(Safetensors, RoundTripsMetadata) {
  const std::map<std::string, std::string> metadata = {
      {"press", "SnapKVPress"}, {"params", "{\"window_size\": \"8\"}"}, {"unicode", "déjà vu"}, {"empty", ""}};
  const std::string p = path("meta.safetensors");
  save_safetensors(p, {{"x", at::ones({2}, at::kFloat)}}, metadata);
  const auto loaded = load_safetensors(p);
  EXPECT_EQ(loaded.metadata, metadata);
  EXPECT_EQ(loaded.tensors.size(), 1u);
}

TEST_F(Safetensors, WritesDeterministicAlignedFiles) {
  std::map<std::string, at::Tensor> tensors = {
      {"a_bool", sample(at::kBool, {3})},
      {"b_f64", sample(at::kDouble, {2, 2})},
      {"c_bf16", sample(at::kBFloat16, {5})},
      {"d_f32", sample(at::kFloat, {3})},
  };
  save_safetensors(path("1.st"), tensors, {{"k", "v"}});
  save_safetensors(path("2.st"), tensors, {{"k", "v"}});
  const std::string bytes = read_bytes(path("1.st"));
  EXPECT_EQ(bytes, read_bytes(path("2.st")));
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ(n % 8, 0u) << "header length must keep the data 8-byte aligned";
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  // Widest dtypes first, so each tensor is aligned to its element size.
  EXPECT_NE(header.find("\"b_f64\":{\"data_offsets\":[0,32]"), std::string::npos) << header;
  EXPECT_NE(header.find("\"d_f32\":{\"data_offsets\":[32,44]"), std::string::npos) << header;
  EXPECT_NE(header.find("\"c_bf16\":{\"data_offsets\":[44,54]"), std::string::npos) << header;
  EXPECT_NE(header.find("\"a_bool\":{\"data_offsets\":[54,57]"), std::string::npos) << header;
  EXPECT_EQ(bytes.size(), 8 + n + 57);
  EXPECT_EQ(listing(), (std::vector<std::string>{"1.st", "2.st"}));  // no temporary file left
}

// A write that fails half-way leaves the existing file as it was and no temporary file.
TEST_F(Safetensors, AFailedWriteLeavesTheTargetAsItWas) {
  const std::string p = path("out.json");
  kvpress::io::write_text_atomically("test", p, "old");
  expect_error(
      [&] {
        kvpress::io::write_file_atomically("test", p, [](std::FILE* f) {
          std::fputs("half", f);
          return false;
        });
      },
      {"test: " + p + ": write failed"});
  EXPECT_EQ(read_bytes(p), "old");
  expect_error(
      [&] {
        kvpress::io::write_file_atomically("test", p, [](std::FILE*) -> bool { TORCH_CHECK(false, "interrupted"); });
      },
      {"interrupted"});
  EXPECT_EQ(read_bytes(p), "old");
  EXPECT_EQ(listing(), (std::vector<std::string>{"out.json"}));
  kvpress::io::write_text_atomically("test", p, "new");
  EXPECT_EQ(read_bytes(p), "new");
  // The usual permissions (0666 less the umask), not the private ones of a temporary file.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  struct stat st {};
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666 & ~mask);
}

TEST_F(Safetensors, OverwritesAnExistingFile) {
  const std::string p = path("x.st");
  save_safetensors(p, {{"x", at::ones({100}, at::kDouble)}});
  save_safetensors(p, {{"y", at::zeros({1}, at::kFloat)}});
  const auto loaded = load_safetensors(p);
  ASSERT_EQ(loaded.tensors.size(), 1u);
  EXPECT_EQ(loaded.tensors.count("y"), 1u);
}

// Written by Python: safetensors.torch.save_file({"a": arange(6).reshape(2, 3) / 4 (F32),
// "b": [True, False, True], "c": [-1, 2**40] (I64), "d": [1.5, -2.25] (BF16)},
// metadata={"format": "pt", "note": "hi"}) with safetensors 0.7.0.
TEST_F(Safetensors, ReadsAFileWrittenByPythonSafetensors) {
  static const unsigned char kBytes[] = {
      0x10, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x7b, 0x22, 0x5f, 0x5f, 0x6d, 0x65, 0x74, 0x61, 0x64, 0x61, 0x74,
      0x61, 0x5f, 0x5f, 0x22, 0x3a, 0x7b, 0x22, 0x6e, 0x6f, 0x74, 0x65, 0x22, 0x3a, 0x22, 0x68, 0x69, 0x22, 0x2c, 0x22,
      0x66, 0x6f, 0x72, 0x6d, 0x61, 0x74, 0x22, 0x3a, 0x22, 0x70, 0x74, 0x22, 0x7d, 0x2c, 0x22, 0x63, 0x22, 0x3a, 0x7b,
      0x22, 0x64, 0x74, 0x79, 0x70, 0x65, 0x22, 0x3a, 0x22, 0x49, 0x36, 0x34, 0x22, 0x2c, 0x22, 0x73, 0x68, 0x61, 0x70,
      0x65, 0x22, 0x3a, 0x5b, 0x32, 0x5d, 0x2c, 0x22, 0x64, 0x61, 0x74, 0x61, 0x5f, 0x6f, 0x66, 0x66, 0x73, 0x65, 0x74,
      0x73, 0x22, 0x3a, 0x5b, 0x30, 0x2c, 0x31, 0x36, 0x5d, 0x7d, 0x2c, 0x22, 0x61, 0x22, 0x3a, 0x7b, 0x22, 0x64, 0x74,
      0x79, 0x70, 0x65, 0x22, 0x3a, 0x22, 0x46, 0x33, 0x32, 0x22, 0x2c, 0x22, 0x73, 0x68, 0x61, 0x70, 0x65, 0x22, 0x3a,
      0x5b, 0x32, 0x2c, 0x33, 0x5d, 0x2c, 0x22, 0x64, 0x61, 0x74, 0x61, 0x5f, 0x6f, 0x66, 0x66, 0x73, 0x65, 0x74, 0x73,
      0x22, 0x3a, 0x5b, 0x31, 0x36, 0x2c, 0x34, 0x30, 0x5d, 0x7d, 0x2c, 0x22, 0x64, 0x22, 0x3a, 0x7b, 0x22, 0x64, 0x74,
      0x79, 0x70, 0x65, 0x22, 0x3a, 0x22, 0x42, 0x46, 0x31, 0x36, 0x22, 0x2c, 0x22, 0x73, 0x68, 0x61, 0x70, 0x65, 0x22,
      0x3a, 0x5b, 0x32, 0x5d, 0x2c, 0x22, 0x64, 0x61, 0x74, 0x61, 0x5f, 0x6f, 0x66, 0x66, 0x73, 0x65, 0x74, 0x73, 0x22,
      0x3a, 0x5b, 0x34, 0x30, 0x2c, 0x34, 0x34, 0x5d, 0x7d, 0x2c, 0x22, 0x62, 0x22, 0x3a, 0x7b, 0x22, 0x64, 0x74, 0x79,
      0x70, 0x65, 0x22, 0x3a, 0x22, 0x42, 0x4f, 0x4f, 0x4c, 0x22, 0x2c, 0x22, 0x73, 0x68, 0x61, 0x70, 0x65, 0x22, 0x3a,
      0x5b, 0x33, 0x5d, 0x2c, 0x22, 0x64, 0x61, 0x74, 0x61, 0x5f, 0x6f, 0x66, 0x66, 0x73, 0x65, 0x74, 0x73, 0x22, 0x3a,
      0x5b, 0x34, 0x34, 0x2c, 0x34, 0x37, 0x5d, 0x7d, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0xff, 0xff, 0xff, 0xff, 0xff,
      0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x3e,
      0x00, 0x00, 0x00, 0x3f, 0x00, 0x00, 0x40, 0x3f, 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0xa0, 0x3f, 0xc0, 0x3f, 0x10,
      0xc0, 0x01, 0x00, 0x01,
  };
  const std::string p = path("python.safetensors");
  {
    std::ofstream out(p, std::ios::binary);
    out.write(reinterpret_cast<const char*>(kBytes), sizeof(kBytes));
  }
  const auto f = load_safetensors(p);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "hi"}};
  EXPECT_EQ(f.metadata, metadata);
  ASSERT_EQ(f.tensors.size(), 4u);
  EXPECT_TRUE(at::equal(f.tensors.at("a"), at::arange(6, at::kFloat).reshape({2, 3}) / 4));
  EXPECT_TRUE(at::equal(f.tensors.at("b"), at::tensor(std::vector<int64_t>{1, 0, 1}, at::kLong).to(at::kBool)));
  EXPECT_TRUE(at::equal(f.tensors.at("c"), at::tensor(std::vector<int64_t>{-1, int64_t{1} << 40}, at::kLong)));
  EXPECT_TRUE(at::equal(f.tensors.at("d"), at::tensor(std::vector<double>{1.5, -2.25}, at::kDouble).to(at::kBFloat16)));
}

// ---- load errors ------------------------------------------------------------------------

TEST_F(Safetensors, MissingFile) {
  const std::string p = path("nope.safetensors");
  expect_error([&] { load_safetensors(p); },
               {"load_safetensors: " + p + ": cannot open file (No such file or directory)"});
}

TEST_F(Safetensors, Directory) {
  expect_error([&] { load_safetensors(dir_); }, {dir_, "is a directory"});
}

TEST_F(Safetensors, TooShortForTheLength) {
  const std::string p = path("short.st");
  std::ofstream(p, std::ios::binary) << "abc";
  expect_error([&] { load_safetensors(p); }, {"load_safetensors: " + p + ": truncated file: 3 bytes, too short"});
}

TEST_F(Safetensors, HeaderLongerThanTheFile) {
  const std::string p = write_raw("long.st", "{}", "", 100);
  expect_error([&] { load_safetensors(p); }, {p, "truncated file: header length 100 but only 2 bytes follow"});
}

TEST_F(Safetensors, HugeHeaderLength) {
  const std::string p = write_raw("huge.st", "{}", "", int64_t{1} << 40);
  expect_error([&] { load_safetensors(p); }, {p, "exceeds the limit"});
}

TEST_F(Safetensors, BadJson) {
  const std::string p = write_raw("bad.st", "{\"x\": [1, 2");
  expect_error([&] { load_safetensors(p); }, {"load_safetensors: " + p + ": header is not valid JSON"});
}

// Found by fuzzing (tests/fuzz, kvpress_fuzz_safetensors): a number too large for a double in the
// header escaped as nlohmann's out_of_range instead of a c10::Error.
TEST_F(Safetensors, NumberOverflowInTheHeader) {
  const std::string p = write_raw("overflow.st", R"({"v":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}})");
  expect_error([&] { load_safetensors(p); },
               {"load_safetensors: " + p + ": header is not valid JSON: number overflow parsing '1e999'"});
  // The fuzzer's input, as it found it.
  const unsigned char found[] = {
      0x30, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x39, 0x32, 0x32, 0x33, 0x33, 0x37, 0x32, 0x30, 0x33, 0x36,
      0x38, 0x35, 0x34, 0x37, 0x31, 0x65, 0x33, 0x30, 0x37, 0x35, 0x35, 0x53, 0x53, 0x5f, 0x7b, 0x22, 0x5f, 0x5f,
      0x6d, 0x65, 0x35, 0x35, 0x35, 0x35, 0x22, 0x74, 0x7b, 0x3a, 0x66, 0x31, 0x22, 0x69, 0x6f, 0x22, 0x3a, 0x33,
      0x37, 0x32, 0x30, 0x33, 0x36, 0x38, 0x35, 0x34, 0x37, 0x37, 0x35, 0x38, 0x30, 0x37, 0x35, 0x35, 0x53, 0x53,
      0x5f, 0x7b, 0x22, 0x5f, 0x5f, 0x6d, 0x65, 0x35, 0x35, 0x35, 0x35, 0x22, 0x74, 0x7b, 0x3a, 0x61, 0x72, 0x22,
      0x69, 0x6f, 0x22, 0x3a, 0x22, 0x2f, 0x72, 0x73, 0x41, 0x00, 0x00, 0x00, 0x00, 0x41, 0x00, 0x00, 0x00, 0x00,
      0x7d, 0x22, 0x2f, 0x41, 0x00, 0x00, 0x00, 0x00, 0x41, 0x00, 0x00, 0x00, 0x00, 0x7d, 0x00, 0x00, 0x52, 0x7d};
  expect_error([&] { parse_safetensors(std::string(reinterpret_cast<const char*>(found), sizeof(found)), "found"); },
               {"parse_safetensors: found: header is not valid JSON: number overflow parsing '922337203685471e30755'"});
}

// A header nesting a million arrays overflowed the stack when its error message printed the value
// (nlohmann's dump() recurses; its parser does not).
TEST_F(Safetensors, DeeplyNestedHeader) {
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  const std::string p = write_raw("deep.st", R"({"v":{"dtype":"F32","shape":[)" + deep + R"(],"data_offsets":[0,0]}})");
  expect_error([&] { load_safetensors(p); }, {"load_safetensors: " + p + ": header nests deeper than 64 levels"});
}

TEST_F(Safetensors, HeaderNotAnObject) {
  const std::string p = write_raw("arr.st", "[1, 2, 3]");
  expect_error([&] { load_safetensors(p); }, {p, "header must be a JSON object, got array"});
}

TEST_F(Safetensors, OffsetsDoNotMatchShape) {
  const std::string p = write_raw("mismatch.st", R"({"keys":{"dtype":"F32","shape":[2,3],"data_offsets":[0,100]}})",
                                  std::string(100, '\0'));
  expect_error(
      [&] { load_safetensors(p); },
      {"load_safetensors: " + p + ": tensor 'keys' data_offsets [0, 100] do not match shape [2, 3] of F32 (24 bytes)"});
}

TEST_F(Safetensors, OffsetsOutOfRange) {
  // A truncated body: the header promises 24 bytes, 10 are there.
  const std::string p =
      write_raw("trunc.st", R"({"keys":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})", std::string(10, '\0'));
  expect_error([&] { load_safetensors(p); },
               {p, "tensor 'keys' data_offsets [0, 24] lie outside the 10-byte data buffer"});
}

TEST_F(Safetensors, OffsetsReversed) {
  const std::string p =
      write_raw("rev.st", R"({"v":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", std::string(4, '\0'));
  expect_error([&] { load_safetensors(p); }, {p, "tensor 'v' data_offsets [4, 0] are not an ordered pair"});
}

// The format's rule (Python's safetensors refuses the same files): tensors tile the data buffer.
// Without it, header entries sharing one region made a file claim many times its size in memory.
TEST_F(Safetensors, TensorsTileTheDataBuffer) {
  const std::string body(8, '\0');
  const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  expect_error(
      [&] {
        load_safetensors(
            write_raw("overlap.st", "{" + a + R"(,"b":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", body));
      },
      {"tensor 'b' data_offsets [0, 8] overlap tensor 'a' [0, 8] (tensors may not share bytes)"});
  expect_error(
      [&] {
        load_safetensors(write_raw("hole.st", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", body));
      },
      {"data buffer bytes [0, 4) belong to no tensor (the format allows no holes)"});
  expect_error([&] { load_safetensors(write_raw("tail.st", "{" + a + "}", body + "xy")); },
               {"data buffer bytes [8, 10) belong to no tensor"});
  // Empty tensors take no bytes, wherever they point.
  const auto f = load_safetensors(
      write_raw("empty.st", "{" + a + R"(,"e":{"dtype":"F16","shape":[0],"data_offsets":[8,8]}})", body));
  EXPECT_EQ(f.tensors.size(), 2u);
}

TEST_F(Safetensors, UnsupportedDtype) {
  const std::string p =
      write_raw("dtype.st", R"({"v":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", std::string(8, '\0'));
  expect_error([&] { load_safetensors(p); }, {p, "tensor 'v' has unsupported dtype 'C64' (supported: F64, F32"});
}

TEST_F(Safetensors, MalformedEntries) {
  const std::string body(8, '\0');
  expect_error([&] { load_safetensors(write_raw("a.st", R"({"v":3})", body)); }, {"tensor 'v' must be an object"});
  expect_error([&] { load_safetensors(write_raw("b.st", R"({"v":{"shape":[2],"data_offsets":[0,8]}})", body)); },
               {"tensor 'v' needs a string 'dtype'"});
  expect_error([&] { load_safetensors(write_raw("c.st", R"({"v":{"dtype":"F32","data_offsets":[0,8]}})", body)); },
               {"tensor 'v' needs an array 'shape'"});
  expect_error(
      [&] { load_safetensors(write_raw("d.st", R"({"v":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", body)); },
      {"tensor 'v' needs 'data_offsets' [begin, end]"});
  expect_error(
      [&] { load_safetensors(write_raw("e.st", R"({"v":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", body)); },
      {"tensor 'v' has a negative dimension"});
  expect_error(
      [&] { load_safetensors(write_raw("f.st", R"({"v":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", body)); },
      {"tensor 'v' shape entry must be an integer, got 2.5"});
  expect_error(
      [&] {
        load_safetensors(
            write_raw("g.st", R"({"v":{"dtype":"F32","shape":[4611686018427387904, 8],"data_offsets":[0,8]}})", body));
      },
      {"tensor 'v' shape [4611686018427387904, 8] is too large"});
}

TEST_F(Safetensors, MetadataMustBeStrings) {
  const std::string p = write_raw("meta.st", R"({"__metadata__":{"n":3}})");
  expect_error([&] { load_safetensors(p); }, {p, "__metadata__ value of 'n' must be a string, got 3"});
}

TEST_F(Safetensors, BoolBytesMustBeZeroOrOne) {
  const std::string p =
      write_raw("bool.st", R"({"b":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", std::string("\x01\x07", 2));
  expect_error([&] { load_safetensors(p); }, {p, "tensor 'b' is BOOL but byte 1 holds 7"});
}

// parse_safetensors is the reader load_safetensors uses, on bytes in memory; its errors name it.
TEST_F(Safetensors, ParsesBytesAsTheFileReaderDoes) {
  const std::map<std::string, at::Tensor> tensors = {{"a", sample(at::kBFloat16, {2, 3})},
                                                     {"b", sample(at::kBool, {4})}};
  const std::string p = path("bytes.st");
  save_safetensors(p, tensors, {{"k", "v"}});
  std::ifstream in(p, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto parsed = parse_safetensors(bytes);
  EXPECT_EQ(parsed.metadata, (std::map<std::string, std::string>{{"k", "v"}}));
  for (const auto& [name, t] : tensors) EXPECT_TRUE(at::equal(parsed.tensors.at(name), t)) << name;
  expect_error([&] { parse_safetensors(bytes.substr(0, bytes.size() - 1), "cut"); },
               {"parse_safetensors: cut: tensor '", "lie outside the"});
  expect_error([&] { parse_safetensors("abc"); }, {"parse_safetensors: <bytes>: truncated file: 3 bytes"});
}

// ---- save errors ------------------------------------------------------------------------

TEST_F(Safetensors, SaveErrors) {
  const std::string p = path("out.st");
  expect_error(
      [&] {
        save_safetensors(p, {{"z", at::zeros({2}, at::kComplexFloat)}});
      },
      {"save_safetensors: " + p + ": tensor 'z' has unsupported dtype ComplexFloat"});
  expect_error(
      [&] {
        save_safetensors(p, {{"u", at::Tensor()}});
      },
      {"save_safetensors: " + p + ": tensor 'u' is undefined"});
  expect_error([&] { save_safetensors(p, {{"__metadata__", at::zeros({1})}}); }, {"'__metadata__' is reserved"});
  expect_error([&] { save_safetensors(p, {{"", at::zeros({1})}}); }, {"tensor names must not be empty"});
  expect_error(
      [&] {
        save_safetensors(p, {{"x", at::zeros({1})}}, {{"bad", std::string("\xff\xfe", 2)}});
      },
      {"cannot encode the header"});
  EXPECT_FALSE(file_exists(p));
  expect_error(
      [&] {
        save_safetensors(dir_, {{"x", at::zeros({1})}});
      },
      {"save_safetensors: " + dir_ + ": is a directory"});
  const std::string missing_dir = path("no/such/dir/out.st");
  expect_error(
      [&] {
        save_safetensors(missing_dir, {{"x", at::zeros({1})}});
      },
      {"save_safetensors: " + missing_dir + ": cannot create a file next to it (No such file or directory)"});
}
