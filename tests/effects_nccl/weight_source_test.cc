#include "effects/nccl/weight_source.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "effects/http/response_parsers.h"
#include "encoding/base64.h"

namespace rc::effects::nccl {
namespace {

std::string Le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}
std::string File(const std::string& header, const std::string& data) {
  return Le64(header.size()) + header + data;
}

const std::string kGoodHeader =
    R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
    R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";
const std::string kGoodData = "AABBccccdddd";

Result<SafetensorsIndex> Parse(const std::string& file) {
  return ParseSafetensorsHeader(file, file.size());
}

// Proves a valid file parses into data-offset order with absolute offsets and metadata; catches
// JSON key order (alphabetical) leaking into the transfer order.
TEST(Safetensors, ValidFileInOffsetOrder) {
  auto idx = Parse(File(kGoodHeader, kGoodData));
  ASSERT_TRUE(idx.ok()) << idx.status().ToString();
  ASSERT_EQ(idx->manifest.tensors.size(), 2u);
  EXPECT_EQ(idx->manifest.tensors[0].name, "a");
  EXPECT_EQ(idx->manifest.tensors[1].name, "b");
  EXPECT_EQ(idx->manifest.tensors[1].dtype, DType::kFloat32);
  const std::uint64_t data_start = 8 + kGoodHeader.size();
  EXPECT_EQ(idx->file_offsets[0], data_start);
  EXPECT_EQ(idx->file_offsets[1], data_start + 4);
  EXPECT_EQ(idx->metadata.at("format"), "pt");
}

// Proves each malformed file is refused with an error naming the problem; catches a parser that
// would stream wrong bytes (gaps, overlaps, short files, size mismatches) into the engine.
TEST(Safetensors, MalformedFilesRejected) {
  struct Case {
    std::string file;
    std::string needle;
  };
  auto hdr = [](const std::string& a, const std::string& b) {
    return R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":)" + a +
           R"(},"b":{"dtype":"F32","shape":[2],"data_offsets":)" + b + "}}";
  };
  const std::vector<Case> cases = {
      {"abc", "shorter than"},
      {Le64(1ull << 40) + "{}", "exceeds"},
      {Le64(500) + "{}", "runs past"},
      {File("not json", ""), "not a JSON object"},
      {File("[1,2]", ""), "not a JSON object"},
      {File(R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", "x"), "unsupported"},
      {File(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", "x"), "lacks"},
      {File(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "x"),
       "non-integer or negative"},
      {File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", "x"), "begin<=end"},
      {File(hdr("[0,4]", "[6,14]"), std::string(14, 'x')), "(gap)"},
      {File(hdr("[0,4]", "[2,10]"), std::string(10, 'x')), "(overlap)"},
      {File(hdr("[0,4]", "[4,12]"), std::string(11, 'x')), "beyond the data section"},
      {File(hdr("[0,4]", "[4,12]"), std::string(13, 'x')), "do not cover the data section"},
      {File(hdr("[0,6]", "[6,14]"), std::string(14, 'x')), "does not match its dtype and shape"},
      {File(R"({"__metadata__":[1]})", ""), "__metadata__"},
  };
  for (const auto& c : cases) {
    auto idx = Parse(c.file);
    ASSERT_FALSE(idx.ok()) << c.needle;
    EXPECT_NE(idx.status().message().find(c.needle), std::string::npos)
        << "want '" << c.needle << "' in: " << idx.status().message();
  }
}

// Proves a file truncated on disk is refused when opened by path and the source reads exactly
// each tensor's bytes from a good file; catches reads at wrong offsets.
TEST(Safetensors, OpenFromDiskAndRead) {
  char tmpl[] = "/tmp/rc_st_XXXXXX";
  const int fd = ::mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  ::close(fd);
  const std::string path = tmpl;
  const std::string good = File(kGoodHeader, kGoodData);
  { std::ofstream(path, std::ios::binary) << good; }
  auto src = SafetensorsSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  std::string a(4, '\0'), b(8, '\0');
  ASSERT_TRUE((*src)->ReadHost(0, a.data()).ok());
  ASSERT_TRUE((*src)->ReadHost(1, b.data()).ok());
  EXPECT_EQ(a, "AABB");
  EXPECT_EQ(b, "ccccdddd");
  { std::ofstream(path, std::ios::binary | std::ios::trunc) << good.substr(0, good.size() - 3); }
  EXPECT_FALSE(SafetensorsSource::Open(path).ok());
  { std::ofstream(path, std::ios::binary | std::ios::trunc) << good.substr(0, 20); }
  auto short_file = SafetensorsSource::Open(path);
  ASSERT_FALSE(short_file.ok());
  EXPECT_NE(short_file.status().message().find("runs past"), std::string::npos);
  std::remove(path.c_str());
}

// Proves a host read takes a deadline and stops with Timeout, having read nothing, once it has
// passed, while a read before it copies the tensor in full; catches a ReadHost without one (the
// sender checked its deadline only around a whole staged op, up to packed_buffer_size_bytes).
TEST(Safetensors, ReadHostStopsAtItsDeadline) {
  char tmpl[] = "/tmp/rc_st_XXXXXX";
  const int fd = ::mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  ::close(fd);
  const std::string path = tmpl;
  { std::ofstream(path, std::ios::binary) << File(kGoodHeader, kGoodData); }
  auto src = SafetensorsSource::Open(path);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  std::string a(4, '\0');
  const auto now = std::chrono::steady_clock::now();
  const Status late = (*src)->ReadHost(0, a.data(), now - std::chrono::milliseconds(1));
  EXPECT_EQ(late.code(), Code::kTimeout) << late.ToString();
  EXPECT_EQ(a, std::string(4, '\0'));
  const Status in_time = (*src)->ReadHost(0, a.data(), now + std::chrono::minutes(1));
  ASSERT_TRUE(in_time.ok()) << in_time.ToString();
  EXPECT_EQ(a, "AABB");
  std::remove(path.c_str());
}

std::string IpcEntry(const std::string& name, std::uint64_t alloc, std::uint64_t off, int dev,
                     const std::string& handle_b64) {
  return R"({"name":")" + name + R"(","dtype":"bfloat16","shape":[4,2],"ipc_handle_b64":")" +
         handle_b64 + R"(","allocation_bytes":)" + std::to_string(alloc) + R"(,"offset":)" +
         std::to_string(off) + R"(,"device":)" + std::to_string(dev) + "}";
}

// Proves the IPC handle file is checked (handle length, bounds inside the allocation, one device,
// version); catches a reader that would map past an allocation or mix devices.
TEST(IpcHandleFile, ParseAndReject) {
  const std::string h = encoding::Base64Encode(std::string(64, '\x5a'));
  auto ok = ParseIpcHandleFile(R"({"version":1,"tensors":[)" + IpcEntry("w", 32, 16, 1, h) + "," +
                               IpcEntry("v", 16, 0, 1, h) + "]}");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->device, 1);
  EXPECT_EQ(ok->refs[0].offset, 16u);
  EXPECT_EQ(ok->refs[0].handle, std::string(64, '\x5a'));
  EXPECT_EQ(ok->manifest.tensors[1].nbytes(), 16u);
  EXPECT_FALSE(
      ParseIpcHandleFile(R"({"version":1,"tensors":[)" + IpcEntry("w", 20, 8, 0, h) + "]}").ok());
  EXPECT_FALSE(ParseIpcHandleFile(R"({"version":1,"tensors":[)" +
                                  IpcEntry("w", 16, 0, 0, encoding::Base64Encode("short")) + "]}")
                   .ok());
  EXPECT_FALSE(ParseIpcHandleFile(R"({"version":1,"tensors":[)" + IpcEntry("w", 16, 0, 0, h) + "," +
                                  IpcEntry("v", 16, 0, 1, h) + "]}")
                   .ok());
  EXPECT_FALSE(ParseIpcHandleFile(R"({"version":2,"tensors":[]})").ok());
  EXPECT_FALSE(ParseIpcHandleFile(R"({"version":1,"tensors":[{"name":"w"}]})").ok());
  EXPECT_FALSE(ParseIpcHandleFile("{").ok());
}

// Proves an ipc file's device must be an integer in [0, INT_MAX]; catches 4294967296 passing
// is_number_integer() and narrowing through get<int>() to device 0 (the tensors would then be
// looked up on the wrong GPU).
TEST(IpcHandleFile, DeviceOutsideIntRangeRefused) {
  const std::string h = encoding::Base64Encode(std::string(64, '\x5a'));
  auto file = [&](const std::string& device) {
    return R"({"version":1,"tensors":[{"name":"w","dtype":"bfloat16","shape":[4,2],)"
           R"("ipc_handle_b64":")" +
           h + R"(","allocation_bytes":16,"offset":0,"device":)" + device + "}]}";
  };
  for (const char* bad :
       {"4294967296", "2147483648", "18446744073709551615", "-1", "-4294967296", "1.0", "\"0\""}) {
    auto r = ParseIpcHandleFile(file(bad));
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("device"), std::string::npos) << r.status().ToString();
  }
  auto max = ParseIpcHandleFile(file("2147483647"));
  ASSERT_TRUE(max.ok()) << max.status().ToString();
  EXPECT_EQ(max->device, INT_MAX);
}

// A temp directory removed at the end of a test.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/rc_srccache_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

std::string Read0(const WeightSource& src) {
  std::string a(4, '\0');
  EXPECT_TRUE(src.ReadHost(0, a.data()).ok());
  return a;
}

Result<std::shared_ptr<WeightSource>> OpenSt(const std::string& uri) {
  auto s = SafetensorsSource::Open(uri.substr(std::string("safetensors:").size()));
  if (!s.ok()) return s.status();
  return std::shared_ptr<WeightSource>(std::move(*s));
}

// Proves a source is reused while its file is unchanged and reopened when the trainer renames a
// new checkpoint onto the same path or rewrites it in place, so the new bytes are sent; would
// catch the stale-descriptor bug (the first cached source still reads the OLD checkpoint through
// its fd, which is what an update would have sent under the new identity).
TEST(SourceCache, ReopensWhenTheFileChanges) {
  TempDir dir;
  const std::string path = dir.path + "/latest.safetensors", uri = "safetensors:" + path;
  { std::ofstream(path, std::ios::binary) << File(kGoodHeader, kGoodData); }
  SourceCache cache(&OpenSt);
  auto first = cache.Get(uri);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(Read0(**first), "AABB");
  auto again = cache.Get(uri);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), first->get());
  EXPECT_EQ(cache.reopens(), 0u);
  // The trainer writes the next checkpoint beside it and renames it over the path.
  { std::ofstream(path + ".tmp", std::ios::binary) << File(kGoodHeader, "XXYYccccdddd"); }
  ASSERT_EQ(std::rename((path + ".tmp").c_str(), path.c_str()), 0);
  auto renamed = cache.Get(uri);
  ASSERT_TRUE(renamed.ok());
  EXPECT_NE(renamed->get(), first->get());
  EXPECT_EQ(Read0(**renamed), "XXYY");
  EXPECT_EQ(Read0(**first), "AABB");  // the old descriptor: what a stale cache would have sent
  // Rewritten in place, same size: the mtime tells.
  { std::ofstream(path, std::ios::binary | std::ios::trunc) << File(kGoodHeader, "ZZWWccccdddd"); }
  const timespec later[2] = {{0, UTIME_OMIT}, {std::time(nullptr) + 5, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), later, 0), 0);
  auto rewritten = cache.Get(uri);
  ASSERT_TRUE(rewritten.ok());
  EXPECT_EQ(Read0(**rewritten), "ZZWW");
  EXPECT_EQ(cache.reopens(), 2u);
  // Gone: an error, and nothing stale is served afterwards.
  std::remove(path.c_str());
  EXPECT_FALSE(cache.Get(uri).ok());
}

// Proves file-backed entries are bounded (each holds a descriptor: one per checkpoint path over a
// long run would exhaust them) while pinned sources are never evicted or stat'ed; would catch an
// unbounded cache or a registered in-process source replaced by a file lookup.
TEST(SourceCache, BoundedAndPinned) {
  TempDir dir;
  SourceCache cache(&OpenSt, 4);
  auto pinned = std::make_shared<DevicePointerSource>(Manifest{}, std::vector<const void*>{}, 0);
  cache.Register("bench:pinned", pinned);
  for (int i = 0; i < 6; ++i) {
    const std::string path = dir.path + "/step-" + std::to_string(i) + ".safetensors";
    { std::ofstream(path, std::ios::binary) << File(kGoodHeader, kGoodData); }
    ASSERT_TRUE(cache.Get("safetensors:" + path).ok());
  }
  EXPECT_EQ(cache.file_entries(), 4u);
  auto p = cache.Get("bench:pinned");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->get(), pinned.get());
  EXPECT_FALSE(cache.Get("safetensors:" + dir.path + "/missing").ok());
  EXPECT_EQ(cache.file_entries(), 4u);
}

// `bytes` of JSON text, about, whose tree is ~33 times the text: `{"x":[[],[],...]}`.
std::string EmptyArrays(const std::string& key, std::size_t bytes) {
  std::string text = "{\"" + key + "\":[[]";
  text.reserve(bytes + 8);
  while (text.size() < bytes) text += ",[]";
  return text + "]}";
}

// Proves a safetensors header whose parse would pass kFileJsonTreeBytesMax (9 MiB of empty
// arrays, ~300 MB once parsed, well under the 100 MiB header bound) is refused before it is
// parsed, by every reader of a named file (the index, SourceManifestDigest, Open), with an error
// naming the file and the bound; and that a real-shaped header of 20,000 tensors still indexes.
// Catches a header parsed into a tree of ~30 times its text on each of the trainer API's threads
// (GBs per call): it was parsed, then refused for its first entry instead.
TEST(Safetensors, AHeaderWhoseTreeWouldPassItsBoundIsRefusedUnparsed) {
  TempDir dir;
  const std::string header = EmptyArrays("x", 9u << 20);
  ASSERT_GT(json_tree_bytes_bound(header), kFileJsonTreeBytesMax);
  const std::string path = dir.path + "/nodes.safetensors";
  { std::ofstream(path, std::ios::binary) << File(header, ""); }
  const std::string bound = std::to_string(kFileJsonTreeBytesMax);
  for (const Status& st :
       {ReadSafetensorsIndex(path).status(), SourceManifestDigest("safetensors:" + path).status(),
        SafetensorsSource::Open(path).status()}) {
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find(path), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find(bound), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find("once parsed"), std::string::npos) << st.ToString();
  }
  const Status in_memory = Parse(File(header, "")).status();
  EXPECT_NE(in_memory.message().find(bound), std::string::npos) << in_memory.ToString();

  constexpr int kTensors = 20000;
  std::string real = "{";
  for (int i = 0; i < kTensors; ++i) {
    real += (i == 0 ? "\"" : ",\"") + std::string("model.layers.") + std::to_string(i / 100) +
            ".mlp.experts." + std::to_string(i % 100) + R"(.down_proj.weight":{"dtype":"U8",)" +
            R"("shape":[1],"data_offsets":[)" + std::to_string(i) + "," + std::to_string(i + 1) +
            "]}";
  }
  real += "}";
  ASSERT_LT(json_tree_bytes_bound(real), kFileJsonTreeBytesMax / 8);
  auto idx = Parse(File(real, std::string(kTensors, 'w')));
  ASSERT_TRUE(idx.ok()) << idx.status().ToString();
  EXPECT_EQ(idx->manifest.tensors.size(), static_cast<std::size_t>(kTensors));
}

// Proves an ipc: handle file whose parse would pass kFileJsonTreeBytesMax is refused before it is
// parsed, the error naming the file and the bound. Catches the file (up to 256 MiB of text)
// parsed into a tree of ~30 times its size, then refused for its envelope.
TEST(IpcHandleFile, AFileWhoseTreeWouldPassItsBoundIsRefusedUnparsed) {
  TempDir dir;
  std::string text = EmptyArrays("pad", 9u << 20);
  text.insert(1, R"("version":1,"tensors":[],)");
  const std::string path = dir.path + "/nodes.json";
  { std::ofstream(path, std::ios::binary) << text; }
  const std::string bound = std::to_string(kFileJsonTreeBytesMax);
  for (const Status& st :
       {ReadIpcHandleFile(path).status(), SourceManifestDigest("ipc:" + path).status()}) {
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find(path), std::string::npos) << st.ToString();
    EXPECT_NE(st.message().find(bound), std::string::npos) << st.ToString();
  }
  EXPECT_NE(ParseIpcHandleFile(text).status().message().find(bound), std::string::npos);
}

}  // namespace
}  // namespace rc::effects::nccl
