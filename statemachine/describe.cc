#include "statemachine/describe.h"

#include <string>
#include <type_traits>

#include "statemachine/quote.h"

namespace rc {
namespace {

// An id or label between quotes, each quote inside it doubled (text::quoted), so an id cannot
// close its field and forge the rest of the description; its printers escape the whole.
std::string q(const std::string& s) { return text::quoted(s); }

std::string version(const WeightVersion& v) {
  return q(v.label) + "#" + std::to_string(v.generation);
}

std::string identity(const WeightIdentity& id) {
  std::string out = "manifest=" + id.manifest_digest.substr(0, 12);
  if (!id.content_digest.empty()) out += " content=" + id.content_digest.substr(0, 12);
  if (!id.checkpoint.empty()) out += " ckpt=" + id.checkpoint;
  if (!id.run.empty()) out += " run=" + id.run;
  if (id.step >= 0) out += " step=" + std::to_string(id.step);
  return out;
}

std::string one(const BootstrapRequested& e) {
  return "label=" + q(e.label) + " " + identity(e.identity) + (e.adopt ? " adopt" : "") +
         (e.require_digest ? " require_digest" : "") +
         (e.expected_digest.empty() ? "" : " expected_digest=" + e.expected_digest.substr(0, 16)) +
         " fold_rules=" + std::to_string(e.fold_rules);
}
std::string digest(const WeightDigest& d) {
  if (!d.present()) return d.error.empty() ? "" : " digest=none(" + d.error + ")";
  return " digest=" + d.algorithm + ":" + d.combined.substr(0, 16) +
         " tensors=" + std::to_string(d.tensors.size()) + " bytes=" + std::to_string(d.bytes);
}
std::string one(const UpdateRequested& e) {
  return "update=" + q(e.update_id) + " target=" + q(e.target_label) + " " + identity(e.identity) +
         (e.source_uri.empty() ? "" : " source=" + e.source_uri) +
         (e.expected_digest.empty() ? "" : " expected_digest=" + e.expected_digest.substr(0, 16));
}
std::string one(const RecoveryStarted& e) {
  std::string out = "executor=" + q(e.executor_id);
  if (e.journal_ending == JournalEnding::kNotRecorded) return out;
  out += std::string(" journal=") + journal_ending_name(e.journal_ending);
  if (e.journal_ending != JournalEnding::kTornTail) return out;
  return out + " bytes_unread=" + std::to_string(e.journal_bytes_unread) +
         " torn_tail=" + q(e.journal_torn_tail);
}
std::string one(const RestoreRequested& e) {
  return "restore=" + q(e.restore_id) + " label=" + q(e.label) +
         (e.adopt ? " adopt" : " source=" + e.source_uri);
}
std::string one(const SleepRequested& e) {
  return "sleep=" + q(e.sleep_id) + " level=" + std::to_string(e.level);
}
std::string one(const WakeRequested& e) { return "wake=" + q(e.wake_id); }
std::string one(const EffectStarted& e) {
  std::string out = effect_name(e.kind);
  if (e.kind == EffectKind::kResetCache) out += std::string("(") + cache_name(e.cache) + ")";
  if (e.kind == EffectKind::kWake) out += std::string("(") + wake_tag_name(e.wake) + ")";
  return out + " deadline=" + std::to_string(e.deadline_ms) + "ms";
}
std::string paused(bool known, bool is_paused) {
  return known ? (is_paused ? " paused" : " running") : " paused=unknown";
}
std::string instance(const std::string& i) { return i.empty() ? "" : " instance=" + q(i); }
std::string one(const EngineProbed& e) {
  std::string out = describe(e.http) + " version=" + q(e.engine_version) +
                    " label=" + q(e.reported_label) + paused(e.is_paused_known, e.is_paused) +
                    instance(e.engine_instance);
  if (!e.label_before.empty()) out += " relabelled_from=" + q(e.label_before);
  if (e.resumed_before) out += " resumed_at_adoption";
  return out + digest(e.digest);
}
std::string one(const EngineMonitored& e) {
  return describe(e.http) + " label=" + q(e.reported_label) +
         paused(e.is_paused_known, e.is_paused) + instance(e.engine_instance) +
         " last_ok_wall_ms=" + std::to_string(e.last_ok_wall_ms) + digest(e.digest);
}
std::string one(const DrainObserved& e) {
  return describe(e.http) + (e.paused ? " paused" : " not-paused");
}
std::string one(const DrainTimedOut& e) {
  return std::to_string(e.active_rollouts) + " active after " + std::to_string(e.waited_ms) + "ms";
}
std::string one(const PreflightObserved& e) {
  return "source_manifest=" + e.source_manifest_digest.substr(0, 12) +
         " device_ok=" + (e.device_ok ? "1" : "0") + " memory_ok=" + (e.memory_ok ? "1" : "0") +
         (e.detail.empty() ? "" : " " + e.detail);
}
std::string one(const TransferObserved& e) {
  return std::string(e.acknowledged ? "acknowledged" : "failed") +
         " mutation=" + mutation_name(e.mutation) + " bytes=" + std::to_string(e.bytes_sent) +
         " tensors=" + std::to_string(e.tensors_sent) +
         " duration=" + std::to_string(e.duration_us) + "us finish_label=" + q(e.finish_label) +
         (e.foreign_session ? " foreign_session" : "") +
         (e.error.empty() ? "" : " error=" + e.error);
}
std::string one(const CacheResetObserved& e) {
  return std::string(cache_name(e.cache)) + " " + describe(e.http) +
         " success=" + (e.reported_success ? "true" : "false") +
         (e.success_unreported ? " (not reported by the engine)" : "");
}
std::string one(const ValidationObserved& e) {
  return describe(e.http) + " label=" + q(e.reported_label) +
         " checks=" + (e.checks_passed ? "passed" : "failed") +
         (e.detail.empty() ? "" : " " + e.detail) + instance(e.engine_instance) + digest(e.digest) +
         (e.is_paused_known ? std::string(" is_paused=") + (e.is_paused ? "true" : "false") : "");
}
std::string one(const ResumeObserved& e) {
  return describe(e.http) +
         " is_paused=" + (e.is_paused_known ? (e.is_paused ? "true" : "false") : "unknown") +
         (e.is_sleeping_known ? std::string(" is_sleeping=") + (e.is_sleeping ? "true" : "false")
                              : "") +
         instance(e.engine_instance);
}
std::string memory(const DeviceMemory& m) {
  if (!m.known) return " memory=unreported";
  return " free_bytes=" + std::to_string(m.free_bytes_before) + "->" +
         std::to_string(m.free_bytes_after) + " total_bytes=" + std::to_string(m.total_bytes);
}
std::string one(const SleepObserved& e) {
  return "level=" + std::to_string(e.level) + " " + describe(e.http) +
         " is_sleeping=" + (e.is_sleeping_known ? (e.is_sleeping ? "true" : "false") : "unknown") +
         memory(e.memory);
}
std::string one(const WakeObserved& e) {
  return std::string("tags=") + wake_tag_name(e.tag) + " " + describe(e.http) +
         " is_paused=" + (e.is_paused_known ? (e.is_paused ? "true" : "false") : "unknown") +
         memory(e.memory) + instance(e.engine_instance);
}
std::string one(const RolloutAdmitted& e) {
  return "rollout=" + q(e.rollout_id) + " version=" + version(e.version) + " " +
         identity(e.identity) + (e.lease_ms ? " lease=" + std::to_string(e.lease_ms) + "ms" : "");
}
std::string one(const RolloutFinished& e) {
  return "rollout=" + q(e.rollout_id) + " " + outcome_name(e.outcome) +
         " prompt_tokens=" + std::to_string(e.prompt_tokens) +
         " completion_tokens=" + std::to_string(e.completion_tokens);
}
std::string one(const TrajectoryRecorded& e) {
  return "rollout=" + q(e.rollout_id) + " part=" + std::to_string(e.part) +
         " prompt_tokens=" + std::to_string(e.prompt_token_ids.size()) +
         " output_tokens=" + std::to_string(e.output_token_ids.size()) +
         " logprobs=" + std::to_string(e.output_logprobs.size());
}
std::string one(const StateChanged& e) {
  return std::string(lifecycle_name(e.from)) + " -> " + lifecycle_name(e.to) + " (" +
         cause_name(e.cause) + ")" + (e.detail.empty() ? "" : ": " + e.detail);
}
std::string one(const VersionPublished& e) {
  return "update=" + q(e.update_id) + " version=" + version(e.version) + " " +
         identity(e.identity) +
         (e.engine_digest.empty() ? "" : " engine_digest=" + e.engine_digest.substr(0, 16));
}
std::string one(const UpdateEnded& e) {
  return "update=" + q(e.update_id) + " " + update_outcome_name(e.outcome) +
         (e.reason.empty() ? "" : ": " + e.reason);
}
std::string one(const FleetConfigured& e) {
  return "staleness_max=" + std::to_string(e.staleness_max) +
         " min_serving=" + std::to_string(e.min_serving);
}
std::string one(const EngineJoined& e) { return "engine=" + q(e.engine); }
std::string one(const EngineRemovalRequested& e) { return "engine=" + q(e.engine); }
std::string one(const EngineRemoved& e) { return "engine=" + q(e.engine); }
std::string one(const FleetUpdateRequested& e) {
  return "update=" + q(e.update_id) + " mode=" + fleet_update_mode_name(e.mode) +
         " batch_max=" + std::to_string(e.batch_max) +
         " min_healthy=" + std::to_string(e.min_healthy) + " target=" + q(e.target_label) + " " +
         identity(e.identity) + (e.source_uri.empty() ? "" : " source=" + e.source_uri) +
         (e.expected_digest.empty() ? "" : " expected_digest=" + e.expected_digest.substr(0, 16));
}
std::string one(const FleetUpdateEnded& e) {
  return "update=" + q(e.update_id) + " " + fleet_outcome_name(e.outcome) +
         " committed=" + std::to_string(e.committed) + " refused=" + std::to_string(e.refused) +
         " tainted=" + std::to_string(e.tainted) + " skipped=" + std::to_string(e.skipped) +
         (e.stalled == 0 ? "" : " stalled=" + std::to_string(e.stalled)) +
         (e.reason.empty() ? "" : ": " + e.reason);
}
std::string one(const FleetUpdateCancelled& e) {
  return "update=" + q(e.update_id) + (e.reason.empty() ? "" : ": " + e.reason);
}

const char* plan_kind(const UpdatePlan& u) {
  if (u.restore) return " restore=";
  if (u.sleep_level > 0) return " sleep=";
  if (u.wake_only) return " wake=";
  return " update=";
}

}  // namespace

std::string describe(const HttpEvidence& h) {
  std::string out = transport_name(h.transport);
  if (h.transport == Transport::kOk) out = "http " + std::to_string(h.http_status);
  if (h.transport == Transport::kOk && !h.body_parsed) out += " (unparseable body)";
  out += " " + std::to_string(h.latency_us) + "us";
  if (!h.error.empty()) out += " error=" + h.error;
  return out;
}

std::string describe(const Event& e) {
  // Raw text: fields came from clients and engines, so every output boundary escapes it
  // (rc::text::escape_line) to keep one record on one line.
  return std::string(event_name(e)) + " " + std::visit([](const auto& v) { return one(v); }, e);
}

std::string describe(const State& s) {
  std::string out = std::string(lifecycle_name(s.lifecycle));
  if (s.lifecycle != Lifecycle::kUninitialized) {
    out += " committed=" + version(s.committed) + " " + identity(s.committed_identity);
  }
  out += " active=" + std::to_string(s.active.size());
  if (s.sleep_level > 0) out += " asleep=level" + std::to_string(s.sleep_level);
  if (s.update) {
    out += std::string(plan_kind(*s.update)) + q(s.update->update_id) + "->" +
           version(s.update->target);
    if (s.update->aborting) out += " (aborting: " + s.update->abort_reason + ")";
  }
  if (s.taint) {
    out += std::string(" TAINT from=") + lifecycle_name(s.taint->from) +
           " cause=" + cause_name(s.taint->cause) + " update=" + q(s.taint->update_id) +
           " target=" + version(s.taint->target) + ": " + s.taint->detail;
  }
  if (!s.engine_reachable) out += " engine=unreachable";
  if (s.engine_recheck) out += " engine=not-reverified";
  out += " next=" + std::string(effect_name(next_effect(s).kind));
  return out;
}

}  // namespace rc
