#include "service/connection_gate.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <climits>

#include <spdlog/spdlog.h>

#include "statemachine/status.h"

namespace rc::service {
namespace {

using Clock = std::chrono::steady_clock;
inline constexpr int kEpollEventsMax = 256;
inline constexpr int kLoopWakeMsMax = 1000;  // bounds a missed wake-up

thread_local int t_fd = -1;
thread_local std::string_view t_head;

constexpr std::string_view kRefusedFull =
    "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
    "Content-Length: 81\r\nConnection: close\r\n\r\n"
    "{\"error\":{\"message\":\"too many connections\",\"type\":\"unavailable\",\"code\":503}}\n";
constexpr std::string_view kRefusedTimeout =
    "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
    "Content-Length: 89\r\nConnection: close\r\n\r\n"
    "{\"error\":{\"message\":\"request head not received in time\",\"type\":\"timeout\","
    "\"code\":408}}\n";
constexpr std::string_view kRefusedTooLarge =
    "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
    "Content-Length: 80\r\nConnection: close\r\n\r\n"
    "{\"error\":{\"message\":\"request head too large\",\"type\":\"too_large\",\"code\":431}}\n";

char lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Body bytes to wait for in the gate: Content-Length capped at kGateBodyBytesMax; none when the
// client waits for "100 Continue" (it sends the body only after the worker answers) or sends a
// chunked or malformed body (the worker reads or refuses it).
std::size_t body_bytes_to_wait(std::string_view head) {
  if (FindRawHeader(head, "Expect").value.has_value()) return 0;
  const RawHeader cl = FindRawHeader(head, "Content-Length");
  if (!cl.value || cl.duplicate) return 0;
  std::uint64_t n = 0;
  const std::string& v = *cl.value;
  const auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || ptr != v.data() + v.size()) return 0;
  return static_cast<std::size_t>(std::min<std::uint64_t>(n, kGateBodyBytesMax));
}

void close_fd(int fd) {
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
}

}  // namespace

std::string_view CurrentRequestHead() { return t_head; }
int CurrentConnectionFd() { return t_fd; }

RawHeader FindRawHeader(std::string_view head, std::string_view name) {
  RawHeader out;
  std::size_t pos = head.find("\r\n");  // skip the request line
  while (pos != std::string_view::npos && pos + 2 < head.size()) {
    const std::size_t begin = pos + 2;
    const std::size_t end = head.find("\r\n", begin);
    const std::string_view line =
        head.substr(begin, end == std::string_view::npos ? head.size() - begin : end - begin);
    pos = end;
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos || !iequals(line.substr(0, colon), name)) continue;
    if (out.value) {
      out.duplicate = true;
      return out;
    }
    out.value = std::string(trim(line.substr(colon + 1)));
  }
  return out;
}

// ---- WorkerPool ----

WorkerPool::WorkerPool(std::size_t threads, std::size_t queue_max) : queue_max_(queue_max) {
  RC_CHECK(threads > 0 && queue_max > 0);
  workers_.reserve(threads);
  running_ = threads;
  for (std::size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { Work(); });
}

WorkerPool::~WorkerPool() { RC_CHECK(joined_); }

bool WorkerPool::Submit(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || jobs_.size() >= queue_max_) return false;
    jobs_.push_back(std::move(fn));
  }
  ready_.notify_one();
  return true;
}

bool WorkerPool::Stop(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  stop_ = true;
  ready_.notify_all();
  const auto done = [&] { return running_ == 0; };
  if (deadline == Clock::time_point::max()) {
    exited_.wait(lock, done);
  } else if (!exited_.wait_until(lock, deadline, done)) {
    return false;
  }
  lock.unlock();
  if (!joined_) {
    for (auto& t : workers_) t.join();  // each has returned from Work()
    joined_ = true;
  }
  return true;
}

void WorkerPool::Work() {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ready_.wait(lock, [&] { return !jobs_.empty() || stop_; });
      if (jobs_.empty()) {  // stop_ and nothing left
        if (--running_ == 0) exited_.notify_all();
        return;
      }
      fn = std::move(jobs_.front());
      jobs_.pop_front();
    }
    fn();
  }
}

// ---- ConnectionGate ----

ConnectionGate::ConnectionGate(GateOptions options, ServeFn serve)
    : options_(options),
      serve_(std::move(serve)),
      // Every connection in the queue is counted in connections_ (<= connections_max), so a
      // hand-over never finds the queue full.
      pool_(options.workers, options.connections_max) {
  RC_CHECK(options_.connections_max > 0 && options_.connections_max <= kGateConnectionsMaxLimit);
  RC_CHECK(options_.header_timeout_ms > 0 && options_.idle_timeout_ms > 0);
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  RC_CHECK(epoll_fd_ >= 0 && wake_fd_ >= 0);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  RC_CHECK(::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) == 0);
  thread_ = std::thread([this] { Loop(); });
}

ConnectionGate::~ConnectionGate() {
  RC_CHECK(stopped_);
  ::close(epoll_fd_);
  ::close(wake_fd_);
}

void ConnectionGate::Admit(int fd) {
  counters_.accepted++;
  if (connections_.fetch_add(1) >= options_.connections_max) {
    counters_.refused++;
    Refuse(fd, kRefusedFull);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(admit_mu_);
    if (!stop_) {
      admitted_.push_back(fd);
      fd = -1;
    }
  }
  if (fd >= 0) {  // stopping: nobody will serve it
    Refuse(fd, kRefusedFull);
    return;
  }
  const std::uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

bool ConnectionGate::Stop(Clock::time_point deadline) {
  if (!stopped_) {
    {
      std::lock_guard<std::mutex> lock(admit_mu_);
      stop_ = true;
    }
    const std::uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
    thread_.join();  // the loop closes what it holds and returns promptly
    stopped_ = true;
  }
  return pool_.Stop(deadline);
}

void ConnectionGate::Refuse(int fd, std::string_view response) {
  // Best effort, never blocking: the client may be gone or not reading.
  (void)!::send(fd, response.data(), response.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  close_fd(fd);
  connections_.fetch_sub(1);
}

void ConnectionGate::Loop() {
  std::array<epoll_event, kEpollEventsMax> events;
  for (;;) {
    const int n = ::epoll_wait(epoll_fd_, events.data(), kEpollEventsMax,
                               NextTimeoutMs(Clock::now()));
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        std::uint64_t v = 0;
        (void)!::read(wake_fd_, &v, sizeof(v));
        continue;
      }
      Check(fd, (events[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0);
    }
    {
      std::lock_guard<std::mutex> lock(admit_mu_);
      if (stop_) break;
    }
    TakeAdmitted();
    ExpireDue(Clock::now());
  }
  // Stopping: what is still held (or was just accepted) is closed unanswered.
  {
    std::lock_guard<std::mutex> lock(admit_mu_);
    for (int fd : admitted_) Refuse(fd, kRefusedFull);
    admitted_.clear();
  }
  for (auto& [fd, h] : held_) {
    close_fd(fd);
    connections_.fetch_sub(1);
  }
  held_.clear();
}

void ConnectionGate::TakeAdmitted() {
  std::vector<int> fds;
  {
    std::lock_guard<std::mutex> lock(admit_mu_);
    const std::size_t n = std::min(admitted_.size(), kGateAdmitBatchMax);
    fds.assign(admitted_.begin(), admitted_.begin() + static_cast<std::ptrdiff_t>(n));
    admitted_.erase(admitted_.begin(), admitted_.begin() + static_cast<std::ptrdiff_t>(n));
    if (!admitted_.empty()) {  // come back for the rest without waiting
      const std::uint64_t one = 1;
      (void)!::write(wake_fd_, &one, sizeof(one));
    }
  }
  const auto now = Clock::now();
  for (int fd : fds) {
    Held h;
    h.id = next_id_++;
    h.accepted = now;
    RC_CHECK(held_.find(fd) == held_.end());  // an fd is held once: closed before it is reused
    held_.emplace(fd, std::move(h));
    idle_due_.push_back({now + std::chrono::milliseconds(options_.idle_timeout_ms), fd,
                         next_id_ - 1});
    header_due_.push_back({now + std::chrono::milliseconds(options_.header_timeout_ms), fd,
                           next_id_ - 1});
    epoll_event ev{};
    // Edge-triggered: the gate never reads, so level-triggered would report the same bytes
    // forever; each arrival of new bytes is one event.
    ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      held_.erase(fd);
      close_fd(fd);
      connections_.fetch_sub(1);
      continue;
    }
    Check(fd, false);  // bytes that came before the registration raise no edge
  }
}

void ConnectionGate::Check(int fd, bool peer_closed) {
  auto it = held_.find(fd);
  if (it == held_.end()) return;
  Held& h = it->second;
  int buffered = 0;
  if (::ioctl(fd, FIONREAD, &buffered) != 0) buffered = -1;
  if (buffered > 0) h.got_bytes = true;
  const auto have = static_cast<std::size_t>(std::max(buffered, 0));
  if (h.head_bytes == 0 && have > 0) {
    std::string peek(std::min(have, kGateHeadBytesMax), '\0');
    const ssize_t got = ::recv(fd, peek.data(), peek.size(), MSG_PEEK | MSG_DONTWAIT);
    if (got > 0) {
      peek.resize(static_cast<std::size_t>(got));
      const std::size_t end = peek.find("\r\n\r\n");
      if (end != std::string::npos) {
        h.head_bytes = end + 4;
        h.head = peek.substr(0, h.head_bytes);
        h.need_bytes = h.head_bytes + body_bytes_to_wait(h.head);
      } else if (peek.size() >= kGateHeadBytesMax) {
        counters_.head_too_large++;
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
        held_.erase(it);
        Refuse(fd, kRefusedTooLarge);
        return;
      }
    }
  }
  // A head whose client already closed is still served (half-close after sending is legal);
  // an incomplete one is dropped.
  if (h.head_bytes > 0 && (have >= h.need_bytes || peer_closed)) {
    HandOver(fd);
    return;
  }
  if (peer_closed || buffered < 0) {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    held_.erase(it);
    close_fd(fd);
    connections_.fetch_sub(1);
  }
}

void ConnectionGate::HandOver(int fd) {
  auto it = held_.find(fd);
  RC_CHECK(it != held_.end());
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  auto head = std::make_shared<std::string>(std::move(it->second.head));
  held_.erase(it);
  counters_.handed_over++;
  const bool queued = pool_.Submit([this, fd, head] {
    t_fd = fd;
    t_head = *head;
    serve_(fd);  // closes fd
    t_fd = -1;
    t_head = {};
    connections_.fetch_sub(1);
  });
  // Only false while stopping (the queue is sized by the budget).
  if (!queued) {
    close_fd(fd);
    connections_.fetch_sub(1);
  }
}

void ConnectionGate::ExpireDue(Clock::time_point now) {
  const auto expire = [&](std::deque<Due>& due, bool idle) {
    while (!due.empty()) {
      const Due d = due.front();
      auto it = held_.find(d.fd);
      if (it == held_.end() || it->second.id != d.id || (idle && it->second.got_bytes)) {
        due.pop_front();  // handed over, closed, or no longer idle
        continue;
      }
      if (d.at > now) return;
      due.pop_front();
      counters_.header_timeouts++;
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, d.fd, nullptr);
      held_.erase(it);
      Refuse(d.fd, kRefusedTimeout);
    }
  };
  expire(idle_due_, true);
  expire(header_due_, false);
}

int ConnectionGate::NextTimeoutMs(Clock::time_point now) const {
  auto next = now + std::chrono::milliseconds(kLoopWakeMsMax);
  if (!idle_due_.empty()) next = std::min(next, idle_due_.front().at);
  if (!header_due_.empty()) next = std::min(next, header_due_.front().at);
  if (next <= now) return 0;
  return static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1);
}

// ---- GatedHttpServer ----
namespace {

// cpp-httplib 0.11 serves a socket only through its private Server::process_and_close_socket.
// An explicit instantiation may name a private member (C++20 [temp.spec.general]/6); this one
// hands its address out through a friend function, so workers can serve a socket the gate held.
using ProcessSocketFn = bool (httplib::Server::*)(socket_t);
ProcessSocketFn process_socket_fn();
template <ProcessSocketFn Fn>
struct ProcessSocketAccess {
  friend ProcessSocketFn process_socket_fn() { return Fn; }
};
template struct ProcessSocketAccess<&httplib::Server::process_and_close_socket>;

// The routes server: it never listens, so its listening socket is a placeholder that is only
// ever compared against INVALID_SOCKET by the per-connection loop (which stops when it is invalid).
class RoutesServer final : public httplib::Server {
 public:
  RoutesServer() : placeholder_(::eventfd(0, EFD_CLOEXEC)) {
    RC_CHECK(placeholder_ >= 0);
    svr_sock_ = placeholder_;
    set_keep_alive_max_count(1);  // one request per connection (connection_gate.h says why)
  }
  ~RoutesServer() override {
    if (svr_sock_.exchange(INVALID_SOCKET) == placeholder_) ::close(placeholder_);
  }

 private:
  const int placeholder_;
};

// Runs the accept loop's job inline: the job only hands the socket to the gate.
class InlineQueue final : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

}  // namespace

class GatedHttpServer::Listener final : public httplib::Server {
 public:
  explicit Listener(ConnectionGate& gate) : gate_(gate) {
    new_task_queue = [] { return new InlineQueue(); };
  }

 private:
  bool process_and_close_socket(socket_t sock) override {
    gate_.Admit(sock);
    return true;
  }
  ConnectionGate& gate_;
};

std::unique_ptr<httplib::Server> GatedHttpServer::MakeRoutesServer() {
  return std::make_unique<RoutesServer>();
}

GatedHttpServer::GatedHttpServer(httplib::Server& routes, GateOptions options) : routes_(routes) {
  RC_CHECK(dynamic_cast<RoutesServer*>(&routes) != nullptr);  // made by MakeRoutesServer
  const ProcessSocketFn serve = process_socket_fn();
  gate_ = std::make_unique<ConnectionGate>(
      options, [this, serve](int fd) { (void)(routes_.*serve)(fd); });
  listener_ = std::make_unique<Listener>(*gate_);
}

GatedHttpServer::~GatedHttpServer() {
  if (!stopped_) RC_CHECK(Stop(Clock::time_point::max()));
}

httplib::Server& GatedHttpServer::listener() { return *listener_; }

int GatedHttpServer::Bind(const std::string& host, int port, int backlog) {
  // cpp-httplib 0.11 listens with a backlog of 5: capture the listening socket when httplib
  // configures it and listen() again with a deep backlog after bind (Linux updates it).
  int listen_fd = -1;
  listener_->set_socket_options([&listen_fd](socket_t fd) {
    httplib::default_socket_options(fd);
    listen_fd = fd;
  });
  int bound = -1;
  if (port == 0) {
    bound = listener_->bind_to_any_port(host);
  } else {
    bound = listener_->bind_to_port(host, port) ? port : -1;
  }
  listener_->set_socket_options(httplib::default_socket_options);  // listen_fd's frame ends here
  if (bound > 0 && (listen_fd < 0 || ::listen(listen_fd, backlog) != 0)) {
    spdlog::warn("serve: could not raise the listen backlog of port {}", bound);
  }
  return bound;
}

void GatedHttpServer::Start() {
  RC_CHECK(!thread_.joinable() && !stopped_);
  thread_ = std::thread([this] { listener_->listen_after_bind(); });
}

bool GatedHttpServer::Stop(Clock::time_point deadline) {
  listener_->stop();
  if (thread_.joinable()) thread_.join();
  stopped_ = gate_->Stop(deadline);
  return stopped_;
}

}  // namespace rc::service
