// The proxied engine calls in flight, so that Shutdown can cancel them at its grace deadline (each
// is then finished as aborted through the proxy's one finish path).
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "effects/http/engine_client.h"
#include "statemachine/status.h"

namespace rc::service {

// At most one per worker; the bound only guards against a leak.
inline constexpr std::size_t kInFlightCallsMax = 65536;

class InFlightCalls {
 public:
  // Returns a registration id (0: not registered because the registry is full or cancelling
  // already began — the token is then cancelled at once).
  std::uint64_t Add(effects::CancelToken token) {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_ || calls_.size() >= kInFlightCallsMax) {
      token.Cancel();
      return 0;
    }
    calls_.emplace(next_id_, std::move(token));
    return next_id_++;
  }
  void Remove(std::uint64_t id) {
    if (id == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    RC_CHECK(calls_.erase(id) == 1);
  }
  // Cancels every registered call and every later one. Returns how many were cancelled now.
  std::size_t CancelAll() {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    for (auto& [id, token] : calls_) token.Cancel();
    return calls_.size();
  }
  bool cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::uint64_t, effects::CancelToken> calls_;
  std::uint64_t next_id_ = 1;
  bool cancelled_ = false;
};

}  // namespace rc::service
