// UpstreamPool: keep-alive connections from the proxy to one engine, bounded.
//
// A connection lives on the event loop of the exchange that opened it, and is reused only by
// exchanges of that loop (each loop keeps its own idle list), so its reads and writes never cross
// threads. Every operation on a connection is started from, and completes on, the event loop of
// the one exchange that holds it (asio::bind_executor). Each of the `loops` event loops keeps at
// most ceil(idle_max / loops) idle connections (so one busy loop cannot take every other loop's
// share); a connection in use belongs to exactly one exchange (the client connection budget
// bounds those). A pooled connection the engine closed meanwhile is detected before reuse.
//
// An engine host that is a name rather than an IP literal is looked up on a thread of its own:
// a fresh connect dials the last addresses it resolved to at once, and the name is looked up
// again in the background when a connect to them failed (the engine may have moved: a restarted
// pod, a Kubernetes Service) or they are older than kAddressesRefreshMs. So an engine whose
// name moves is followed within a retry, a DNS outage keeps the last addresses working, and
// neither an event loop nor the shutdown ever waits on DNS (a lookup still running when the
// pool goes is abandoned). A pooled connection keeps the address it was opened to.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>

#include "statemachine/status.h"

namespace rc::service {

// A response head (64 KiB at most) and the framing around each body read.
inline constexpr std::size_t kUpstreamBufferBytesMax = 192 << 10;
// What one read from the engine may take. Beast reads what the buffer has room for, 512 bytes
// from an empty one: an answer of a few KiB then took a read (and a pass of the event loop) per
// 512 bytes. Kept for the connection's life: 10,000 held streams hold 80 MiB of it.
inline constexpr std::size_t kUpstreamReadHintBytes = 8 << 10;

struct UpstreamConn {
  // `executor`: the opening exchange's event loop (a connection outlives the exchange, and every
  // operation runs on the loop of the exchange that holds it).
  UpstreamConn(const boost::asio::any_io_executor& executor, const void* loop)
      : socket(executor), loop(loop) {
    buffer.reserve(kUpstreamReadHintBytes);
  }
  boost::asio::ip::tcp::socket socket;
  const void* loop;  // that event loop (a key, never dereferenced)
  // Bytes read past the last response. Bounded: Beast's limits do not count an answer's
  // chunk-size lines or trailer, so an engine sending one without end is cut off here.
  boost::beast::flat_buffer buffer{kUpstreamBufferBytesMax};
  std::uint64_t uses = 0;
};

struct UpstreamTarget {
  std::string host;  // as in the engine URL (the Host header)
  std::uint16_t port = 0;
  std::string authority;  // "HOST:PORT", the Host header of every request to the engine
  std::string base_path;  // URL path prefix ("" for none)
};

// Parses "http://HOST[:PORT][/PREFIX]". Only plain HTTP: the engine sits on a private network
// or loopback beside the executor (docs/security.md).
[[nodiscard]] Result<UpstreamTarget> ParseEngineUrl(const std::string& url);

// The addresses `host` has now, as a fresh connect would look them up. Blocking: for the start
// (a typo in an engine URL fails it), never on an event loop. The error is a fresh connect's.
[[nodiscard]] Result<std::vector<boost::asio::ip::tcp::endpoint>> ResolveEngineHost(
    const std::string& host, std::uint16_t port);

// How often a name's addresses are looked up again while connects find them working.
inline constexpr std::uint64_t kAddressesRefreshMs = 5000;
// How long a connect waits for a name's new lookup before it dials the last addresses instead.
inline constexpr std::uint64_t kLookupWaitMs = 250;
// Fresh connects that may wait for a name's lookup at once (the rest are refused).
inline constexpr std::size_t kAddressWaitersMax = 1024;

class UpstreamDial;

class UpstreamPool {
 public:
  // The addresses a name stands for, in the order to try. Tests only, in place of the system
  // resolver; called on the lookup's own thread.
  using Resolve = std::function<Result<std::vector<boost::asio::ip::tcp::endpoint>>(
      const std::string& host, std::uint16_t port)>;

  // `host`: an IP literal, connected to as is, or a name (see above).
  UpstreamPool(std::string host, std::uint16_t port, std::size_t idle_max, std::size_t loops,
               Resolve resolve = nullptr, std::uint64_t refresh_ms = kAddressesRefreshMs);
  ~UpstreamPool();
  UpstreamPool(const UpstreamPool&) = delete;
  UpstreamPool& operator=(const UpstreamPool&) = delete;

  // A connection: an idle one (reused = true) or a fresh one resolving and connecting within
  // connect_timeout_ms (a name that does not resolve: Unavailable);
  // `fresh_only`: never a pooled one (the retry after a pooled one turned out closed, since the
  // next pooled one may have been closed by the same engine timeout). `done` runs on `executor`.
  using Ready = std::function<void(Status, std::unique_ptr<UpstreamConn>, bool reused)>;
  void Acquire(const boost::asio::any_io_executor& executor, std::uint64_t connect_timeout_ms,
               Ready done, bool fresh_only = false);
  // A name's addresses as the start resolved them: the first connects need no lookup.
  void SeedAddresses(std::vector<boost::asio::ip::tcp::endpoint> endpoints);
  // Returns a connection whose last response was read completely (keep-alive).
  void Release(std::unique_ptr<UpstreamConn> conn);

  std::size_t idle() const;

 private:
  friend class UpstreamDial;
  struct HostAddresses;
  std::unique_ptr<UpstreamConn> TakeIdle(const void* loop);
  void Connect(const boost::asio::any_io_executor& executor, std::uint64_t connect_timeout_ms,
               Ready done);
  void ConnectByName(const std::shared_ptr<UpstreamDial>& dial,
                     const boost::asio::any_io_executor& executor);

  const std::optional<boost::asio::ip::tcp::endpoint> literal_;  // when the host is an IP literal
  const std::shared_ptr<HostAddresses> addresses_;               // when it is a name
  const std::uint64_t refresh_ms_;
  const std::size_t idle_max_per_loop_;
  mutable std::mutex mu_;
  std::map<const void*, std::deque<std::unique_ptr<UpstreamConn>>> idle_;  // by event loop
  std::size_t idle_count_ = 0;                                             // in all loops
};

}  // namespace rc::service
