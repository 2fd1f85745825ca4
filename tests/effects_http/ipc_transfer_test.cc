// The vllm-ipc: weight-source file as IpcTransfer reads it: what it forwards to vLLM (the
// unpacked update_info), its manifest, and a clear refusal — never an exception, never the file's
// bytes echoed — for every malformed file a trainer (or anyone who can write the path) produces;
// and IpcTransfer against scripted engines: every call of a transfer ends by its one deadline.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "effects/clock.h"
#include "effects/http/ipc_transfer.h"
#include "effects/http/response_parsers.h"
#include "statemachine/text.h"
#include "tests/effects_http/slow_transfer_engine.h"
#include "tests/effects_http/test_servers.h"

namespace rc::effects {
namespace {

using nlohmann::json;

json GoodFile() {
  return {{"format", "rolloutcore-vllm-ipc"},
          {"version", 1},
          {"gpu_uuids", {"53e453ed-62c9-48db-8fed-1e8c25d98d47"}},
          {"names", {"model.a.weight", "model.b.bias"}},
          {"dtype_names", {"bfloat16", "float32"}},
          {"shapes", {{64, 48}, {7}}},
          {"ipc_handles_pickled", "gARdlC4="}};
}

std::string Refusal(const json& file) {
  Result<VllmIpcFile> f = ParseVllmIpcFile(file.dump());
  EXPECT_FALSE(f.ok()) << file.dump();
  return f.ok() ? "" : f.status().message();
}

// A good file becomes vLLM's unpacked update_info (the handles forwarded byte for byte) and the
// manifest of its names, dtypes and shapes in file order; catches a forwarded key vLLM refuses
// (any unknown key is its ValueError) or a manifest in another order than the transfer's.
TEST(VllmIpcFile, ForwardsTheHandlesAsUnpackedUpdateInfo) {
  Result<VllmIpcFile> f = ParseVllmIpcFile(GoodFile().dump());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->update_info, (json{{"names", {"model.a.weight", "model.b.bias"}},
                                  {"dtype_names", {"bfloat16", "float32"}},
                                  {"shapes", {{64, 48}, {7}}},
                                  {"ipc_handles_pickled", "gARdlC4="},
                                  {"packed", false}}));
  Manifest m;
  m.tensors = {{"model.a.weight", DType::kBFloat16, {64, 48}},
               {"model.b.bias", DType::kFloat32, {7}}};
  EXPECT_EQ(f->manifest.digest(), m.digest());
  EXPECT_EQ(f->gpu_uuids, std::vector<std::string>{"53e453ed-62c9-48db-8fed-1e8c25d98d47"});
}

// Every malformed file is refused with a message naming what is wrong; catches a file that
// reaches vLLM's unpickler malformed, or an exception escaping the parser on outside bytes.
TEST(VllmIpcFile, RefusesMalformedFilesClearly) {
  EXPECT_EQ(Refusal(json("not an object")), "not a JSON object");
  EXPECT_NE(ParseVllmIpcFile("{\"format\":").status().message().find("not JSON"),
            std::string::npos);
  auto with = [](const char* key, json v) {
    json f = GoodFile();
    f[key] = std::move(v);
    return f;
  };
  auto without = [](const char* key) {
    json f = GoodFile();
    f.erase(key);
    return f;
  };
  EXPECT_NE(Refusal(with("format", "other")).find("not a 'rolloutcore-vllm-ipc' file"),
            std::string::npos);
  EXPECT_NE(Refusal(with("version", 2)).find("version 1"), std::string::npos);
  EXPECT_NE(Refusal(with("packed", true)).find("a key other than"), std::string::npos);
  EXPECT_NE(Refusal(with("ipc_handles_pickled", "not base64!")).find("standard base64"),
            std::string::npos);
  EXPECT_NE(Refusal(without("ipc_handles_pickled")).find("standard base64"), std::string::npos);
  EXPECT_NE(Refusal(with("gpu_uuids", json::array())).find("gpu_uuids"), std::string::npos);
  EXPECT_NE(Refusal(with("gpu_uuids", {"a", "a"})).find("repeats"), std::string::npos);
  EXPECT_NE(Refusal(with("gpu_uuids", {"bad\nuuid"})).find("printable"), std::string::npos);
  EXPECT_NE(Refusal(with("dtype_names", {"bfloat16"})).find("one entry per name"),
            std::string::npos);
  EXPECT_NE(Refusal(with("dtype_names", {"bfloat16", "complex32"})).find("tensor #1"),
            std::string::npos);
  EXPECT_NE(Refusal(with("shapes", {{64, 48}, {-7}})).find("integer >= 0"), std::string::npos);
  EXPECT_NE(Refusal(with("shapes", {{64, 48}, {1, 1, 1, 1, 1, 1, 1, 1, 1}})).find("at most"),
            std::string::npos);
  EXPECT_NE(Refusal(with("names", {"model.a.weight", "model.a.weight"})).find("duplicate"),
            std::string::npos);
  EXPECT_NE(Refusal(with("names", {"model.a.weight", 5})).find("strings"), std::string::npos);
}

// An error never quotes the file's content (a key, a name, a dtype it invents); catches a control
// byte or a secret from a file reaching a log line or an HTTP answer.
TEST(VllmIpcFile, ErrorsNeverQuoteTheFile) {
  json f = GoodFile();
  f["evil\nkey"] = 1;
  EXPECT_EQ(Refusal(f).find("evil"), std::string::npos);
  json g = GoodFile();
  g["dtype_names"] = {"bfloat16", "secret\ndtype"};
  EXPECT_EQ(Refusal(g).find("secret"), std::string::npos);
}

// Proves a vllm-ipc: file whose parse would pass kFileJsonTreeBytesMax (9 MiB of empty arrays
// as its names, ~300 MB once parsed, well within the file's 64 MiB bound) is refused before it is
// parsed, the error naming the file and the bound, while a good file still reads. Catches the
// file parsed into a tree of ~30 times its text on a trainer API thread (the source check of
// every colocated update), then refused for its names.
TEST(VllmIpcFile, AFileWhoseTreeWouldPassItsBoundIsRefusedUnparsed) {
  std::string names = "[[]";
  while (names.size() < (9u << 20)) names += ",[]";
  names += "]";
  std::string text = GoodFile().dump();
  const std::string key = R"("names":)";
  const std::size_t at = text.find(key);
  ASSERT_NE(at, std::string::npos);
  text.insert(at + key.size(), names + R"(,"unused":)");
  ASSERT_GT(json_tree_bytes_bound(text), kFileJsonTreeBytesMax);
  const std::string bound = std::to_string(kFileJsonTreeBytesMax);
  const Status parsed = ParseVllmIpcFile(text).status();
  EXPECT_EQ(parsed.code(), Code::kInvalidArgument) << parsed.ToString();
  EXPECT_NE(parsed.message().find(bound), std::string::npos) << parsed.ToString();
  const auto dir = std::filesystem::temp_directory_path() / "rc-ipc-tree-test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "nodes.json").string();
  std::ofstream(path) << text;
  const Status read = ReadVllmIpcFile("vllm-ipc:" + path).status();
  EXPECT_NE(read.message().find(path), std::string::npos) << read.ToString();
  EXPECT_NE(read.message().find(bound), std::string::npos) << read.ToString();
  EXPECT_TRUE(ParseVllmIpcFile(GoodFile().dump()).ok());
  std::filesystem::remove_all(dir);
}

// The URI names an absolute, normal path; the file is read within its bound; catches a relative
// or traversing path, and an oversized file read whole into memory.
TEST(VllmIpcFile, PathsAndSizesAreBounded) {
  EXPECT_FALSE(VllmIpcPath("ipc:/x.json").ok());
  EXPECT_FALSE(VllmIpcPath("vllm-ipc:x.json").ok());
  EXPECT_FALSE(VllmIpcPath("vllm-ipc:/a/../b.json").ok());
  EXPECT_FALSE(VllmIpcPath("vllm-ipc:/a/").ok());
  EXPECT_EQ(*VllmIpcPath("vllm-ipc:/run/rc/step-7.json"), "/run/rc/step-7.json");
  const auto dir = std::filesystem::temp_directory_path() / "rc-ipc-file-test";
  std::filesystem::create_directories(dir);
  const std::string good = (dir / "good.json").string();
  std::ofstream(good) << GoodFile().dump();
  EXPECT_TRUE(ReadVllmIpcFile("vllm-ipc:" + good).ok());
  const std::string big = (dir / "big.json").string();
  {
    std::ofstream out(big);
    out << std::string(kVllmIpcFileBytesMax + 1, ' ');
  }
  Result<VllmIpcFile> r = ReadVllmIpcFile("vllm-ipc:" + big);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("over"), std::string::npos) << r.status().ToString();
  EXPECT_FALSE(ReadVllmIpcFile("vllm-ipc:" + (dir / "missing.json").string()).ok());
  std::filesystem::remove_all(dir);
}

// A bounded text is cut on a character boundary; catches a 4096-byte cut through a multi-byte
// character, which leaves a journal field that is not UTF-8.
TEST(VllmIpcFile, BoundedTextsStayUtf8) {
  const std::string s = std::string(4095, 'a') + "\xc3\xa9";  // 4097 bytes, "é" across the bound
  const std::string cut = text::utf8_prefix(s, 4096);
  EXPECT_EQ(cut.size(), 4095u);
  EXPECT_TRUE(text::valid_utf8(cut));
  EXPECT_EQ(text::utf8_prefix("short", 4096), "short");
}

// A directory under the temp directory, removed at the end of a test.
struct ScratchDir {
  std::filesystem::path path;
  explicit ScratchDir(const std::string& name)
      : path(std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// Proves reading a vllm-ipc: source never waits on a FIFO, even one renamed over the path between
// a size check and the open (a regular file and a FIFO swapped in turn while it is read); catches
// file_size() by path followed by a blocking std::ifstream open of whatever the path names by
// then, which waits forever for a writer.
TEST(VllmIpcFile, SourceSwappedForAFifoIsRefusedWithoutBlocking) {
  ScratchDir dir("rc-ipc-fifo-test");
  const std::string path = (dir.path / "source.json").string();
  const std::string fifo = (dir.path / "keep.fifo").string();
  const std::string next = (dir.path / "next").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    const std::string text = GoodFile().dump();
    while (!stop.load()) {
      { std::ofstream(next) << text; }
      std::rename(next.c_str(), path.c_str());
      // `next` must never stay a FIFO: the writer above would then wait for a reader.
      if (::link(fifo.c_str(), next.c_str()) == 0 && std::rename(next.c_str(), path.c_str()) != 0) {
        ::unlink(next.c_str());
      }
    }
  });
  // Reads for half a second (thousands of swaps): the window between a size check by path and
  // an open by path is then hit many times over. The bound below is only for a blocked read.
  auto done = std::make_shared<std::promise<int>>();
  std::future<int> result = done->get_future();
  std::thread([done, uri = "vllm-ipc:" + path] {
    int answered = 0;
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(500)) {
      (void)ReadVllmIpcFile(uri);  // the file, or a refusal: never a wait
      ++answered;
    }
    done->set_value(answered);
  }).detach();
  const bool finished = result.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  stop = true;
  swapper.join();
  if (!finished) {  // a reader blocked in open(): give it the writer it waits for
    const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (w >= 0) ::close(w);
  }
  ASSERT_TRUE(finished) << "a read blocked on the FIFO";
  EXPECT_GT(result.get(), 0);
  Result<VllmIpcFile> plain = ReadVllmIpcFile("vllm-ipc:" + fifo);
  ASSERT_FALSE(plain.ok());
  EXPECT_NE(plain.status().message().find("not a regular file"), std::string::npos)
      << plain.status().ToString();
}

using rc::testing::ScriptedServer;

using rc::testing::kStallMs;
using rc::testing::SlowDeadlines;
using rc::testing::SlowTransferEngine;

// The good file on disk and a target that declares its manifest.
struct IpcSourceOnDisk {
  ScratchDir dir{"rc-ipc-transfer-test"};
  TransferTarget target;
  IpcSourceOnDisk() {
    const std::string path = (dir.path / "step.json").string();
    std::ofstream(path) << GoodFile().dump();
    target.update_id = "u1";
    target.target = WeightVersion{1, "rc-1"};
    target.source_uri = "vllm-ipc:" + path;
    target.identity.manifest_digest = ParseVllmIpcFile(GoodFile().dump())->manifest.digest();
  }
};

// Proves the check that the engine is still the initialized process and the init after a restart
// end by one deadline: a label read answered at 1.6 s of 2 s (naming a new process) leaves the
// stalled init only the rest; catches SameEngineAs and the init each given the same `left` (the
// transfer then ran to ~3.6 s, almost twice its journaled deadline).
TEST(IpcTransfer, RestartCheckAndInitEndByOneDeadline) {
  IpcSourceOnDisk source;
  SlowTransferEngine e;
  EngineClient c(e.s.url(), SlowDeadlines());
  c.set_label_route(LabelRoute::kWeightInfoRoute);
  IpcTransfer t(c);
  TransferObserved first = t.Transfer(source.target, 5000);
  ASSERT_EQ(first.mutation, MutationClass::kComplete) << first.error;
  e.generation = 2;  // restarted: the transfer engine must be initialized again
  e.label_delay_ms = 1600;
  e.init_delay_ms = kStallMs;
  const auto t0 = std::chrono::steady_clock::now();
  TransferObserved o = t.Transfer(source.target, 2000);
  EXPECT_LT(elapsed_ms(t0), 3000u);  // deadline 2000 ms; the stale timeout took >= 3600 ms
  EXPECT_EQ(o.mutation, MutationClass::kNone);
  EXPECT_NE(o.error.find("/init_weight_transfer_engine"), std::string::npos) << o.error;
}

// Proves the transfer's GPU check (rc_device_info) is bounded by the transfer's deadline, not by
// the client's per-call timeout: a stalled answer ends the transfer near its 1 s deadline as a
// refusal with nothing started; catches the check sent without the deadline (it then waited the
// 5 s call timeout).
TEST(IpcTransfer, DeviceCheckEndsByTheTransferDeadline) {
  IpcSourceOnDisk source;
  SlowTransferEngine e;
  e.device_delay_ms = kStallMs;
  EngineClient c(e.s.url(), SlowDeadlines());
  c.set_label_route(LabelRoute::kWeightInfoRoute);
  IpcTransfer t(c);
  const auto t0 = std::chrono::steady_clock::now();
  TransferObserved o = t.Transfer(source.target, 1000);
  EXPECT_LT(elapsed_ms(t0), 3000u);  // deadline 1000 ms; the call's own timeout is 5000 ms
  EXPECT_EQ(o.mutation, MutationClass::kNone);
  for (const std::string& p : e.s.paths()) EXPECT_NE(p, "POST /start_weight_update");
}

}  // namespace
}  // namespace rc::effects
