// Checkpoint directories for the reload transfer's service tests: each holds one
// model.safetensors of four bf16 [8, 8] layers whose bytes are all one value, so two checkpoints
// share a manifest and differ in every tensor.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace rc::service::test {

// A checkpoint directory holding one model.safetensors of four bf16 [8, 8] layers whose bytes
// are all `fill`; returns the file.
std::string WriteCheckpoint(const std::filesystem::path& dir, int fill) {
  std::filesystem::create_directories(dir);
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (int i = 0; i < 4; ++i) {
    const std::size_t n = 8 * 8 * 2;
    header["model.layers." + std::to_string(i) + ".weight"] = {
        {"dtype", "BF16"}, {"shape", {8, 8}}, {"data_offsets", {data.size(), data.size() + n}}};
    data.append(n, static_cast<char>(fill));
  }
  const std::string h = header.dump();
  std::string len(8, '\0');
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((h.size() >> (8 * i)) & 0xFF);
  const std::filesystem::path file = dir / "model.safetensors";
  std::ofstream(file, std::ios::binary) << len << h << data;
  return file.string();
}

struct Checkpoints {
  std::filesystem::path dir;
  std::string v0, v1, v2;
  Checkpoints() {
    char tmpl[] = "/tmp/rc_ckpt_svc_XXXXXX";
    dir = ::mkdtemp(tmpl);
    v0 = WriteCheckpoint(dir / "v0", 10);
    v1 = WriteCheckpoint(dir / "v1", 11);
    v2 = WriteCheckpoint(dir / "v2", 12);
  }
  ~Checkpoints() { std::filesystem::remove_all(dir); }
};

}  // namespace rc::service::test
