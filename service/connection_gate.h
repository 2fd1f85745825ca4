// The connection gate: accepted HTTP connections wait here, without a worker, until their whole
// request head (and the start of the body, up to kGateBodyBytesMax) is in the kernel's receive
// buffer; only then is the connection handed to a worker. A connection that has not sent a byte
// within idle_timeout_ms, or not completed its head within header_timeout_ms, is answered 408 and
// closed; connections beyond connections_max are answered 503 and closed at once.
//
// Why: cpp-httplib 0.11 gives each connection a worker for as long as the client takes to send
// its request (only per-recv timeouts), so a few hundred clients trickling a byte a second held
// every worker. With the gate a worker only ever waits on the engine or the journal, never on a
// client's request bytes.
//
// Keep-alive: every connection serves exactly one request ("Connection: close"). cpp-httplib 0.11
// keeps a connection's keep-alive loop inside its worker and offers no hook to hand the socket
// back between requests, so a kept connection could start its next request with one byte and hold
// the worker again at per-recv timeouts. One request per connection keeps the invariant above for
// every request, at the cost of a loopback connect per request.
//
// Threads: one gate thread (epoll, edge-triggered) owns every held connection; a fixed pool of
// workers serves handed-over connections. One budget (connections_max) counts a connection from
// accept until its worker closes it, so the hand-over queue can never overflow.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <httplib.h>

namespace rc::service {

// cpp-httplib's CPPHTTPLIB_HEADER_MAX_LENGTH: a head that does not end within it is refused (431).
inline constexpr std::size_t kGateHeadBytesMax = 8192;
// Body bytes waited for in the gate (always fits a default receive buffer). A larger body is read
// by its worker under the server's read timeout.
inline constexpr std::size_t kGateBodyBytesMax = 16384;
inline constexpr std::size_t kGateConnectionsMaxLimit = 65536;
// Connections handed from the accept thread to the gate thread per wake-up (the rest next round).
inline constexpr std::size_t kGateAdmitBatchMax = 1024;

struct GateOptions {
  std::uint64_t header_timeout_ms = 10000;  // accept -> complete request head
  std::uint64_t idle_timeout_ms = 5000;     // accept -> first byte
  std::size_t connections_max = 4096;       // held + queued + being served (global budget)
  std::size_t workers = 512;
};

struct GateCounters {
  std::atomic<std::uint64_t> accepted{0};
  std::atomic<std::uint64_t> refused{0};        // over connections_max: 503
  std::atomic<std::uint64_t> header_timeouts{0};  // 408 (idle or header deadline)
  std::atomic<std::uint64_t> head_too_large{0};   // 431
  std::atomic<std::uint64_t> handed_over{0};
};

// A fixed set of workers fed by a FIFO bounded at queue_max. Submit never blocks: it refuses
// (false) when the FIFO is full. Stop runs what is queued, then waits for the workers until a
// deadline.
class WorkerPool {
 public:
  WorkerPool(std::size_t threads, std::size_t queue_max);
  ~WorkerPool();  // requires a Stop that returned true (RC_CHECK)
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  [[nodiscard]] bool Submit(std::function<void()> fn);
  // True when every worker exited (and was joined) by `deadline`; false leaves them running (the
  // pool must then outlive them: the caller leaks it and exits).
  [[nodiscard]] bool Stop(std::chrono::steady_clock::time_point deadline);

 private:
  void Work();

  const std::size_t queue_max_;
  std::mutex mu_;
  std::condition_variable ready_, exited_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::size_t running_ = 0;  // workers not yet returned from Work()
  std::vector<std::thread> workers_;
  bool joined_ = false;
};

class ConnectionGate {
 public:
  // serve(fd) serves one connection and closes fd; it runs on a worker.
  using ServeFn = std::function<void(int fd)>;
  ConnectionGate(GateOptions options, ServeFn serve);
  ~ConnectionGate();  // requires Stop() == true
  ConnectionGate(const ConnectionGate&) = delete;
  ConnectionGate& operator=(const ConnectionGate&) = delete;

  // Takes ownership of an accepted socket. Never blocks (called on the accept thread).
  void Admit(int fd);
  // Closes every held connection, stops the gate thread, then the workers (see WorkerPool::Stop).
  [[nodiscard]] bool Stop(std::chrono::steady_clock::time_point deadline);

  const GateCounters& counters() const { return counters_; }
  std::size_t connections() const { return connections_.load(); }

 private:
  struct Held {
    std::uint64_t id = 0;
    std::chrono::steady_clock::time_point accepted;
    bool got_bytes = false;
    std::size_t head_bytes = 0;  // 0 until the head's end was seen
    std::size_t need_bytes = 0;  // head + the body bytes waited for
    std::string head;            // the raw head, once complete (see CurrentRequestHead)
  };
  struct Due {
    std::chrono::steady_clock::time_point at;
    int fd;
    std::uint64_t id;
  };
  void Loop();
  void TakeAdmitted();
  void Check(int fd, bool peer_closed);
  void ExpireDue(std::chrono::steady_clock::time_point now);
  void Refuse(int fd, std::string_view response);  // answers, closes, releases the budget
  void HandOver(int fd);
  int NextTimeoutMs(std::chrono::steady_clock::time_point now) const;

  const GateOptions options_;
  const ServeFn serve_;
  GateCounters counters_;
  std::atomic<std::size_t> connections_{0};
  int epoll_fd_ = -1;
  int wake_fd_ = -1;

  std::mutex admit_mu_;
  std::vector<int> admitted_;  // accepted, not yet registered by the gate thread
  bool stop_ = false;

  // Gate thread only.
  std::unordered_map<int, Held> held_;
  std::deque<Due> idle_due_, header_due_;  // in accept order, so in deadline order
  std::uint64_t next_id_ = 1;

  WorkerPool pool_;
  std::thread thread_;
  bool stopped_ = false;
};

// The raw request head the gate saw for the connection the calling worker serves (empty outside a
// gated request). Header values read from it are verbatim: cpp-httplib 0.11 percent-decodes the
// values it hands to handlers.
std::string_view CurrentRequestHead();
// The socket the calling worker serves, or -1.
int CurrentConnectionFd();

// The value of header `name` (case-insensitive) in a raw head, trimmed of spaces and tabs:
// nullopt when absent; an error (has_value() with *duplicate set) when it occurs more than once.
struct RawHeader {
  std::optional<std::string> value;
  bool duplicate = false;
};
RawHeader FindRawHeader(std::string_view head, std::string_view name);

// cpp-httplib wired through a gate: a listener (its own httplib::Server, which only accepts) hands
// each accepted socket to the gate; workers serve it with `routes`, a server made by
// MakeRoutesServer() on which the routes are registered and which never listens itself.
class GatedHttpServer {
 public:
  // The server to register routes on. It serves one request per connection (see above).
  static std::unique_ptr<httplib::Server> MakeRoutesServer();

  GatedHttpServer(httplib::Server& routes, GateOptions options);
  ~GatedHttpServer();  // Stop() with no deadline unless Stop() already returned true
  GatedHttpServer(const GatedHttpServer&) = delete;
  GatedHttpServer& operator=(const GatedHttpServer&) = delete;

  // The listener, to set socket options and timeouts on before Bind.
  httplib::Server& listener();
  // Binds host:port (0: ephemeral) with a deep listen backlog. Returns the port, or -1.
  int Bind(const std::string& host, int port, int backlog);
  void Start();  // serves on a background thread
  // Stops accepting, closes held connections, waits for the workers until `deadline`.
  [[nodiscard]] bool Stop(std::chrono::steady_clock::time_point deadline);
  const ConnectionGate& gate() const { return *gate_; }

 private:
  class Listener;
  httplib::Server& routes_;
  std::unique_ptr<ConnectionGate> gate_;
  std::unique_ptr<Listener> listener_;
  std::thread thread_;
  bool stopped_ = false;
};

}  // namespace rc::service
