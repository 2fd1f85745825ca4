// JSON views of records, events and states. See json.h.
#include "journal/json.h"

#include "journal/codec.h"
#include "statemachine/overloaded.h"

namespace rc::journal {
namespace {

using nlohmann::json;

const char* family_name(Family f) {
  switch (f) {
    case Family::kInput:
      return "input";
    case Family::kBinding:
      return "binding";
    case Family::kDecision:
      return "decision";
  }
  return "?";
}

json DeviceMemoryToJson(const DeviceMemory& m) {
  if (!m.known) return nullptr;
  return json{{"free_bytes_before", m.free_bytes_before},
              {"free_bytes_after", m.free_bytes_after},
              {"total_bytes", m.total_bytes}};
}

// The fleet's own events (statemachine/fleet.h); every other alternative is Fields'.
json FleetFields(const Event& event) {
  return std::visit(
      Overloaded{
          [](const FleetConfigured& e) {
            return json{{"staleness_max", e.staleness_max}, {"min_serving", e.min_serving}};
          },
          [](const EngineJoined& e) {
            return json{{"engine", e.engine}};
          },
          [](const EngineRemovalRequested& e) {
            return json{{"engine", e.engine}};
          },
          [](const EngineRemoved& e) {
            return json{{"engine", e.engine}};
          },
          [](const FleetUpdateRequested& e) {
            return json{{"update_id", e.update_id},
                        {"mode", fleet_update_mode_name(e.mode)},
                        {"batch_max", e.batch_max},
                        {"min_healthy", e.min_healthy},
                        {"target_label", e.target_label},
                        {"identity", WeightIdentityToJson(e.identity)},
                        {"source_uri", e.source_uri},
                        {"expected_digest", e.expected_digest},
                        {"stall_judged_per_group", e.stall_judged_per_group}};
          },
          [](const FleetUpdateEnded& e) {
            return json{{"update_id", e.update_id}, {"outcome", fleet_outcome_name(e.outcome)},
                        {"committed", e.committed}, {"refused", e.refused},
                        {"tainted", e.tainted},     {"skipped", e.skipped},
                        {"stalled", e.stalled},     {"reason", e.reason}};
          },
          [](const FleetUpdateCancelled& e) {
            return json{{"update_id", e.update_id}, {"reason", e.reason}};
          },
          [](const auto&) -> json { return nullptr; },
      },
      event);
}

// Bindings and decisions; the inputs are Fields', the fleet's own events FleetFields'.
json OutcomeFields(const Event& event) {
  return std::visit(Overloaded{
                        [](const RolloutAdmitted& e) {
                          return json{{"rollout_id", e.rollout_id},
                                      {"version", WeightVersionToJson(e.version)},
                                      {"identity", WeightIdentityToJson(e.identity)},
                                      {"lease_ms", e.lease_ms}};
                        },
                        [](const RolloutFinished& e) {
                          return json{{"rollout_id", e.rollout_id},
                                      {"outcome", outcome_name(e.outcome)},
                                      {"prompt_tokens", e.prompt_tokens},
                                      {"completion_tokens", e.completion_tokens}};
                        },
                        [](const TrajectoryRecorded& e) {
                          json logprobs = json::array();
                          for (float lp : e.output_logprobs) {
                            logprobs.push_back(lp == lp ? json(lp) : json());  // NaN: not reported
                          }
                          return json{{"rollout_id", e.rollout_id},
                                      {"part", e.part},
                                      {"prompt_token_ids", e.prompt_token_ids},
                                      {"output_token_ids", e.output_token_ids},
                                      {"output_logprobs", std::move(logprobs)}};
                        },
                        [](const StateChanged& e) {
                          return json{{"from", lifecycle_name(e.from)},
                                      {"to", lifecycle_name(e.to)},
                                      {"cause", cause_name(e.cause)},
                                      {"detail", e.detail}};
                        },
                        [](const VersionPublished& e) {
                          return json{{"update_id", e.update_id},
                                      {"version", WeightVersionToJson(e.version)},
                                      {"identity", WeightIdentityToJson(e.identity)},
                                      {"engine_digest", e.engine_digest}};
                        },
                        [](const UpdateEnded& e) {
                          return json{{"update_id", e.update_id},
                                      {"outcome", update_outcome_name(e.outcome)},
                                      {"reason", e.reason}};
                        },
                        [](const auto&) -> json { return nullptr; },
                    },
                    event);
}

json Fields(const Event& event) {
  return std::visit(
      Overloaded{
          [](const BootstrapRequested& e) {
            return json{{"label", e.label},
                        {"identity", WeightIdentityToJson(e.identity)},
                        {"adopt", e.adopt},
                        {"require_digest", e.require_digest},
                        {"expected_digest", e.expected_digest},
                        {"fold_rules", e.fold_rules}};
          },
          [](const UpdateRequested& e) {
            return json{{"update_id", e.update_id},
                        {"target_label", e.target_label},
                        {"identity", WeightIdentityToJson(e.identity)},
                        {"source_uri", e.source_uri},
                        {"expected_digest", e.expected_digest}};
          },
          [](const RecoveryStarted& e) {
            return json{{"executor_id", e.executor_id},
                        {"journal_ending", journal_ending_name(e.journal_ending)},
                        {"journal_bytes_unread", e.journal_bytes_unread},
                        {"journal_torn_tail", e.journal_torn_tail}};
          },
          [](const RestoreRequested& e) {
            return json{{"restore_id", e.restore_id},
                        {"label", e.label},
                        {"source_uri", e.source_uri},
                        {"adopt", e.adopt}};
          },
          [](const EffectStarted& e) {
            return json{{"kind", effect_name(e.kind)},
                        {"cache", cache_name(e.cache)},
                        {"wake", wake_tag_name(e.wake)},
                        {"deadline_ms", e.deadline_ms}};
          },
          [](const SleepRequested& e) {
            return json{{"sleep_id", e.sleep_id}, {"level", e.level}};
          },
          [](const WakeRequested& e) {
            return json{{"wake_id", e.wake_id}};
          },
          [](const SleepObserved& e) {
            return json{{"http", HttpEvidenceToJson(e.http)},
                        {"level", e.level},
                        {"is_sleeping_known", e.is_sleeping_known},
                        {"is_sleeping", e.is_sleeping},
                        {"memory", DeviceMemoryToJson(e.memory)}};
          },
          [](const WakeObserved& e) {
            return json{
                {"http", HttpEvidenceToJson(e.http)},     {"tags", wake_tag_name(e.tag)},
                {"is_paused_known", e.is_paused_known},   {"is_paused", e.is_paused},
                {"memory", DeviceMemoryToJson(e.memory)}, {"engine_instance", e.engine_instance}};
          },
          [](const EngineProbed& e) {
            return json{{"http", HttpEvidenceToJson(e.http)},
                        {"engine_version", e.engine_version},
                        {"reported_label", e.reported_label},
                        {"is_paused_known", e.is_paused_known},
                        {"is_paused", e.is_paused},
                        {"engine_instance", e.engine_instance},
                        {"label_before", e.label_before},
                        {"resumed_before", e.resumed_before},
                        {"digest", WeightDigestToJson(e.digest)}};
          },
          [](const EngineMonitored& e) {
            return json{
                {"http", HttpEvidenceToJson(e.http)},   {"reported_label", e.reported_label},
                {"is_paused_known", e.is_paused_known}, {"is_paused", e.is_paused},
                {"engine_instance", e.engine_instance}, {"last_ok_wall_ms", e.last_ok_wall_ms},
                {"updates_seen", e.updates_seen},       {"digest", WeightDigestToJson(e.digest)}};
          },
          [](const DrainObserved& e) {
            return json{{"http", HttpEvidenceToJson(e.http)}, {"paused", e.paused}};
          },
          [](const DrainTimedOut& e) {
            return json{{"waited_ms", e.waited_ms}, {"active_rollouts", e.active_rollouts}};
          },
          [](const PreflightObserved& e) {
            return json{{"source_manifest_digest", e.source_manifest_digest},
                        {"device_ok", e.device_ok},
                        {"memory_ok", e.memory_ok},
                        {"detail", e.detail}};
          },
          [](const TransferObserved& e) {
            return json{{"acknowledged", e.acknowledged},
                        {"mutation", mutation_name(e.mutation)},
                        {"bytes_sent", e.bytes_sent},
                        {"tensors_sent", e.tensors_sent},
                        {"duration_us", e.duration_us},
                        {"finish_label", e.finish_label},
                        {"error", e.error},
                        {"foreign_session", e.foreign_session}};
          },
          [](const CacheResetObserved& e) {
            return json{{"cache", cache_name(e.cache)},
                        {"http", HttpEvidenceToJson(e.http)},
                        {"reported_success", e.reported_success},
                        {"success_unreported", e.success_unreported}};
          },
          [](const ValidationObserved& e) {
            return json{
                {"http", HttpEvidenceToJson(e.http)},   {"reported_label", e.reported_label},
                {"checks_passed", e.checks_passed},     {"detail", e.detail},
                {"engine_instance", e.engine_instance}, {"digest", WeightDigestToJson(e.digest)},
                {"is_paused_known", e.is_paused_known}, {"is_paused", e.is_paused}};
          },
          [](const ResumeObserved& e) {
            return json{{"http", HttpEvidenceToJson(e.http)},
                        {"is_paused_known", e.is_paused_known},
                        {"is_paused", e.is_paused},
                        {"engine_instance", e.engine_instance},
                        {"is_sleeping_known", e.is_sleeping_known},
                        {"is_sleeping", e.is_sleeping}};
          },
          [&](const auto&) {
            return is_fleet_event(event) ? FleetFields(event) : OutcomeFields(event);
          },
      },
      event);
}

}  // namespace

json WeightVersionToJson(const WeightVersion& v) {
  return json{{"generation", v.generation}, {"label", v.label}};
}

json WeightIdentityToJson(const WeightIdentity& id) {
  return json{{"manifest_digest", id.manifest_digest},
              {"content_digest", id.content_digest},
              {"checkpoint", id.checkpoint},
              {"run", id.run},
              {"step", id.step}};
}

json WeightDigestToJson(const WeightDigest& d) {
  if (!d.present() && d.error.empty()) return nullptr;
  json tensors = json::object();
  for (const TensorDigest& t : d.tensors) tensors[t.name] = t.digest;
  return json{{"algorithm", d.algorithm},
              {"combined", d.combined},
              {"bytes", d.bytes},
              {"error", d.error},
              {"tensors", std::move(tensors)}};
}

json HttpEvidenceToJson(const HttpEvidence& h) {
  return json{{"transport", transport_name(h.transport)},
              {"http_status", h.http_status},
              {"body_parsed", h.body_parsed},
              {"latency_us", h.latency_us},
              {"error", h.error}};
}

json EventToJson(const Event& event) {
  json out = Fields(event);
  out["type"] = event_name(event);
  out["family"] = family_name(family_of(event));
  return out;
}

json RecordToJson(const Record& record) {
  json out{{"seq", record.seq},
           {"wall_time_ms", record.wall_time_ms},
           {"cause_seq", record.cause_seq},
           {"prev_hash", HashHex(record.prev_hash)},
           {"hash", HashHex(record.hash)},
           {"event", EventToJson(record.event)}};
  if (!record.engine.empty()) out["engine"] = record.engine;  // a fleet's journal only
  return out;
}

namespace {
json CountersToJson(const Counters& c) {
  return json{{"events", c.events},
              {"rollouts_admitted", c.rollouts_admitted},
              {"rollouts_completed", c.rollouts_completed},
              {"rollouts_aborted", c.rollouts_aborted},
              {"rollouts_abandoned", c.rollouts_abandoned},
              {"updates_requested", c.updates_requested},
              {"updates_committed", c.updates_committed},
              {"updates_refused", c.updates_refused},
              {"recoveries", c.recoveries},
              {"rollouts_expired", c.rollouts_expired},
              {"restores_requested", c.restores_requested},
              {"restores_committed", c.restores_committed},
              {"sleeps_requested", c.sleeps_requested},
              {"sleeps_committed", c.sleeps_committed},
              {"wakes_requested", c.wakes_requested},
              {"wakes_committed", c.wakes_committed}};
}
}  // namespace

json StateToJson(const State& s) {
  json out;
  out["lifecycle"] = lifecycle_name(s.lifecycle);
  out["committed"] = WeightVersionToJson(s.committed);
  out["committed_identity"] = WeightIdentityToJson(s.committed_identity);
  out["bootstrap"] = s.bootstrap ? json{{"label", s.bootstrap->label},
                                        {"identity", WeightIdentityToJson(s.bootstrap->identity)}}
                                 : json(nullptr);
  out["attempts"] = s.attempts;
  out["in_flight"] = s.in_flight ? json{{"kind", effect_name(s.in_flight->kind)},
                                        {"cache", cache_name(s.in_flight->cache)},
                                        {"wake", wake_tag_name(s.in_flight->wake)}}
                                 : json(nullptr);
  json active = json::object();
  for (const auto& [id, r] : s.active) {
    active[id] = json{{"version", WeightVersionToJson(r.version)}, {"lease_ms", r.lease_ms}};
  }
  out["active"] = std::move(active);
  if (s.update) {
    const UpdatePlan& u = *s.update;
    out["update"] = json{{"update_id", u.update_id},
                         {"target", WeightVersionToJson(u.target)},
                         {"identity", WeightIdentityToJson(u.identity)},
                         {"source_uri", u.source_uri},
                         {"drain_seen", u.drain_seen},
                         {"transfer_started", u.transfer_started},
                         {"caches_reset_mask", u.caches_reset_mask},
                         {"validated", u.validated},
                         {"aborting", u.aborting},
                         {"abort_reason", u.abort_reason},
                         {"expected_digest", u.expected_digest},
                         {"observed_digest", WeightDigestToJson(u.observed_digest)},
                         {"restore", u.restore},
                         {"adopt", u.adopt},
                         {"sleep_level", u.sleep_level},
                         {"wake_only", u.wake_only},
                         {"from_sleep", u.from_sleep},
                         {"weights_awake", u.weights_awake},
                         {"sleep_memory", DeviceMemoryToJson(u.sleep_memory)},
                         {"wake_first", u.wake_first},
                         {"kv_awake", u.kv_awake}};
  } else {
    out["update"] = nullptr;
  }
  if (s.taint) {
    const TaintRecord& t = *s.taint;
    out["taint"] = json{{"from", lifecycle_name(t.from)},
                        {"cause", cause_name(t.cause)},
                        {"update_id", t.update_id},
                        {"target", WeightVersionToJson(t.target)},
                        {"detail", t.detail}};
  } else {
    out["taint"] = nullptr;
  }
  out["counters"] = CountersToJson(s.counters);
  out["engine"] = json{{"instance", s.engine_instance},
                       {"reachable", s.engine_reachable},
                       {"recheck", s.engine_recheck}};
  out["labels"] = s.labels.size();
  out["committed_digest"] = WeightDigestToJson(s.committed_digest);
  out["label_digests"] = s.label_digests;
  out["sleep_level"] = s.sleep_level;
  return out;
}

namespace {
json FleetUpdateToJson(const FleetUpdate& u) {
  json members = json::object();
  for (const auto& [engine, status] : u.members) members[engine] = member_status_name(status);
  return json{{"request", EventToJson(u.request)},
              {"members", std::move(members)},
              {"cancelled", u.cancelled ? json(*u.cancelled) : json(nullptr)}};
}
}  // namespace

json FleetStateToJson(const FleetState& f) {
  json engines = json::object();
  for (const auto& [id, s] : f.engines) {
    const std::optional<std::uint64_t> g = fleet_generation(f, id);
    engines[id] = json{{"generation", g ? json(*g) : json(nullptr)}, {"state", StateToJson(s)}};
  }
  return json{{"engines", std::move(engines)},
              {"leaving", f.leaving},
              {"policy", EventToJson(f.policy)},
              {"generations", f.label_generation},
              {"update", f.update ? FleetUpdateToJson(*f.update) : json(nullptr)},
              {"fleet_updates_ended", f.fleet_updates_ended},
              {"removed", CountersToJson(f.removed)},
              {"events", f.events}};
}

}  // namespace rc::journal
