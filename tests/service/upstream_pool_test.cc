// The engine connection pool over real loopback TCP, with two event loops as serve runs them.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
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
  explicit SilentEngine(const std::string& address = "127.0.0.1", std::uint16_t port = 0)
      : acceptor_(io_, tcp::endpoint(asio::ip::make_address(address), port)) {
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

struct AcquireOptions {
  std::uint64_t connect_timeout_ms = 2000;
  bool fresh_only = false;
};

// Acquires on a strand of `loop`, running the loop until the connection is handed over; a
// completion that does not come within the timeout and 5 s more is a failure, not a hang.
Got AcquireOn(UpstreamPool& pool, asio::io_context& loop, AcquireOptions o = {}) {
  auto got = std::make_shared<Got>();
  auto done = std::make_shared<int>(0);  // completions: exactly one is expected
  pool.Acquire(
      asio::make_strand(loop), o.connect_timeout_ms,
      [got, done](Status st, std::unique_ptr<UpstreamConn> c, bool reused) {
        *got = Got{st, std::move(c), reused};
        ++*done;
      },
      o.fresh_only);
  loop.restart();
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(o.connect_timeout_ms + 5000);
  while (*done == 0 && std::chrono::steady_clock::now() < give_up) {
    loop.run_one_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(*done, 1) << "the acquire did not complete within its connect timeout";
  loop.poll();  // a second completion, if any, would come now
  EXPECT_LE(*done, 1) << "the acquire completed twice";
  return std::move(*got);
}

std::uint16_t PortOf(const Got& got) { return got.conn->socket.remote_endpoint().port(); }
std::string AddressOf(const Got& got) {
  return got.conn->socket.remote_endpoint().address().to_string();
}

// Proves a pooled connection is reused only by an exchange of the event loop it was opened on,
// and that each loop keeps its share of the idle bound. Catches a connection handed to another
// loop (its reads and writes would then cross threads on every request), and one busy loop
// taking every idle place so the others reconnect on every request.
TEST(UpstreamPool, AConnectionIsReusedOnlyOnItsOwnLoop) {
  SilentEngine engine;
  asio::io_context a(1), b(1);  // outlive the pool: its idle sockets are registered with them
  UpstreamPool pool("127.0.0.1", engine.endpoint().port(), /*idle_max=*/3, /*loops=*/2);
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

// Proves a pool built from a host name, not an IP literal, resolves it and connects. Catches a
// name handed to the literal path, and a lookup whose completion never reaches the exchange.
TEST(UpstreamPool, ANameIsResolvedAndConnected) {
  SilentEngine engine;  // on 127.0.0.1, which localhost names (maybe after ::1, refused)
  asio::io_context loop(1);
  UpstreamPool pool("localhost", engine.endpoint().port(), /*idle_max=*/1, /*loops=*/1);
  Got got = AcquireOn(pool, loop);
  ASSERT_TRUE(got.status.ok()) << got.status.ToString();
  EXPECT_FALSE(got.reused);
  EXPECT_EQ(got.conn->socket.remote_endpoint(), engine.endpoint());
}

// A name's resolver for tests: answers `address` (or `error`) from the lookup's own thread.
struct FakeDns {
  std::mutex mu;
  std::string address = "127.0.0.1";
  std::string error;  // non-empty: the lookup fails with it
  int delay_ms = 0;   // how long each lookup takes
  int lookups = 0;

  int lookups_now() {
    std::lock_guard<std::mutex> g(mu);
    return lookups;
  }
  static UpstreamPool::Resolve Of(const std::shared_ptr<FakeDns>& dns) {
    return [dns](const std::string& host,
                 std::uint16_t port) -> Result<std::vector<tcp::endpoint>> {
      int delay_ms = 0;
      {
        std::lock_guard<std::mutex> g(dns->mu);
        delay_ms = dns->delay_ms;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      std::lock_guard<std::mutex> g(dns->mu);
      EXPECT_EQ(host, "engine.test");
      ++dns->lookups;
      if (!dns->error.empty()) return Status::Unavailable(dns->error);
      return std::vector<tcp::endpoint>{tcp::endpoint(asio::ip::make_address(dns->address), port)};
    };
  }
};

// Proves an engine whose name moves is followed by the next connect: once the engine at
// 127.0.0.1 is gone and the name points at 127.0.0.2 (same port, a lookup taking 200 ms), the
// refused connect has the name looked up again, and the next fresh connect waits for that lookup
// and reaches the new address; a pooled connection is reused without a lookup. Catches an
// address fixed when the pool was built, the retry dialing the dead address again while the
// lookup runs (every retry of a rollout would fail within a slow lookup), and a lookup on reuse.
TEST(UpstreamPool, AnEngineWhoseNameMovesIsFollowedByTheNextConnect) {
  auto old_engine = std::make_unique<SilentEngine>("127.0.0.1");
  const std::uint16_t port = old_engine->endpoint().port();
  SilentEngine new_engine("127.0.0.2", port);
  auto dns = std::make_shared<FakeDns>();
  asio::io_context loop(1);
  UpstreamPool pool("engine.test", port, /*idle_max=*/2, /*loops=*/1, FakeDns::Of(dns));
  Got first = AcquireOn(pool, loop);
  ASSERT_TRUE(first.status.ok()) << first.status.ToString();
  EXPECT_EQ(AddressOf(first), "127.0.0.1");
  pool.Release(std::move(first.conn));
  Got pooled = AcquireOn(pool, loop);
  ASSERT_TRUE(pooled.status.ok()) << pooled.status.ToString();
  EXPECT_TRUE(pooled.reused);
  EXPECT_EQ(dns->lookups_now(), 1) << "a pooled connection was reused after a lookup";
  EXPECT_EQ(AddressOf(pooled), "127.0.0.1") << "a pooled connection keeps its address";

  {
    std::lock_guard<std::mutex> g(dns->mu);
    dns->address = "127.0.0.2";  // the engine restarted elsewhere
    dns->delay_ms = 200;
  }
  old_engine.reset();  // connects to the old address are refused now
  Got refused = AcquireOn(pool, loop, {.fresh_only = true});
  EXPECT_EQ(refused.status.code(), Code::kUnavailable) << refused.status.ToString();
  Got moved = AcquireOn(pool, loop, {.fresh_only = true});
  ASSERT_TRUE(moved.status.ok()) << moved.status.ToString();
  EXPECT_EQ(AddressOf(moved), "127.0.0.2") << "the fresh connect dialed the old address";
  EXPECT_EQ(dns->lookups_now(), 2);
}

// Proves the start's addresses serve the first connects: a pool seeded with them connects with
// no lookup. Catches every first connect after a start waiting on DNS (or failing with it down).
TEST(UpstreamPool, SeededAddressesNeedNoLookup) {
  SilentEngine engine("127.0.0.1");
  auto dns = std::make_shared<FakeDns>();
  dns->error = "SERVFAIL";
  asio::io_context loop(1);
  UpstreamPool pool("engine.test", engine.endpoint().port(), /*idle_max=*/1, /*loops=*/1,
                    FakeDns::Of(dns));
  pool.SeedAddresses({engine.endpoint()});
  Got got = AcquireOn(pool, loop);
  ASSERT_TRUE(got.status.ok()) << got.status.ToString();
  EXPECT_EQ(dns->lookups_now(), 0);
}

// Proves a DNS outage leaves the last addresses in use: with every lookup failing (looked up at
// each connect here), fresh connects to the engine that never moved still succeed. Catches fresh
// connects failing for as long as DNS does, which a pool resolved once at start never did.
TEST(UpstreamPool, ADnsOutageKeepsTheLastAddresses) {
  SilentEngine engine("127.0.0.1");
  auto dns = std::make_shared<FakeDns>();
  asio::io_context loop(1);
  UpstreamPool pool("engine.test", engine.endpoint().port(), /*idle_max=*/1, /*loops=*/1,
                    FakeDns::Of(dns), /*refresh_ms=*/0);
  ASSERT_TRUE(AcquireOn(pool, loop).status.ok());
  {
    std::lock_guard<std::mutex> g(dns->mu);
    dns->error = "SERVFAIL";
  }
  for (int i = 0; i < 3; ++i) {
    Got got = AcquireOn(pool, loop, {.fresh_only = true});
    ASSERT_TRUE(got.status.ok()) << got.status.ToString();
    EXPECT_EQ(AddressOf(got), "127.0.0.1");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the failing lookup end
  }
  EXPECT_GE(dns->lookups_now(), 2) << "no lookup was tried during the outage";
}

// Proves a failed connect during a DNS outage does not cut off an engine that never moved: the
// engine restarts in place (one connect refused), every lookup fails, and then one hangs; the
// next connects still reach it at its last address, at once or after kLookupWaitMs. Catches
// connects that wait for a lookup that fails or hangs and then fail with it, for as long as DNS
// is down, though the last address works.
TEST(UpstreamPool, AFailedConnectDuringADnsOutageKeepsTheLastAddress) {
  auto engine = std::make_unique<SilentEngine>("127.0.0.1");
  const std::uint16_t port = engine->endpoint().port();
  auto dns = std::make_shared<FakeDns>();
  asio::io_context loop(1);
  UpstreamPool pool("engine.test", port, /*idle_max=*/1, /*loops=*/1, FakeDns::Of(dns));
  ASSERT_TRUE(AcquireOn(pool, loop).status.ok());
  {
    std::lock_guard<std::mutex> g(dns->mu);
    dns->error = "SERVFAIL";
  }
  engine.reset();  // restarting in place: this connect is refused
  EXPECT_FALSE(AcquireOn(pool, loop, {.fresh_only = true}).status.ok());
  engine = std::make_unique<SilentEngine>("127.0.0.1", port);
  Got back = AcquireOn(pool, loop, {.fresh_only = true});
  ASSERT_TRUE(back.status.ok()) << back.status.ToString();
  EXPECT_EQ(AddressOf(back), "127.0.0.1");

  {
    std::lock_guard<std::mutex> g(dns->mu);
    dns->error.clear();
    dns->delay_ms = 3000;  // the DNS server hangs now
  }
  engine.reset();
  EXPECT_FALSE(AcquireOn(pool, loop, {.fresh_only = true}).status.ok());
  engine = std::make_unique<SilentEngine>("127.0.0.1", port);
  Got after_hang = AcquireOn(pool, loop, {.fresh_only = true});
  ASSERT_TRUE(after_hang.status.ok()) << after_hang.status.ToString();
  EXPECT_EQ(AddressOf(after_hang), "127.0.0.1");
}

// Proves a lookup that hangs holds neither the connect past its deadline nor the pool's end (the
// shutdown). Catches a lookup joined at teardown: serve's exit would wait for the resolver's
// timeout, past an orchestrator's kill grace.
TEST(UpstreamPool, AHungLookupNeverHoldsTheShutdown) {
  auto hung = [](const std::string&, std::uint16_t) -> Result<std::vector<tcp::endpoint>> {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return Status::Unavailable("timed out");
  };
  const auto start = std::chrono::steady_clock::now();
  {
    asio::io_context loop(1);
    UpstreamPool pool("engine.test", 8000, /*idle_max=*/1, /*loops=*/1, hung);
    Got got = AcquireOn(pool, loop, {.connect_timeout_ms = 200});
    EXPECT_EQ(got.status.code(), Code::kTimeout) << got.status.ToString();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1500))
      << "the pool's end waited for the hung lookup";
}

// Proves the connect tries the addresses of a name in order until one answers, as localhost
// resolving to ::1 and 127.0.0.1 with the engine on one of them needs. Catches a connect to the
// first address alone.
TEST(UpstreamPool, TheConnectTriesEachAddressOfTheName) {
  SilentEngine engine("127.0.0.1");
  const std::uint16_t port = engine.endpoint().port();  // nothing listens on 127.0.0.2:port
  auto resolve = [](const std::string&, std::uint16_t p) -> Result<std::vector<tcp::endpoint>> {
    return std::vector<tcp::endpoint>{tcp::endpoint(asio::ip::make_address("127.0.0.2"), p),
                                      tcp::endpoint(asio::ip::make_address("127.0.0.1"), p)};
  };
  asio::io_context loop(1);
  UpstreamPool pool("engine.test", port, /*idle_max=*/1, /*loops=*/1, resolve);
  Got got = AcquireOn(pool, loop);
  ASSERT_TRUE(got.status.ok()) << got.status.ToString();
  EXPECT_EQ(AddressOf(got), "127.0.0.1");
  EXPECT_EQ(PortOf(got), port);
}

// Proves a name the system resolver does not know fails the acquire with Unavailable, once and
// within the connect timeout. Catches a lookup error reported as a connect error or a timeout,
// and an acquire that never completes. (Needs a resolver that answers NXDOMAIN for .invalid;
// with no DNS reachable, the acquire ends at the deadline with Timeout instead.)
TEST(UpstreamPool, ANameThatDoesNotResolveFailsTheAcquire) {
  asio::io_context loop(1);
  UpstreamPool pool("no-such-host.invalid", 8000, /*idle_max=*/1, /*loops=*/1);
  const auto start = std::chrono::steady_clock::now();
  Got got = AcquireOn(pool, loop, {.connect_timeout_ms = 3000});
  const auto took = std::chrono::steady_clock::now() - start;
  // Unavailable where DNS answers; Timeout where no DNS server answers within the deadline.
  if (got.status.code() != Code::kTimeout) {
    EXPECT_EQ(got.status.code(), Code::kUnavailable) << got.status.ToString();
    EXPECT_NE(got.status.message().find("cannot resolve the engine host 'no-such-host.invalid'"),
              std::string::npos)
        << got.status.message();
  }
  EXPECT_EQ(got.conn, nullptr);
  EXPECT_LT(took, std::chrono::milliseconds(3000 + 500));
}

// Proves a failed lookup completes the acquire with Unavailable, naming the host escaped (it comes
// from a configuration file). Catches the failure reported as a connect error, and a control
// character of the name written raw into a log line.
TEST(UpstreamPool, AFailedLookupIsUnavailableAndNamesTheHostEscaped) {
  auto resolve = [](const std::string&, std::uint16_t) -> Result<std::vector<tcp::endpoint>> {
    return Status::NotFound("NXDOMAIN");
  };
  asio::io_context loop(1);
  UpstreamPool pool("bad\nname", 8000, /*idle_max=*/1, /*loops=*/1, resolve);
  Got got = AcquireOn(pool, loop);
  EXPECT_EQ(got.status.code(), Code::kUnavailable) << got.status.ToString();
  EXPECT_EQ(got.status.message(), "cannot resolve the engine host 'bad\\nname': NXDOMAIN");
  EXPECT_EQ(got.conn, nullptr);
}

// Proves the engine host check of the start: a literal and localhost pass, an unknown name fails
// with the message a fresh connect gives. Catches a typo in engine_url accepted at start.
TEST(UpstreamPool, TheStartCheckResolvesTheHostNow) {
  EXPECT_TRUE(ResolveEngineHost("127.0.0.1", 8000).ok());
  EXPECT_TRUE(ResolveEngineHost("::1", 8000).ok());
  EXPECT_TRUE(ResolveEngineHost("localhost", 8000).ok());
  const Status st = ResolveEngineHost("no-such-host.invalid", 8000).status();
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("cannot resolve the engine host 'no-such-host.invalid'"),
            std::string::npos);
}

}  // namespace
}  // namespace rc::service
