#include "effects/http/engine_control.h"

#include "effects/http/weight_digest.h"

namespace rc::effects {

EngineProbed HttpEngineControl::Probe() {
  EngineProbed probed = client_.Probe();
  if (probed.http.ok_2xx()) probed.digest = ReadWeightDigest(client_);
  return probed;
}

// The digest is computed while the engine is still paused, right after the label was read.
ValidationObserved HttpEngineControl::WeightInfo() {
  ValidationObserved observed = client_.WeightInfo();
  if (observed.http.ok_2xx()) observed.digest = ReadWeightDigest(client_);
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

}  // namespace rc::effects
