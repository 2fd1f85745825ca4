#include "sim/sim_threads.h"

#include <utility>

#include "statemachine/status.h"

namespace rc::sim {

SimThreads::~SimThreads() { RC_CHECK(threads_.empty()); }

std::uint64_t SimThreads::Start(std::function<void()> drive) {
  auto t = std::make_unique<Thread>();
  Thread* raw = t.get();
  s_.Enter(raw->turn);
  raw->thread = std::thread([this, raw, drive = std::move(drive)] {
    s_.Await(raw->turn);
    drive();
    raw->done = true;
    s_.Leave();
  });
  threads_.emplace(++last_id_, std::move(t));
  return last_id_;
}

void SimThreads::Join(std::uint64_t id) {
  auto it = threads_.find(id);
  RC_CHECK(it != threads_.end());
  while (!it->second->done) s_.RunUntil(s_.now_us() + kJoinPollUs);
  it->second->thread.join();
  threads_.erase(it);
}

}  // namespace rc::sim
