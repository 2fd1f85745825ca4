// init_info / update_info payloads exactly as vLLM parses them (reference §2.2, §2.3, §8).
// vLLM builds its dataclasses with `cls(**dict)`: an unknown key is an error, so which keys are
// sent depends on the engine's protocol line.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "effects/manifest.h"
#include "effects/nccl/engine_api.h"

namespace rc::effects::nccl {

enum class Rendezvous : std::uint8_t { kAuto = 0, kTcpStore = 1, kUniqueId = 2 };
const char* rendezvous_name(Rendezvous r);

struct PackingParams {
  bool packed = true;
  std::uint64_t packed_buffer_size_bytes = 1ull << 30;
  std::uint32_t packed_num_buffers = 2;
};

// TCPStore mode: master_address/master_port; unique-id mode: nccl_unique_id_b64 (no master_*).
nlohmann::json BuildInitInfo(ProtocolLine line, Rendezvous mode, const std::string& master_address,
                             std::uint16_t master_port, int world_size, const std::string& unique_id_b64,
                             const PackingParams& packing);
nlohmann::json BuildUpdateInfo(ProtocolLine line, const Manifest& manifest, const PackingParams& packing);

}  // namespace rc::effects::nccl
