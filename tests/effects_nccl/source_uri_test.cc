// Tests of the checks a source must pass before the engine is touched (ValidateSourceUri,
// SourceManifestDigest), of error messages that never carry file content, and of the one
// descriptor behind a SafetensorsSource. Real files, FIFOs and inotify; no mocks.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "effects/http/sequence_transfer.h"
#include "effects/nccl/weight_source.h"
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
const std::string kHeader =
    R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/rc_srcuri_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string Write(const std::string& name, const std::string& bytes) const {
    const std::string p = path + "/" + name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
};

// Proves the URI check accepts the documented forms and refuses traversal, relative paths,
// control bytes, bad synthetic specs and unknown schemes without opening anything; catches the
// update that drained and paused the engine before refusing "safetensors:../../etc/passwd" or
// "synthetic:-1x64".
TEST(SourceUri, ValidateSyntaxAndBounds) {
  for (const std::string good :
       {"synthetic:8x64", "synthetic:8x64:7", "safetensors:/ckpt/m.safetensors", "ipc:/tmp/h.json",
        "safetensors:/ckpt/\xc3\xa9t\xc3\xa9.safetensors", "safetensors:/a..b/c."}) {
    EXPECT_TRUE(ValidateSourceUri(good).ok()) << good << ": " << ValidateSourceUri(good).ToString();
  }
  const std::vector<std::string> bad = {"safetensors:../../etc/passwd",
                                        "safetensors:/ckpt/../../etc/passwd",
                                        "safetensors:/ckpt/..",
                                        "ipc:relative/handles.json",
                                        "safetensors:",
                                        "safetensors:/a//b",
                                        "safetensors:/a/./b",
                                        "safetensors:/a/",
                                        "safetensors:/",
                                        "synthetic:-1x64",
                                        "synthetic:0x64",
                                        "synthetic:8x64:-1",
                                        "synthetic:99999999999999999999x1",
                                        "synthetic:8x",
                                        "ftp:/x",
                                        "/ckpt/m.safetensors",
                                        "",
                                        "safetensors:/a\nb",
                                        std::string("safetensors:/a\0b", 16),
                                        "safetensors:/a\xff",
                                        "safetensors:/a\x1b[2J",
                                        "safetensors:/a\xc2\x85",
                                        "safetensors:/" + std::string(5000, 'a'),
                                        "safetensors:/" + std::string(4094, 'a')};
  for (const std::string& uri : bad) {
    const Status st = ValidateSourceUri(uri);
    EXPECT_FALSE(st.ok()) << uri;
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << uri;
    EXPECT_FALSE(SourceManifestDigest(uri).ok()) << uri;
  }
}

// Proves the digest computed before submitting equals the one the transfer computes (synthetic
// spec, safetensors header, IPC file), so a mismatching manifest can be refused up front; catches
// a pre-check that hashes something else than the sender will.
TEST(SourceUri, ManifestDigestMatchesTheSource) {
  TempDir dir;
  EXPECT_EQ(*SourceManifestDigest("synthetic:8x64:3"),
            synthetic_manifest("synthetic:8x64")->digest());
  const std::string st = dir.Write("m.safetensors", File(kHeader, "AABBccccdddd"));
  auto digest = SourceManifestDigest("safetensors:" + st);
  ASSERT_TRUE(digest.ok()) << digest.status().ToString();
  EXPECT_EQ(*digest, ReadSafetensorsIndex(st)->manifest.digest());
  const std::string h = encoding::Base64Encode(std::string(64, 'z'));
  const std::string ipc =
      dir.Write("h.json", R"({"version":1,"tensors":[{"name":"w","dtype":"bfloat16","shape":[2],)"
                          R"("ipc_handle_b64":")" +
                              h + R"(","allocation_bytes":4,"offset":0,"device":0}]})");
  auto ipc_digest = SourceManifestDigest("ipc:" + ipc);
  ASSERT_TRUE(ipc_digest.ok()) << ipc_digest.status().ToString();
  EXPECT_EQ(*ipc_digest, ReadIpcHandleFile(ipc)->manifest.digest());
  EXPECT_FALSE(SourceManifestDigest("safetensors:" + dir.path + "/missing").ok());
}

// Proves no error about a file quotes its bytes: not the first 8 (once printed as a "header
// length"), not tensor names or dtypes from a header, not names from an IPC file; catches the
// manifest route as a way to read any file the service can open.
TEST(SourceUri, ErrorsNeverQuoteFileContent) {
  TempDir dir;
  const std::string secret = "SECRET!!";
  std::uint64_t as_u64 = 0;
  for (int i = 7; i >= 0; --i) as_u64 = (as_u64 << 8) | static_cast<std::uint8_t>(secret[i]);
  const std::vector<std::string> files = {
      dir.Write("shadow", secret + "root:$6$hash:19000:0:99999:7:::\n"),
      dir.Write("short", "SECRET"),
      dir.Write("len", Le64(40) + "SECRET-not-json-at-all-but-40-bytes-long" + "x"),
      dir.Write("names",
                File(R"({"SECRET-name":{"dtype":"SECRET-dtype","shape":[1],"data_offsets":[0,1]}})",
                     "x")),
      dir.Write(
          "shape",
          File(R"({"SECRET-name":{"dtype":"U8","shape":["SECRET"],"data_offsets":[0,1]}})", "x")),
      dir.Write(
          "offsets",
          File(R"({"SECRET-name":{"dtype":"U8","shape":[1],"data_offsets":[0,987654321]}})", "x")),
      dir.Write("dup",
                File(R"({"SECRET-a":{"dtype":"U8","shape":[2],"data_offsets":[0,1]}})", "x")),
  };
  for (const std::string& path : files) {
    for (const std::string& uri : {"safetensors:" + path, "ipc:" + path}) {
      auto r = SourceManifestDigest(uri);
      ASSERT_FALSE(r.ok()) << uri;
      const std::string msg = r.status().ToString();
      EXPECT_EQ(msg.find("SECRET"), std::string::npos) << msg;
      EXPECT_EQ(msg.find(std::to_string(as_u64)), std::string::npos) << msg;
      EXPECT_EQ(msg.find("987654321"), std::string::npos) << msg;
    }
    auto opened = SafetensorsSource::Open(path);
    ASSERT_FALSE(opened.ok());
    EXPECT_EQ(opened.status().ToString().find("SECRET"), std::string::npos);
  }
  const std::string ipc = dir.Write(
      "ipc.json", R"({"version":1,"tensors":[{"name":"SECRET-w","dtype":"SECRET-t","shape":[2],)"
                  R"("ipc_handle_b64":"AAAA","allocation_bytes":4,"offset":0,"device":0}]})");
  auto r = ReadIpcHandleFile(ipc);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().ToString().find("SECRET"), std::string::npos) << r.status().ToString();
}

// Proves a FIFO (or any non-regular file) is refused at once instead of blocking open() until a
// writer appears; catches an unbounded wait in the manifest route and the sender's source open.
TEST(SourceUri, NonRegularFilesRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.path + "/pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> result = done->get_future();
  std::thread([done, fifo] {
    done->set_value(SourceManifestDigest("safetensors:" + fifo).status());
  }).detach();
  const bool finished = result.wait_for(std::chrono::seconds(2)) == std::future_status::ready;
  if (!finished) {  // unblock the reader so the process can exit, then fail
    const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (w >= 0) ::close(w);
  }
  ASSERT_TRUE(finished) << "open() of a FIFO blocked";
  EXPECT_FALSE(result.get().ok());
  EXPECT_FALSE(SafetensorsSource::Open(fifo).ok());
  EXPECT_FALSE(SafetensorsSource::Open("/dev/zero").ok());
  EXPECT_FALSE(SafetensorsSource::Open(dir.path).ok());
  EXPECT_FALSE(ReadIpcHandleFile(fifo).ok());
}

// Counts the IN_OPEN events inotify reports for `path` while `fn` runs.
template <class Fn>
int OpensDuring(const std::string& path, Fn fn) {
  const int in = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  RC_CHECK(in >= 0);
  RC_CHECK(::inotify_add_watch(in, path.c_str(), IN_OPEN) >= 0);
  fn();
  int opens = 0;
  alignas(inotify_event) char buf[4096];
  for (;;) {
    const ssize_t n = ::read(in, buf, sizeof buf);
    if (n <= 0) break;
    for (ssize_t off = 0; off < n;) {
      const auto* ev = reinterpret_cast<const inotify_event*>(buf + off);
      if (ev->mask & IN_OPEN) ++opens;
      off += static_cast<ssize_t>(sizeof(inotify_event) + ev->len);
    }
  }
  ::close(in);
  return opens;
}

// Proves SafetensorsSource::Open opens its file exactly once (the index and every later read
// use one descriptor), so a rename onto the path cannot pair one file's index with another's
// bytes; catches the index-then-data double open() (inotify sees two IN_OPEN events).
TEST(SourceUri, SafetensorsOpenUsesOneDescriptor) {
  TempDir dir;
  const std::string path = dir.Write("latest.safetensors", File(kHeader, "AABBccccdddd"));
  std::unique_ptr<SafetensorsSource> src;
  EXPECT_EQ(OpensDuring(path,
                        [&] {
                          auto s = SafetensorsSource::Open(path);
                          ASSERT_TRUE(s.ok()) << s.status().ToString();
                          src = std::move(*s);
                        }),
            1);
  // A different file (another layout: one 12-byte tensor) renamed into place afterwards: the open
  // source keeps reading the file its index describes.
  const std::string other = dir.Write(
      "next", File(R"({"z":{"dtype":"U8","shape":[12],"data_offsets":[0,12]}})", "XXXXXXXXXXXX"));
  ASSERT_EQ(std::rename(other.c_str(), path.c_str()), 0);
  std::string a(4, '\0'), b(8, '\0');
  ASSERT_TRUE(src->ReadHost(0, a.data()).ok());
  ASSERT_TRUE(src->ReadHost(1, b.data()).ok());
  EXPECT_EQ(a, "AABB");
  EXPECT_EQ(b, "ccccdddd");
  EXPECT_EQ(src->manifest().tensors.size(), 2u);
}

}  // namespace
}  // namespace rc::effects::nccl
