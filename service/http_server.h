// HttpServer: the event-driven HTTP/1.1 front of `rolloutcore serve` (Boost.Beast over Asio).
//
// Why Beast: it is a protocol layer, not a framework — it parses and serialises HTTP/1.1 with
// explicit limits and leaves the event loop, the buffers and the timers to us, so a connection
// costs a socket and a few KiB instead of a thread, back-pressure is the natural shape of an
// async write, and the same library is the upstream client (upstream.h). It ships with Debian.
//
// Model: `io_threads` event loops, each an io_context run by one thread of its own (as nginx's
// workers: one io_context shared by many threads serialises them on its scheduler's lock, and
// measured so, CPU per request rose with every thread added). Accepted connections are handed
// to the loops round-robin; each connection is a Session whose handlers all run on its loop's
// one thread (so they never run at once), and what it starts (engine connections, timers) lives
// on that loop. A Session reads one
// request (idle deadline before its first byte, header deadline for the head, body deadline for the
// body, bounded head and body), hands it to the router as an Exchange, and reads the next request
// only once that Exchange has been answered (keep-alive). Routes are either async (run on the
// loop; they must not block) or blocking (run on a bounded pool: the trainer API's long polls and
// updates), answered back on the loop.
//
// Invariants: an Exchange is answered exactly once (Respond, or StartStream..EndStream); a write
// the client does not take within write_timeout_ms closes the connection; connections beyond
// connections_max are answered 503 and closed; at most SocketsMaxFor(connections_max) client
// sockets are open at once (counted, refused and lingering ones): beyond it the server stops
// accepting (a pause, counted, timed and logged) and connections wait in the listen backlog; a
// request head is at most header_bytes_max bytes and kHeaderFieldsMax fields, whatever its shape
// (431); nothing is buffered beyond one response or one streamed chunk per connection.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/execution/context.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/query.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

#include "effects/thread_start.h"
#include "service/byte_budget.h"
#include "service/head_limits.h"  // kHeaderFieldsMax: a request's, its trailer's included
#include "statemachine/status.h"

namespace rc::service {

namespace bhttp = boost::beast::http;
using HttpRequest = bhttp::request<bhttp::string_body>;
using HttpResponse = bhttp::response<bhttp::string_body>;

// The event loop (io_context) an executor runs on, a strand's included: a key, never dereferenced.
inline const void* EventLoopOf(const boost::asio::any_io_executor& executor) {
  return &boost::asio::query(executor, boost::asio::execution::context);
}

// The client sockets a server with `connections_max` holds open at most: its connections and a
// margin (an eighth, at least 16) for those it refuses with 503 or that linger after their last
// answer. The descriptors serve keeps for its clients.
std::size_t SocketsMaxFor(std::size_t connections_max);

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: ephemeral
  std::size_t io_threads = 2;
  std::size_t connections_max = 4096;       // open connections; beyond: 503 and close
  std::size_t header_bytes_max = 16 << 10;  // request line + headers; beyond: 431
  std::size_t body_bytes_max = 8 << 20;     // beyond: 413
  // Bodies all connections and exchanges hold at once (ByteBudget); a request beyond it: 503.
  // A request body counts its declared Content-Length from the head, a chunked one what its
  // buffer has reserved.
  std::uint64_t body_memory_bytes_max = std::uint64_t{1} << 30;
  std::uint64_t idle_timeout_ms = 5000;     // connection open, no byte of a request yet
  std::uint64_t header_timeout_ms = 10000;  // first byte -> complete head, else 408
  std::uint64_t body_timeout_ms = 30000;    // complete head -> complete body, else 408
  std::uint64_t write_timeout_ms = 60000;   // one write the client does not take: closed
  std::size_t blocking_threads = 16;        // threads running blocking routes
  std::size_t blocking_queue_max = 1024;    // blocking calls queued or running; beyond: 503
  // After a connection's last answer (a refusal's included), until the client's EOF: then closed.
  std::uint64_t linger_ms = 1000;
  // How Start gets the event loops' and the blocking pool's threads (empty: std::thread). Tests
  // give one that refuses some, as the system does when out of threads.
  effects::ThreadStarter thread_starter;
};

// An answer handed to a connection with no hold for its buffer (an error answer, a trainer
// route's JSON, the last bytes of a stream) is held there against body_budget() once its buffer
// passes this many bytes; at or below it, it is held nowhere. A connection writes one answer at a
// time, so at most connections_max times this goes unheld in all (64 MiB at 4,096 connections).
// Error answers and events are a few hundred bytes (fixed text, bounded excerpts of the engine's
// body): they stay below it, as do the small JSON answers of the trainer routes polled most.
inline constexpr std::size_t kAnswerUnheldBytesMax = std::size_t{16} << 10;

// Why a request is answered 503 when the body budget cannot hold what serving it takes: its body,
// the copy of it a pass-through sends, or its answer.
inline constexpr const char* kBodyMemoryRefusal =
    "the bodies other requests hold take the server's memory budget (body_memory_bytes_max); "
    "try again";

struct HttpServerCounters {
  std::atomic<std::uint64_t> accepted{0};
  std::atomic<std::uint64_t> refused_over_budget{0};
  std::atomic<std::uint64_t> accept_errors{0};  // e.g. out of file descriptors
  std::atomic<std::uint64_t> idle_timeouts{0};
  std::atomic<std::uint64_t> header_timeouts{0};
  std::atomic<std::uint64_t> body_timeouts{0};
  std::atomic<std::uint64_t> write_timeouts{0};
  std::atomic<std::uint64_t> bad_requests{0};
  std::atomic<std::uint64_t> blocking_refused{0};
  std::atomic<std::uint64_t> body_memory_refused{0};  // 503: body_memory_bytes_max taken
  std::atomic<std::int64_t> open_connections{0};
  // Times accepting paused: SocketsMaxFor(connections_max) client sockets were open.
  std::atomic<std::uint64_t> accept_pauses{0};
};

class Session;

// A handle on one request of one connection. Copyable; every method runs on the exchange's
// executor (call Post() from other threads). Calls on an exchange that has already ended are
// ignored (a late completion after the client left), never applied to the next request.
class Exchange {
 public:
  Exchange() = default;
  Exchange(std::shared_ptr<Session> session, std::uint64_t serial);

  const HttpRequest& request() const;
  std::string_view path() const;  // the target without its query
  // The header's value when it occurs exactly once; `duplicate` set when it occurs more often.
  std::optional<std::string_view> header(std::string_view name, bool* duplicate = nullptr) const;

  // Answers with a complete response (Content-Length, keep-alive as the request allows).
  void Respond(HttpResponse response);
  // Answers with `response`, whose bytes `hold` holds of body_budget(): the connection keeps the
  // hold until the response is written or the connection ends, so an answer a client is slow to
  // take stays charged while it waits (and none is charged past its write). A body whose buffer
  // passes kAnswerUnheldBytesMax and what `hold` holds is held for the rest there; when the
  // budget cannot give it, the client gets 503 (kBodyMemoryRefusal) instead.
  void Respond(HttpResponse response, BudgetHold hold);
  // A streamed response: the head now, then Write()s, each completing only when the client took
  // the bytes (back-pressure), then End(). `done(false)`: the client is gone or stalled. Chunked
  // to an HTTP/1.1 request; to an HTTP/1.0 one (no chunked coding) the body ends where the
  // connection does, and the connection is not kept alive. A Write's bytes are freed as it
  // completes (written, failed or refused): a caller holding body budget for them gives it back
  // in its `done`.
  using WriteDone = std::function<void(bool delivered)>;
  void StartStream(HttpResponse head, WriteDone done);
  void Write(std::string bytes, WriteDone done);
  void End(std::string last_bytes);
  // End, with `hold` holding `last_bytes` of body_budget() until they are written (as Respond's,
  // which holds what passes kAnswerUnheldBytesMax: last bytes the budget cannot hold are dropped
  // and the connection closes, the client seeing its stream cut).
  void End(std::string last_bytes, BudgetHold hold);
  // A stream's write that waits on the client (its head's, or a Write's) fails now (the
  // connection closes); no-op otherwise.
  void AbandonWrite();
  // Ends an exchange that cannot be answered (a handler failed mid-stream): the connection
  // closes, and the client sees its answer cut. No-op once answered.
  void Close();
  // `on_gone` runs (once, on the executor) if the client closes its connection before the
  // exchange ended. Watching reads the socket; bytes that arrive meanwhile are kept.
  void WatchClient(std::function<void()> on_gone);

  boost::asio::any_io_executor executor() const;
  bool OnItsLoop() const;  // the caller runs on the connection's event loop, inside run()
  void Post(std::function<void()> fn) const;
  // The server's budget for bodies held at once: an exchange holding a body beyond the
  // request's (an engine's answer) takes from it.
  ByteBudget& body_budget() const;

 private:
  std::shared_ptr<Session> session_;
  std::uint64_t serial_ = 0;
};

// A request as blocking handlers see it: the message, the path's captures, the query.
struct ApiRequest {
  const HttpRequest& message;
  std::vector<std::string> captures;  // the path segments matched by '*' in the route
  Exchange exchange;

  const std::string& body() const { return message.body(); }
  std::optional<std::string> query(std::string_view key) const;
  std::string header(std::string_view name) const;  // "" when absent
};

using AsyncHandler = std::function<void(Exchange)>;
using BlockingHandler = std::function<void(const ApiRequest&, HttpResponse&)>;

// Routes: exact paths, or patterns with '*' standing for one non-empty path segment.
class HttpRouter {
 public:
  void Async(bhttp::verb method, std::string pattern, AsyncHandler handler);
  void Blocking(bhttp::verb method, std::string pattern, BlockingHandler handler);
  // Any method and path not matched by a route (read-only pass-through); nullptr: 404.
  void Fallback(AsyncHandler handler) { fallback_ = std::move(handler); }

  struct Match {
    const AsyncHandler* async = nullptr;
    const BlockingHandler* blocking = nullptr;
    std::vector<std::string> captures;
    bool path_known = false;  // some route has this path (another method: 405)
  };
  Match Find(bhttp::verb method, std::string_view path) const;

 private:
  struct Route {
    bhttp::verb method;
    std::vector<std::string> segments;  // pattern split at '/'; "*" captures
    AsyncHandler async;
    BlockingHandler blocking;
  };
  std::vector<Route> routes_;
  AsyncHandler fallback_;
};

class HttpServer {
 public:
  HttpServer(HttpServerOptions options, HttpRouter router);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts the blocking pool's threads, then the io threads (no loop runs, so nothing is
  // posted to the pool, before all of the pool's started). Returns the bound port. A thread the
  // system refuses is Unavailable naming it: the threads started by then are stopped and joined,
  // the listening socket is closed, and the server serves no more (Stop returns at once).
  [[nodiscard]] Result<int> Start();
  // Stops accepting, lets the blocking handlers running end (up to `deadline_ms` from now; their
  // answers are sent), closes every connection, joins the threads. True when every blocking
  // handler returned by then; false leaves the pool's threads running those handlers, and the
  // destructor joins them before it destroys the loops their answers are posted to. A later call
  // gives the handlers an earlier one left running `deadline_ms` more (their answers go to
  // stopped loops, never written) and joins the pool once none runs: true only then, so that
  // whoever owns what the handlers use may destroy it once Stop returned true. Never called from
  // a loop or a pool thread: it joins them.
  bool Stop(std::uint64_t deadline_ms);

  const HttpServerCounters& counters() const { return counters_; }
  // Accepting paused at the socket bound: how long in all (the pause going on included, so the
  // figure only grows) and whether it is paused now.
  struct AcceptPaused {
    std::uint64_t paused_us = 0;
    bool now = false;
  };
  AcceptPaused accept_paused() const;
  const HttpServerOptions& options() const { return options_; }
  ByteBudget& body_budget() { return body_budget_; }
  // The first event loop (the acceptor's): for work that belongs to no connection.
  boost::asio::io_context& io() { return *loops_.front(); }
  std::size_t loop_count() const { return loops_.size(); }

  // Internal (Session): dispatch of a complete request.
  HttpRouter::Match RouteOf(const Exchange& ex) const;
  void Dispatch(const Exchange& exchange);
  void SessionClosed(Session* session);
  HttpServerCounters& mutable_counters() { return counters_; }

 private:
  [[nodiscard]] Status Listen();
  [[nodiscard]] Status StartThreads();
  void AbandonStart();
  void RunLoop(std::size_t loop);
  void Accept();
  void AcceptLater();
  [[nodiscard]] std::optional<std::uint64_t> PauseAccepting();
  void LogAcceptPause(std::uint64_t unlogged) const;
  void RunBlocking(const BlockingHandler* handler, std::vector<std::string> captures,
                   Exchange exchange);
  enum class BlockingSlot { kTaken, kStopping, kFull };
  BlockingSlot TakeBlockingSlot();
  // Stop's steps.
  bool JoinBlocking(std::uint64_t deadline_ms);
  bool WaitBlockingIdle(std::uint64_t timeout_ms);
  void CloseSessions();
  void FlushLoops(std::uint64_t timeout_ms);
  void RunHandler(const BlockingHandler* handler, const std::vector<std::string>& captures,
                  const Exchange& exchange);

  const HttpServerOptions options_;
  const HttpRouter router_;
  const std::size_t sockets_max_;  // SocketsMaxFor(connections_max): sessions at once
  HttpServerCounters counters_;
  ByteBudget body_budget_;  // declared before the sessions and loops: it outlives their holds
  // Before loops_: sessions destroyed with a loop's pending handlers still unregister here.
  mutable std::mutex sessions_mu_;
  std::unordered_map<Session*, std::weak_ptr<Session>> sessions_;
  bool accept_paused_ = false;  // under sessions_mu_: no accept pending, sockets_max_ reached
  // Under sessions_mu_: the pauses' clock, and their warnings' rate (one line per pause, at most
  // one per kAcceptPauseLogIntervalMs; the line says how many pauses went unlogged before it).
  std::chrono::steady_clock::time_point paused_since_;
  std::uint64_t paused_us_ = 0;  // the pauses that ended
  std::optional<std::chrono::steady_clock::time_point> pause_logged_;
  std::uint64_t pauses_unlogged_ = 0;
  std::vector<std::unique_ptr<boost::asio::io_context>> loops_;  // one per io thread
  std::vector<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> guards_;
  std::size_t next_loop_ = 0;  // the acceptor's handler only: the loop of the next connection
  std::optional<boost::asio::ip::tcp::acceptor> acceptor_;  // on loops_[0]; reset before the loops
  std::optional<boost::asio::steady_timer> accept_retry_;   // likewise
  std::vector<std::thread> io_threads_;
  std::atomic<bool> stopping_{false};
  std::mutex stop_mu_;  // one Stop at a time: a later one waits on the pool an earlier one left

  struct BlockingPool;
  std::unique_ptr<BlockingPool> blocking_;
};

// Small response helpers.
HttpResponse MakeResponse(int status, std::string body, std::string_view content_type);
void SetBody(HttpResponse& res, int status, std::string body, std::string_view content_type);

}  // namespace rc::service
