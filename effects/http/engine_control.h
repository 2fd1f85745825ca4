// EngineControl over vLLM's HTTP routes (the libcurl EngineClient).
#pragma once

#include "effects/engine.h"
#include "effects/http/engine_client.h"

namespace rc::effects {

class HttpEngineControl final : public EngineControl {
 public:
  explicit HttpEngineControl(EngineClient& client) : client_(client) {}
  HttpEvidence Health() override { return client_.Health().http; }
  // With the weight digest (effects/http/weight_digest.h) when the engine answered.
  EngineProbed Probe() override;
  HttpEvidence SetLabel(const std::string& label) override {
    return client_.WriteLabel(label).http;
  }
  HttpEvidence EndOpenWeightSession() override {
    return client_.FinishWeightUpdate(std::nullopt).http;
  }
  // The drain deadline is the client's drain_timeout_ms unless a shorter one is asked for.
  DrainObserved PauseWait(std::uint64_t timeout_ms) override;
  CacheResetObserved ResetCache(CacheKind cache) override { return client_.ResetCache(cache); }
  ValidationObserved WeightInfo() override;
  ResumeObserved Resume() override { return client_.Resume(); }
  SleepObserved Sleep(std::uint8_t level, std::uint64_t timeout_ms) override;
  WakeObserved Wake(WakeTag tag, std::uint64_t timeout_ms) override;
  EngineMonitored Observe(bool with_digest, std::uint64_t timeout_ms) override;

 private:
  EngineClient& client_;
};

}  // namespace rc::effects
