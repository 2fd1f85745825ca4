#include "effects/http/protocol.h"

#include <cctype>

namespace rc::effects {

const char* protocol_line_name(ProtocolLine l) {
  switch (l) {
    case ProtocolLine::kUnknown:
      return "unknown";
    case ProtocolLine::kPackedInUpdateInfo:
      return "packed-in-update-info(0.25)";
    case ProtocolLine::kPackedInInitInfo:
      return "packed-in-init-info(>=0.28)";
  }
  return "?";
}

namespace {
bool read_int(const std::string& s, std::size_t* i, int* out) {
  const std::size_t start = *i;
  long v = 0;
  while (*i < s.size() && std::isdigit(static_cast<unsigned char>(s[*i])) && *i - start < 6) {
    v = v * 10 + (s[*i] - '0');
    ++*i;
  }
  if (*i == start) return false;
  *out = static_cast<int>(v);
  return true;
}
}  // namespace

Result<SemVer> parse_vllm_version(const std::string& raw) {
  if (raw.empty() || raw.size() > 128) return Status::InvalidArgument("empty or long version");
  std::size_t i = 0;
  if (raw[0] == 'v' || raw[0] == 'V') i = 1;
  SemVer v;
  if (!read_int(raw, &i, &v.major) || i >= raw.size() || raw[i] != '.') {
    return Status::InvalidArgument("unparseable version '" + raw + "'");
  }
  ++i;
  if (!read_int(raw, &i, &v.minor))
    return Status::InvalidArgument("unparseable version '" + raw + "'");
  if (i < raw.size() && raw[i] == '.') {
    ++i;
    if (!read_int(raw, &i, &v.patch)) {
      return Status::InvalidArgument("unparseable version '" + raw + "'");
    }
  }
  // Anything after X.Y[.Z] (rc, .dev, -N-gHASH, +g<hash>) makes the number approximate, except
  // a plain ".postN" (a re-release of the same code) and a build-variant local segment such as
  // "+cu129", "+cpu", "+rocm6.3" (the release's code built for another platform).
  std::string rest = raw.substr(i);
  if (rest.rfind(".post", 0) == 0) {
    std::size_t k = 5;
    while (k < rest.size() && std::isdigit(static_cast<unsigned char>(rest[k]))) ++k;
    rest = rest.substr(k);
  }
  const bool variant = rest.rfind("+cu", 0) == 0 || rest == "+cpu" || rest.rfind("+rocm", 0) == 0 ||
                       rest == "+xpu" || rest == "+tpu";
  bool variant_ok = variant;
  for (std::size_t k = 1; variant && k < rest.size(); ++k) {
    const char c = rest[k];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.') variant_ok = false;
  }
  v.dev = !rest.empty() && !variant_ok;
  return v;
}

EngineProtocol detect_protocol(const std::string& version, const ProtocolOverride& o) {
  EngineProtocol p;
  p.version = version;
  Result<SemVer> v = parse_vllm_version(version);
  if (v.ok()) {
    p.dev_build = v->dev;
    const int mm = v->major * 1000 + v->minor;  // minor < 1000
    if (!v->dev && v->major == 0 && v->minor >= 25) {
      p.line = mm >= 28 ? ProtocolLine::kPackedInInitInfo : ProtocolLine::kPackedInUpdateInfo;
      p.unique_id_rendezvous = mm >= 30;
    } else if (!v->dev && v->major >= 1) {
      p.line = ProtocolLine::kPackedInInitInfo;
      p.unique_id_rendezvous = true;
    }
  }
  if (o.line) p.line = *o.line;
  if (o.unique_id_rendezvous) p.unique_id_rendezvous = *o.unique_id_rendezvous;
  return p;
}

Result<nlohmann::json> build_init_info(const EngineProtocol& p, const NcclInitParams& init,
                                       const PackingParams& packing) {
  if (p.line == ProtocolLine::kUnknown) {
    return Status::InvalidArgument("engine version '" + p.version +
                                   "' has no known weight-transfer protocol line; override it");
  }
  if (init.world_size < 2) return Status::InvalidArgument("world_size must be >= 2");
  if (init.rank_offset < 1) return Status::InvalidArgument("rank_offset must be >= 1");
  const bool tcp = !init.master_address.empty() || init.master_port != 0;
  const bool uid = !init.nccl_unique_id_b64.empty();
  if (tcp == uid) {
    return Status::InvalidArgument(
        "exactly one rendezvous: master_address+master_port or nccl_unique_id_b64");
  }
  if (tcp && (init.master_address.empty() || init.master_port == 0)) {
    return Status::InvalidArgument("TCP rendezvous needs master_address and master_port");
  }
  if (uid && !p.unique_id_rendezvous) {
    return Status::InvalidArgument("engine '" + p.version +
                                   "' does not accept nccl_unique_id_b64 (needs >= 0.30)");
  }
  if (uid && init.nccl_unique_id_b64.size() != 172) {  // base64 of 128 bytes, padded
    return Status::InvalidArgument("nccl_unique_id_b64 must encode exactly 128 bytes");
  }
  nlohmann::json j = nlohmann::json::object();
  if (tcp) {
    j["master_address"] = init.master_address;
    j["master_port"] = init.master_port;
  } else {
    j["nccl_unique_id_b64"] = init.nccl_unique_id_b64;
  }
  j["rank_offset"] = init.rank_offset;
  j["world_size"] = init.world_size;
  if (p.line == ProtocolLine::kPackedInInitInfo) {
    j["packed"] = packing.packed;
    j["packed_buffer_size_bytes"] = packing.packed_buffer_size_bytes;
    j["packed_num_buffers"] = packing.packed_num_buffers;
  }
  return j;
}

Result<nlohmann::json> build_update_info(const EngineProtocol& p, const Manifest& manifest,
                                         const PackingParams& packing) {
  if (p.line == ProtocolLine::kUnknown) {
    return Status::InvalidArgument("engine version '" + p.version +
                                   "' has no known weight-transfer protocol line; override it");
  }
  RC_RETURN_IF_ERROR(manifest.Validate());
  nlohmann::json names = nlohmann::json::array();
  nlohmann::json dtypes = nlohmann::json::array();
  nlohmann::json shapes = nlohmann::json::array();
  for (const TensorSpec& t : manifest.tensors) {
    names.push_back(t.name);
    dtypes.push_back(dtype_torch_name(t.dtype));
    nlohmann::json shape = nlohmann::json::array();
    for (std::uint64_t d : t.shape) shape.push_back(d);
    shapes.push_back(std::move(shape));
  }
  nlohmann::json j = nlohmann::json::object();
  j["names"] = std::move(names);
  j["dtype_names"] = std::move(dtypes);
  j["shapes"] = std::move(shapes);
  if (p.line == ProtocolLine::kPackedInUpdateInfo) {
    j["packed"] = packing.packed;
    j["packed_buffer_size_bytes"] = packing.packed_buffer_size_bytes;
    j["packed_num_buffers"] = packing.packed_num_buffers;
  }
  return j;
}

}  // namespace rc::effects
