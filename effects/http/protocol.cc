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

constexpr int kVersionPartMax = 999999;  // read_int reads at most six digits

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

// "X.Y" or "X.Y.Z" from *i on; *i ends after the last number read.
bool read_numbers(const std::string& s, std::size_t* i, SemVer* v) {
  if (!read_int(s, i, &v->major) || *i >= s.size() || s[*i] != '.') return false;
  ++*i;
  if (!read_int(s, i, &v->minor)) return false;
  if (*i < s.size() && s[*i] == '.') {
    ++*i;
    if (!read_int(s, i, &v->patch)) return false;
  }
  return true;
}

// A plain ".postN" re-releases the same code: the rest after it.
std::string without_post_release(std::string rest) {
  if (rest.rfind(".post", 0) != 0) return rest;
  std::size_t k = 5;
  while (k < rest.size() && std::isdigit(static_cast<unsigned char>(rest[k]))) ++k;
  return rest.substr(k);
}

// A build-variant local segment ("+cu129", "+cpu", "+rocm6.3", "+xpu", "+tpu"): the release's
// code built for another platform.
bool is_build_variant(const std::string& rest) {
  const bool variant = rest.rfind("+cu", 0) == 0 || rest == "+cpu" || rest.rfind("+rocm", 0) == 0 ||
                       rest == "+xpu" || rest == "+tpu";
  if (!variant) return false;
  for (std::size_t k = 1; k < rest.size(); ++k) {
    const char c = rest[k];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.') return false;
  }
  return true;
}

}  // namespace

Result<SemVer> parse_vllm_version(const std::string& raw) {
  if (raw.empty() || raw.size() > 128) return Status::InvalidArgument("empty or long version");
  std::size_t i = (raw[0] == 'v' || raw[0] == 'V') ? 1 : 0;
  SemVer v;
  if (!read_numbers(raw, &i, &v)) {
    return Status::InvalidArgument("unparseable version '" + raw + "'");
  }
  // Anything after X.Y[.Z] (rc, .dev, -N-gHASH, +g<hash>) makes the number approximate, except
  // a plain ".postN" and a build variant.
  const std::string rest = without_post_release(raw.substr(i));
  v.dev = !rest.empty() && !is_build_variant(rest);
  RC_CHECK(v.major >= 0 && v.major <= kVersionPartMax && v.minor >= 0 &&
           v.minor <= kVersionPartMax && v.patch >= 0 && v.patch <= kVersionPartMax);
  return v;
}

namespace {

// The rules of protocol.h for a parsed version, before any override.
void apply_version_rules(const SemVer& v, EngineProtocol& p) {
  p.dev_build = v.dev;
  if (v.dev) return;
  const int mm = v.major * 1000 + v.minor;  // used only where major == 0
  if (v.major == 0 && v.minor >= 25) {
    p.line = mm >= 28 ? ProtocolLine::kPackedInInitInfo : ProtocolLine::kPackedInUpdateInfo;
    p.unique_id_rendezvous = mm >= 30;
  } else if (v.major >= 1) {
    p.line = ProtocolLine::kPackedInInitInfo;
    p.unique_id_rendezvous = true;
  }
}

}  // namespace

EngineProtocol detect_protocol(const std::string& version, const ProtocolOverride& o) {
  EngineProtocol p;
  p.version = version;
  Result<SemVer> v = parse_vllm_version(version);
  if (v.ok()) apply_version_rules(*v, p);
  if (o.line) p.line = *o.line;
  if (o.unique_id_rendezvous) p.unique_id_rendezvous = *o.unique_id_rendezvous;
  // Only an override dates a dev build.
  RC_CHECK(o.line || !p.dev_build || p.line == ProtocolLine::kUnknown);
  RC_CHECK(!o.line || p.line == *o.line);
  return p;
}

namespace {

Status unknown_line(const EngineProtocol& p) {
  return Status::InvalidArgument("engine version '" + p.version +
                                 "' has no known weight-transfer protocol line; override it");
}

// build_init_info's refusals, in the order it reports them.
Status check_init_params(const EngineProtocol& p, const NcclInitParams& init) {
  if (p.line == ProtocolLine::kUnknown) return unknown_line(p);
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
  return Status::OK();
}

void put_packing(const PackingParams& packing, nlohmann::json& j) {
  j["packed"] = packing.packed;
  j["packed_buffer_size_bytes"] = packing.packed_buffer_size_bytes;
  j["packed_num_buffers"] = packing.packed_num_buffers;
}

}  // namespace

Result<nlohmann::json> build_init_info(const EngineProtocol& p, const NcclInitParams& init,
                                       const PackingParams& packing) {
  RC_RETURN_IF_ERROR(check_init_params(p, init));
  const bool tcp = !init.master_address.empty() || init.master_port != 0;
  nlohmann::json j = nlohmann::json::object();
  if (tcp) {
    j["master_address"] = init.master_address;
    j["master_port"] = init.master_port;
  } else {
    j["nccl_unique_id_b64"] = init.nccl_unique_id_b64;
  }
  j["rank_offset"] = init.rank_offset;
  j["world_size"] = init.world_size;
  if (p.line == ProtocolLine::kPackedInInitInfo) put_packing(packing, j);
  // Exactly one rendezvous, and packed* only where this line wants them.
  RC_CHECK(j.contains("master_address") != j.contains("nccl_unique_id_b64"));
  RC_CHECK(j.contains("packed") == (p.line == ProtocolLine::kPackedInInitInfo));
  return j;
}

Result<nlohmann::json> build_update_info(const EngineProtocol& p, const Manifest& manifest,
                                         const PackingParams& packing) {
  if (p.line == ProtocolLine::kUnknown) return unknown_line(p);
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
  if (p.line == ProtocolLine::kPackedInUpdateInfo) put_packing(packing, j);
  // One entry per tensor, in manifest order.
  RC_CHECK(j["names"].size() == manifest.tensors.size());
  RC_CHECK(j["shapes"].size() == manifest.tensors.size());
  return j;
}

}  // namespace rc::effects
