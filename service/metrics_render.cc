// /metrics: the executor's state, the journal and the proxy as Prometheus text.
//
// Each family group is one short function over rows in exposition order. The text is kept
// byte-stable for scrapers: some families' later labels (admissions_refused_total's overloaded
// and failed, rollouts_finished_total's expired, updates_total's outcome_unknown and replayed)
// follow other families' rows, where they have always been.
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "service/api_parse.h"
#include "service/http_util.h"
#include "service/service.h"
#include "service/service_internal.h"

namespace rc::service {
namespace {

using namespace internal;  // NOLINT: the service's own helpers

// The few fields /metrics shows, read without copying the state (its active rollouts may be
// tens of thousands).
struct MetricsState {
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  std::uint64_t generation = 0;
  std::size_t active = 0;
  Counters counters;
  std::string engine_instance;
  bool engine_reachable = false;
};

MetricsState ReadMetricsState(const journal::Journal& journal) {
  MetricsState s;
  journal.ReadState([&s](const State& st) {
    s = {st.lifecycle, st.committed.generation, st.active.size(),
         st.counters,  st.engine_instance,      st.engine_reachable};
  });
  return s;
}

// What the engine monitor last saw, as /metrics shows it.
struct EngineProbes {
  bool journal_failed = false;
  bool up = false;
  std::int64_t last_probe_wall_ms = 0;
  std::int64_t last_ok_wall_ms = 0;
  std::string instance, label;
  std::int64_t last_digest_check_wall_ms = 0;
};

void AppendHead(std::string& out, std::string_view name, std::string_view type,
                std::string_view help) {
  out.append("# HELP ").append(name).append(" ").append(help);
  out.append("\n# TYPE ").append(name).append(" ").append(type).append("\n");
}

// `series` is the metric's name with its labels, if any.
void AppendSample(std::string& out, std::string_view series, std::string_view value) {
  out.append(series).append(" ").append(value).append("\n");
}

void AppendGauge(std::string& out, std::string_view name, std::string_view help,
                 std::string_view value) {
  AppendHead(out, name, "gauge", help);
  AppendSample(out, name, value);
}

void AppendCounter(std::string& out, std::string_view name, std::string_view help,
                   std::uint64_t value) {
  AppendHead(out, name, "counter", help);
  AppendSample(out, name, std::to_string(value));
}

std::string Series(std::string_view name, std::string_view key, std::string_view label) {
  return std::string(name) + "{" + std::string(key) + "=\"" + std::string(label) + "\"}";
}

std::string Seconds(std::int64_t ms) { return FormatDouble(static_cast<double>(ms) / 1e3); }

struct CounterRow {
  const char* name;
  const char* help;
  std::uint64_t value;
};

void AppendCounters(std::string& out, std::initializer_list<CounterRow> rows) {
  for (const CounterRow& r : rows) AppendCounter(out, r.name, r.help, r.value);
}

void AppendLifecycle(std::string& out, Lifecycle current) {
  RC_CHECK(static_cast<std::uint8_t>(current) <= kLifecycleMax);  // exactly one line says 1
  AppendHead(out, "rolloutcore_lifecycle_state", "gauge", "1 for the current lifecycle state");
  for (std::uint8_t i = 0; i <= kLifecycleMax; ++i) {
    const auto l = static_cast<Lifecycle>(i);
    AppendSample(out, Series("rolloutcore_lifecycle_state", "state", lifecycle_name(l)),
                 l == current ? "1" : "0");
  }
}

// The durable head, as /v1/state's head_seq and the X-RolloutCore-Head header report it: groups
// only queued for the next group commit are not counted (a crash now would take them back).
void AppendJournalHead(std::string& out, std::uint64_t durable_seq) {
  AppendGauge(out, "rolloutcore_journal_head_seq", "last durable journal seq",
              std::to_string(durable_seq));
}

void AppendJournalGauges(std::string& out, const MetricsState& s, const ServiceMetrics& m,
                         std::uint64_t durable_seq) {
  AppendGauge(out, "rolloutcore_committed_generation", "committed weight generation",
              std::to_string(s.generation));
  AppendGauge(out, "rolloutcore_active_rollouts", "rollouts admitted and not finished (journal)",
              std::to_string(s.active));
  AppendGauge(out, "rolloutcore_proxy_in_flight", "proxied requests in flight",
              std::to_string(m.proxy_in_flight.load()));
  AppendJournalHead(out, durable_seq);
  AppendCounter(out, "rolloutcore_rollouts_admitted_total",
                "admissions journaled (journal counters)", s.counters.rollouts_admitted);
}

// One sample of a family labelled by outcome or reason; `help` only on the family's first row.
struct LabeledRow {
  const char* family;
  const char* help;  // nullptr: not the family's first row
  const char* key;
  const char* label;
  std::uint64_t value;
};

void AppendOutcomes(std::string& out, const Counters& c, const ServiceMetrics& m) {
  constexpr const char* kFinished = "rolloutcore_rollouts_finished_total";
  constexpr const char* kRefused = "rolloutcore_admissions_refused_total";
  constexpr const char* kUpdates = "rolloutcore_updates_total";
  constexpr const char* kRestores = "rolloutcore_restores_total";
  constexpr const char* kSleeps = "rolloutcore_sleeps_total";
  constexpr const char* kWakes = "rolloutcore_wakes_total";
  const LabeledRow rows[] = {
      {kFinished, "rollouts finished, by outcome (journal)", "outcome", "completed",
       c.rollouts_completed},
      {kFinished, nullptr, "outcome", "aborted", c.rollouts_aborted},
      {kFinished, nullptr, "outcome", "abandoned", c.rollouts_abandoned},
      {kRefused, "proxied/explicit admissions refused", "reason", "tainted",
       m.admission_rejected_tainted.load()},
      {kRefused, nullptr, "reason", "not_ready", m.admission_rejected_unavailable.load()},
      {kRefused, nullptr, "reason", "shutting_down", m.admission_rejected_shutdown.load()},
      {kUpdates, "update requests answered, by outcome", "outcome", "committed",
       m.updates_committed.load()},
      {kUpdates, nullptr, "outcome", "refused", m.updates_refused.load()},
      {kUpdates, nullptr, "outcome", "tainted", m.updates_tainted.load()},
      {kUpdates, nullptr, "outcome", "conflict", m.updates_conflict.load()},
      {kUpdates, nullptr, "outcome", "invalid", m.updates_invalid.load()},
      {kRefused, nullptr, "reason", "overloaded", m.admission_rejected_overloaded.load()},
      {kRefused, nullptr, "reason", "failed", m.admission_rejected_failed.load()},
      {kFinished, nullptr, "outcome", "expired", c.rollouts_expired},
      {kUpdates, nullptr, "outcome", "outcome_unknown", m.updates_outcome_unknown.load()},
      {kUpdates, nullptr, "outcome", "replayed", m.updates_replayed.load()},
      {kRestores, "restore requests answered, by outcome", "outcome", "committed",
       m.restores_committed.load()},
      {kRestores, nullptr, "outcome", "refused", m.restores_refused.load()},
      {kRestores, nullptr, "outcome", "tainted", m.restores_tainted.load()},
      {kRestores, nullptr, "outcome", "conflict", m.restores_conflict.load()},
      {kRestores, nullptr, "outcome", "invalid", m.restores_invalid.load()},
      {kRestores, nullptr, "outcome", "replayed", m.restores_replayed.load()},
      {kRestores, nullptr, "outcome", "outcome_unknown", m.restores_outcome_unknown.load()},
      {kSleeps, "colocated sleep requests answered, by outcome", "outcome", "committed",
       m.sleeps_committed.load()},
      {kSleeps, nullptr, "outcome", "refused", m.sleeps_refused.load()},
      {kSleeps, nullptr, "outcome", "tainted", m.sleeps_tainted.load()},
      {kSleeps, nullptr, "outcome", "conflict", m.sleeps_conflict.load()},
      {kSleeps, nullptr, "outcome", "invalid", m.sleeps_invalid.load()},
      {kSleeps, nullptr, "outcome", "replayed", m.sleeps_replayed.load()},
      {kSleeps, nullptr, "outcome", "outcome_unknown", m.sleeps_outcome_unknown.load()},
      {kWakes, "colocated wake-up requests answered, by outcome", "outcome", "committed",
       m.wakes_committed.load()},
      {kWakes, nullptr, "outcome", "refused", m.wakes_refused.load()},
      {kWakes, nullptr, "outcome", "tainted", m.wakes_tainted.load()},
      {kWakes, nullptr, "outcome", "conflict", m.wakes_conflict.load()},
      {kWakes, nullptr, "outcome", "invalid", m.wakes_invalid.load()},
      {kWakes, nullptr, "outcome", "replayed", m.wakes_replayed.load()},
      {kWakes, nullptr, "outcome", "outcome_unknown", m.wakes_outcome_unknown.load()},
  };
  for (const LabeledRow& r : rows) {
    if (r.help != nullptr) AppendHead(out, r.family, "counter", r.help);
    AppendSample(out, Series(r.family, r.key, r.label), std::to_string(r.value));
  }
}

void AppendEngine(std::string& out, const EngineProbes& e, const MetricsState& s) {
  AppendGauge(out, "rolloutcore_journal_failed",
              "1 once the executor fail-stopped on a journal error", e.journal_failed ? "1" : "0");
  AppendGauge(out, "rolloutcore_engine_up", "1 when the engine monitor's last probe succeeded",
              e.up ? "1" : "0");
  AppendGauge(out, "rolloutcore_engine_reachable", "the journaled view: 0 refuses admissions",
              s.engine_reachable ? "1" : "0");
  AppendGauge(out, "rolloutcore_engine_last_probe_timestamp_seconds",
              "wall time of the last engine probe", Seconds(e.last_probe_wall_ms));
  AppendGauge(out, "rolloutcore_engine_last_ok_timestamp_seconds",
              "wall time of the last successful engine probe", Seconds(e.last_ok_wall_ms));
  AppendGauge(out, "rolloutcore_weight_digest_last_check_timestamp_seconds",
              "wall time of the monitor's last weight-digest check",
              Seconds(e.last_digest_check_wall_ms));
  AppendGauge(out, "rolloutcore_engine_last_probe_age_seconds",
              "seconds since the last engine probe",
              e.last_probe_wall_ms == 0 ? "NaN" : Seconds(wall_ms() - e.last_probe_wall_ms));
  AppendHead(out, "rolloutcore_engine_info", "gauge",
             "the engine process the monitor sees (instance, label)");
  AppendSample(out,
               "rolloutcore_engine_info{instance=\"" + EscapeLabelValue(e.instance) +
                   "\",journal_instance=\"" + EscapeLabelValue(s.engine_instance) + "\",label=\"" +
                   EscapeLabelValue(e.label) + "\"}",
               "1");
}

void AppendServiceCounters(std::string& out, const ServiceMetrics& m) {
  AppendCounters(
      out,
      {{"rolloutcore_finish_retries_total", "finishes retried while the journal queue was full",
        m.finish_retries.load()},
       {"rolloutcore_leases_renewed_total", "explicit rollout leases renewed",
        m.leases_renewed.load()},
       {"rolloutcore_engine_probes_total", "engine monitor probes", m.engine_probes.load()},
       {"rolloutcore_engine_probe_failures_total", "engine monitor probes that failed",
        m.engine_probe_failures.load()},
       {"rolloutcore_engine_monitor_events_total", "EngineMonitored events journaled",
        m.engine_monitor_submits.load()},
       {"rolloutcore_stalled_plan_retries_total",
        "stalled plans tried again once their engine answered", m.stalled_plan_retries.load()},
       {"rolloutcore_weight_digest_checks_match_total",
        "monitor weight digests equal to the committed version's", m.digest_checks_match.load()},
       {"rolloutcore_weight_digest_checks_drift_total",
        "monitor weight digests other than the committed version's (tainted)",
        m.digest_checks_drift.load()},
       {"rolloutcore_weight_digest_checks_unavailable_total",
        "monitor weight digest checks the engine could not answer",
        m.digest_checks_unavailable.load()},
       {"rolloutcore_bad_requests_total", "requests refused as malformed (4xx)",
        m.bad_requests.load()},
       {"rolloutcore_watches_refused_total",
        "GET /v1/watch answered 503: a quarter of http_threads already wait",
        m.watches_refused.load()},
       {"rolloutcore_unauthorized_total", "requests refused for a missing or wrong token",
        m.unauthorized.load()}});
}

void AppendBodyMemory(std::string& out, const ByteBudget& b) {
  AppendGauge(out, "rolloutcore_http_body_memory_bytes",
              "request and response bodies held now (bound: body_memory_bytes_max)",
              std::to_string(b.used()));
}

void AppendAcceptPaused(std::string& out, const HttpServer::AcceptPaused& paused) {
  AppendHead(out, "rolloutcore_http_accept_paused_seconds_total", "counter",
             "time accepting was paused, the pause going on included");
  AppendSample(out, "rolloutcore_http_accept_paused_seconds_total",
               FormatDouble(static_cast<double>(paused.paused_us) / 1e6));
  AppendGauge(out, "rolloutcore_http_accept_paused", "1 while accepting is paused",
              paused.now ? "1" : "0");
}

void AppendHttp(std::string& out, const HttpServer& http) {
  const HttpServerCounters& h = http.counters();
  AppendGauge(out, "rolloutcore_http_open_connections", "client connections open",
              std::to_string(h.open_connections.load()));
  AppendCounters(
      out,
      {{"rolloutcore_http_connections_refused_total",
        "connections answered 503 beyond http_connections_max", h.refused_over_budget.load()},
       {"rolloutcore_http_accept_errors_total",
        "accepts that failed (e.g. out of file descriptors), each tried again 50 ms later",
        h.accept_errors.load()},
       {"rolloutcore_http_header_timeouts_total", "requests cut at header_timeout_ms (408)",
        h.header_timeouts.load()},
       {"rolloutcore_http_body_timeouts_total", "requests cut at body_timeout_ms (408)",
        h.body_timeouts.load()},
       {"rolloutcore_http_write_timeouts_total",
        "connections closed at write_timeout_ms (client not reading)", h.write_timeouts.load()},
       {"rolloutcore_http_blocking_refused_total",
        "trainer calls refused: the blocking pool's queue was full", h.blocking_refused.load()},
       {"rolloutcore_http_body_memory_refused_total",
        "requests answered 503 or streams cut because the bodies others held took "
        "body_memory_bytes_max",
        h.body_memory_refused.load()},
       {"rolloutcore_http_accept_pauses_total",
        "times accepting paused: the client sockets serve keeps (http_connections_max and a "
        "margin for refusals) were all open, new connections waited in the listen backlog",
        h.accept_pauses.load()}});
  AppendAcceptPaused(out, http.accept_paused());
}

void AppendProxyCounters(std::string& out, const ServiceMetrics& m,
                         const TrajectoryLogStats& lines) {
  AppendCounters(
      out, {{"rolloutcore_client_disconnects_total", "proxied clients that hung up mid-request",
             m.client_disconnects.load()},
            {"rolloutcore_admissions_abandoned_total",
             "proxied admissions abandoned while they waited for the engine (the client left, "
             "or its exchange failed): never admitted",
             m.admissions_abandoned.load()},
            {"rolloutcore_upstream_errors_total", "proxied requests the engine failed",
             m.upstream_errors.load()},
            {"rolloutcore_proxy_step_failures_total",
             "proxied requests ended by an internal error (the rollout finished as aborted)",
             m.proxy_step_failures.load()},
            {"rolloutcore_trajectories_written_total", "trajectory lines written", lines.written},
            {"rolloutcore_trajectories_dropped_total",
             "trajectory lines dropped (size, queue full, I/O, or not written at "
             "shutdown)",
             lines.dropped}});
}

void AppendUpdatePhases(std::string& out, const effects::PhaseTimings& t) {
  AppendHead(out, "rolloutcore_update_phase_seconds", "gauge",
             "phase durations of the last update, restore, sleep or wake-up");
  for (auto [phase, us] : {std::pair{"drain", t.drain_us},
                           {"preflight", t.preflight_us},
                           {"transfer", t.transfer_us},
                           {"invalidate", t.invalidate_us},
                           {"validate", t.validate_us},
                           {"resume", t.resume_us},
                           {"sleep", t.sleep_us},
                           {"wake_weights", t.wake_weights_us},
                           {"wake_kv", t.wake_kv_us},
                           {"journal", t.journal_us},
                           {"total", t.total_us}}) {
    AppendSample(out, Series("rolloutcore_update_phase_seconds", "phase", phase),
                 FormatDouble(static_cast<double>(us) / 1e6));
  }
}

struct HistogramRow {
  const Histogram& histogram;
  const char* name;
  const char* help;
};

void AppendHistograms(std::string& out, const ServiceMetrics& m) {
  const HistogramRow rows[] = {
      {m.journal_append, "rolloutcore_journal_append_seconds",
       "admission/finish Submit + durable Wait"},
      {m.proxy_total, "rolloutcore_proxy_request_seconds", "proxied request end to end"},
      {m.proxy_upstream, "rolloutcore_proxy_upstream_seconds", "the engine call alone"},
      {m.proxy_added, "rolloutcore_proxy_added_seconds",
       "what the proxy adds (end to end minus the engine call)"},
      {m.proxy_relay, "rolloutcore_proxy_relay_seconds",
       "streamed: from an engine read's completion until the client's socket took its events"},
  };
  for (const HistogramRow& r : rows) {
    AppendHead(out, r.name, "histogram", r.help);
    r.histogram.Render(out, r.name, "");
  }
}

// One fleet member as /metrics shows it, read under the journal's lock without its rollouts.
struct MemberMetrics {
  std::string engine;
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  std::uint64_t generation = 0;  // the fleet generation of its committed label
  std::size_t active = 0;
  bool admitting = false;
  bool leaving = false;
  std::uint64_t admitted = 0;
};

struct FleetMetrics {
  std::vector<MemberMetrics> members;
  Counters summed;  // every engine's counters added, removed ones too (the one-engine families)
  std::uint64_t updates_ended = 0;
};

FleetMetrics ReadFleetMetrics(const journal::Journal& journal) {
  FleetMetrics out;
  journal.ReadFleetState([&out](const FleetState& f) {
    for (const auto& [name, s] : f.engines) {
      out.members.push_back({name, s.lifecycle, fleet_generation(f, name).value_or(0),
                             s.active.size(), fleet_admits(f, name), f.leaving.count(name) != 0,
                             s.counters.rollouts_admitted});
      add_counters(out.summed, s.counters);
    }
    add_counters(out.summed, f.removed);  // a removed engine's totals stay counted
    out.updates_ended = f.fleet_updates_ended;
  });
  return out;
}

std::string EngineSeries(std::string_view name, const std::string& engine) {
  return Series(name, "engine", EscapeLabelValue(engine));
}

void AppendMemberStates(std::string& out, const std::vector<MemberMetrics>& members) {
  constexpr const char* kState = "rolloutcore_fleet_engine_state";
  AppendHead(out, kState, "gauge", "1 for each engine's current lifecycle state");
  for (const MemberMetrics& m : members) {
    for (std::uint8_t i = 0; i <= kLifecycleMax; ++i) {
      const auto l = static_cast<Lifecycle>(i);
      AppendSample(out,
                   std::string(kState) + "{engine=\"" + EscapeLabelValue(m.engine) + "\",state=\"" +
                       lifecycle_name(l) + "\"}",
                   l == m.lifecycle ? "1" : "0");
    }
  }
}

// Per engine: `value` of each member, under one family head.
template <class Value>
void AppendPerEngine(std::string& out, const char* name, const char* type, const char* help,
                     const std::vector<MemberMetrics>& members, Value value) {
  AppendHead(out, name, type, help);
  for (const MemberMetrics& m : members) {
    AppendSample(out, EngineSeries(name, m.engine), std::to_string(value(m)));
  }
}

// What serve knows of a member beyond the journal: the balancer's count and the monitor's look.
struct MemberLive {
  std::uint32_t outstanding = 0;
  bool up = false;
  std::int64_t last_probe_wall_ms = 0;
};

void AppendMembers(std::string& out, const FleetMetrics& f,
                   const std::map<std::string, MemberLive>& live) {
  const auto& ms = f.members;
  AppendMemberStates(out, ms);
  AppendPerEngine(out, "rolloutcore_fleet_engine_generation", "gauge",
                  "the fleet generation of the label each engine has committed", ms,
                  [](const MemberMetrics& m) { return m.generation; });
  AppendPerEngine(out, "rolloutcore_fleet_engine_admitting", "gauge",
                  "1 while a rollout may be admitted to the engine", ms,
                  [](const MemberMetrics& m) { return m.admitting ? 1 : 0; });
  AppendPerEngine(out, "rolloutcore_fleet_engine_leaving", "gauge",
                  "1 once the engine's removal was requested", ms,
                  [](const MemberMetrics& m) { return m.leaving ? 1 : 0; });
  AppendPerEngine(out, "rolloutcore_fleet_engine_active_rollouts", "gauge",
                  "rollouts admitted to the engine and not finished (journal)", ms,
                  [](const MemberMetrics& m) { return m.active; });
  AppendPerEngine(out, "rolloutcore_fleet_engine_outstanding", "gauge",
                  "proxied requests in flight to the engine (the balancer's count)", ms,
                  [&live](const MemberMetrics& m) {
                    const auto it = live.find(m.engine);
                    return it == live.end() ? 0u : it->second.outstanding;
                  });
  AppendPerEngine(out, "rolloutcore_fleet_engine_up", "gauge",
                  "1 when the monitor's last probe of the engine succeeded", ms,
                  [&live](const MemberMetrics& m) {
                    const auto it = live.find(m.engine);
                    return it != live.end() && it->second.up ? 1 : 0;
                  });
  AppendHead(out, "rolloutcore_fleet_engine_last_probe_age_seconds", "gauge",
             "seconds since the monitor's last probe of the engine");
  for (const MemberMetrics& m : ms) {
    const auto it = live.find(m.engine);
    const std::int64_t at = it == live.end() ? 0 : it->second.last_probe_wall_ms;
    AppendSample(out, EngineSeries("rolloutcore_fleet_engine_last_probe_age_seconds", m.engine),
                 at == 0 ? "NaN" : Seconds(wall_ms() - at));
  }
  AppendPerEngine(out, "rolloutcore_fleet_engine_rollouts_admitted_total", "counter",
                  "admissions journaled for the engine", ms,
                  [](const MemberMetrics& m) { return m.admitted; });
  AppendCounter(out, "rolloutcore_fleet_updates_ended_total", "fleet updates ended (journal)",
                f.updates_ended);
}

}  // namespace

std::string Service::RenderFleetMetrics() const {
  const FleetMetrics f = ReadFleetMetrics(*journal_);
  std::map<std::string, MemberLive> live;
  for (const auto& [name, m] : fleet_members_) {
    live[name] = {m->outstanding.load(), m->watch.up.load(), m->watch.last_probe_wall_ms.load()};
  }
  std::string out;
  AppendMembers(out, f, live);
  AppendGauge(out, "rolloutcore_fleet_engines", "engines in the fleet (journal)",
              std::to_string(f.members.size()));
  std::size_t active = 0;
  for (const MemberMetrics& m : f.members) active += m.active;
  AppendGauge(out, "rolloutcore_active_rollouts", "rollouts admitted and not finished (journal)",
              std::to_string(active));
  AppendGauge(out, "rolloutcore_proxy_in_flight", "proxied requests in flight",
              std::to_string(metrics_.proxy_in_flight.load()));
  AppendJournalHead(out, journal_->durable_seq());
  AppendCounter(out, "rolloutcore_rollouts_admitted_total",
                "admissions journaled (journal counters)", f.summed.rollouts_admitted);
  AppendGauge(out, "rolloutcore_journal_failed",
              "1 once the executor fail-stopped on a journal error", failed() ? "1" : "0");
  AppendOutcomes(out, f.summed, metrics_);
  AppendServiceCounters(out, metrics_);
  if (http_) {
    AppendHttp(out, *http_);
    AppendBodyMemory(out, http_->body_budget());
  }
  AppendProxyCounters(out, metrics_, trajectories_.stats());
  AppendHistograms(out, metrics_);
  return out;
}

std::string Service::RenderMetrics() const {
  if (is_fleet()) return RenderFleetMetrics();
  const MetricsState s = ReadMetricsState(*journal_);
  EngineProbes probes{failed(),
                      watch_.up.load(),
                      watch_.last_probe_wall_ms.load(),
                      watch_.last_ok_wall_ms.load(),
                      "",
                      ""};
  {
    std::lock_guard<std::mutex> g(watch_.seen_mu);
    probes.instance = watch_.instance_seen;
    probes.label = watch_.label_seen;
  }
  probes.last_digest_check_wall_ms = watch_.last_digest_check_wall_ms.load();
  std::string out;
  AppendLifecycle(out, s.lifecycle);
  AppendJournalGauges(out, s, metrics_, journal_->durable_seq());
  AppendOutcomes(out, s.counters, metrics_);
  AppendEngine(out, probes, s);
  AppendServiceCounters(out, metrics_);
  if (http_) {
    AppendHttp(out, *http_);
    AppendBodyMemory(out, http_->body_budget());
  }
  AppendProxyCounters(out, metrics_, trajectories_.stats());
  effects::PhaseTimings timings;
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    timings = last_timings_;
  }
  AppendUpdatePhases(out, timings);
  AppendHistograms(out, metrics_);
  return out;
}

void Service::HandleMetrics(const ApiRequest&, HttpResponse& res) {
  SetBody(res, 200, RenderMetrics(), "text/plain; version=0.0.4");
}

}  // namespace rc::service
