#include "effects/http/engine_control.h"

namespace rc::effects {

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
