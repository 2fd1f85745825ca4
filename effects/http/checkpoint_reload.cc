#include "effects/http/checkpoint_reload.h"

#include <chrono>

#include "effects/clock.h"
#include "effects/manifest.h"
#include "effects/nccl/weight_source.h"
#include "statemachine/hex.h"
#include "statemachine/text.h"

namespace rc::effects {

using nlohmann::json;

namespace {

constexpr std::size_t kDigestHexBytes = 64;  // SHA-256
constexpr std::size_t kWeightsPathBytesMax = 4096;
constexpr std::uint64_t kCheckpointFilesMax = 1u << 16;

using text::utf8_prefix;

// Text an engine wrote, as one escaped line of at most kEngineErrorBytesMax bytes.
std::string engine_text(std::string_view s) {
  return utf8_prefix(text::escape_line(s), kEngineErrorBytesMax);
}

// What one exchange looked like, for an error text (escaped: bodies are the engine's bytes).
std::string summary(const char* step, const HttpEvidence& h) {
  std::string s = std::string(step) + ": transport=" + transport_name(h.transport) +
                  " status=" + std::to_string(h.http_status);
  if (h.transport == Transport::kOk && !h.body_parsed) s += " body=unparseable";
  if (!h.error.empty()) s += " " + engine_text(h.error);
  return s;
}

// Why an rc_checkpoint_manifest call failed, with what usually fixes it.
std::string manifest_call_failed(const HttpEvidence& h) {
  std::string s = summary("POST /collective_rpc rc_checkpoint_manifest", h);
  if (h.transport == Transport::kOk && h.http_status == 404) {
    s += " (/collective_rpc is a dev route: start vLLM with VLLM_SERVER_DEV_MODE=1)";
  } else if (h.transport == Transport::kOk && h.http_status == 500) {
    s += std::string(" (does the engine run RolloutCore's worker extension with ") +
         kCheckpointManifestMethod + "? --worker-extension-cls " + kWorkerExtensionClass + ")";
  }
  return s;
}

std::uint64_t remaining_ms(std::uint64_t deadline_at_ms) {
  const auto now_ms = static_cast<std::uint64_t>(steady_now_ms());
  return now_ms >= deadline_at_ms ? 0 : deadline_at_ms - now_ms;
}

bool string_field(const json& j, const char* key, std::string* out) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return false;
  *out = it->get<std::string>();
  return true;
}

bool unsigned_field(const json& j, const char* key, std::uint64_t max, std::uint64_t* out) {
  auto it = j.find(key);
  const bool non_negative =
      it != j.end() &&
      (it->is_number_unsigned() || (it->is_number_integer() && it->get<std::int64_t>() >= 0));
  if (!non_negative || it->get<std::uint64_t>() > max) return false;
  *out = it->get<std::uint64_t>();
  return true;
}

Status dummy_refusal() {
  return Status::Rejected(
      "the engine runs --load-format dummy: vLLM's reload_weights cannot load a checkpoint path "
      "with it (NotImplementedError); start the engine with a real load format");
}

// The fields a worker answers on success, checked.
Status read_success(const json& r, const std::string& who, CheckpointManifest* m) {
  std::uint64_t tensors = 0;
  std::uint64_t files = 0;
  if (!string_field(r, "manifest_digest", &m->digest) || m->digest.size() != kDigestHexBytes ||
      !hex::is_lower(m->digest)) {
    return Status::InvalidArgument(who + ": manifest_digest is not 64 lowercase hex digits");
  }
  if (!unsigned_field(r, "tensors", kTensorsMax, &tensors) || tensors == 0 ||
      !unsigned_field(r, "bytes", UINT64_MAX, &m->bytes) ||
      !unsigned_field(r, "files", kCheckpointFilesMax, &files) || files == 0) {
    return Status::InvalidArgument(who + ": tensors, bytes or files missing or out of bounds");
  }
  if (!string_field(r, "weights_path", &m->weights_path) || m->weights_path.empty() ||
      m->weights_path.front() != '/' || m->weights_path.size() > kWeightsPathBytesMax ||
      !text::printable_utf8(m->weights_path)) {
    return Status::InvalidArgument(who + ": weights_path is not an absolute printable path");
  }
  m->tensors = static_cast<std::uint32_t>(tensors);
  m->files = static_cast<std::uint32_t>(files);
  return Status::OK();
}

// One worker's answer.
Result<CheckpointManifest> worker_manifest(const json& r, std::size_t rank) {
  const std::string who = "rc_checkpoint_manifest (worker #" + std::to_string(rank) + ")";
  CheckpointManifest m;
  std::string error;
  if (!r.is_object() || !string_field(r, "error", &error) ||
      !string_field(r, "load_format", &m.load_format)) {
    return Status::InvalidArgument(who + ": not the extension's answer (an older extension?)");
  }
  if (m.load_format == "dummy") return dummy_refusal();
  if (!error.empty()) return Status::Rejected(who + ": " + engine_text(error));
  RC_RETURN_IF_ERROR(read_success(r, who, &m));
  m.load_format = engine_text(m.load_format);
  return m;
}

bool same_checkpoint(const CheckpointManifest& a, const CheckpointManifest& b) {
  return a.digest == b.digest && a.tensors == b.tensors && a.bytes == b.bytes &&
         a.weights_path == b.weights_path;
}

}  // namespace

Result<std::string> ReloadPath(const std::string& source_uri) {
  if (source_uri.rfind(kReloadScheme, 0) != 0) {
    return Status::InvalidArgument(
        "transfer reload loads a checkpoint from the engine's disk: the source must be "
        "safetensors:/path (a directory, or a .safetensors file alone in its directory)");
  }
  RC_RETURN_IF_ERROR(nccl::ValidateSourceUri(source_uri));
  std::string path = source_uri.substr(std::string_view(kReloadScheme).size());
  RC_CHECK(!path.empty() && path.front() == '/');  // ValidateSourceUri: absolute and normal
  return path;
}

Result<CheckpointManifest> ParseCheckpointManifestReply(const json& body) {
  if (!body.is_object() || !body.contains("results") || !body["results"].is_array() ||
      body["results"].empty() || body["results"].size() > kRpcWorkersMax) {
    return Status::InvalidArgument("rc_checkpoint_manifest: the reply is not a list of 1.." +
                                   std::to_string(kRpcWorkersMax) + " worker answers");
  }
  const json& results = body["results"];
  Result<CheckpointManifest> first = worker_manifest(results[0], 0);
  if (!first.ok()) return first.status();
  for (std::size_t rank = 1; rank < results.size(); ++rank) {
    Result<CheckpointManifest> other = worker_manifest(results[rank], rank);
    if (!other.ok()) return other.status();
    if (!same_checkpoint(*first, *other)) {
      return Status::Rejected("rc_checkpoint_manifest: worker #" + std::to_string(rank) +
                              " sees another checkpoint than worker #0 (per-host disks "
                              "that differ?)");
    }
  }
  RC_CHECK(first->tensors > 0 && first->digest.size() == kDigestHexBytes);
  return first;
}

bool ReloadAnswered(const json& body) {
  if (!body.is_object() || !body.contains("results")) return false;
  const json& results = body["results"];
  if (!results.is_array() || results.empty() || results.size() > kRpcWorkersMax) return false;
  for (const json& r : results) {
    if (!r.is_null()) return false;
  }
  return true;
}

Result<CheckpointManifest> CheckpointReload::AskManifest(const std::string& source_uri,
                                                         std::uint64_t timeout_ms) {
  RC_CHECK(timeout_ms > 0);
  Result<std::string> path = ReloadPath(source_uri);
  if (!path.ok()) return path.status();
  HttpReply reply =
      client_.CollectiveRpc(kCheckpointManifestMethod, {*path}, CallOptions{timeout_ms, {}});
  if (!reply.http.ok_2xx()) return Status::Unavailable(manifest_call_failed(reply.http));
  return ParseCheckpointManifestReply(reply.body);
}

PreflightObserved CheckpointReload::Preflight(const TransferTarget& target) {
  PreflightObserved p;
  p.device_ok = true;  // the engine's own GPU: nothing of ours to check
  p.memory_ok = true;  // no staging buffers
  Result<CheckpointManifest> m =
      AskManifest(target.source_uri, client_.deadlines().call_timeout_ms);
  if (m.ok()) {
    p.source_manifest_digest = m->digest;
    p.detail = std::to_string(m->tensors) + " tensors, " + std::to_string(m->bytes) + " bytes in " +
               std::to_string(m->files) + " files under " + text::escape_line(m->weights_path) +
               ", read by the engine (load_format " + m->load_format + ")";
  } else {
    p.detail = m.status().ToString();  // empty digest: the fold refuses it
  }
  p.detail = utf8_prefix(std::move(p.detail), kTextBytesMax);
  // A digest is the checkpoint's or absent (the refusal); a refusal always says why.
  RC_CHECK(p.source_manifest_digest.empty() == !m.ok());
  RC_CHECK(!p.detail.empty() && p.detail.size() <= kTextBytesMax);
  return p;
}

namespace {

using StepFailed = CheckpointReload::StepFailed;

// The checkpoint must still be the one the update declared: a checkpoint rewritten between
// preflight and transfer is refused before anything is sent.
std::optional<StepFailed> check_declared(const CheckpointManifest& m, const TransferTarget& t) {
  if (t.identity.manifest_digest.empty() || m.digest == t.identity.manifest_digest) {
    return std::nullopt;
  }
  return StepFailed{MutationClass::kNone, "the checkpoint's manifest is now " +
                                              m.digest.substr(0, 16) + ", not the declared " +
                                              t.identity.manifest_digest.substr(0, 16) +
                                              "; reload_weights not sent"};
}

// POST /collective_rpc reload_weights {weights_path}: the one call that changes the weights.
std::optional<StepFailed> reload_weights(EngineClient& client, const std::string& weights_path,
                                         std::uint64_t deadline_at_ms) {
  const std::uint64_t left = remaining_ms(deadline_at_ms);
  if (left == 0) return StepFailed{MutationClass::kNone, "deadline spent before reload_weights"};
  const json body = {{"method", kReloadWeightsMethod},
                     {"kwargs", {{"weights_path", weights_path}}}};
  HttpReply reply = client.PostJson("/collective_rpc", body, CallOptions{left, {}});
  if (reply.http.ok_2xx() && ReloadAnswered(reply.body)) return std::nullopt;
  if (reply.http.never_sent()) {
    return StepFailed{MutationClass::kNone,
                      summary("POST /collective_rpc reload_weights", reply.http)};
  }
  std::string why = summary("POST /collective_rpc reload_weights", reply.http);
  if (reply.http.ok_2xx()) why += " (not vLLM's {\"results\": [null, ...]})";
  return StepFailed{MutationClass::kPossible,
                    why + "; the engine may hold part of the checkpoint (layerwise reload)"};
}

// The label, as every transfer sets it on this engine line; out.finish_label once it is sent.
std::optional<StepFailed> set_label(EngineClient& client, const std::string& label,
                                    std::uint64_t deadline_at_ms, TransferObserved& out) {
  const std::uint64_t left = remaining_ms(deadline_at_ms);
  if (left == 0) {
    return StepFailed{MutationClass::kPossible,
                      "deadline passed after the reload, before the label"};
  }
  out.finish_label = label;
  HttpReply set = client.WriteLabel(label, CallOptions{left, {}});
  if (set.http.ok_2xx()) return std::nullopt;
  return StepFailed{MutationClass::kPossible,
                    "weights reloaded, label not set: " + summary("label", set.http)};
}

}  // namespace

std::optional<StepFailed> CheckpointReload::RunReload(const TransferTarget& target,
                                                      std::uint64_t deadline_at_ms,
                                                      TransferObserved& out) {
  const std::uint64_t left = remaining_ms(deadline_at_ms);
  if (left == 0) return StepFailed{MutationClass::kNone, "deadline spent before the first call"};
  Result<CheckpointManifest> m =
      AskManifest(target.source_uri, std::min(left, client_.deadlines().call_timeout_ms));
  if (!m.ok()) return StepFailed{MutationClass::kNone, m.status().ToString()};
  if (std::optional<StepFailed> refused = check_declared(*m, target)) return refused;
  if (std::optional<StepFailed> failed = reload_weights(client_, m->weights_path, deadline_at_ms)) {
    return failed;
  }
  out.bytes_sent = m->bytes;
  out.tensors_sent = m->tensors;
  return set_label(client_, target.target.label, deadline_at_ms, out);
}

TransferObserved CheckpointReload::Transfer(const TransferTarget& target,
                                            std::uint64_t deadline_ms) {
  RC_CHECK(!target.target.label.empty());  // the fold names every target
  const SteadyTime started = std::chrono::steady_clock::now();
  const std::uint64_t deadline_at_ms = static_cast<std::uint64_t>(steady_now_ms()) + deadline_ms;
  TransferObserved out;
  const std::optional<StepFailed> failed = RunReload(target, deadline_at_ms, out);
  out.mutation = failed ? failed->mutation : MutationClass::kComplete;
  out.acknowledged = !failed;
  out.error = failed ? utf8_prefix(failed->error, kTextBytesMax) : std::string();
  out.duration_us = elapsed_us(started);
  // Complete means the checkpoint was counted and the engine holds the target's label; a
  // failure is never complete and always says why.
  RC_CHECK(!out.acknowledged ||
           (out.error.empty() && out.tensors_sent > 0 && out.finish_label == target.target.label));
  RC_CHECK(out.acknowledged || (out.mutation != MutationClass::kComplete && !out.error.empty()));
  RC_CHECK(out.error.size() <= kTextBytesMax);
  return out;
}

}  // namespace rc::effects
