#include "service/durable_waits.h"

#include <exception>

#include <boost/asio/post.hpp>

#include "service/http_server.h"

namespace rc::service {

namespace asio = boost::asio;

DurableWaits::DurableWaits(journal::Journal& journal) : journal_(journal) {}

void DurableWaits::Wait(const journal::Ticket& ticket, const asio::any_io_executor& executor,
                        Done done) {
  RC_CHECK(done != nullptr);
  const Key key{EventLoopOf(executor), ticket.batch_id};
  {
    std::lock_guard<std::mutex> g(shared_->mu);
    std::vector<Waiter>& waiters = shared_->waiting[key];
    waiters.push_back(Waiter{executor, std::move(done)});
    shared_->count++;
    if (waiters.size() > 1) return;  // the batch's notice for this loop is registered already
    shared_->registrations++;
  }
  // Runs on the committer (or here, when the batch is decided already): it only takes the
  // waiters and posts them on. Waiters that come after it form a new entry and a new notice.
  journal_.WaitAsync(ticket, [shared = shared_, key, executor](Status durable) {
    asio::post(executor, [waiters = Take(*shared, key), executor, durable]() mutable {
      Run(waiters, executor, durable);
    });
  });
}

std::vector<DurableWaits::Waiter> DurableWaits::Take(Shared& shared, const Key& key) {
  std::lock_guard<std::mutex> g(shared.mu);
  auto it = shared.waiting.find(key);
  RC_CHECK(it != shared.waiting.end() && !it->second.empty());  // one notice per entry
  std::vector<Waiter> waiters = std::move(it->second);
  shared.waiting.erase(it);
  RC_CHECK(shared.count >= waiters.size());
  shared.count -= waiters.size();
  return waiters;
}

// Every group of a batch has the same fate, so each waiter takes `durable`. One registered on
// another executor of the same loop (a strand) is posted there. A waiter that throws leaves the
// rest to run as handlers of their own before the loop sees the exception.
void DurableWaits::Run(std::vector<Waiter>& waiters, const asio::any_io_executor& on,
                       const Status& durable) {
  for (std::size_t i = 0; i < waiters.size(); ++i) {
    Waiter& w = waiters[i];
    if (w.executor != on) {
      asio::post(w.executor, [done = std::move(w.done), durable] { done(durable); });
      continue;
    }
    try {
      w.done(durable);
    } catch (...) {
      for (std::size_t j = i + 1; j < waiters.size(); ++j) {
        asio::post(waiters[j].executor,
                   [done = std::move(waiters[j].done), durable] { done(durable); });
      }
      throw;
    }
  }
}

std::size_t DurableWaits::waiting() const {
  std::lock_guard<std::mutex> g(shared_->mu);
  return shared_->count;
}

std::uint64_t DurableWaits::registrations() const {
  std::lock_guard<std::mutex> g(shared_->mu);
  return shared_->registrations;
}

}  // namespace rc::service
