#include "service/upstream.h"

#include <sys/socket.h>

#include <chrono>

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include "service/config.h"
#include "service/http_util.h"

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

// The loop's own executor, also when a caller hands a strand of it.
asio::any_io_executor LoopExecutor(const asio::any_io_executor& executor) {
  using Strand = asio::strand<asio::io_context::executor_type>;
  if (const Strand* strand = executor.target<Strand>()) return strand->get_inner_executor();
  return executor;
}

}  // namespace

UpstreamPool::UpstreamPool(tcp::endpoint endpoint, std::size_t idle_max, std::size_t loops)
    : endpoint_(std::move(endpoint)),
      idle_max_per_loop_((idle_max + loops - 1) / std::max<std::size_t>(loops, 1)) {
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
  auto conn = std::make_shared<std::unique_ptr<UpstreamConn>>(
      std::make_unique<UpstreamConn>(LoopExecutor(executor), EventLoopOf(executor)));
  auto timer = std::make_shared<asio::steady_timer>(executor);
  timer->expires_after(std::chrono::milliseconds(connect_timeout_ms));
  timer->async_wait([conn](boost::system::error_code ec) {
    if (!ec && *conn) (*conn)->socket.close(ec);  // the connect completes with an error
  });
  UpstreamConn& c = **conn;
  c.socket.async_connect(
      endpoint_, asio::bind_executor(executor, [conn, timer, done = std::move(done),
                                                connect_timeout_ms](boost::system::error_code ec) {
        timer->cancel();
        if (ec == asio::error::operation_aborted || ec == asio::error::bad_descriptor) {
          return done(Status::Timeout("connect timed out after " +
                                      std::to_string(connect_timeout_ms) + " ms"),
                      nullptr, false);
        }
        if (ec) return done(Status::Unavailable("connect failed: " + ec.message()), nullptr, false);
        (*conn)->socket.set_option(tcp::no_delay(true), ec);
        done(Status::OK(), std::move(*conn), false);
      }));
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
