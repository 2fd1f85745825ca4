#include "effects/nccl/protocol.h"

namespace rc::effects::nccl {

const char* rendezvous_name(Rendezvous r) {
  switch (r) {
    case Rendezvous::kAuto: return "auto";
    case Rendezvous::kTcpStore: return "tcpstore";
    case Rendezvous::kUniqueId: return "unique-id";
  }
  return "?";
}

nlohmann::json BuildInitInfo(ProtocolLine line, Rendezvous mode, const std::string& master_address,
                             std::uint16_t master_port, int world_size, const std::string& unique_id_b64,
                             const PackingParams& packing) {
  RC_ASSERT(mode != Rendezvous::kAuto);
  RC_ASSERT(mode != Rendezvous::kUniqueId || line == ProtocolLine::kUniqueIdCapable);
  nlohmann::json j = nlohmann::json::object();
  if (mode == Rendezvous::kTcpStore) {
    j["master_address"] = master_address;
    j["master_port"] = master_port;
  } else {
    j["nccl_unique_id_b64"] = unique_id_b64;
  }
  j["rank_offset"] = 1;
  j["world_size"] = world_size;
  if (line != ProtocolLine::kPackedInUpdateInfo) {
    j["packed"] = packing.packed;
    j["packed_buffer_size_bytes"] = packing.packed_buffer_size_bytes;
    j["packed_num_buffers"] = packing.packed_num_buffers;
  }
  return j;
}

nlohmann::json BuildUpdateInfo(ProtocolLine line, const Manifest& manifest, const PackingParams& packing) {
  nlohmann::json names = nlohmann::json::array();
  nlohmann::json dtypes = nlohmann::json::array();
  nlohmann::json shapes = nlohmann::json::array();
  for (const auto& t : manifest.tensors) {
    names.push_back(t.name);
    dtypes.push_back(dtype_torch_name(t.dtype));
    nlohmann::json shape = nlohmann::json::array();
    for (std::uint64_t d : t.shape) shape.push_back(d);
    shapes.push_back(std::move(shape));
  }
  nlohmann::json j = {{"names", std::move(names)}, {"dtype_names", std::move(dtypes)}, {"shapes", std::move(shapes)}};
  if (line == ProtocolLine::kPackedInUpdateInfo) {
    j["packed"] = packing.packed;
    j["packed_buffer_size_bytes"] = packing.packed_buffer_size_bytes;
    j["packed_num_buffers"] = packing.packed_num_buffers;
  }
  return j;
}

}  // namespace rc::effects::nccl
