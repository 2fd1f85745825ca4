// The control-plane calls the runner makes on the engine, returning typed evidence.
// Implemented over HTTP by HttpEngineControl (effects/http/engine_control.h, libcurl); tests may
// plug in fault-injecting versions. The decision is always the fold's: these only observe.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "effects/clock.h"  // Clock, which the runner takes next to EngineControl
#include "statemachine/events.h"

namespace rc::effects {

class EngineControl {
 public:
  virtual ~EngineControl() = default;
  // GET /health alone: whether the engine process answers at all (startup waits on it).
  virtual HttpEvidence Health() = 0;
  // /health, /version and the label (GET /weight_info, or the worker extension on vLLM 0.25.x).
  virtual EngineProbed Probe() = 0;
  // Sets the label: names the initial weights at bootstrap, and an adopted engine at a restore.
  virtual HttpEvidence SetLabel(const std::string& label) = 0;
  // A restore that adopts ends a weight session left open on its TAINTED engine (POST
  // /finish_weight_update without a label), so that the next update does not meet it and blame
  // someone else. Whatever the answer, the adopt's digest check proves what the engine holds
  // afterwards; a finish that was sent may have committed a load (vLLM 0.25.x).
  virtual HttpEvidence EndOpenWeightSession() = 0;
  // POST /pause?mode=wait&clear_cache=false — blocks until running requests finish.
  virtual DrainObserved PauseWait(std::uint64_t timeout_ms) = 0;
  virtual CacheResetObserved ResetCache(CacheKind cache) = 0;
  // The label again, while still paused.
  virtual ValidationObserved WeightInfo() = 0;
  // POST /resume then GET /is_paused.
  virtual ResumeObserved Resume() = 0;
  // Colocated mode. POST /sleep?level=L&mode=wait (the engine is drained: nothing is running),
  // then GET /is_sleeping, with the device memory read around the call when the engine reports it.
  virtual SleepObserved Sleep(std::uint8_t level, std::uint64_t timeout_ms) = 0;
  // POST /wake_up?tags=<tag>; after the KV cache (which resumes the scheduler), GET /is_paused.
  virtual WakeObserved Wake(WakeTag tag, std::uint64_t timeout_ms) = 0;
  // The engine as the monitor sees it: the label, /is_paused and the process instance, and the
  // weight digest when `with_digest` (a sleeper's weights are not mapped: never then), every read
  // ending within `timeout_ms`. A plan reads it before its first effect, so that an engine
  // someone else changed is recorded as the monitor records it before anything is sent.
  // The default is one Probe(), whose calls each keep their own deadline (at most the effect
  // bound of a probe): for controls that have no cheaper view.
  virtual EngineMonitored Observe(bool with_digest, std::uint64_t timeout_ms) {
    (void)timeout_ms;
    EngineProbed p = Probe();
    EngineMonitored m;
    m.http = std::move(p.http);
    m.reported_label = std::move(p.reported_label);
    m.is_paused_known = p.is_paused_known;
    m.is_paused = p.is_paused;
    m.engine_instance = std::move(p.engine_instance);
    if (with_digest) m.digest = std::move(p.digest);
    return m;
  }
};

}  // namespace rc::effects
