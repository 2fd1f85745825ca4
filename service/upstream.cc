#include "service/upstream.h"

#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include "service/config.h"
#include "service/http_util.h"
#include "statemachine/text.h"

namespace rc::service {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

constexpr std::uint16_t kHttpPortDefault = 80;

// HOST and PORT of an authority ("HOST", "HOST:PORT", "[IPv6]" or "[IPv6]:PORT"); the port is
// kHttpPortDefault when none is given.
Status ParseAuthority(const std::string& url, const std::string& authority, UpstreamTarget& t) {
  const std::size_t colon = authority.rfind(':');
  const bool bracketed = !authority.empty() && authority.front() == '[';
  if (colon == std::string::npos || (bracketed && authority.back() == ']')) {
    t.host = authority;
    t.port = kHttpPortDefault;
  } else {
    t.host = authority.substr(0, colon);
    const auto port = parse_u64(authority.substr(colon + 1));
    if (!port || *port == 0 || *port > kPortMax) {
      return Status::InvalidArgument("engine_url has no valid port: '" + url + "'");
    }
    t.port = static_cast<std::uint16_t>(*port);
  }
  if (t.host.size() > 2 && t.host.front() == '[') t.host = t.host.substr(1, t.host.size() - 2);
  if (t.host.empty()) return Status::InvalidArgument("engine_url has no host: '" + url + "'");
  return Status::OK();
}

}  // namespace

Result<UpstreamTarget> ParseEngineUrl(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) {
    return Status::InvalidArgument("engine_url must start with http:// (got '" + url + "')");
  }
  const std::string rest = url.substr(scheme.size());
  const std::size_t slash = rest.find('/');
  const std::string authority = rest.substr(0, slash);
  UpstreamTarget t;
  t.base_path = slash == std::string::npos ? "" : rest.substr(slash);
  while (!t.base_path.empty() && t.base_path.back() == '/') t.base_path.pop_back();
  RC_RETURN_IF_ERROR(ParseAuthority(url, authority, t));
  t.authority = authority.find(':') == std::string::npos ? authority + ":" + std::to_string(t.port)
                                                         : authority;
  RC_CHECK(!t.host.empty() && t.port != 0);
  return t;
}

namespace {

using error_code = boost::system::error_code;

// The loop's own executor, also when a caller hands a strand of it.
asio::any_io_executor LoopExecutor(const asio::any_io_executor& executor) {
  using Strand = asio::strand<asio::io_context::executor_type>;
  if (const Strand* strand = executor.target<Strand>()) return strand->get_inner_executor();
  return executor;
}

// The address `host` is when it is an IP literal (ParseEngineUrl strips an IPv6 one's brackets).
std::optional<tcp::endpoint> LiteralEndpoint(const std::string& host, std::uint16_t port) {
  error_code ec;
  const asio::ip::address address = asio::ip::make_address(host, ec);
  if (ec) return std::nullopt;
  return tcp::endpoint(address, port);
}

Status CannotResolve(const std::string& host, const std::string& why) {
  return Status::Unavailable("cannot resolve the engine host '" + text::escape_line(host) +
                             "': " + why);
}

// The addresses `host` has now: a blocking lookup (never on an event loop). The error is the
// resolver's own text.
Result<std::vector<tcp::endpoint>> ResolveNow(const std::string& host, std::uint16_t port) {
  if (std::optional<tcp::endpoint> literal = LiteralEndpoint(host, port)) {
    return std::vector<tcp::endpoint>{*literal};
  }
  asio::io_context io;
  tcp::resolver resolver(io);
  error_code ec;
  const tcp::resolver::results_type results = resolver.resolve(host, std::to_string(port), ec);
  if (ec) return Status::Unavailable(ec.message());
  std::vector<tcp::endpoint> endpoints;
  for (const auto& r : results) endpoints.push_back(r.endpoint());
  return endpoints;
}

}  // namespace

// The addresses of a named engine host (upstream.h). Shared with the lookup thread, which may
// outlive the pool: `open` turns false when the pool goes, and nothing is posted after that.
struct UpstreamPool::HostAddresses {
  using Answer = std::function<void(const Result<std::vector<tcp::endpoint>>&)>;
  struct Waiter {
    asio::any_io_executor executor;
    Answer answer;
    std::weak_ptr<void> dial;  // expired: the connect ended (its deadline), nobody waits
  };

  HostAddresses(std::string h, std::uint16_t p, Resolve r)
      : host(std::move(h)), port(p), seam(std::move(r)) {}

  const std::string host;
  const std::uint16_t port;
  const Resolve seam;  // null: the system resolver
  std::mutex mu;
  bool open = true;
  bool looking = false;  // a lookup runs
  bool stale = false;    // a connect to `endpoints` failed: look again
  std::chrono::steady_clock::time_point resolved_at;
  std::vector<tcp::endpoint> endpoints;  // the last that resolved
  std::vector<Waiter> waiters;           // connects with no addresses yet (kAddressWaitersMax)

  // Requires mu. One lookup at a time, on a thread of its own: DNS blocks for as long as it
  // likes, and neither an event loop nor the shutdown may wait for it.
  static void LookUp(const std::shared_ptr<HostAddresses>& self) {
    if (self->looking || !self->open) return;
    self->looking = true;
    try {
      std::thread([self] {
        {
          std::lock_guard<std::mutex> g(self->mu);
          if (!self->open) return (void)(self->looking = false);
        }
        self->Answered(self->seam ? self->seam(self->host, self->port)
                                  : ResolveNow(self->host, self->port));
      }).detach();
    } catch (...) {  // no thread: this lookup fails, and the next connect tries again
      self->looking = false;
      self->Tell(CannotResolve(self->host, "no thread for the lookup"));
    }
  }

  // A lookup that fails keeps the last addresses (a DNS outage is not a move): the connects that
  // waited dial them, and later ones do so at once until a connect to them fails again.
  void Answered(const Result<std::vector<tcp::endpoint>>& r) {
    std::lock_guard<std::mutex> g(mu);
    looking = false;
    if (!open) return;
    if (!r.ok() || r->empty()) {
      if (!endpoints.empty()) {
        stale = false;
        return Tell(endpoints);
      }
      return Tell(CannotResolve(host, r.ok() ? "it has no address" : r.status().message()));
    }
    endpoints = *r;
    resolved_at = std::chrono::steady_clock::now();
    stale = false;
    Tell(endpoints);
  }

  // Requires mu: whether another connect may wait for the lookup.
  bool RoomToWait() {
    waiters.erase(std::remove_if(waiters.begin(), waiters.end(),
                                 [](const Waiter& w) { return w.dial.expired(); }),
                  waiters.end());
    return waiters.size() < kAddressWaitersMax;
  }

  // Requires mu and open: the pool, and so its event loops, live while both hold.
  void Tell(const Result<std::vector<tcp::endpoint>>& r) {
    for (Waiter& w : waiters) {
      asio::post(w.executor, [answer = std::move(w.answer), r] { answer(r); });
    }
    waiters.clear();
  }
};

// One fresh connect: to the addresses it is given (an IP literal's, or the last a name resolved
// to), or, for a name with none yet, to those its lookup answers. One deadline bounds it all.
// Every handler runs on the exchange's executor, so `finished_` needs no lock: whichever ends
// first, the chain or the deadline, calls `done_`, exactly once.
class UpstreamDial : public std::enable_shared_from_this<UpstreamDial> {
 public:
  // A name's: a failed connect has its addresses looked up again (the engine may have moved).
  using Addresses = std::shared_ptr<UpstreamPool::HostAddresses>;
  UpstreamDial(const asio::any_io_executor& executor, std::uint64_t timeout_ms,
               UpstreamPool::Ready done, Addresses addresses)
      : executor_(executor),
        conn_(std::make_unique<UpstreamConn>(LoopExecutor(executor), EventLoopOf(executor))),
        timer_(executor),
        timeout_ms_(timeout_ms),
        done_(std::move(done)),
        addresses_(std::move(addresses)) {}

  void Start() {
    timer_.expires_after(std::chrono::milliseconds(timeout_ms_));
    timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (!ec) self->OnDeadline();
    });
  }

  void ConnectTo(const std::vector<tcp::endpoint>& endpoints) {
    RC_CHECK(!endpoints.empty() && !connecting_);
    connecting_ = true;
    asio::async_connect(conn_->socket, endpoints,
                        asio::bind_executor(executor_, [self = shared_from_this()](
                                                           error_code ec, const tcp::endpoint&) {
                          self->OnConnected(ec);
                        }));
  }

  // What the lookup this connect waits for answers (on the executor; the dial may be gone).
  UpstreamPool::HostAddresses::Answer Await() {
    return [weak = weak_from_this()](const Result<std::vector<tcp::endpoint>>& r) {
      const std::shared_ptr<UpstreamDial> self = weak.lock();
      if (self == nullptr || self->finished_ || self->connecting_) return;
      if (!r.ok()) return self->Finish(r.status());
      self->ConnectTo(*r);
    };
  }

  // A lookup that keeps a waiting connect past kLookupWaitMs (a DNS server that hangs) leaves it
  // to dial `last`, the addresses that worked before.
  void FallBackAfter(std::vector<tcp::endpoint> last) {
    wait_timer_.emplace(executor_);
    wait_timer_->expires_after(std::chrono::milliseconds(kLookupWaitMs));
    wait_timer_->async_wait([self = shared_from_this(), last = std::move(last)](error_code ec) {
      if (ec || self->finished_ || self->connecting_) return;
      self->ConnectTo(last);
    });
  }

  void Fail(Status st) { Finish(std::move(st)); }

 private:
  void OnConnected(error_code ec) {
    if (finished_) return;
    if (ec) {
      LookAgain();
      return Finish(Status::Unavailable("connect failed: " + ec.message()));
    }
    conn_->socket.set_option(tcp::no_delay(true), ec);
    Finish(Status::OK());
  }

  void OnDeadline() {
    if (finished_) return;
    error_code ignored;
    conn_->socket.close(ignored);  // a connect in progress completes with an error, ignored
    LookAgain();
    Finish(Status::Timeout("connect timed out after " + std::to_string(timeout_ms_) + " ms"));
  }

  void LookAgain() {
    if (addresses_ == nullptr) return;
    std::lock_guard<std::mutex> g(addresses_->mu);
    addresses_->stale = true;
    UpstreamPool::HostAddresses::LookUp(addresses_);
  }

  void Finish(Status st) {
    RC_CHECK(!finished_);
    finished_ = true;
    timer_.cancel();
    if (wait_timer_) wait_timer_->cancel();
    std::unique_ptr<UpstreamConn> conn = st.ok() ? std::move(conn_) : nullptr;
    UpstreamPool::Ready done = std::move(done_);
    done(std::move(st), std::move(conn), false);
  }

  const asio::any_io_executor executor_;  // the exchange's: every handler runs on it
  std::unique_ptr<UpstreamConn> conn_;
  asio::steady_timer timer_;
  const std::uint64_t timeout_ms_;
  UpstreamPool::Ready done_;
  const Addresses addresses_;                     // null for an IP literal
  std::optional<asio::steady_timer> wait_timer_;  // waiting for a lookup, with a fallback
  bool connecting_ = false;
  bool finished_ = false;
};

Result<std::vector<tcp::endpoint>> ResolveEngineHost(const std::string& host, std::uint16_t port) {
  Result<std::vector<tcp::endpoint>> r = ResolveNow(host, port);
  if (!r.ok()) return CannotResolve(host, r.status().message());
  if (r->empty()) return CannotResolve(host, "it has no address");
  return r;
}

UpstreamPool::UpstreamPool(std::string host, std::uint16_t port, std::size_t idle_max,
                           std::size_t loops, Resolve resolve, std::uint64_t refresh_ms)
    : literal_(LiteralEndpoint(host, port)),
      addresses_(literal_
                     ? nullptr
                     : std::make_shared<HostAddresses>(std::move(host), port, std::move(resolve))),
      refresh_ms_(refresh_ms),
      idle_max_per_loop_((idle_max + loops - 1) / std::max<std::size_t>(loops, 1)) {
  RC_CHECK(port != 0 && (literal_ || !addresses_->host.empty()));
  RC_CHECK(idle_max >= 1 && loops >= 1 && idle_max_per_loop_ >= 1);
}

// A lookup still running answers nobody.
UpstreamPool::~UpstreamPool() {
  if (addresses_ == nullptr) return;
  std::lock_guard<std::mutex> g(addresses_->mu);
  addresses_->open = false;
  addresses_->waiters.clear();
}

std::size_t UpstreamPool::idle() const {
  std::lock_guard<std::mutex> g(mu_);
  return idle_count_;
}

// The most recently used idle connection whose peer has not closed it (a closed one reads EOF
// at once; one with stray bytes is not at a response boundary either: both are dropped).
std::unique_ptr<UpstreamConn> UpstreamPool::TakeIdle(const void* loop) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = idle_.find(loop);
  if (it == idle_.end()) return nullptr;
  std::deque<std::unique_ptr<UpstreamConn>>& idle = it->second;
  while (!idle.empty()) {
    std::unique_ptr<UpstreamConn> c = std::move(idle.back());
    idle.pop_back();
    RC_CHECK(idle_count_ > 0);
    idle_count_--;
    char probe = 0;
    const ssize_t n = ::recv(c->socket.native_handle(), &probe, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return c;
  }
  return nullptr;
}

void UpstreamPool::Acquire(const asio::any_io_executor& executor, std::uint64_t connect_timeout_ms,
                           Ready done, bool fresh_only) {
  if (std::unique_ptr<UpstreamConn> c = fresh_only ? nullptr : TakeIdle(EventLoopOf(executor))) {
    asio::dispatch(executor, [c = std::move(c), done = std::move(done)]() mutable {
      done(Status::OK(), std::move(c), true);
    });
    return;
  }
  Connect(executor, connect_timeout_ms, std::move(done));
}

void UpstreamPool::Connect(const asio::any_io_executor& executor, std::uint64_t connect_timeout_ms,
                           Ready done) {
  auto dial =
      std::make_shared<UpstreamDial>(executor, connect_timeout_ms, std::move(done), addresses_);
  dial->Start();
  if (literal_) return dial->ConnectTo({*literal_});
  ConnectByName(dial, executor);
}

// The last addresses the name resolved to, at once (looked up again in the background when a
// connect to them failed or they are older than refresh_ms_); with none yet, the
// connect waits for the lookup.
// A connect to addresses that just failed waits for their new lookup instead of failing again
// (an engine that moved is followed as soon as the lookup answers, within the dial's deadline).
void UpstreamPool::ConnectByName(const std::shared_ptr<UpstreamDial>& dial,
                                 const asio::any_io_executor& executor) {
  std::vector<tcp::endpoint> endpoints;
  std::string refused;
  {
    std::lock_guard<std::mutex> g(addresses_->mu);
    HostAddresses& a = *addresses_;
    const bool old =
        std::chrono::steady_clock::now() - a.resolved_at >= std::chrono::milliseconds(refresh_ms_);
    if (a.stale || old || a.endpoints.empty()) HostAddresses::LookUp(addresses_);
    const bool wait = a.endpoints.empty() || (a.stale && a.looking);
    if (!wait) {
      endpoints = a.endpoints;
    } else if (!a.looking) {
      refused = "no lookup could be started";
    } else if (!a.RoomToWait()) {
      refused = "too many connects wait for its lookup";
    } else {
      a.waiters.push_back({executor, dial->Await(), dial});
      if (!a.endpoints.empty()) dial->FallBackAfter(a.endpoints);
      return;
    }
  }
  if (!refused.empty()) return dial->Fail(CannotResolve(addresses_->host, refused));
  dial->ConnectTo(endpoints);
}

void UpstreamPool::SeedAddresses(std::vector<tcp::endpoint> endpoints) {
  if (addresses_ == nullptr || endpoints.empty()) return;
  std::lock_guard<std::mutex> g(addresses_->mu);
  addresses_->endpoints = std::move(endpoints);
  addresses_->resolved_at = std::chrono::steady_clock::now();
}

void UpstreamPool::Release(std::unique_ptr<UpstreamConn> conn) {
  RC_CHECK(conn != nullptr);
  if (!conn->socket.is_open() || conn->buffer.size() != 0) return;
  conn->uses++;
  std::lock_guard<std::mutex> g(mu_);
  std::deque<std::unique_ptr<UpstreamConn>>& idle = idle_[conn->loop];
  if (idle.size() >= idle_max_per_loop_) return;  // closed by its destructor
  idle.push_back(std::move(conn));
  idle_count_++;
  RC_CHECK(idle.size() <= idle_max_per_loop_);
}

}  // namespace rc::service
