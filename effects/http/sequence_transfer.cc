#include "effects/http/sequence_transfer.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "effects/clock.h"
#include "effects/thread_start.h"
#include "encoding/base64.h"
#include "statemachine/text.h"

namespace rc::effects {

namespace {

bool parse_u64(const std::string& s, std::uint64_t max, std::uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    const std::uint64_t d = static_cast<std::uint64_t>(c - '0');
    if (v > (max - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

std::string summary(const char* step, const HttpEvidence& h) {
  std::string s = std::string(step) + ": transport=" + transport_name(h.transport) +
                  " status=" + std::to_string(h.http_status);
  if (h.transport == Transport::kOk && !h.body_parsed) s += " body=unparseable";
  if (!h.error.empty()) s += " " + h.error;
  if (s.size() > kTextBytesMax) s.resize(kTextBytesMax);
  return s;
}

// Milliseconds left until deadline_at_ms, or 0 when it has passed. Integer milliseconds: a
// time_point (nanoseconds) overflows past ~292 years.
std::uint64_t remaining_ms(std::uint64_t deadline_at_ms) {
  const auto now_ms = static_cast<std::uint64_t>(steady_now_ms());
  return now_ms >= deadline_at_ms ? 0 : deadline_at_ms - now_ms;
}

}  // namespace

namespace {

// Drops a ":seed" from spec; false when the seed is not a number.
bool strip_seed(std::string& spec) {
  const std::size_t colon = spec.find(':');
  if (colon == std::string::npos) return true;
  std::uint64_t seed = 0;
  if (!parse_u64(spec.substr(colon + 1), UINT64_MAX, &seed)) return false;
  spec.resize(colon);
  return true;
}

// "<n>x<dim>", each within its bound and non-zero.
bool parse_shape(const std::string& spec, std::uint64_t* n, std::uint64_t* dim) {
  const std::size_t x = spec.find('x');
  return x != std::string::npos && parse_u64(spec.substr(0, x), kSyntheticTensorsMax, n) &&
         parse_u64(spec.substr(x + 1), kSyntheticDimMax, dim) && *n != 0 && *dim != 0;
}

Manifest synthetic_layers(std::uint64_t n, std::uint64_t dim) {
  Manifest m;
  m.tensors.reserve(n);
  for (std::uint64_t i = 0; i < n; ++i) {
    m.tensors.push_back(
        TensorSpec{"model.layers." + std::to_string(i) + ".weight", DType::kBFloat16, {dim, dim}});
  }
  return m;
}

}  // namespace

Result<Manifest> synthetic_manifest(const std::string& uri) {
  static const std::string kScheme = "synthetic:";
  if (uri.rfind(kScheme, 0) != 0) {
    return Status::InvalidArgument("not a synthetic source: '" + uri.substr(0, 128) + "'");
  }
  std::string spec = uri.substr(kScheme.size());
  if (!strip_seed(spec)) {
    return Status::InvalidArgument("bad seed in '" + uri.substr(0, 128) + "'");
  }
  std::uint64_t n = 0;
  std::uint64_t dim = 0;
  if (!parse_shape(spec, &n, &dim)) {
    return Status::InvalidArgument("expected synthetic:<n_tensors>x<dim>[:seed], got '" +
                                   uri.substr(0, 128) + "'");
  }
  Manifest m = synthetic_layers(n, dim);
  RC_RETURN_IF_ERROR(m.Validate());
  RC_CHECK(m.tensors.size() == n && n <= kSyntheticTensorsMax);
  return m;
}

namespace {

// No data plane here, so the rendezvous is nominal: a random unique id where the engine accepts
// one, else a loopback address nobody listens on.
NcclInitParams nominal_rendezvous(bool unique_id) {
  NcclInitParams params;
  if (unique_id) {
    std::string raw(128, '\0');
    std::random_device rd;
    for (char& c : raw) c = static_cast<char>(rd() & 0xff);
    params.nccl_unique_id_b64 = encoding::Base64Encode(raw);
  } else {
    params.master_address = "127.0.0.1";
    params.master_port = 29555;
  }
  return params;
}

}  // namespace

HttpSequenceTransfer::HttpSequenceTransfer(EngineClient& client, EngineProtocol protocol,
                                           PackingParams packing)
    : client_(client), protocol_(std::move(protocol)), packing_(packing) {}

Status HttpSequenceTransfer::Initialize(std::uint64_t deadline_at_ms) {
  HttpReply world = client_.GetWorldSize(true, UntilDeadlineMs(deadline_at_ms));
  if (!world.http.ok_2xx() || !world.body.contains("world_size") ||
      !world.body["world_size"].is_number_unsigned()) {
    return Status::Unavailable(summary("/get_world_size", world.http));
  }
  NcclInitParams params = nominal_rendezvous(protocol_.unique_id_rendezvous);
  params.world_size = 1 + world.body["world_size"].get<std::uint32_t>();
  Result<nlohmann::json> info = build_init_info(protocol_, params, packing_);
  if (!info.ok()) return info.status();
  HttpReply init = client_.InitWeightTransferEngine(*info, UntilDeadlineMs(deadline_at_ms));
  if (!init.http.ok_2xx()) {
    return Status::Unavailable(summary("/init_weight_transfer_engine", init.http));
  }
  return Status::OK();
}

PreflightObserved HttpSequenceTransfer::Preflight(const TransferTarget& target) {
  PreflightObserved p;
  p.device_ok = true;  // no device: nothing to check
  p.memory_ok = true;  // no staging buffers
  Result<Manifest> m = synthetic_manifest(target.source_uri);
  if (!m.ok()) {
    p.detail = m.status().ToString();  // empty digest: the fold refuses it
    return p;
  }
  p.source_manifest_digest = m->digest();
  RC_CHECK(!p.source_manifest_digest.empty());  // the fold reads empty as a refusal
  p.detail = std::to_string(m->tensors.size()) + " tensors, " + std::to_string(m->total_bytes()) +
             " bytes (synthetic, no device)";
  return p;
}

namespace {

using StepFailed = HttpSequenceTransfer::StepFailed;

// 1. /start_weight_update: the first call that may change the engine. A session found open is
//    finished only by a restore (StaleSessionFor); refused, it fails the step as kPossible.
std::optional<StepFailed> start_update(EngineClient& client, bool restore,
                                       std::uint64_t deadline_at_ms) {
  const std::uint64_t left = remaining_ms(deadline_at_ms);
  if (left == 0) return StepFailed{MutationClass::kNone, "deadline passed before start"};
  HttpReply start =
      client.StartWeightUpdate(StaleSessionFor(restore), UntilDeadlineMs(deadline_at_ms));
  if (start.http.ok_2xx()) return std::nullopt;
  return StepFailed{start.http.never_sent() ? MutationClass::kNone : MutationClass::kPossible,
                    summary("/start_weight_update", start.http), start.foreign_weight_session};
}

// The data plane's stand-in: names the source, whose bytes NCCL would carry, to an engine that
// models content (the vLLM double's /_double/data_plane). A real engine answers 404; either way
// the answer changes nothing here, because no byte of a weight moves over this call.
void announce_content(EngineClient& client, const std::string& source_uri,
                      std::uint64_t deadline_at_ms) {
  CallOptions o = UntilDeadlineMs(deadline_at_ms);
  o.timeout_ms = 1000;
  (void)client.PostJson(kDataPlaneRoute, nlohmann::json{{"content", source_uri}}, o);
}

// 2. /update_weights from a second thread, as vLLM requires (the data plane would run here). A
//    thread the system refuses fails the step: /update_weights was never sent, but
//    /start_weight_update was, so the engine may be mid-update (kPossible).
std::optional<StepFailed> update_weights(EngineClient& client, const nlohmann::json& update_info,
                                         std::uint64_t deadline_at_ms,
                                         const ThreadStarter& starter) {
  if (remaining_ms(deadline_at_ms) == 0) {
    return StepFailed{MutationClass::kPossible, "deadline passed after start"};
  }
  HttpReply update;
  Result<std::thread> updater = StartThread(
      "the /update_weights thread",
      [&] { update = client.UpdateWeights(update_info, UntilDeadlineMs(deadline_at_ms)); },
      starter);
  if (!updater.ok()) {
    return StepFailed{MutationClass::kPossible, "/update_weights: " + updater.status().ToString()};
  }
  updater->join();  // bounded: the call carries the remaining deadline
  if (update.http.ok_2xx()) return std::nullopt;
  return StepFailed{MutationClass::kPossible, summary("/update_weights", update.http)};
}

// 3. /finish_weight_update {"weight_version": label}; out.finish_label once it is sent.
std::optional<StepFailed> finish_update(EngineClient& client, const std::string& label,
                                        std::uint64_t deadline_at_ms, TransferObserved& out) {
  if (remaining_ms(deadline_at_ms) == 0) {
    return StepFailed{MutationClass::kPossible, "deadline passed before finish"};
  }
  out.finish_label = label;
  HttpReply fin = client.FinishWeightUpdate(label, UntilDeadlineMs(deadline_at_ms));
  if (fin.http.ok_2xx()) return std::nullopt;
  return StepFailed{MutationClass::kPossible, summary("/finish_weight_update", fin.http)};
}

}  // namespace

// 0. Once per engine: /init_weight_transfer_engine. It changes no weights, so its failure is a
//    refusal (kNone).
std::optional<StepFailed> HttpSequenceTransfer::InitializeOnce(std::uint64_t deadline_at_ms) {
  const std::uint64_t left = remaining_ms(deadline_at_ms);
  if (left == 0) {
    return StepFailed{MutationClass::kNone, "deadline spent before the first engine call"};
  }
  // The instance check is one label read (and /metrics) within a call's timeout; whatever it
  // leaves of the deadline is all the initialization gets.
  std::string before;
  if (SameEngineAs(client_, initialized_on_, std::min(left, client_.deadlines().call_timeout_ms),
                   &before)) {
    return std::nullopt;
  }
  // The process is read before (unless just read) and after: a restart in between is not the
  // process initialized.
  if (before.empty()) before = client_.Instance(UntilDeadlineMs(deadline_at_ms));
  Status init = Initialize(deadline_at_ms);
  if (!init.ok()) return StepFailed{MutationClass::kNone, init.ToString()};
  initialized_on_ = OneInstance(before, client_.Instance(UntilDeadlineMs(deadline_at_ms)));
  return std::nullopt;
}

std::optional<StepFailed> HttpSequenceTransfer::RunSequence(const TransferTarget& target,
                                                            std::uint64_t deadline_at_ms,
                                                            TransferObserved& out) {
  Result<Manifest> manifest = synthetic_manifest(target.source_uri);
  if (!manifest.ok()) return StepFailed{MutationClass::kNone, manifest.status().ToString()};
  Result<nlohmann::json> update_info = build_update_info(protocol_, *manifest, packing_);
  if (!update_info.ok()) return StepFailed{MutationClass::kNone, update_info.status().ToString()};
  if (std::optional<StepFailed> failed = InitializeOnce(deadline_at_ms)) return failed;
  if (std::optional<StepFailed> failed = start_update(client_, target.restore, deadline_at_ms)) {
    return failed;
  }
  announce_content(client_, target.source_uri, deadline_at_ms);
  if (std::optional<StepFailed> failed =
          update_weights(client_, *update_info, deadline_at_ms, thread_starter_)) {
    return failed;
  }
  out.bytes_sent = manifest->total_bytes();
  out.tensors_sent = static_cast<std::uint32_t>(manifest->tensors.size());
  return finish_update(client_, target.target.label, deadline_at_ms, out);
}

TransferObserved HttpSequenceTransfer::Transfer(const TransferTarget& target,
                                                std::uint64_t deadline_ms) {
  const SteadyTime started = std::chrono::steady_clock::now();
  const std::uint64_t deadline_at_ms = static_cast<std::uint64_t>(steady_now_ms()) + deadline_ms;
  TransferObserved out;
  const std::optional<StepFailed> failed = RunSequence(target, deadline_at_ms, out);
  out.mutation = failed ? failed->mutation : MutationClass::kComplete;
  out.acknowledged = out.mutation == MutationClass::kComplete;
  out.error = failed ? text::utf8_prefix(failed->error, kTextBytesMax) : std::string();
  out.foreign_session = failed && failed->foreign_session;
  out.duration_us = elapsed_us(started);
  // Complete means every step answered: the bytes were counted and nothing is left to explain.
  RC_CHECK(!out.acknowledged || (out.error.empty() && out.tensors_sent > 0));
  RC_CHECK(out.error.size() <= kTextBytesMax);
  return out;
}

}  // namespace rc::effects
