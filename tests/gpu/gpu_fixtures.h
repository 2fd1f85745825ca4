// Shared by the GPU drivers: the weight sets (Qwen3-8B- and OPT-125M-shaped manifests), the
// seeded byte generator the receiver double also implements (receiver_double.expected_bytes),
// device uploads, a safetensors writer and the client for the double's test routes.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "effects/manifest.h"

namespace rc::gpu_test {

using namespace rc::effects;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

inline Manifest Qwen3_8B() {
  Manifest m;
  auto add = [&m](std::string n, std::vector<std::uint64_t> s) {
    m.tensors.push_back({std::move(n), DType::kBFloat16, std::move(s)});
  };
  add("model.embed_tokens.weight", {151936, 4096});
  for (int l = 0; l < 36; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", {4096, 4096});
    add(p + "self_attn.k_proj.weight", {1024, 4096});
    add(p + "self_attn.v_proj.weight", {1024, 4096});
    add(p + "self_attn.o_proj.weight", {4096, 4096});
    add(p + "self_attn.q_norm.weight", {128});
    add(p + "self_attn.k_norm.weight", {128});
    add(p + "mlp.gate_proj.weight", {12288, 4096});
    add(p + "mlp.up_proj.weight", {12288, 4096});
    add(p + "mlp.down_proj.weight", {4096, 12288});
    add(p + "input_layernorm.weight", {4096});
    add(p + "post_attention_layernorm.weight", {4096});
  }
  add("model.norm.weight", {4096});
  add("lm_head.weight", {151936, 4096});
  return m;
}

inline Manifest Opt125M() {
  Manifest m;
  auto add = [&m](std::string n, std::vector<std::uint64_t> s) {
    m.tensors.push_back({std::move(n), DType::kBFloat16, std::move(s)});
  };
  add("model.decoder.embed_tokens.weight", {50272, 768});
  add("model.decoder.embed_positions.weight", {2050, 768});
  for (int l = 0; l < 12; ++l) {
    const std::string p = "model.decoder.layers." + std::to_string(l) + ".";
    for (const char* proj : {"k_proj", "v_proj", "q_proj", "out_proj"}) {
      add(p + "self_attn." + proj + ".weight", {768, 768});
      add(p + "self_attn." + proj + ".bias", {768});
    }
    add(p + "self_attn_layer_norm.weight", {768});
    add(p + "self_attn_layer_norm.bias", {768});
    add(p + "fc1.weight", {3072, 768});
    add(p + "fc1.bias", {3072});
    add(p + "fc2.weight", {768, 3072});
    add(p + "fc2.bias", {768});
    add(p + "final_layer_norm.weight", {768});
    add(p + "final_layer_norm.bias", {768});
  }
  add("model.decoder.final_layer_norm.weight", {768});
  add("model.decoder.final_layer_norm.bias", {768});
  return m;
}

// Same generator as receiver_double.expected_bytes: u32 word j of tensor i.
inline void Generate(std::uint64_t seed, std::size_t i, std::uint64_t nbytes, char* dst) {
  const std::uint64_t nwords = (nbytes + 3) / 4;
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([=] {
      const std::uint64_t lo = nwords * t / threads, hi = nwords * (t + 1) / threads;
      const std::uint64_t c = (i + 1) * 2246822519ull + seed;
      for (std::uint64_t j = lo; j < hi; ++j) {
        const std::uint32_t w = static_cast<std::uint32_t>(j * 2654435761ull + c);
        const std::uint64_t off = j * 4;
        if (off + 4 <= nbytes)
          std::memcpy(dst + off, &w, 4);
        else
          std::memcpy(dst + off, &w, nbytes - off);
      }
    });
  }
  for (auto& th : pool) th.join();
}

struct DeviceSet {
  std::vector<void*> allocations;
  std::vector<const void*> ptrs;
  ~DeviceSet() {
    for (void* p : allocations) cudaFree(p);
  }
};

// contiguous: one allocation, tensors back to back (broadcast straight from it); else one each.
inline std::unique_ptr<DeviceSet> Upload(const Manifest& m, std::uint64_t seed, bool contiguous) {
  auto set = std::make_unique<DeviceSet>();
  std::uint64_t max_bytes = 0;
  for (const auto& t : m.tensors) max_bytes = std::max(max_bytes, t.nbytes());
  char* host = nullptr;
  RC_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), max_bytes, cudaHostAllocDefault) ==
           cudaSuccess);
  char* base = nullptr;
  if (contiguous) {
    RC_CHECK(cudaMalloc(reinterpret_cast<void**>(&base), m.total_bytes()) == cudaSuccess);
    set->allocations.push_back(base);
  }
  std::uint64_t off = 0;
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    const std::uint64_t n = m.tensors[i].nbytes();
    Generate(seed, i, n, host);
    char* dst = nullptr;
    if (contiguous) {
      dst = base + off;
    } else {
      RC_CHECK(cudaMalloc(reinterpret_cast<void**>(&dst), std::max<std::uint64_t>(n, 1)) ==
               cudaSuccess);
      set->allocations.push_back(dst);
    }
    RC_CHECK(cudaMemcpy(dst, host, n, cudaMemcpyHostToDevice) == cudaSuccess);
    set->ptrs.push_back(dst);
    off += n;
  }
  cudaFreeHost(host);
  return set;
}

inline void WriteSafetensors(const Manifest& m, std::uint64_t seed, const std::string& path) {
  json h = json::object();
  std::uint64_t off = 0;
  for (const auto& t : m.tensors) {
    h[t.name] = {{"dtype", dtype_safetensors_name(t.dtype)},
                 {"shape", t.shape},
                 {"data_offsets", {off, off + t.nbytes()}}};
    off += t.nbytes();
  }
  std::string header = h.dump();
  while ((8 + header.size()) % 8) header.push_back(' ');
  std::ofstream f(path, std::ios::binary);
  const std::uint64_t len = header.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f << header;
  std::vector<char> buf;
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    buf.resize(m.tensors[i].nbytes());
    Generate(seed, i, buf.size(), buf.data());
    f.write(buf.data(), static_cast<std::streamsize>(buf.size()));
  }
}

inline std::int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// The sender and the test routes share the project's one HTTP client.
struct Ctx {
  std::uint16_t port;
  EngineClient api;
  explicit Ctx(std::uint16_t p) : port(p), api("http://127.0.0.1:" + std::to_string(p)) {}
  HttpReply Call(EngineClient::Method method, const std::string& path, std::optional<json> body,
                 std::uint64_t timeout_ms) {
    EngineClient::Request r;
    r.method = method;
    r.path = path;
    if (body) r.json_body = body->dump();
    r.shape = EngineClient::Shape::kJsonObject;
    r.timeout_ms = timeout_ms;
    return api.Call(r, {});
  }
  void Config(const std::string& version, json seed, double stall_s = 0) {
    auto r =
        Call(EngineClient::Method::kPost, "/test/config",
             json{{"version", version}, {"seed", seed}, {"stall_after_first_s", stall_s}}, 5000);
    RC_CHECK(r.http.http_status == 200);
    // The receiver now answers as `version` (0.25.x: no /weight_info): as after an engine restart
    // with another vLLM, the client finds the label route again.
    api.set_label_route(LabelRoute::kUnknown);
  }
  json Report() {
    return Call(EngineClient::Method::kGet, "/test/report", std::nullopt, 5000).body;
  }
  std::string Label() {  // either route: /weight_info, or the worker extension on 0.25.x
    auto r = api.ReadLabel();
    return r.body.is_object() ? r.body.value("weight_version", "") : "";
  }
};

}  // namespace rc::gpu_test
