// The trainer API's body parsers (see api_parse.h).
#include "service/api_parse.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "effects/http/sequence_transfer.h"
#include "service/config.h"
#include "service/http_util.h"
#include "statemachine/fleet.h"
#include "statemachine/hex.h"
#include "statemachine/state.h"
#include "statemachine/text.h"

namespace rc::service {

using nlohmann::json;

namespace {

// A plan's id or label, checked as the fold checks it (1..kIdBytesMax bytes of printable UTF-8)
// before anything waits on the plan slot: a malformed one is 400 at once, never a 409 because
// another plan runs.
Result<std::string> GetId(const json& body, const char* key) {
  auto v = GetString(body, key, true);
  if (!v.ok()) return v.status();
  if (Status st = check_id(key, *v); !st.ok()) {
    return Status::InvalidArgument("'" + std::string(key) + "': " + st.message());
  }
  return v;
}

constexpr std::size_t kSourceEchoBytesMax = 64;  // an unknown scheme is quoted at most this long

std::string Esc(const std::string& s) { return rc::text::escape_line(s); }

Status ValidateSyntheticSource(const std::string& uri) {
  auto m = effects::synthetic_manifest(uri);
  if (!m.ok()) return Status::InvalidArgument("'source': " + m.status().message());
  return Status::OK();
}

// The absolute path a safetensors: or ipc: source names.
Result<std::string> SourcePath(const std::string& uri) {
  std::string path;
  bool file_scheme = false;
  for (const char* scheme : {"safetensors:", "ipc:", "vllm-ipc:"}) {
    if (uri.rfind(scheme, 0) != 0) continue;
    path = uri.substr(std::strlen(scheme));
    file_scheme = true;
  }
  if (!file_scheme) {
    return Status::InvalidArgument(
        "'source' must start with safetensors:, ipc:, vllm-ipc: or synthetic: (got '" +
        Esc(uri.substr(0, kSourceEchoBytesMax)) + "')");
  }
  if (path.empty() || path.front() != '/') {
    return Status::InvalidArgument("'source' must name an absolute path (got '" + Esc(uri) + "')");
  }
  return path;
}

Status CheckReadableFile(const std::string& uri, const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || ::access(path.c_str(), R_OK) != 0) {
    return Status::InvalidArgument("'source' " + Esc(uri) +
                                   ": not a readable regular file on the executor's host");
  }
  return Status::OK();
}

// The declared identity, checked with the fold's own rule (check_weight_identity, which the
// update and the fleet update apply to it unchanged): a malformed one is a 400 before the source
// is read for its manifest, never a manifest_mismatch after, and never stricter than the fold.
Result<WeightIdentity> ParseIdentity(const json& body) {
  auto it = body.find("identity");
  if (it == body.end() || !it->is_object()) {
    return Status::InvalidArgument("missing object field 'identity'");
  }
  const json& idj = *it;
  RC_RETURN_IF_ERROR(OnlyFields(
      idj, {"manifest_digest", "content_digest", "checkpoint", "run", "step"}, "identity."));
  auto md = GetString(idj, "manifest_digest", true, "identity.");
  if (!md.ok()) return md.status();
  auto cd = GetString(idj, "content_digest", false, "identity.");
  if (!cd.ok()) return cd.status();
  auto ck = GetString(idj, "checkpoint", false, "identity.");
  if (!ck.ok()) return ck.status();
  auto run = GetString(idj, "run", false, "identity.");
  if (!run.ok()) return run.status();
  auto step = GetInt(idj, "step", -1, -1, INT64_MAX, "identity.");
  if (!step.ok()) return step.status();
  WeightIdentity identity{*md, *cd, *ck, *run, *step};
  RC_RETURN_IF_ERROR(check_weight_identity(identity));  // its messages name the field
  return identity;
}

}  // namespace

Status ValidateSource(const std::string& uri, SourceReader reader) {
  if (uri.empty() || uri.size() > kTextBytesMax || !rc::text::printable_utf8(uri)) {
    return Status::InvalidArgument("'source' must be 1.." + std::to_string(kTextBytesMax) +
                                   " bytes of printable UTF-8");
  }
  if (uri.rfind("synthetic:", 0) == 0) return ValidateSyntheticSource(uri);
  Result<std::string> path = SourcePath(uri);
  if (!path.ok()) return path.status();
  if (reader == SourceReader::kEngine) return Status::OK();
  return CheckReadableFile(uri, *path);
}

Result<UpdateRequested> ParseUpdate(const json& body, SourceReader reader) {
  RC_RETURN_IF_ERROR(
      OnlyFields(body, {"update_id", "target_label", "identity", "source", "expected_digest"}, ""));
  UpdateRequested r;
  auto id = GetId(body, "update_id");
  if (!id.ok()) return id.status();
  r.update_id = *id;
  auto label = GetId(body, "target_label");
  if (!label.ok()) return label.status();
  r.target_label = *label;
  auto source = GetString(body, "source", true);
  if (!source.ok()) return source.status();
  r.source_uri = *source;
  RC_RETURN_IF_ERROR(ValidateSource(r.source_uri, reader));
  Result<WeightIdentity> identity = ParseIdentity(body);
  if (!identity.ok()) return identity.status();
  r.identity = std::move(identity.value());
  auto expected = GetString(body, "expected_digest", false);
  if (!expected.ok()) return expected.status();
  if (expected->size() > kDigestBytesMax || !hex::is_lower(*expected)) {
    return Status::InvalidArgument("'expected_digest' must be lowercase hex of at most " +
                                   std::to_string(kDigestBytesMax) + " chars");
  }
  r.expected_digest = *expected;
  return r;
}

Result<UpdateRequested> ParseUpdateBody(const std::string& body, SourceReader reader) {
  auto parsed = ParseObject(body, false);
  return parsed.ok() ? ParseUpdate(*parsed, reader) : Result<UpdateRequested>(parsed.status());
}

namespace {

Result<FleetUpdateMode> GetFleetMode(const json& body) {
  auto mode = GetString(body, "mode", false);
  if (!mode.ok()) return mode.status();
  if (mode->empty() || *mode == "all") return FleetUpdateMode::kAll;
  if (*mode == "rolling") return FleetUpdateMode::kRolling;
  return Status::InvalidArgument("'mode' must be \"all\" or \"rolling\", got '" +
                                 Esc(mode->substr(0, kSourceEchoBytesMax)) + "'");
}

}  // namespace

Result<FleetUpdateRequested> ParseFleetUpdateBody(const std::string& req_body,
                                                  SourceReader reader) {
  auto body = ParseObject(req_body, false);
  if (!body.ok()) return body.status();
  json member = *body;
  for (const char* key : {"mode", "batch_max", "min_healthy"}) member.erase(key);
  Result<UpdateRequested> update = ParseUpdate(member, reader);
  if (!update.ok()) return update.status();
  Result<FleetUpdateMode> mode = GetFleetMode(*body);
  if (!mode.ok()) return mode.status();
  auto batch = GetInt(*body, "batch_max", 1, 1, static_cast<std::int64_t>(kFleetEnginesMax));
  if (!batch.ok()) return batch.status();
  auto healthy = GetInt(*body, "min_healthy", 1, 0, static_cast<std::int64_t>(kFleetEnginesMax));
  if (!healthy.ok()) return healthy.status();
  UpdateRequested& u = update.value();
  return FleetUpdateRequested{std::move(u.update_id),
                              *mode,
                              static_cast<std::uint32_t>(*batch),
                              static_cast<std::uint32_t>(*healthy),
                              std::move(u.target_label),
                              std::move(u.identity),
                              std::move(u.source_uri),
                              std::move(u.expected_digest)};
}

Result<std::string> ParseFleetCancelBody(const std::string& req_body) {
  if (req_body.empty()) return std::string("cancelled by the trainer");
  auto body = ParseObject(req_body, false);
  if (!body.ok()) return body.status();
  RC_RETURN_IF_ERROR(OnlyFields(*body, {"reason"}, ""));
  auto reason = GetString(*body, "reason", false);
  if (!reason.ok()) return reason.status();
  if (reason->size() > kFleetCancelReasonBytesMax || !text::printable_utf8(*reason)) {
    return Status::InvalidArgument("'reason' must be printable UTF-8 of at most " +
                                   std::to_string(kFleetCancelReasonBytesMax) + " bytes");
  }
  return reason->empty() ? std::string("cancelled by the trainer") : *reason;
}

namespace {

Result<bool> GetAdopt(const json& body) {
  auto it = body.find("adopt");
  if (it == body.end() || it->is_null()) return false;
  if (!it->is_boolean()) return Status::InvalidArgument("'adopt' must be a boolean");
  return it->get<bool>();
}

Result<RestoreRequested> ParseRestore(const json& body, SourceReader reader) {
  RC_RETURN_IF_ERROR(OnlyFields(body, {"restore_id", "label", "source", "adopt"}, ""));
  RestoreRequested r;
  auto id = GetId(body, "restore_id");
  if (!id.ok()) return id.status();
  r.restore_id = *id;
  auto label = GetId(body, "label");
  if (!label.ok()) return label.status();
  r.label = *label;
  auto adopt = GetAdopt(body);
  if (!adopt.ok()) return adopt.status();
  r.adopt = *adopt;
  auto source = GetString(body, "source", false);
  if (!source.ok()) return source.status();
  r.source_uri = *source;
  if (r.adopt == !r.source_uri.empty()) {
    return Status::InvalidArgument(
        r.adopt ? "'adopt': true takes no 'source' (the engine already holds the weights)"
                : "'source' is required (where the version's weights are), or 'adopt': true");
  }
  if (!r.adopt) RC_RETURN_IF_ERROR(ValidateSource(r.source_uri, reader));
  return r;
}

}  // namespace

Result<RestoreRequested> ParseRestoreBody(const std::string& body, SourceReader reader) {
  auto parsed = ParseObject(body, false);
  return parsed.ok() ? ParseRestore(*parsed, reader) : Result<RestoreRequested>(parsed.status());
}

Result<SleepRequested> ParseSleepBody(const std::string& req_body) {
  auto body = ParseObject(req_body, false);
  if (!body.ok()) return body.status();
  RC_RETURN_IF_ERROR(OnlyFields(*body, {"sleep_id", "level"}, ""));
  auto id = GetId(*body, "sleep_id");
  if (!id.ok()) return id.status();
  auto level = GetInt(*body, "level", 0, 1, kSleepLevelMax);
  if (!level.ok()) return level.status();
  if (*level == 0) {  // absent or null: the fallback, below the range a value must be in
    return Status::InvalidArgument(
        "'level' is required: 1 (weights kept in host memory) or 2 "
        "(weights discarded)");
  }
  return SleepRequested{*id, static_cast<std::uint8_t>(*level)};
}

Result<WakeRequested> ParseWakeBody(const std::string& req_body) {
  auto body = ParseObject(req_body, false);
  if (!body.ok()) return body.status();
  RC_RETURN_IF_ERROR(OnlyFields(*body, {"wake_id"}, ""));
  auto id = GetId(*body, "wake_id");
  if (!id.ok()) return id.status();
  return WakeRequested{*id};
}

Status CheckClientRolloutId(const std::string& id) {
  if (id.rfind(kGeneratedRolloutIdPrefix, 0) != 0) return Status::OK();
  return Status::InvalidArgument("a client's rollout id may not begin with '" +
                                 std::string(kGeneratedRolloutIdPrefix) +
                                 "': serve generates those");
}

Result<AdmitBody> ParseAdmitBody(const std::string& req_body, std::uint64_t admit_wait_ms,
                                 std::uint32_t rollout_lease_ms) {
  RC_CHECK(rollout_lease_ms >= kRolloutLeaseMsMin && rollout_lease_ms <= kRolloutLeaseMsMax);
  auto body = ParseObject(req_body, true);
  if (!body.ok()) return body.status();
  RC_RETURN_IF_ERROR(OnlyFields(*body, {"rollout_id", "wait_ms", "lease_ms"}, ""));
  AdmitBody out;
  auto r = GetString(*body, "rollout_id", false);
  if (!r.ok()) return r.status();
  if (r->size() > kIdBytesMax || !rc::text::printable_utf8(*r)) {
    return Status::InvalidArgument("'rollout_id' must be 1.." + std::to_string(kIdBytesMax) +
                                   " bytes of printable UTF-8");
  }
  RC_RETURN_IF_ERROR(CheckClientRolloutId(*r));
  out.rollout_id = *r;
  auto w = GetInt(*body, "wait_ms", static_cast<std::int64_t>(admit_wait_ms), 0,
                  static_cast<std::int64_t>(admit_wait_ms));
  if (!w.ok()) return w.status();
  out.wait_ms = *w;
  auto l = GetInt(*body, "lease_ms", rollout_lease_ms, kRolloutLeaseMsMin, kRolloutLeaseMsMax);
  if (!l.ok()) return l.status();
  out.lease_ms = *l;
  RC_CHECK(out.lease_ms >= kRolloutLeaseMsMin && out.lease_ms <= kRolloutLeaseMsMax);
  return out;
}

Result<FinishBody> ParseFinishBody(const std::string& req_body) {
  auto body = ParseObject(req_body, true);
  if (!body.ok()) return body.status();
  RC_RETURN_IF_ERROR(OnlyFields(*body, {"outcome", "prompt_tokens", "completion_tokens"}, ""));
  FinishBody out;
  auto o = GetString(*body, "outcome", false);
  if (!o.ok()) return o.status();
  if (*o == "aborted") {
    out.outcome = RolloutOutcome::kAborted;
  } else if (!o->empty() && *o != "completed") {
    return Status::InvalidArgument("'outcome' must be 'completed' or 'aborted'");
  }
  auto p = GetInt(*body, "prompt_tokens", 0, 0, UINT32_MAX);
  if (!p.ok()) return p.status();
  auto c = GetInt(*body, "completion_tokens", 0, 0, UINT32_MAX);
  if (!c.ok()) return c.status();
  out.prompt_tokens = *p;
  out.completion_tokens = *c;
  RC_CHECK(out.prompt_tokens >= 0 && out.prompt_tokens <= UINT32_MAX);
  RC_CHECK(out.completion_tokens >= 0 && out.completion_tokens <= UINT32_MAX);
  return out;
}

Status ParseLeaseBody(const std::string& req_body) {
  auto body = ParseObject(req_body, true);
  return body.ok() ? OnlyFields(*body, {}, "") : body.status();
}

}  // namespace rc::service
