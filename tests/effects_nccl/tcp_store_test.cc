#include "effects/nccl/tcp_store.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>

#include "effects/nccl/rendezvous.h"
#include "tests/effects_nccl/store_client.h"

namespace rc::effects::nccl {
namespace {

using testing::StoreClient;
using Q = StoreQuery;

std::unique_ptr<TcpStoreServer> StartStore(TcpStoreOptions o = {}) {
  o.bind_address = "127.0.0.1";
  auto s = TcpStoreServer::Start(o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(*s);
}

void Validate(StoreClient& c) {
  c.Type(static_cast<std::uint8_t>(Q::kValidate));
  c.Pod<std::uint32_t>(kTcpStoreValidateMagic);
}

// Proves a worker's exact vLLM sequence (VALIDATE, PING, ADD init/, WAIT, GET) receives the pickled
// id byte for byte; catches framing errors (length widths, reply types, the "/" key prefix).
TEST(TcpStore, VllmWorkerSequenceGetsPickledId) {
  auto store = StartStore();
  UniqueIdBytes id;
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<std::uint8_t>(i * 7 + 3);
  const std::string pickled = PickleNcclUniqueId(id);
  ASSERT_TRUE(store->Set(std::string(kUniqueIdWireKey), pickled).ok());
  StoreClient c(store->port());
  ASSERT_TRUE(c.connected());
  Validate(c);
  c.Type(static_cast<std::uint8_t>(Q::kPing));
  c.Pod<std::uint32_t>(424242);
  c.Type(static_cast<std::uint8_t>(Q::kAdd));
  c.Str("init/");
  c.Pod<std::int64_t>(1);
  c.Type(static_cast<std::uint8_t>(Q::kWait));
  c.Pod<std::uint64_t>(1);
  c.Str(std::string(kUniqueIdWireKey));
  c.Type(static_cast<std::uint8_t>(Q::kGet));
  c.Str(std::string(kUniqueIdWireKey));
  ASSERT_TRUE(c.Flush());
  std::uint32_t nonce = 0;
  ASSERT_TRUE(c.Read(&nonce));
  EXPECT_EQ(nonce, 424242u);
  std::int64_t count = 0;
  ASSERT_TRUE(c.Read(&count));
  EXPECT_EQ(count, 1);
  std::uint8_t wait = 9;
  ASSERT_TRUE(c.Read(&wait));
  EXPECT_EQ(wait, 0);  // STOP_WAITING
  std::string got;
  ASSERT_TRUE(c.ReadStr(&got));
  EXPECT_EQ(got, pickled);
  EXPECT_EQ(store->Get("init/").value_or(""), "1");
}

// Proves WAIT is deferred until a SET from another client (or the server) and then answered;
// catches a master that replies immediately or never wakes waiters.
TEST(TcpStore, WaitIsDeferredUntilSet) {
  auto store = StartStore();
  StoreClient waiter(store->port()), setter(store->port());
  Validate(waiter);
  waiter.Type(static_cast<std::uint8_t>(Q::kWait));
  waiter.Pod<std::uint64_t>(2);
  waiter.Str("/a");
  waiter.Str("/b");
  ASSERT_TRUE(waiter.Flush());
  EXPECT_TRUE(waiter.Silent(200));
  setter.Type(static_cast<std::uint8_t>(Q::kSet));
  setter.Str("/a");
  setter.Str("1");
  ASSERT_TRUE(setter.Flush());
  EXPECT_TRUE(waiter.Silent(200));          // only one of two keys
  ASSERT_TRUE(store->Set("/b", "2").ok());  // server-side set wakes too
  std::uint8_t r = 9;
  ASSERT_TRUE(waiter.Read(&r));
  EXPECT_EQ(r, 0);
}

// Proves CANCEL_WAIT answers WAIT_CANCELED (1) and drops the registration; catches a master that
// later sends a stray STOP_WAITING to a client that gave up.
TEST(TcpStore, CancelWait) {
  auto store = StartStore();
  StoreClient c(store->port());
  c.Type(static_cast<std::uint8_t>(Q::kWait));
  c.Pod<std::uint64_t>(1);
  c.Str("/never");
  c.Type(static_cast<std::uint8_t>(Q::kCancelWait));
  ASSERT_TRUE(c.Flush());
  std::uint8_t r = 9;
  ASSERT_TRUE(c.Read(&r));
  EXPECT_EQ(r, 1);
  ASSERT_TRUE(store->Set("/never", "x").ok());
  EXPECT_TRUE(c.Silent(200));
}

// Proves ADD stores decimal ASCII and accumulates (negative deltas too), and CHECK / GETNUMKEYS /
// DELETE_KEY answer with the documented widths; catches binary counters or wrong reply types.
TEST(TcpStore, AddCheckDeleteNumKeys) {
  auto store = StartStore();
  StoreClient c(store->port());
  for (std::int64_t d : {5, 7, -2}) {
    c.Type(static_cast<std::uint8_t>(Q::kAdd));
    c.Str("/n");
    c.Pod<std::int64_t>(d);
  }
  c.Type(static_cast<std::uint8_t>(Q::kCheck));
  c.Pod<std::uint64_t>(2);
  c.Str("/n");
  c.Str("/missing");
  c.Type(static_cast<std::uint8_t>(Q::kCheck));
  c.Pod<std::uint64_t>(1);
  c.Str("/n");
  c.Type(static_cast<std::uint8_t>(Q::kGetNumKeys));
  c.Type(static_cast<std::uint8_t>(Q::kDeleteKey));
  c.Str("/n");
  c.Type(static_cast<std::uint8_t>(Q::kDeleteKey));
  c.Str("/n");
  c.Type(static_cast<std::uint8_t>(Q::kGetNumKeys));
  ASSERT_TRUE(c.Flush());
  std::int64_t v = 0;
  ASSERT_TRUE(c.Read(&v));
  EXPECT_EQ(v, 5);
  ASSERT_TRUE(c.Read(&v));
  EXPECT_EQ(v, 12);
  ASSERT_TRUE(c.Read(&v));
  EXPECT_EQ(v, 10);
  std::uint8_t ready = 9;
  ASSERT_TRUE(c.Read(&ready));
  EXPECT_EQ(ready, 1);  // NOT_READY
  ASSERT_TRUE(c.Read(&ready));
  EXPECT_EQ(ready, 0);  // READY
  ASSERT_TRUE(c.Read(&v));
  EXPECT_EQ(v, 1);
  ASSERT_TRUE(c.Read(&v));
  EXPECT_EQ(v, 1);
  ASSERT_TRUE(c.Read(&v));
  EXPECT_EQ(v, 0);
  ASSERT_TRUE(c.Read(&v));
  EXPECT_EQ(v, 0);
}

// Proves MULTI_SET/MULTI_GET, APPEND and COMPARE_SET follow c10d semantics; catches reordered
// replies or compare-set that overwrites on mismatch.
TEST(TcpStore, MultiAppendCompareSet) {
  auto store = StartStore();
  StoreClient c(store->port());
  c.Type(static_cast<std::uint8_t>(Q::kMultiSet));
  c.Pod<std::uint64_t>(2);
  c.Str("/x");
  c.Str("ab");
  c.Str("/y");
  c.Str("");
  c.Type(static_cast<std::uint8_t>(Q::kAppend));
  c.Str("/x");
  c.Str("cd");
  c.Type(static_cast<std::uint8_t>(Q::kMultiGet));
  c.Pod<std::uint64_t>(2);
  c.Str("/y");
  c.Str("/x");
  c.Type(static_cast<std::uint8_t>(Q::kCompareSet));
  c.Str("/x");
  c.Str("zz");
  c.Str("new");  // mismatch: returns current
  c.Type(static_cast<std::uint8_t>(Q::kCompareSet));
  c.Str("/x");
  c.Str("abcd");
  c.Str("new");  // match: returns desired
  ASSERT_TRUE(c.Flush());
  std::string s;
  ASSERT_TRUE(c.ReadStr(&s));
  EXPECT_EQ(s, "");
  ASSERT_TRUE(c.ReadStr(&s));
  EXPECT_EQ(s, "abcd");
  ASSERT_TRUE(c.ReadStr(&s));
  EXPECT_EQ(s, "abcd");
  ASSERT_TRUE(c.ReadStr(&s));
  EXPECT_EQ(s, "new");
  EXPECT_EQ(store->Get("/x").value_or(""), "new");
}

// Proves a wrong VALIDATE magic, an oversize key and an unknown query type each disconnect only
// the offender while other clients keep being served; catches a master that trusts lengths.
TEST(TcpStore, ProtocolViolationsDisconnectOnlyTheOffender) {
  TcpStoreOptions o;
  o.key_bytes_max = 16;
  auto store = StartStore(o);
  StoreClient good(store->port());
  {
    StoreClient bad(store->port());
    bad.Type(static_cast<std::uint8_t>(Q::kValidate));
    bad.Pod<std::uint32_t>(0xdeadbeef);
    ASSERT_TRUE(bad.Flush());
    EXPECT_TRUE(bad.ClosedByServer());
  }
  {
    StoreClient bad(store->port());
    bad.Type(static_cast<std::uint8_t>(Q::kSet));
    bad.Pod<std::uint64_t>(1ull << 40);  // claims a 1 TiB key
    ASSERT_TRUE(bad.Flush());
    EXPECT_TRUE(bad.ClosedByServer());
  }
  {
    StoreClient bad(store->port());
    bad.Type(200);
    ASSERT_TRUE(bad.Flush());
    EXPECT_TRUE(bad.ClosedByServer());
  }
  good.Type(static_cast<std::uint8_t>(Q::kPing));
  good.Pod<std::uint32_t>(7);
  ASSERT_TRUE(good.Flush());
  std::uint32_t n = 0;
  ASSERT_TRUE(good.Read(&n));
  EXPECT_EQ(n, 7u);
  EXPECT_GE(store->stats().protocol_errors, 3u);
}

// Proves GET of a missing key closes the connection instead of inventing a value; catches a
// master that answers an empty string (a worker would unpickle garbage).
TEST(TcpStore, GetMissingKeyDisconnects) {
  auto store = StartStore();
  StoreClient c(store->port());
  c.Type(static_cast<std::uint8_t>(Q::kGet));
  c.Str("/nope");
  ASSERT_TRUE(c.Flush());
  EXPECT_TRUE(c.ClosedByServer());
}

// Proves the connection bound: the (max+1)-th client is closed at once; catches unbounded accept.
TEST(TcpStore, ConnectionsBounded) {
  TcpStoreOptions o;
  o.connections_max = 2;
  auto store = StartStore(o);
  StoreClient a(store->port()), b(store->port());
  a.Type(static_cast<std::uint8_t>(Q::kPing));
  a.Pod<std::uint32_t>(1);
  ASSERT_TRUE(a.Flush());
  b.Type(static_cast<std::uint8_t>(Q::kPing));
  b.Pod<std::uint32_t>(2);
  ASSERT_TRUE(b.Flush());
  std::uint32_t n;
  ASSERT_TRUE(a.Read(&n));
  ASSERT_TRUE(b.Read(&n));
  StoreClient c(store->port());
  EXPECT_TRUE(c.ClosedByServer());
  EXPECT_EQ(store->stats().connections_refused, 1u);
}

// Proves Stop() returns promptly with a client parked in WAIT; catches a shutdown that hangs.
TEST(TcpStore, StopWithWaiterIsBounded) {
  auto store = StartStore();
  StoreClient c(store->port());
  c.Type(static_cast<std::uint8_t>(Q::kWait));
  c.Pod<std::uint64_t>(1);
  c.Str("/never");
  ASSERT_TRUE(c.Flush());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(store->stats().waiters, 1u);
  const auto t0 = std::chrono::steady_clock::now();
  store->Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_TRUE(c.ClosedByServer());
}

// Proves a query split across many TCP segments is reassembled; catches a parser that assumes
// one recv() holds one whole query.
TEST(TcpStore, ByteByByteFraming) {
  auto store = StartStore();
  StoreClient c(store->port());
  StoreClient helper(store->port());
  // Build the whole query in `helper`'s buffer format, then send it one byte at a time via c.
  std::string q;
  auto put = [&q](const void* p, std::size_t n) { q.append(static_cast<const char*>(p), n); };
  std::uint8_t t = static_cast<std::uint8_t>(Q::kSet);
  put(&t, 1);
  std::uint64_t n = 3;
  put(&n, 8);
  q += "/kk";
  n = 5;
  put(&n, 8);
  q += "hello";
  for (char ch : q) {
    c.Pod<char>(ch);
    ASSERT_TRUE(c.Flush());
  }
  for (int i = 0; i < 100 && !store->Get("/kk"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(store->Get("/kk").value_or(""), "hello");
}

}  // namespace
}  // namespace rc::effects::nccl
