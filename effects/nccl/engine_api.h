// The HTTP calls the NCCL sender needs from a vLLM engine, behind a small interface so the sender
// can use the team's EngineClient (effects/http/) once it lands, and tests can inject faults.
// SocketEngineApi is a minimal blocking HTTP/1.1 client (one connection per call, bounded sizes,
// every call has a deadline) used by the GPU tests and benchmarks until then.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "statemachine/types.h"

namespace rc::effects::nccl {

struct EngineReply {
  HttpEvidence http;
  nlohmann::json body;  // null unless the body parsed as JSON
};

// Which layout of init_info / update_info an engine expects (reference §2.2, §2.3, §8).
enum class ProtocolLine : std::uint8_t {
  kPackedInUpdateInfo = 0,   // vLLM 0.25.x: packed* in update_info; TCPStore rendezvous only
  kPackedInInitInfo = 1,     // reference commit / >= 0.28: packed* in init_info; TCPStore only
  kUniqueIdCapable = 2,      // >= 0.30 (PR #53784): init_info may carry nccl_unique_id_b64
};
const char* protocol_line_name(ProtocolLine line);
// From GET /version's "version": major.minor < 0.28 -> kPackedInUpdateInfo; 0.28-0.29 ->
// kPackedInInitInfo; >= 0.30 -> kUniqueIdCapable; unparsable or dev builds -> kPackedInInitInfo
// (the main-branch layout that needs no unique-id support).
ProtocolLine DetectProtocolLine(const std::string& version);

class EngineApi {
 public:
  virtual ~EngineApi() = default;
  virtual EngineReply Version(std::uint64_t timeout_ms) = 0;
  virtual EngineReply GetWorldSize(std::uint64_t timeout_ms) = 0;
  virtual EngineReply InitWeightTransferEngine(const nlohmann::json& init_info,
                                               std::uint64_t timeout_ms) = 0;
  virtual EngineReply StartWeightUpdate(std::uint64_t timeout_ms) = 0;
  virtual EngineReply UpdateWeights(const nlohmann::json& update_info, std::uint64_t timeout_ms) = 0;
  virtual EngineReply FinishWeightUpdate(const std::string& label, std::uint64_t timeout_ms) = 0;
};

inline constexpr std::size_t kHttpResponseBytesMax = 4u << 20;

// Plain HTTP/1.1 over TCP (IPv4 host or dotted address), "Connection: close".
class SocketEngineApi final : public EngineApi {
 public:
  SocketEngineApi(std::string host, std::uint16_t port) : host_(std::move(host)), port_(port) {}
  EngineReply Version(std::uint64_t timeout_ms) override;
  EngineReply GetWorldSize(std::uint64_t timeout_ms) override;
  EngineReply InitWeightTransferEngine(const nlohmann::json& init_info, std::uint64_t timeout_ms) override;
  EngineReply StartWeightUpdate(std::uint64_t timeout_ms) override;
  EngineReply UpdateWeights(const nlohmann::json& update_info, std::uint64_t timeout_ms) override;
  EngineReply FinishWeightUpdate(const std::string& label, std::uint64_t timeout_ms) override;
  // Any route (tests use the receiver double's extra routes).
  EngineReply Call(const std::string& method, const std::string& path, const std::string& body,
                   std::uint64_t timeout_ms);

 private:
  std::string host_;
  std::uint16_t port_;
};

}  // namespace rc::effects::nccl
