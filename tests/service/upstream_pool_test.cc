// The engine connection pool over real loopback TCP, with two event loops as serve runs them.
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>
#include <gtest/gtest.h>

#include "service/upstream.h"

namespace rc::service {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

// An engine that accepts and holds every connection open, saying nothing.
class SilentEngine {
 public:
  SilentEngine() : acceptor_(io_, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)) {
    Accept();
    thread_ = std::thread([this] { io_.run(); });
  }
  ~SilentEngine() {
    io_.stop();
    thread_.join();
  }
  tcp::endpoint endpoint() const { return acceptor_.local_endpoint(); }

 private:
  void Accept() {
    acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket s) {
      if (ec) return;
      held_.push_back(std::make_unique<tcp::socket>(std::move(s)));
      Accept();
    });
  }
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::vector<std::unique_ptr<tcp::socket>> held_;
  std::thread thread_;
};

struct Got {
  Status status;
  std::unique_ptr<UpstreamConn> conn;
  bool reused = false;
};

// Acquires on a strand of `loop`, running the loop until the connection is handed over.
Got AcquireOn(UpstreamPool& pool, asio::io_context& loop) {
  Got got;
  bool done = false;
  pool.Acquire(asio::make_strand(loop), 2000,
               [&](Status st, std::unique_ptr<UpstreamConn> c, bool reused) {
                 got = Got{st, std::move(c), reused};
                 done = true;
               });
  loop.restart();
  while (!done) loop.run_one_for(std::chrono::seconds(5));
  return got;
}

// Proves a pooled connection is reused only by an exchange of the event loop it was opened on,
// and that each loop keeps its share of the idle bound. Catches a connection handed to another
// loop (its reads and writes would then cross threads on every request), and one busy loop
// taking every idle place so the others reconnect on every request.
TEST(UpstreamPool, AConnectionIsReusedOnlyOnItsOwnLoop) {
  SilentEngine engine;
  asio::io_context a(1), b(1);  // outlive the pool: its idle sockets are registered with them
  UpstreamPool pool(engine.endpoint(), /*idle_max=*/3, /*loops=*/2);
  Got first = AcquireOn(pool, a);
  ASSERT_TRUE(first.status.ok()) << first.status.ToString();
  EXPECT_FALSE(first.reused);
  const UpstreamConn* opened_on_a = first.conn.get();
  pool.Release(std::move(first.conn));
  EXPECT_EQ(pool.idle(), 1u);

  Got on_b = AcquireOn(pool, b);
  ASSERT_TRUE(on_b.status.ok());
  EXPECT_FALSE(on_b.reused) << "loop b took loop a's connection";
  EXPECT_NE(on_b.conn.get(), opened_on_a);
  Got again_a = AcquireOn(pool, a);
  ASSERT_TRUE(again_a.status.ok());
  EXPECT_TRUE(again_a.reused);
  EXPECT_EQ(again_a.conn.get(), opened_on_a);

  std::vector<std::unique_ptr<UpstreamConn>> more;
  for (int i = 0; i < 3; ++i) more.push_back(AcquireOn(pool, b).conn);
  pool.Release(std::move(on_b.conn));
  pool.Release(std::move(again_a.conn));
  for (auto& c : more) pool.Release(std::move(c));
  EXPECT_EQ(pool.idle(), 3u) << "four released on b (two kept), one on a";
}

}  // namespace
}  // namespace rc::service
