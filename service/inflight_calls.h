// The proxied engine calls in flight, so that Shutdown can cancel them at its grace deadline (each
// is then finished as aborted through the proxy's one finish path).
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "statemachine/status.h"

namespace rc::service {

// At most one per open connection; the bound only guards against a leak.
inline constexpr std::size_t kInFlightCallsMax = 1 << 20;

class InFlightCalls {
 public:
  // `cancel` must be cheap and thread-safe (it posts to the call's executor). Returns a
  // registration id (0: not registered because the registry is full or cancelling already
  // began — `cancel` is then called at once).
  std::uint64_t Add(std::function<void()> cancel) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!cancelled_ && calls_.size() < kInFlightCallsMax) {
        calls_.emplace(next_id_, std::move(cancel));
        return next_id_++;
      }
    }
    cancel();
    return 0;
  }
  void Remove(std::uint64_t id) {
    if (id == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    RC_CHECK(calls_.erase(id) == 1);
  }
  // Cancels every registered call and every later one. Returns how many were cancelled now.
  std::size_t CancelAll() {
    std::unordered_map<std::uint64_t, std::function<void()>> calls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      calls = calls_;
    }
    for (auto& [id, cancel] : calls) cancel();
    return calls.size();
  }
  bool cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::uint64_t, std::function<void()>> calls_;
  std::uint64_t next_id_ = 1;
  bool cancelled_ = false;
};

}  // namespace rc::service
