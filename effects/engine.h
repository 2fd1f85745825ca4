// The control-plane calls the runner makes on the engine, returning typed evidence.
// Implemented over HTTP by HttpEngineControl (effects/http/engine_control.h, libcurl); tests may
// plug in fault-injecting versions. The decision is always the fold's: these only observe.
#pragma once

#include <cstdint>
#include <string>

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
};

}  // namespace rc::effects
