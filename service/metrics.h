// Prometheus text exposition for the service: lock-free counters and fixed-bucket histograms.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

namespace rc::service {

// Cumulative histogram over fixed bounds (seconds), recorded in microseconds.
class Histogram {
 public:
  static constexpr std::array<double, 18> kBoundsS = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                      0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                                      1.0,    2.5,     5.0,    10.0,  30.0,   60.0};
  void ObserveUs(std::uint64_t us);
  // Appends the _bucket/_sum/_count lines for `name` (labels: extra, without braces, or "").
  void Render(std::string& out, const std::string& name, const std::string& labels) const;
  std::uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::array<std::atomic<std::uint64_t>, kBoundsS.size() + 1> buckets_{};
  std::atomic<std::uint64_t> sum_us_{0};
  std::atomic<std::uint64_t> count_{0};
};

struct ServiceMetrics {
  std::atomic<std::uint64_t> admissions{0};
  std::atomic<std::uint64_t> finishes_completed{0};
  std::atomic<std::uint64_t> finishes_aborted{0};
  std::atomic<std::uint64_t> admission_rejected_tainted{0};
  std::atomic<std::uint64_t> admission_rejected_unavailable{0};  // waited past admit_wait_ms
  std::atomic<std::uint64_t> admission_rejected_shutdown{0};
  std::atomic<std::uint64_t> bad_requests{0};
  std::atomic<std::uint64_t> watches_refused{0};  // GET /v1/watch beyond its share of threads
  std::atomic<std::uint64_t> unauthorized{0};
  std::atomic<std::uint64_t> client_disconnects{0};
  std::atomic<std::uint64_t> admissions_abandoned{0};  // the client left while its admission waited
  std::atomic<std::uint64_t> upstream_errors{0};
  std::atomic<std::uint64_t> proxy_step_failures{0};  // a proxied rollout's step threw
  std::atomic<std::uint64_t> updates_committed{0};
  std::atomic<std::uint64_t> updates_refused{0};
  std::atomic<std::uint64_t> updates_tainted{0};
  std::atomic<std::uint64_t> updates_conflict{0};
  // Refused before anything was journaled because the fold found the request invalid.
  std::atomic<std::uint64_t> updates_invalid{0};
  std::atomic<std::uint64_t> updates_outcome_unknown{0};  // answered 503 outcome_unknown
  std::atomic<std::uint64_t> updates_replayed{0};         // a re-POST answered from the record
  std::atomic<std::uint64_t> restores_committed{0};       // restore answers, by outcome
  std::atomic<std::uint64_t> restores_refused{0};
  std::atomic<std::uint64_t> restores_tainted{0};
  std::atomic<std::uint64_t> restores_conflict{0};
  std::atomic<std::uint64_t> restores_invalid{0};
  std::atomic<std::uint64_t> restores_outcome_unknown{0};
  std::atomic<std::uint64_t> restores_replayed{0};
  // Colocated sleeps and wake-ups answered, by outcome (committed, refused, tainted, conflict,
  // invalid, replayed, outcome unknown).
  std::atomic<std::uint64_t> sleeps_committed{0};
  std::atomic<std::uint64_t> sleeps_refused{0};
  std::atomic<std::uint64_t> sleeps_tainted{0};
  std::atomic<std::uint64_t> sleeps_conflict{0};
  std::atomic<std::uint64_t> sleeps_invalid{0};
  std::atomic<std::uint64_t> sleeps_replayed{0};
  std::atomic<std::uint64_t> sleeps_outcome_unknown{0};
  std::atomic<std::uint64_t> wakes_committed{0};
  std::atomic<std::uint64_t> wakes_refused{0};
  std::atomic<std::uint64_t> wakes_tainted{0};
  std::atomic<std::uint64_t> wakes_conflict{0};
  std::atomic<std::uint64_t> wakes_invalid{0};
  std::atomic<std::uint64_t> wakes_replayed{0};
  std::atomic<std::uint64_t> wakes_outcome_unknown{0};
  std::atomic<std::uint64_t> admission_rejected_overloaded{0};  // group-commit queue full
  std::atomic<std::uint64_t> admission_rejected_failed{0};      // after fail-stop
  std::atomic<std::uint64_t> finish_retries{0};  // FinishDurably retries (queue full)
  std::atomic<std::uint64_t> leases_renewed{0};
  std::atomic<std::uint64_t> leases_expired{0};          // RolloutFinished{kExpired} submitted
  std::atomic<std::uint64_t> engine_monitor_submits{0};  // EngineMonitored journaled
  std::atomic<std::uint64_t> engine_probes{0};
  // The monitor's weight-digest checks by result (docs/lifecycle.md, "Weight digests").
  std::atomic<std::uint64_t> digest_checks_match{0};
  std::atomic<std::uint64_t> digest_checks_drift{0};
  std::atomic<std::uint64_t> digest_checks_unavailable{0};
  std::atomic<std::uint64_t> engine_probe_failures{0};
  std::atomic<std::uint64_t> stalled_plan_retries{0};  // a stalled plan tried again (Recover)
  std::atomic<std::int64_t> proxy_in_flight{0};
  Histogram journal_append;  // Submit + Wait (admissions and finishes)
  Histogram proxy_total;     // proxy request, receipt to last byte handed to the socket
  Histogram proxy_upstream;  // the engine call alone
  Histogram proxy_added;     // total - upstream: what the proxy adds
  Histogram proxy_relay;     // streamed: an engine read's events until the client took them
};

std::string FormatDouble(double v);
// `v` as the value of a Prometheus label: backslash, double quote and newline escaped; other
// control bytes and ill-formed UTF-8 are escaped as text (never a second line).
std::string EscapeLabelValue(const std::string& v);

}  // namespace rc::service
