// The vllm-ipc: weight-source file as IpcTransfer reads it: what it forwards to vLLM (the
// unpacked update_info), its manifest, and a clear refusal — never an exception, never the file's
// bytes echoed — for every malformed file a trainer (or anyone who can write the path) produces.
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "effects/http/ipc_transfer.h"
#include "statemachine/text.h"

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

}  // namespace
}  // namespace rc::effects
