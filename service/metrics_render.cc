// /metrics: the executor's state, the journal and the proxy as Prometheus text.
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#include <openssl/crypto.h>
#include <spdlog/spdlog.h>

#include "journal/json.h"
#include "service/api_parse.h"
#include "service/http_util.h"
#include "service/service.h"
#include "service/service_internal.h"
#include "statemachine/text.h"

namespace rc::service {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
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

std::string Service::RenderMetrics() const {
  MetricsState s;
  journal_->ReadState([&s](const State& st) {
    s = {st.lifecycle, st.committed.generation, st.active.size(),
         st.counters,  st.engine_instance,      st.engine_reachable};
  });
  std::string out;
  auto gauge = [&out](const std::string& name, const std::string& help, const std::string& v) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " gauge\n" + name + " " + v + "\n";
  };
  auto counter = [&out](const std::string& name, const std::string& help, std::uint64_t v) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " counter\n" + name + " " +
           std::to_string(v) + "\n";
  };
  out +=
      "# HELP rolloutcore_lifecycle_state 1 for the current lifecycle state\n"
      "# TYPE rolloutcore_lifecycle_state gauge\n";
  for (std::uint8_t i = 0; i <= kLifecycleMax; ++i) {
    const auto l = static_cast<Lifecycle>(i);
    out += std::string("rolloutcore_lifecycle_state{state=\"") + lifecycle_name(l) + "\"} " +
           (l == s.lifecycle ? "1" : "0") + "\n";
  }
  gauge("rolloutcore_committed_generation", "committed weight generation",
        std::to_string(s.generation));
  gauge("rolloutcore_active_rollouts", "rollouts admitted and not finished (journal)",
        std::to_string(s.active));
  gauge("rolloutcore_proxy_in_flight", "proxied requests in flight",
        std::to_string(metrics_.proxy_in_flight.load()));
  gauge("rolloutcore_journal_head_seq", "last journal seq", std::to_string(journal_->head_seq()));
  counter("rolloutcore_rollouts_admitted_total", "admissions journaled (journal counters)",
          s.counters.rollouts_admitted);
  out +=
      "# HELP rolloutcore_rollouts_finished_total rollouts finished, by outcome (journal)\n"
      "# TYPE rolloutcore_rollouts_finished_total counter\n";
  out += "rolloutcore_rollouts_finished_total{outcome=\"completed\"} " +
         std::to_string(s.counters.rollouts_completed) + "\n";
  out += "rolloutcore_rollouts_finished_total{outcome=\"aborted\"} " +
         std::to_string(s.counters.rollouts_aborted) + "\n";
  out += "rolloutcore_rollouts_finished_total{outcome=\"abandoned\"} " +
         std::to_string(s.counters.rollouts_abandoned) + "\n";
  out +=
      "# HELP rolloutcore_admissions_refused_total proxied/explicit admissions refused\n"
      "# TYPE rolloutcore_admissions_refused_total counter\n";
  out += "rolloutcore_admissions_refused_total{reason=\"tainted\"} " +
         std::to_string(metrics_.admission_rejected_tainted.load()) + "\n";
  out += "rolloutcore_admissions_refused_total{reason=\"not_ready\"} " +
         std::to_string(metrics_.admission_rejected_unavailable.load()) + "\n";
  out += "rolloutcore_admissions_refused_total{reason=\"shutting_down\"} " +
         std::to_string(metrics_.admission_rejected_shutdown.load()) + "\n";
  out +=
      "# HELP rolloutcore_updates_total update requests answered, by outcome\n"
      "# TYPE rolloutcore_updates_total counter\n";
  out += "rolloutcore_updates_total{outcome=\"committed\"} " +
         std::to_string(metrics_.updates_committed.load()) + "\n";
  out += "rolloutcore_updates_total{outcome=\"refused\"} " +
         std::to_string(metrics_.updates_refused.load()) + "\n";
  out += "rolloutcore_updates_total{outcome=\"tainted\"} " +
         std::to_string(metrics_.updates_tainted.load()) + "\n";
  out += "rolloutcore_updates_total{outcome=\"conflict\"} " +
         std::to_string(metrics_.updates_conflict.load()) + "\n";
  out += "rolloutcore_admissions_refused_total{reason=\"overloaded\"} " +
         std::to_string(metrics_.admission_rejected_overloaded.load()) + "\n";
  out += "rolloutcore_admissions_refused_total{reason=\"failed\"} " +
         std::to_string(metrics_.admission_rejected_failed.load()) + "\n";
  out += "rolloutcore_rollouts_finished_total{outcome=\"expired\"} " +
         std::to_string(s.counters.rollouts_expired) + "\n";
  out += "rolloutcore_updates_total{outcome=\"outcome_unknown\"} " +
         std::to_string(metrics_.updates_outcome_unknown.load()) + "\n";
  out += "rolloutcore_updates_total{outcome=\"replayed\"} " +
         std::to_string(metrics_.updates_replayed.load()) + "\n";
  gauge("rolloutcore_journal_failed", "1 once the executor fail-stopped on a journal error",
        failed() ? "1" : "0");
  gauge("rolloutcore_engine_up", "1 when the engine monitor's last probe succeeded",
        engine_up_.load() ? "1" : "0");
  gauge("rolloutcore_engine_reachable", "the journaled view: 0 refuses admissions",
        s.engine_reachable ? "1" : "0");
  {
    const std::int64_t probe_ms = engine_last_probe_wall_ms_.load();
    const std::int64_t ok_ms = engine_last_ok_wall_ms_.load();
    gauge("rolloutcore_engine_last_probe_timestamp_seconds", "wall time of the last engine probe",
          format_double(static_cast<double>(probe_ms) / 1e3));
    gauge("rolloutcore_engine_last_ok_timestamp_seconds",
          "wall time of the last successful engine probe",
          format_double(static_cast<double>(ok_ms) / 1e3));
    gauge("rolloutcore_engine_last_probe_age_seconds", "seconds since the last engine probe",
          probe_ms == 0 ? "NaN" : format_double(static_cast<double>(wall_ms() - probe_ms) / 1e3));
    std::string instance, label;
    {
      std::lock_guard<std::mutex> g(engine_info_mu_);
      instance = engine_instance_seen_;
      label = engine_label_seen_;
    }
    out +=
        "# HELP rolloutcore_engine_info the engine process the monitor sees (instance, label)\n"
        "# TYPE rolloutcore_engine_info gauge\n"
        "rolloutcore_engine_info{instance=\"" +
        escape_label_value(instance) + "\",journal_instance=\"" +
        escape_label_value(s.engine_instance) + "\",label=\"" + escape_label_value(label) +
        "\"} 1\n";
  }
  counter("rolloutcore_finish_retries_total", "finishes retried while the journal queue was full",
          metrics_.finish_retries.load());
  counter("rolloutcore_leases_renewed_total", "explicit rollout leases renewed",
          metrics_.leases_renewed.load());
  counter("rolloutcore_engine_probes_total", "engine monitor probes",
          metrics_.engine_probes.load());
  counter("rolloutcore_engine_probe_failures_total", "engine monitor probes that failed",
          metrics_.engine_probe_failures.load());
  counter("rolloutcore_engine_monitor_events_total", "EngineMonitored events journaled",
          metrics_.engine_monitor_submits.load());
  counter("rolloutcore_bad_requests_total", "requests refused as malformed (4xx)",
          metrics_.bad_requests.load());
  counter("rolloutcore_unauthorized_total", "requests refused for a missing or wrong token",
          metrics_.unauthorized.load());
  if (http_) {
    const HttpServerCounters& h = http_->counters();
    gauge("rolloutcore_http_open_connections", "client connections open",
          std::to_string(h.open_connections.load()));
    counter("rolloutcore_http_connections_refused_total",
            "connections answered 503 beyond http_connections_max", h.refused_over_budget.load());
    counter("rolloutcore_http_header_timeouts_total", "requests cut at header_timeout_ms (408)",
            h.header_timeouts.load());
    counter("rolloutcore_http_body_timeouts_total", "requests cut at body_timeout_ms (408)",
            h.body_timeouts.load());
    counter("rolloutcore_http_write_timeouts_total",
            "connections closed at write_timeout_ms (client not reading)", h.write_timeouts.load());
    counter("rolloutcore_http_blocking_refused_total",
            "trainer calls refused: the blocking pool's queue was full", h.blocking_refused.load());
  }
  counter("rolloutcore_client_disconnects_total", "proxied clients that hung up mid-request",
          metrics_.client_disconnects.load());
  counter("rolloutcore_upstream_errors_total", "proxied requests the engine failed",
          metrics_.upstream_errors.load());
  counter("rolloutcore_trajectories_written_total", "trajectory lines written",
          metrics_.trajectories_written.load());
  counter("rolloutcore_trajectories_dropped_total", "trajectory lines dropped (size or I/O)",
          metrics_.trajectories_dropped.load());
  effects::PhaseTimings t;
  {
    std::lock_guard<std::mutex> g(update_id_mu_);
    t = last_timings_;
  }
  out +=
      "# HELP rolloutcore_update_phase_seconds phase durations of the last update\n"
      "# TYPE rolloutcore_update_phase_seconds gauge\n";
  for (auto [phase, us] : {std::pair{"drain", t.drain_us},
                           {"preflight", t.preflight_us},
                           {"transfer", t.transfer_us},
                           {"invalidate", t.invalidate_us},
                           {"validate", t.validate_us},
                           {"resume", t.resume_us},
                           {"journal", t.journal_us},
                           {"total", t.total_us}}) {
    out += std::string("rolloutcore_update_phase_seconds{phase=\"") + phase + "\"} " +
           format_double(static_cast<double>(us) / 1e6) + "\n";
  }
  auto hist = [&out](const Histogram& h, const std::string& name, const std::string& help) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
    h.Render(out, name, "");
  };
  hist(metrics_.journal_append, "rolloutcore_journal_append_seconds",
       "admission/finish Submit + durable Wait");
  hist(metrics_.proxy_total, "rolloutcore_proxy_request_seconds", "proxied request end to end");
  hist(metrics_.proxy_upstream, "rolloutcore_proxy_upstream_seconds", "the engine call alone");
  hist(metrics_.proxy_added, "rolloutcore_proxy_added_seconds",
       "what the proxy adds (end to end minus the engine call)");
  hist(metrics_.proxy_relay, "rolloutcore_proxy_relay_seconds",
       "streamed: from an engine read's completion until the client's socket took its events");
  return out;
}

void Service::HandleMetrics(const ApiRequest&, HttpResponse& res) {
  SetBody(res, 200, RenderMetrics(), "text/plain; version=0.0.4");
}

}  // namespace rc::service
