#include "service/upstream.h"

#include <sys/socket.h>

#include <chrono>
#include <optional>
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

// One fresh connect: for a name, a lookup and then a connect to each address it gave in turn;
// for an IP literal, the connect alone. One deadline bounds it all. Every handler runs on the
// exchange's executor, so `finished_` needs no lock: whichever ends first, the chain or the
// deadline, calls `done_`, exactly once. The deadline ends a lookup itself rather than waiting
// for its handler: asio runs the lookups of a loop one at a time on a thread of that loop's own,
// and cancel() skips a lookup not yet started there but cannot stop one in progress (so a slow
// DNS server delays the loop's later lookups, each still bounded by its own deadline).
class Dial : public std::enable_shared_from_this<Dial> {
 public:
  Dial(const asio::any_io_executor& executor, std::uint64_t timeout_ms, UpstreamPool::Ready done)
      : executor_(executor),
        conn_(std::make_unique<UpstreamConn>(LoopExecutor(executor), EventLoopOf(executor))),
        timer_(executor),
        timeout_ms_(timeout_ms),
        done_(std::move(done)) {}

  void ConnectTo(const tcp::endpoint& endpoint) {
    StartDeadline();
    conn_->socket.async_connect(
        endpoint, asio::bind_executor(executor_, [self = shared_from_this()](error_code ec) {
          self->OnConnected(ec);
        }));
  }

  void Resolve(const std::string& host, std::uint16_t port, const UpstreamPool::Resolve& seam) {
    StartDeadline();
    host_ = host;
    resolving_ = true;
    if (seam) return ResolveBy(seam, port);
    resolver_.emplace(LoopExecutor(executor_));
    resolver_->async_resolve(
        host, std::to_string(port),
        asio::bind_executor(executor_, [self = shared_from_this()](
                                           error_code ec, tcp::resolver::results_type results) {
          self->OnResolved(ec ? ec.message() : "", results);
        }));
  }

 private:
  // The test seam's answer, delivered as a lookup's is: later, on the executor.
  void ResolveBy(const UpstreamPool::Resolve& seam, std::uint16_t port) {
    Result<std::vector<tcp::endpoint>> r = seam(host_, port);
    std::string error;
    std::vector<tcp::endpoint> endpoints;
    if (r.ok()) {
      endpoints = std::move(r.value());
    } else {
      error = r.status().message();
    }
    asio::post(executor_,
               [self = shared_from_this(), error = std::move(error),
                endpoints = std::move(endpoints)] { self->OnResolved(error, endpoints); });
  }

  template <typename Endpoints>
  void OnResolved(const std::string& error, const Endpoints& endpoints) {
    if (finished_) return;
    resolving_ = false;
    if (!error.empty() || endpoints.empty()) {
      return Finish(CannotResolve(host_, error.empty() ? "it has no address" : error));
    }
    asio::async_connect(conn_->socket, endpoints,
                        asio::bind_executor(executor_, [self = shared_from_this()](
                                                           error_code ec, const tcp::endpoint&) {
                          self->OnConnected(ec);
                        }));
  }

  void OnConnected(error_code ec) {
    if (finished_) return;
    if (ec) return Finish(Status::Unavailable("connect failed: " + ec.message()));
    conn_->socket.set_option(tcp::no_delay(true), ec);
    Finish(Status::OK());
  }

  void StartDeadline() {
    timer_.expires_after(std::chrono::milliseconds(timeout_ms_));
    timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (!ec) self->OnDeadline();
    });
  }

  void OnDeadline() {
    if (finished_) return;
    if (resolver_) resolver_->cancel();
    error_code ignored;
    conn_->socket.close(ignored);  // a connect in progress completes with an error, ignored
    const std::string after = " timed out after " + std::to_string(timeout_ms_) + " ms";
    Finish(Status::Timeout(resolving_ ? "resolving the engine host '" + text::escape_line(host_) +
                                            "'" + after
                                      : "connect" + after));
  }

  void Finish(Status st) {
    RC_CHECK(!finished_);
    finished_ = true;
    timer_.cancel();
    std::unique_ptr<UpstreamConn> conn = st.ok() ? std::move(conn_) : nullptr;
    UpstreamPool::Ready done = std::move(done_);
    done(std::move(st), std::move(conn), false);
  }

  const asio::any_io_executor executor_;  // the exchange's: every handler runs on it
  std::unique_ptr<UpstreamConn> conn_;
  asio::steady_timer timer_;
  std::optional<tcp::resolver> resolver_;  // a name's lookup only
  const std::uint64_t timeout_ms_;
  UpstreamPool::Ready done_;
  std::string host_;  // a name's, for the messages
  bool resolving_ = false;
  bool finished_ = false;
};

}  // namespace

Status CheckEngineHostResolves(const std::string& host, std::uint16_t port) {
  if (LiteralEndpoint(host, port)) return Status::OK();
  asio::io_context io;
  tcp::resolver resolver(io);
  error_code ec;
  const tcp::resolver::results_type endpoints = resolver.resolve(host, std::to_string(port), ec);
  if (!ec && !endpoints.empty()) return Status::OK();
  return CannotResolve(host, ec ? ec.message() : "it has no address");
}

UpstreamPool::UpstreamPool(std::string host, std::uint16_t port, std::size_t idle_max,
                           std::size_t loops, Resolve resolve)
    : host_(std::move(host)),
      port_(port),
      literal_(LiteralEndpoint(host_, port_)),
      resolve_(std::move(resolve)),
      idle_max_per_loop_((idle_max + loops - 1) / std::max<std::size_t>(loops, 1)) {
  RC_CHECK(!host_.empty() && port_ != 0);
  RC_CHECK(idle_max >= 1 && loops >= 1 && idle_max_per_loop_ >= 1);
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
  auto dial = std::make_shared<Dial>(executor, connect_timeout_ms, std::move(done));
  if (literal_) return dial->ConnectTo(*literal_);
  dial->Resolve(host_, port_, resolve_);
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
