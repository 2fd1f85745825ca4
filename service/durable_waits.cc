#include "service/durable_waits.h"

#include <boost/asio/execution/context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/query.hpp>

namespace rc::service {

namespace asio = boost::asio;

namespace {
const void* LoopKey(const asio::any_io_executor& executor) {
  return &asio::query(executor, asio::execution::context);
}
}  // namespace

DurableWaits::DurableWaits(journal::Journal& journal) : journal_(journal) {}

void DurableWaits::Wait(const journal::Ticket& ticket, const asio::any_io_executor& executor,
                        Done done) {
  RC_CHECK(done != nullptr);
  const Key key{LoopKey(executor), ticket.batch_id};
  bool first = false;
  {
    std::lock_guard<std::mutex> g(shared_->mu);
    std::vector<Waiter>& waiters = shared_->waiting[key];
    first = waiters.empty();
    waiters.push_back(Waiter{executor, std::move(done)});
    shared_->count++;
  }
  if (!first) return;  // the batch's closure for this loop is registered already
  // One journal waiter per (loop, batch): it runs on the committer, so it only posts.
  journal_.WaitAsync(ticket, [shared = shared_, key, executor](Status durable) {
    asio::post(executor,
               [shared, key, executor, durable] { RunBatch(shared, key, executor, durable); });
  });
}

// Every group of a batch has the same fate, so each waiter of the batch takes `durable`. A waiter
// registered on another executor of the same loop (a strand) is posted there: each runs where it
// asked to.
void DurableWaits::RunBatch(const std::shared_ptr<Shared>& shared, const Key& key,
                            const asio::any_io_executor& on, Status durable) {
  std::vector<Waiter> waiters;
  {
    std::lock_guard<std::mutex> g(shared->mu);
    auto it = shared->waiting.find(key);
    RC_CHECK(it != shared->waiting.end() && !it->second.empty());
    waiters = std::move(it->second);
    shared->waiting.erase(it);
    RC_CHECK(shared->count >= waiters.size());
    shared->count -= waiters.size();
  }
  for (Waiter& w : waiters) {
    if (w.executor == on) {
      w.done(durable);
    } else {
      asio::post(w.executor, [done = std::move(w.done), durable] { done(durable); });
    }
  }
}

std::size_t DurableWaits::pending() const {
  std::lock_guard<std::mutex> g(shared_->mu);
  return shared_->count;
}

}  // namespace rc::service
