#include "effects/http/engine_control.h"

#include <utility>

#include "effects/http/response_parsers.h"
#include "effects/http/weight_digest.h"
#include "statemachine/state.h"

namespace rc::effects {

EngineProbed HttpEngineControl::Probe() {
  EngineProbed probed = client_.Probe();
  if (probed.http.ok_2xx()) probed.digest = ReadWeightDigest(client_);
  return probed;
}

// The digest is computed while the engine is still paused, right after the label was read;
// /is_paused is read last, so a resume from outside at any point before it shows.
ValidationObserved HttpEngineControl::WeightInfo() {
  ValidationObserved observed = client_.WeightInfo();
  if (!observed.http.ok_2xx()) return observed;
  observed.digest = ReadWeightDigest(client_);
  HttpReply paused = client_.IsPaused();
  if (paused.http.ok_2xx()) {
    observed.is_paused_known = true;
    observed.is_paused = paused.body.at("is_paused").get<bool>();
  }
  return observed;
}

DrainObserved HttpEngineControl::PauseWait(std::uint64_t timeout_ms) {
  if (timeout_ms >= client_.deadlines().drain_timeout_ms) return client_.PauseWait();
  CallOptions o;
  o.timeout_ms = timeout_ms;
  HttpReply reply = client_.Pause(PauseMode::kWait, /*clear_cache=*/false, o);
  DrainObserved observed;
  observed.http = reply.http;
  observed.paused = reply.http.ok_2xx() && reply.body.is_object() &&
                    reply.body.value("status", std::string()) == "paused";
  return observed;
}

namespace {

// The device memory summed over the engine's workers, or unknown (no worker extension, or an
// answer that does not parse: the figure is evidence, never a reason to fail the effect).
struct DeviceTotals {
  bool known = false;
  std::uint64_t free_bytes = 0;
  std::uint64_t total_bytes = 0;
};

DeviceTotals read_device_totals(EngineClient& client, const CallOptions& o) {
  HttpReply reply = client.DeviceInfo(o);
  if (!reply.http.ok_2xx()) return {};
  Result<std::vector<WorkerDevice>> devices = parse_device_info(reply.body);
  if (!devices.ok()) return {};
  DeviceTotals t{true, 0, 0};
  for (const WorkerDevice& d : devices.value()) {
    // A sum that wraps is no figure: unknown, like an answer that does not parse.
    if (__builtin_add_overflow(t.free_bytes, d.free_bytes, &t.free_bytes) ||
        __builtin_add_overflow(t.total_bytes, d.total_bytes, &t.total_bytes)) {
      return {};
    }
  }
  return t;
}

// Unknown unless both readings agree on the total and the fold accepts the figures: an
// observation the fold refused would stop the executor on every recovery.
DeviceMemory around(const DeviceTotals& before, const DeviceTotals& after) {
  if (!before.known || !after.known || before.total_bytes != after.total_bytes) return {};
  const DeviceMemory m{true, before.free_bytes, after.free_bytes, after.total_bytes};
  return check_device_memory(m).ok() ? m : DeviceMemory{};
}

// Every call of a sleep or a wake ends by the effect's one deadline; each keeps its own
// per-call timeout within it (the reads call_timeout_ms, the sleep or wake-up the effect's).
CallOptions within(std::uint64_t timeout_ms) {
  CallOptions o;
  o.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  return o;
}

CallOptions whole(CallOptions o, std::uint64_t timeout_ms) {
  o.timeout_ms = timeout_ms;
  return o;
}

}  // namespace

// The monitor's reads (/health, then EngineClient::ObserveView), then the digest, all by one
// deadline.
EngineMonitored HttpEngineControl::Observe(bool with_digest, std::uint64_t timeout_ms) {
  RC_CHECK(timeout_ms > 0);
  CallOptions o = within(timeout_ms);
  o.fresh_connection = true;  // the process the address reaches now (CallOptions)
  EngineMonitored seen;
  // /health first, as the monitor reads it: the look and the monitor must agree on "reachable".
  HttpReply health = client_.Health(o);
  seen.http = health.http;
  if (!health.http.ok_2xx()) return seen;
  EngineClient::EngineView view = client_.ObserveView(o);
  view.http.latency_us += seen.http.latency_us;  // the look's evidence: both reads' time
  seen.http = std::move(view.http);
  seen.reported_label = std::move(view.label);
  seen.is_paused_known = view.is_paused_known;
  seen.is_paused = view.is_paused;
  seen.engine_instance = std::move(view.instance);
  if (with_digest && seen.http.ok_2xx()) seen.digest = ReadWeightDigest(client_, o);
  RC_CHECK(with_digest || !seen.digest.present());
  return seen;
}

// /is_sleeping is read only after a 2xx sleep: its failure leaves the sleep's own evidence (the
// fold then judges the sleep by its answer alone) rather than turning a done sleep into a failure.
SleepObserved HttpEngineControl::Sleep(std::uint8_t level, std::uint64_t timeout_ms) {
  RC_CHECK(level >= 1 && level <= kSleepLevelMax && timeout_ms > 0);
  SleepObserved out;
  out.level = level;
  const CallOptions o = within(timeout_ms);
  const DeviceTotals before = read_device_totals(client_, o);
  out.http = client_.Sleep(level, PauseMode::kWait, whole(o, timeout_ms)).http;
  if (!out.http.ok_2xx()) return out;
  HttpReply sleeping = client_.IsSleeping(o);
  if (sleeping.http.ok_2xx()) {
    out.is_sleeping_known = true;
    out.is_sleeping = sleeping.body.at("is_sleeping").get<bool>();
  }
  out.memory = around(before, read_device_totals(client_, o));
  return out;
}

WakeObserved HttpEngineControl::Wake(WakeTag tag, std::uint64_t timeout_ms) {
  RC_CHECK(timeout_ms > 0);
  WakeObserved out;
  out.tag = tag;
  const CallOptions o = within(timeout_ms);
  const DeviceTotals before = read_device_totals(client_, o);
  out.http = client_.WakeUp(tag, whole(o, timeout_ms)).http;
  if (!out.http.ok_2xx()) return out;
  out.memory = around(before, read_device_totals(client_, o));
  if (tag != WakeTag::kKvCache) return out;
  HttpReply paused = client_.IsPaused(o);
  if (paused.http.ok_2xx()) {
    out.is_paused_known = true;
    out.is_paused = paused.body.at("is_paused").get<bool>();
  }
  out.engine_instance = client_.Instance(o);
  return out;
}

}  // namespace rc::effects
