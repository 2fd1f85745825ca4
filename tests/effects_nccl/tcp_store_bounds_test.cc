// Tests of the TCPStore master under hostile peers over real loopback sockets: every allocation
// is bounded before it is made, the rendezvous key cannot be changed by a client, the master
// listens only where it was told to, silent peers cannot hold its connections, and a stopped
// master refuses connects.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "effects/nccl/rendezvous.h"
#include "effects/nccl/tcp_store.h"
#include "tests/effects_nccl/store_client.h"

namespace rc::effects::nccl {
namespace {

using testing::StoreClient;
using Q = StoreQuery;

std::unique_ptr<TcpStoreServer> Start(TcpStoreOptions o) {
  auto s = TcpStoreServer::Start(o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(*s);
}

// True when a fresh client gets its PING answered: the master is still serving.
bool StillServes(std::uint16_t port) {
  StoreClient c(port);
  c.Type(static_cast<std::uint8_t>(Q::kPing));
  c.Pod<std::uint32_t>(99);
  if (!c.Flush()) return false;
  std::uint32_t n = 0;
  return c.Read(&n) && n == 99;
}

long MaxRssKib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

// Proves a MULTI_GET whose reply would pass the output bound is refused before the reply is
// built: 64 x a 16 MiB value (1 GiB) leaves the peak RSS nearly unchanged and the master serving;
// catches the reply assembled in full (2.1 GB RSS, bad_alloc aborting the executor under ulimit)
// before output_bytes_max was looked at.
TEST(TcpStoreBounds, MultiGetReplyCheckedBeforeItIsBuilt) {
  TcpStoreOptions o;
  o.value_bytes_max = 16u << 20;
  o.query_bytes_max = 64u << 20;
  o.output_bytes_max = 64u << 20;
  o.store_bytes_max = 32u << 20;
  auto store = Start(o);
  ASSERT_TRUE(store->Set("/big", std::string(16u << 20, 'v')).ok());
  const long before_kib = MaxRssKib();
  StoreClient c(store->port());
  c.Type(static_cast<std::uint8_t>(Q::kMultiGet));
  c.Pod<std::uint64_t>(64);
  for (int i = 0; i < 64; ++i) c.Str("/big");
  ASSERT_TRUE(c.Flush());
  EXPECT_TRUE(c.ClosedByServer());
  EXPECT_LT(MaxRssKib() - before_kib, 128 * 1024) << "the reply was allocated";
  EXPECT_GE(store->stats().budget_refusals, 1u);
  EXPECT_TRUE(StillServes(store->port()));
  // Within the bound MULTI_GET still answers.
  StoreClient ok(store->port());
  ok.Type(static_cast<std::uint8_t>(Q::kMultiGet));
  ok.Pod<std::uint64_t>(2);
  ok.Str("/big");
  ok.Str("/big");
  ASSERT_TRUE(ok.Flush());
  std::string v;
  ASSERT_TRUE(ok.ReadStr(&v));
  EXPECT_EQ(v.size(), 16u << 20);
}

// Proves the store's total bytes are capped (SET, APPEND and MULTI_SET alike) and a refused
// MULTI_SET stores nothing; catches a store that grows until the executor runs out of memory.
TEST(TcpStoreBounds, StoredBytesCapped) {
  TcpStoreOptions o;
  o.bind_address = "127.0.0.1";
  o.store_bytes_max = 1u << 20;
  auto store = Start(o);
  {
    StoreClient c(store->port());
    for (int i = 0; i < 40; ++i) {
      c.Type(static_cast<std::uint8_t>(Q::kSet));
      c.Str("/k" + std::to_string(i));
      c.Str(std::string(64u << 10, 'x'));
    }
    c.Flush();
    EXPECT_TRUE(c.ClosedByServer());
  }
  EXPECT_LE(store->stats().stored_bytes, o.store_bytes_max);
  EXPECT_GT(store->stats().stored_bytes, o.store_bytes_max / 2);
  {
    StoreClient c(store->port());
    for (int i = 0; i < 40; ++i) {
      c.Type(static_cast<std::uint8_t>(Q::kAppend));
      c.Str("/k0");
      c.Str(std::string(64u << 10, 'y'));
    }
    c.Flush();
    EXPECT_TRUE(c.ClosedByServer());
  }
  EXPECT_LE(store->stats().stored_bytes, o.store_bytes_max);
  const std::size_t before = store->stats().stored_bytes;
  {
    StoreClient c(store->port());
    c.Type(static_cast<std::uint8_t>(Q::kMultiSet));
    c.Pod<std::uint64_t>(2);
    c.Str("/small");
    c.Str("1");
    c.Str("/huge");
    c.Str(std::string(900u << 10, 'z'));
    c.Flush();
    EXPECT_TRUE(c.ClosedByServer());
  }
  EXPECT_EQ(store->stats().stored_bytes, before);
  EXPECT_FALSE(store->Get("/small").has_value()) << "a refused MULTI_SET stored part of itself";
  EXPECT_TRUE(StillServes(store->port()));
}

// Proves the bytes buffered for all connections together are bounded: peers each holding an
// incomplete query are dropped once the shared budget is spent, and the master keeps serving;
// catches 256 connections x a 64 MiB partial query (16 GiB) being accepted.
TEST(TcpStoreBounds, BufferedBytesAcrossConnectionsBounded) {
  TcpStoreOptions o;
  o.bind_address = "127.0.0.1";
  o.value_bytes_max = 1u << 20;
  o.query_bytes_max = 2u << 20;
  o.buffered_bytes_max = 2u << 20;
  auto store = Start(o);
  std::vector<std::unique_ptr<StoreClient>> peers;
  for (int i = 0; i < 6; ++i) {
    auto c = std::make_unique<StoreClient>(store->port());
    c->Type(static_cast<std::uint8_t>(Q::kSet));
    c->Str("/slow" + std::to_string(i));
    c->Pod<std::uint64_t>(1u << 20);  // announces a 1 MiB value, sends 700 KiB, never the rest
    for (std::size_t b = 0; b < (700u << 10); ++b) c->Pod<char>('p');
    c->Flush();
    peers.push_back(std::move(c));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_GE(store->stats().budget_refusals, 1u);
  EXPECT_LT(store->stats().connections_open, 6u);
  peers.clear();
  EXPECT_TRUE(StillServes(store->port()));
}

// Proves no client can overwrite, delete, compare-and-swap, append to, add to or multi-set the
// rendezvous key, before or after the master set it, and that the master cannot set it twice;
// catches a peer redirecting workers to its own NCCL unique id.
TEST(TcpStoreBounds, RendezvousKeyIsWriteOnceAndMasterOnly) {
  TcpStoreOptions o;
  auto store = Start(o);
  const std::string key(kUniqueIdWireKey);
  {
    StoreClient early(store->port());
    early.Type(static_cast<std::uint8_t>(Q::kSet));
    early.Str(key);
    early.Str("attacker-id");
    ASSERT_TRUE(early.Flush());
    EXPECT_TRUE(early.ClosedByServer());
  }
  EXPECT_FALSE(store->Get(key).has_value());
  UniqueIdBytes id{};
  id[0] = 7;
  const std::string pickled = PickleNcclUniqueId(id);
  ASSERT_TRUE(store->Set(key, pickled).ok());
  EXPECT_EQ(store->Set(key, "again").code(), Code::kRejected);
  auto attack = [&](auto&& write) {
    StoreClient c(store->port());
    write(c);
    EXPECT_TRUE(c.Flush());
    EXPECT_TRUE(c.ClosedByServer());
    EXPECT_EQ(store->Get(key).value_or(""), pickled);
  };
  attack([&](StoreClient& c) {
    c.Type(static_cast<std::uint8_t>(Q::kSet));
    c.Str(key);
    c.Str("x");
  });
  attack([&](StoreClient& c) {
    c.Type(static_cast<std::uint8_t>(Q::kDeleteKey));
    c.Str(key);
  });
  attack([&](StoreClient& c) {
    c.Type(static_cast<std::uint8_t>(Q::kCompareSet));
    c.Str(key);
    c.Str(pickled);
    c.Str("x");
  });
  attack([&](StoreClient& c) {
    c.Type(static_cast<std::uint8_t>(Q::kAppend));
    c.Str(key);
    c.Str("x");
  });
  attack([&](StoreClient& c) {
    c.Type(static_cast<std::uint8_t>(Q::kAdd));
    c.Str(key);
    c.Pod<std::int64_t>(1);
  });
  attack([&](StoreClient& c) {
    c.Type(static_cast<std::uint8_t>(Q::kMultiSet));
    c.Pod<std::uint64_t>(1);
    c.Str(key);
    c.Str("x");
  });
  EXPECT_GE(store->stats().write_once_refusals, 7u);
  // The legitimate worker read still works.
  StoreClient worker(store->port());
  worker.Type(static_cast<std::uint8_t>(Q::kGet));
  worker.Str(key);
  ASSERT_TRUE(worker.Flush());
  std::string got;
  ASSERT_TRUE(worker.ReadStr(&got));
  EXPECT_EQ(got, pickled);
}

// A loopback connection to the master that streams `bytes` again and again until Stop().
class Flooder {
 public:
  Flooder(std::uint16_t port, std::string bytes) : bytes_(std::move(bytes)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    thread_ = std::thread([this] {
      while (connected_ && !stop_.load()) {
        const ssize_t n = ::send(fd_, bytes_.data(), bytes_.size(), MSG_NOSIGNAL);
        if (n <= 0) return;
        sent_bytes_ += static_cast<std::uint64_t>(n);
      }
    });
  }
  ~Flooder() { Stop(); }
  // Ends the flood; shutdown() also wakes a send() blocked on a full socket.
  void Stop() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool connected() const { return connected_; }
  std::uint64_t sent_bytes() const { return sent_bytes_.load(); }

 private:
  std::string bytes_;
  int fd_ = -1;
  bool connected_ = false;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> sent_bytes_{0};
  std::thread thread_;
};

// Proves a peer streaming SETs faster than the master serves them cannot keep the master to
// itself: while the flood goes on, another client's GET is answered, the server-side Set returns
// and Stop() returns; catches a Receive that reads one connection until EAGAIN while holding the
// store's lock (a flood that outpaces the master keeps it from EAGAIN, and the GET, the Set or
// Stop waits behind the flood).
TEST(TcpStoreBounds, FloodingPeerCannotHoldTheStore) {
  auto store = Start(TcpStoreOptions{});
  ASSERT_TRUE(store->Set("/k", "v").ok());
  // ~1 MiB of small SETs: cheap to send, far slower to serve one by one.
  std::string flood;
  auto put_string = [&flood](const std::string& v) {
    const std::uint64_t n = v.size();
    flood.append(reinterpret_cast<const char*>(&n), sizeof(n));
    flood.append(v);
  };
  for (int i = 0; i < 16384; ++i) {
    flood.push_back(static_cast<char>(Q::kSet));
    put_string("/flood");
    put_string(std::string(40, 'f'));
  }
  Flooder flooder(store->port(), std::move(flood));
  ASSERT_TRUE(flooder.connected());
  for (int i = 0; i < 1000 && flooder.sent_bytes() < (4u << 20); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  StoreClient getter(store->port());
  getter.Type(static_cast<std::uint8_t>(Q::kGet));
  getter.Str("/k");
  ASSERT_TRUE(getter.Flush());
  std::uint64_t size = 0;
  char value = 0;
  const bool answered = getter.Read(&size, 5000) && size == 1 && getter.Read(&value, 5000);
  auto set = std::async(std::launch::async, [&] { return store->Set("/after", "x").ok(); });
  const bool set_returned = set.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  auto stop = std::async(std::launch::async, [&] { store->Stop(); });
  const bool stop_returned = stop.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  flooder.Stop();  // before the futures are waited for again: frees a master stuck in the flood
  EXPECT_TRUE(answered && value == 'v') << "the GET was not answered during the flood";
  EXPECT_TRUE(set_returned) << "Set() waited behind the flood";
  EXPECT_TRUE(stop_returned) << "Stop() waited behind the flood";
  EXPECT_TRUE(set.get());
  stop.get();
}

// True when a TCP connect to addr:port succeeds.
bool Connects(const char* addr, std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, addr, &a.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// Proves the master listens only on its configured address (loopback by default), not on every
// interface: 127.0.0.2 reaches a 0.0.0.0 listener but not one bound to 127.0.0.1; catches the
// unauthenticated store exposed on 0.0.0.0.
TEST(TcpStoreBounds, BindsOnlyTheConfiguredAddress) {
  auto store = Start(TcpStoreOptions{});
  EXPECT_TRUE(Connects("127.0.0.1", store->port()));
  EXPECT_FALSE(Connects("127.0.0.2", store->port()));
  TcpStoreOptions any;
  any.bind_address = "0.0.0.0";
  auto open_store = Start(any);
  EXPECT_TRUE(Connects("127.0.0.2", open_store->port())) << "control: 127.0.0.2 is routable here";
}

// True once pred() holds, polled every 5 ms for at most timeout_ms.
template <typename Pred>
bool Eventually(Pred pred, int timeout_ms = 3000) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

TcpStoreOptions ShortDeadlines(std::uint32_t idle_timeout_ms, std::uint32_t wait_timeout_ms) {
  TcpStoreOptions o;
  o.idle_timeout_ms = idle_timeout_ms;
  o.wait_timeout_ms = wait_timeout_ms;
  return o;
}

// Proves peers that connect and send nothing are closed after idle_timeout_ms and counted, which
// frees connections_max for a worker; catches silent strangers holding every connection forever.
TEST(TcpStoreBounds, SilentConnectionsClosedAfterIdleDeadline) {
  TcpStoreOptions o = ShortDeadlines(200, 10000);
  o.connections_max = 2;
  auto store = Start(o);
  StoreClient silent_a(store->port()), silent_b(store->port());
  ASSERT_TRUE(silent_a.connected() && silent_b.connected());
  EXPECT_TRUE(silent_a.ClosedByServer(3000)) << "a silent connection outlived its idle deadline";
  EXPECT_TRUE(silent_b.ClosedByServer(3000)) << "a silent connection outlived its idle deadline";
  EXPECT_TRUE(Eventually([&] { return store->stats().connections_open == 0; }));
  const TcpStoreStats st = store->stats();
  EXPECT_EQ(st.idle_disconnects, 2u);
  EXPECT_EQ(st.protocol_errors, 0u) << "an idle close is not a protocol error";
  EXPECT_TRUE(StillServes(store->port())) << "the freed slots do not take a worker";
}

// Proves a rank blocked in a WAIT for a key set later is not cut by the idle deadline (while a
// silent peer beside it is) and reads the value once the key is set; catches an idle rule that
// counts a deferred WAIT as silence and breaks the rendezvous of a rank that arrives early.
TEST(TcpStoreBounds, RankWaitingForAKeyIsNotIdle) {
  auto store = Start(ShortDeadlines(300, 10000));
  StoreClient waiter(store->port()), silent(store->port());
  waiter.Type(static_cast<std::uint8_t>(Q::kValidate));
  waiter.Pod<std::uint32_t>(kTcpStoreValidateMagic);
  waiter.Type(static_cast<std::uint8_t>(Q::kWait));
  waiter.Pod<std::uint64_t>(1);
  waiter.Str("/late");
  ASSERT_TRUE(waiter.Flush());
  ASSERT_TRUE(Eventually([&] { return store->stats().waiters == 1; }));
  EXPECT_TRUE(silent.ClosedByServer(3000)) << "control: the idle deadline is not running";
  EXPECT_TRUE(waiter.Silent(1200)) << "the waiting rank was answered or cut before its key was set";
  EXPECT_EQ(store->stats().idle_disconnects, 1u);
  EXPECT_EQ(store->stats().wait_timeouts, 0u);
  ASSERT_TRUE(store->Set("/late", "v").ok());
  std::uint8_t stop = 9;
  ASSERT_TRUE(waiter.Read(&stop));
  EXPECT_EQ(stop, 0);  // STOP_WAITING
  waiter.Type(static_cast<std::uint8_t>(Q::kGet));
  waiter.Str("/late");
  ASSERT_TRUE(waiter.Flush());
  std::string got;
  ASSERT_TRUE(waiter.ReadStr(&got));
  EXPECT_EQ(got, "v");
}

// Proves a deferred WAIT is itself bounded by wait_timeout_ms and counted; catches a WAIT
// exemption without a bound, which lets a peer park connections on a key no one sets.
TEST(TcpStoreBounds, DeferredWaitIsBounded) {
  auto store = Start(ShortDeadlines(2000, 100));
  StoreClient c(store->port());
  c.Type(static_cast<std::uint8_t>(Q::kWait));
  c.Pod<std::uint64_t>(1);
  c.Str("/never");
  ASSERT_TRUE(c.Flush());
  EXPECT_TRUE(c.ClosedByServer(3000)) << "a WAIT on a key no one sets was held past its bound";
  EXPECT_TRUE(Eventually([&] { return store->stats().wait_timeouts == 1; }));
  EXPECT_EQ(store->stats().idle_disconnects, 0u);
}

// Proves a connection that keeps sending valid queries is never cut, over several idle deadlines;
// catches an idle deadline counted from the accept instead of from the last query served.
TEST(TcpStoreBounds, ActiveConnectionIsNeverCut) {
  auto store = Start(ShortDeadlines(250, 10000));
  StoreClient c(store->port());
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1000);
  for (std::uint32_t nonce = 1; std::chrono::steady_clock::now() < until; ++nonce) {
    c.Type(static_cast<std::uint8_t>(Q::kPing));
    c.Pod<std::uint32_t>(nonce);
    ASSERT_TRUE(c.Flush());
    std::uint32_t echo = 0;
    ASSERT_TRUE(c.Read(&echo)) << "an active connection was cut after " << nonce << " pings";
    ASSERT_EQ(echo, nonce);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(store->stats().idle_disconnects, 0u);
}

// Proves bytes trickled into a query that never completes do not keep a connection past the idle
// deadline; catches an idle clock reset by every received byte (one byte per deadline would then
// hold a connection forever).
TEST(TcpStoreBounds, TricklingAnUnfinishedQueryIsIdle) {
  auto store = Start(ShortDeadlines(100, 10000));
  StoreClient c(store->port());
  c.Type(static_cast<std::uint8_t>(Q::kSet));
  c.Str("/slow");
  c.Pod<std::uint64_t>(1000);  // announces a 1000-byte value, then sends it a byte at a time
  ASSERT_TRUE(c.Flush());
  bool closed = false;
  for (int i = 0; i < 300 && !closed; ++i) {
    c.Pod<char>('t');
    (void)c.Flush();  // fails once the server has closed: what counts is the EOF read below
    closed = c.ClosedByServer(10);
  }
  EXPECT_TRUE(closed) << "a trickling peer held its connection for 3 s with a 100 ms deadline";
  EXPECT_TRUE(Eventually([&] { return store->stats().idle_disconnects == 1; }));
}

// Proves zero deadlines are refused when the store starts; catches a 0 that would close every
// connection at once (or be read as "no deadline").
TEST(TcpStoreBounds, ZeroDeadlinesRefused) {
  EXPECT_EQ(TcpStoreServer::Start(ShortDeadlines(0, 1000)).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(TcpStoreServer::Start(ShortDeadlines(1000, 0)).status().code(), Code::kInvalidArgument);
}

// Proves that once the owner ends the rendezvous (Stop) a new connect is refused and the worker's
// connection is closed; catches a Stop that leaves the listener open, where connects complete into
// an accept queue no one serves for the rest of the owner's life.
TEST(TcpStoreBounds, StopRefusesNewConnections) {
  auto store = Start(TcpStoreOptions{});
  ASSERT_TRUE(store->Set(std::string(kUniqueIdWireKey), "id").ok());
  StoreClient worker(store->port());
  worker.Type(static_cast<std::uint8_t>(Q::kGet));
  worker.Str(std::string(kUniqueIdWireKey));
  ASSERT_TRUE(worker.Flush());
  std::string got;
  ASSERT_TRUE(worker.ReadStr(&got));
  EXPECT_EQ(got, "id");
  const std::uint16_t port = store->port();
  store->Stop();
  EXPECT_EQ(store->port(), port);
  EXPECT_TRUE(worker.ClosedByServer());
  EXPECT_FALSE(Connects("127.0.0.1", port)) << "the stopped store still accepts connections";
}

}  // namespace
}  // namespace rc::effects::nccl
