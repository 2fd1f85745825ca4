// Time in the effects layer. The runner takes all of its time from a Clock (injectable: the
// simulator substitutes its own); system_clock() is the real one. Code that only measures its own
// durations and deadlines against the real steady clock (the HTTP client, the transfers) uses the
// helpers below instead of restating the chrono conversions.
#pragma once

#include <chrono>
#include <cstdint>

namespace rc::effects {

// Monotonic time and sleeping, injectable for simulation.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual std::int64_t now_ms() = 0;                         // monotonic
  virtual std::int64_t now_us() { return now_ms() * 1000; }  // monotonic, for phase timings
  virtual std::int64_t wall_ms() = 0;  // wall clock, recorded in the journal envelope
  virtual void sleep_ms(std::uint32_t ms) = 0;
};

// steady_clock for now_ms/now_us, system_clock for wall_ms, this_thread::sleep_for.
Clock& system_clock();

using SteadyTime = std::chrono::steady_clock::time_point;

// The steady clock since its epoch: only differences mean anything.
std::int64_t steady_now_us();
std::int64_t steady_now_ms();
// The system clock since the Unix epoch.
std::int64_t wall_now_ms();
// Time from `start` until now on the steady clock; 0 when `start` is later (never wraps).
std::uint64_t elapsed_us(SteadyTime start);
std::uint64_t elapsed_ms(SteadyTime start);
// Milliseconds from now until `deadline` on the steady clock; 0 once it has passed.
std::uint64_t remaining_ms(SteadyTime deadline);

}  // namespace rc::effects
