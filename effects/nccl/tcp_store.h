// A c10d TCPStore master speaking the wire protocol torch's TCPStore client uses
// (docs/vllm-protocol.md §5; checked against torch 2.11's own client).
//
// Grammar (client -> server; integers little-endian host order):
//   query    := u8 type payload
//   string   := u64 length byte*                 (keys and values alike)
//   VALIDATE(0)    u32 magic(0x3C85F7CE)          -> (no reply; wrong magic closes the connection)
//   SET(1)         key value                      -> (no reply; wakes waiters)
//   COMPARE_SET(2) key expected desired           -> string (value after the operation)
//   GET(3)         key                            -> string  (missing key closes the connection)
//   ADD(4)         key i64 delta                  -> i64 new value (stored as decimal ASCII)
//   CHECK(5)       u64 n key*n                    -> u8 READY(0) | NOT_READY(1)
//   WAIT(6)        u64 n key*n                    -> u8 STOP_WAITING(0), now or once all exist
//   GETNUMKEYS(7)                                 -> i64
//   DELETE_KEY(8)  key                            -> i64 number deleted
//   APPEND(9)      key value                      -> (no reply; wakes waiters)
//   MULTI_GET(10)  u64 n key*n                    -> string*n
//   MULTI_SET(11)  u64 n (key value)*n            -> (no reply; wakes waiters)
//   CANCEL_WAIT(12)                               -> u8 WAIT_CANCELED(1)
//   PING(13)       u32 nonce                      -> u32 nonce
// Keys are raw wire keys: torch's client prefixes user keys with "/" (but not "init/").
//
// One thread serves every connection with poll(), reading at most one buffer per connection per
// round, so no peer can keep it (and the lock that Set and stats() share) to itself. Every
// resource is bounded BEFORE it is allocated (connections, key and value sizes, stored keys and
// stored bytes, buffered input/output per connection and across all connections, the size of a
// reply computed before it is built); a client that breaks a bound or the grammar is
// disconnected, and an allocation failure while serving one connection drops that connection
// only. The store never grows beyond its limits.
//
// A connection that completes no query for idle_timeout_ms is closed, so peers that connect during
// the init window and stay silent cannot hold every one of connections_max while the engine's
// ranks are refused. A rank blocked in a deferred WAIT is not idle (the key may come from a rank
// that has not got there yet); its wait is bounded by wait_timeout_ms instead. A peer that keeps
// sending queries keeps its connection: without credentials it cannot be told from a rank, so the
// bind address and the store's short life bound it. The master serves one rendezvous: its owner
// calls Stop() once the rendezvous is over, which closes the listener too, so a later connect is
// refused.
//
// The master is unauthenticated (torch's protocol has no credentials), so it binds to one address
// (the rendezvous host, loopback by default) and the rendezvous key is write-once and master-only:
// the server-side Set writes it once; any client SET / COMPARE_SET / ADD / APPEND / MULTI_SET /
// DELETE_KEY naming it is refused, before or after it is set (so no peer can race the master). A
// refusal is signalled as torch's own master signals a failed query: the connection is closed
// (there is no error reply on this wire). The legitimate flow (master Set, then workers VALIDATE,
// PING, ADD init/, WAIT, GET) never writes the key from a client and is unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "effects/nccl/rendezvous.h"
#include "statemachine/status.h"

namespace rc::effects::nccl {

inline constexpr std::uint32_t kTcpStoreValidateMagic = 0x3C85F7CE;

enum class StoreQuery : std::uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kGetNumKeys = 7,
  kDeleteKey = 8,
  kAppend = 9,
  kMultiGet = 10,
  kMultiSet = 11,
  kCancelWait = 12,
  kPing = 13,
};

struct TcpStoreOptions {
  // IPv4 address to listen on: the rendezvous host the engine's workers are told to reach.
  // "0.0.0.0" listens on every interface; only configure it deliberately.
  std::string bind_address = "127.0.0.1";
  std::uint16_t port = 0;  // 0: an ephemeral port (see port())
  std::size_t connections_max = 256;
  std::size_t key_bytes_max = 4096;
  std::size_t value_bytes_max = 1u << 20;       // the rendezvous value is 223 bytes
  std::size_t keys_max = 65536;                 // stored keys
  std::size_t store_bytes_max = 64u << 20;      // stored keys + values, all together
  std::size_t keys_per_query_max = 1024;        // CHECK / WAIT / MULTI_*
  std::size_t query_bytes_max = 4u << 20;       // one query's encoding (buffered input)
  std::size_t output_bytes_max = 4u << 20;      // unread replies per connection
  std::size_t buffered_bytes_max = 128u << 20;  // input + output + waits, all connections
  // Wire keys only the server-side Set may write, once; no client may write or delete them.
  std::vector<std::string> write_once_keys = {std::string(kUniqueIdWireKey)};
  // A connection that completes no query for this long is closed (checked once per poll tick, so
  // it goes within idle_timeout_ms + 100 ms). torch's client sends its queries back to back
  // (VALIDATE, PING, ADD init/ as it connects; WAIT, GET once its communicator asks for the id), so
  // its silences last milliseconds. The bytes of a query still incomplete do not count: trickling
  // one byte at a time does not keep a connection. Time spent in a deferred WAIT does not count
  // either, and the clock restarts when the WAIT is answered.
  std::uint32_t idle_timeout_ms = 30000;
  // A WAIT deferred this long is closed. torch's client gives up after its store timeout (300 s in
  // vLLM's StatelessProcessGroup) and sends CANCEL_WAIT; only a peer that ignores its own deadline
  // waits longer.
  std::uint32_t wait_timeout_ms = 300000;
};

struct TcpStoreStats {
  std::uint64_t connections_accepted = 0;
  std::uint64_t connections_refused = 0;  // over connections_max
  std::uint64_t protocol_errors = 0;      // disconnected for a grammar or bound violation
  std::uint64_t queries = 0;
  std::uint64_t write_once_refusals = 0;  // writes or deletes of a write-once key
  std::uint64_t budget_refusals = 0;      // a store, reply or buffer bound would be passed
  std::uint64_t allocation_failures = 0;  // bad_alloc while serving a connection (dropped)
  std::uint64_t idle_disconnects = 0;     // closed after idle_timeout_ms without a query
  std::uint64_t wait_timeouts = 0;        // closed after a WAIT deferred for wait_timeout_ms
  std::size_t stored_bytes = 0;
  std::size_t connections_open = 0;
  std::size_t waiters = 0;
};

class TcpStoreServer {
 public:
  [[nodiscard]] static Result<std::unique_ptr<TcpStoreServer>> Start(
      const TcpStoreOptions& options);
  ~TcpStoreServer();  // Stop()
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  std::uint16_t port() const { return port_; }
  // Server-side access with wire keys; Set wakes waiting clients. Set is bounded like a client's
  // SET and refuses to change a write-once key that already holds a value.
  [[nodiscard]] Status Set(const std::string& wire_key, const std::string& value);
  std::optional<std::string> Get(const std::string& wire_key) const;
  // Closes every connection, joins the serving thread and closes the listener, so a later connect
  // is refused rather than left in the accept queue. Idempotent; bounded by one poll tick plus one
  // serving round (at most one receive per connection). port() stays what it was.
  void Stop();
  TcpStoreStats stats() const;

  struct Impl;

 private:
  explicit TcpStoreServer(std::unique_ptr<Impl> impl, std::uint16_t port);
  std::unique_ptr<Impl> impl_;
  std::uint16_t port_ = 0;
};

// The server's frame handler without sockets or a thread, for tests and fuzzing: one store
// (TcpStoreServer's own Impl and bounds) and `connections` in-memory connections. Feed hands bytes
// to a connection as the serving thread does after recv() (bounded by the same receive room, every
// complete query served); TakeOutput drains what the server would send; SetServer is
// TcpStoreServer::Set plus the wake-up the serving thread would run.
class TcpStoreFrameHarness {
 public:
  TcpStoreFrameHarness(const TcpStoreOptions& options, std::size_t connections);
  ~TcpStoreFrameHarness();
  TcpStoreFrameHarness(const TcpStoreFrameHarness&) = delete;
  TcpStoreFrameHarness& operator=(const TcpStoreFrameHarness&) = delete;

  void Feed(std::size_t conn, const char* data, std::size_t size);
  std::string TakeOutput(std::size_t conn);
  bool closed(std::size_t conn) const;   // dropped for a grammar or bound violation
  bool waiting(std::size_t conn) const;  // holds a deferred WAIT
  [[nodiscard]] Status SetServer(const std::string& wire_key, const std::string& value);
  std::optional<std::string> Get(const std::string& wire_key) const;
  TcpStoreStats stats() const;
  // "" when the store is within its bounds and its byte count is exact; else what is wrong.
  std::string CheckInvariants() const;

 private:
  std::unique_ptr<TcpStoreServer::Impl> impl_;
};

}  // namespace rc::effects::nccl
