// The fleet executor's member threads in the simulator: real threads that take turns on the
// scheduler (sim/engine.h), so that members drain, transfer and validate side by side in virtual
// time while only one of them runs at any moment, in an order the seed fixes.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "effects/fleet_runner.h"
#include "sim/engine.h"

namespace rc::sim {

class SimThreads final : public effects::MemberThreads {
 public:
  explicit SimThreads(Scheduler& s) : s_(s) {}
  ~SimThreads() override;
  // The new thread's first turn comes once the caller next lets virtual time pass.
  std::uint64_t Start(std::function<void()> drive) override;
  // Lets virtual time pass (kJoinPollUs at a time) until that drive returned.
  void Join(std::uint64_t id) override;

 private:
  static constexpr std::int64_t kJoinPollUs = 1000;
  struct Thread {
    Scheduler::Turn turn;
    bool done = false;  // written before the thread leaves; read after a turn
    std::thread thread;
  };
  Scheduler& s_;
  std::map<std::uint64_t, std::unique_ptr<Thread>> threads_;
  std::uint64_t last_id_ = 0;
};

}  // namespace rc::sim
