// Which weight-transfer protocol line an engine speaks, from `GET /version`, and the init_info /
// update_info JSON bodies for that line (docs/vllm-protocol.md §3).
//
// Rules (overridable with ProtocolOverride, e.g. for dev builds or back-ports):
//   0.25 <= v < 0.28  kPackedInUpdateInfo: init_info = {master_address, master_port, rank_offset,
//                     world_size}; packed, packed_buffer_size_bytes, packed_num_buffers go in
//                     update_info next to names/dtype_names/shapes. TCPStore rendezvous only.
//                     (The move was PR #50902; v0.25.1 has the old layout; "vLLM >= 0.28 moved
//                     it", trl#7131. 0.26/0.27 were not read: they are assumed old.)
//   v >= 0.28         kPackedInInitInfo: all seven keys in init_info, update_info has only
//                     names/dtype_names/shapes (extra keys are a ValueError on the engine).
//   v >= 0.30         additionally accepts `nccl_unique_id_b64` instead of master_address/port
//                     (PR #53784, merged 2026-08-25; "checked against v0.30.0").
//   anything else     kUnknown: dev builds ("0.23.1.dev2095+g0fe9a916e" is newer than its
//                     number says), versions below 0.25, unparseable strings. Builders refuse
//                     kUnknown; the operator must pass an override.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "effects/manifest.h"
#include "statemachine/status.h"

namespace rc::effects {

enum class ProtocolLine : std::uint8_t {
  kUnknown = 0,
  kPackedInUpdateInfo = 1,  // v0.25.x
  kPackedInInitInfo = 2,    // >= 0.28
};
const char* protocol_line_name(ProtocolLine l);

struct EngineProtocol {
  std::string version;  // as reported by /version
  ProtocolLine line = ProtocolLine::kUnknown;
  bool unique_id_rendezvous = false;  // nccl_unique_id_b64 accepted in init_info
  bool dev_build = false;             // ".dev", "+g", "rc" or a git-describe suffix
};

struct ProtocolOverride {
  std::optional<ProtocolLine> line;
  std::optional<bool> unique_id_rendezvous;
};

struct SemVer {
  int major = 0, minor = 0, patch = 0;
  bool dev = false;  // pre-release or local build: the number alone does not date the code
};
// Parses "0.30.0", "v0.25.1", "0.30.0rc1", "0.23.1.dev2095+g0fe9a916e", "0.23.1rc0-2095-g0fe9".
[[nodiscard]] Result<SemVer> parse_vllm_version(const std::string& v);

// Applies the rules above, then the override. An unparseable version yields kUnknown (never an
// error) so that an override can still make it usable.
EngineProtocol detect_protocol(const std::string& version, const ProtocolOverride& o = {});

struct NcclInitParams {
  // TCP rendezvous (trainer hosts the TCPStore) — or the unique id: exactly one.
  std::string master_address;
  std::uint16_t master_port = 0;
  std::string nccl_unique_id_b64;  // standard base64 of the 128-byte ncclUniqueId
  std::uint32_t rank_offset = 1;
  std::uint32_t world_size = 0;  // 1 + GET /get_world_size?include_dp=true
};

struct PackingParams {
  bool packed = true;
  std::uint64_t packed_buffer_size_bytes = std::uint64_t{1} << 30;
  std::uint32_t packed_num_buffers = 2;
};

// init_info for POST /init_weight_transfer_engine {"init_info": ...}.
[[nodiscard]] Result<nlohmann::json> build_init_info(const EngineProtocol& p,
                                                     const NcclInitParams& init,
                                                     const PackingParams& packing);
// update_info for POST /update_weights {"update_info": ...}: names, torch dtype names, shapes in
// manifest order (+ packed* on kPackedInUpdateInfo).
[[nodiscard]] Result<nlohmann::json> build_update_info(const EngineProtocol& p,
                                                       const Manifest& manifest,
                                                       const PackingParams& packing);

}  // namespace rc::effects
