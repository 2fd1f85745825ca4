#include "effects/clock.h"

#include <thread>

namespace rc::effects {
namespace {

using std::chrono::duration_cast;
using std::chrono::microseconds;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

// A negative duration (a start in the future) counts as none: callers store unsigned values.
template <class Unit>
std::uint64_t clamped(steady_clock::duration d) {
  const auto count = duration_cast<Unit>(d).count();
  return count > 0 ? static_cast<std::uint64_t>(count) : 0;
}

class SystemClock final : public Clock {
 public:
  std::int64_t now_ms() override { return steady_now_ms(); }
  std::int64_t now_us() override { return steady_now_us(); }
  std::int64_t wall_ms() override { return wall_now_ms(); }
  void sleep_ms(std::uint32_t ms) override { std::this_thread::sleep_for(milliseconds(ms)); }
};

}  // namespace

Clock& system_clock() {
  static SystemClock clock;
  return clock;
}

std::int64_t steady_now_us() {
  return duration_cast<microseconds>(steady_clock::now().time_since_epoch()).count();
}

std::int64_t steady_now_ms() {
  return duration_cast<milliseconds>(steady_clock::now().time_since_epoch()).count();
}

std::int64_t wall_now_ms() {
  return duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::uint64_t elapsed_us(SteadyTime start) {
  return clamped<microseconds>(steady_clock::now() - start);
}

std::uint64_t elapsed_ms(SteadyTime start) {
  return clamped<milliseconds>(steady_clock::now() - start);
}

std::uint64_t remaining_ms(SteadyTime deadline) {
  return clamped<milliseconds>(deadline - steady_clock::now());
}

}  // namespace rc::effects
