// The plans of one kind that ended in this process or were read back from the journal, for
// idempotent re-POSTs answered before the plan slot: a retry of an ended plan never waits for,
// nor is refused by, another plan that holds the slot.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "statemachine/events.h"
#include "statemachine/status.h"

namespace rc::service {

// id -> the request journaled under it and its end. Bounded: the `max` newest ids are kept, older
// ones are looked up in the journal again. Each kind of plan has its own ids, so its own memory.
// `End` is the plan's end as the fold decided it (UpdateEnded, or a fleet's FleetUpdateEnded).
template <class Request, class End = UpdateEnded>
class EndedPlans {
 public:
  struct Ended {
    Request request;
    End ended;
  };

  explicit EndedPlans(std::size_t max) : max_(max) { RC_CHECK(max_ > 0); }
  EndedPlans(const EndedPlans&) = delete;
  EndedPlans& operator=(const EndedPlans&) = delete;

  std::optional<Ended> Find(const std::string& id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return std::nullopt;
    return it->second;
  }

  // The first end remembered for an id stays: an id ends once.
  void Remember(const std::string& id, const Request& request, const End& ended) {
    RC_CHECK(ended.update_id == id);
    std::lock_guard<std::mutex> lock(mu_);
    if (by_id_.emplace(id, Ended{request, ended}).second) order_.push_back(id);
    while (order_.size() > max_) {
      by_id_.erase(order_.front());
      order_.pop_front();
    }
    RC_CHECK(by_id_.size() == order_.size() && by_id_.size() <= max_);
  }

 private:
  const std::size_t max_;
  mutable std::mutex mu_;
  std::map<std::string, Ended> by_id_;
  std::deque<std::string> order_;  // FIFO eviction past max_
};

}  // namespace rc::service
