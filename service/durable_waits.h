// DurableWaits: the journal's durability notices, delivered to the event loops a batch at a time.
//
// A group commit makes the groups of many requests durable at once. Posting each waiter to its
// loop separately costs the committer one post per waiter, each taking the loop's queue lock
// while the loop itself takes it, and may wake the loop each time. Here every waiter of one
// committed batch on one loop is run by a single closure posted to that loop.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <boost/asio/any_io_executor.hpp>

#include "journal/journal.h"
#include "statemachine/status.h"

namespace rc::service {

class DurableWaits {
 public:
  using Done = std::function<void(Status)>;

  explicit DurableWaits(journal::Journal& journal);

  // Runs `done` on `executor` exactly once: with OK once `ticket`'s group is durable, or with the
  // journal's failure. Never inline: always through `executor`.
  void Wait(const journal::Ticket& ticket, const boost::asio::any_io_executor& executor, Done done);

  // Waiters whose batch's notice has not come yet. Once it comes they belong to the closure
  // posted to their loop, so a loop's queue (destroyed with its io_context) owns every waiter
  // still holding that loop's timers and sockets, never this object.
  std::size_t waiting() const;
  // Journal waiters registered so far: one per (loop, batch) that had any waiter.
  std::uint64_t registrations() const;

 private:
  struct Waiter {
    boost::asio::any_io_executor executor;
    Done done;
  };
  using Key = std::pair<const void*, std::uint64_t>;  // (event loop, batch id)
  struct Shared {
    mutable std::mutex mu;
    std::map<Key, std::vector<Waiter>> waiting;  // bounded by the journal's pending groups
    std::size_t count = 0;
    std::uint64_t registrations = 0;
  };

  static std::vector<Waiter> Take(Shared& shared, const Key& key);
  static void Run(std::vector<Waiter>& waiters, const boost::asio::any_io_executor& on,
                  const Status& durable);

  journal::Journal& journal_;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
};

}  // namespace rc::service
