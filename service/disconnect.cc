#include "service/disconnect.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

namespace rc::service {
namespace {

bool endpoint_matches(int fd, int local_port, const std::string& remote_addr, int remote_port) {
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) return false;
  char host[INET6_ADDRSTRLEN] = {0};
  int port = -1;
  if (peer.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&peer);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (peer.ss_family == AF_INET6) {
    auto* in = reinterpret_cast<sockaddr_in6*>(&peer);
    ::inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
    port = ntohs(in->sin6_port);
  } else {
    return false;
  }
  if (port != remote_port || remote_addr != host) return false;
  sockaddr_storage self{};
  len = sizeof(self);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) != 0) return false;
  const int lport = self.ss_family == AF_INET
                        ? ntohs(reinterpret_cast<sockaddr_in*>(&self)->sin_port)
                        : ntohs(reinterpret_cast<sockaddr_in6*>(&self)->sin6_port);
  return lport == local_port;
}

}  // namespace

bool RaiseListenBacklog(int port, int backlog) {
  for (int fd = 3; fd < 65536; ++fd) {
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) continue;
    sockaddr_storage self{};
    len = sizeof(self);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) != 0) continue;
    const int lport = self.ss_family == AF_INET
                          ? ntohs(reinterpret_cast<sockaddr_in*>(&self)->sin_port)
                          : ntohs(reinterpret_cast<sockaddr_in6*>(&self)->sin6_port);
    if (lport == port) return ::listen(fd, backlog) == 0;
  }
  return false;
}

int FindPeerSocket(int local_port, const std::string& remote_addr, int remote_port) {
  thread_local int cached_fd = -1;
  if (cached_fd >= 0 && endpoint_matches(cached_fd, local_port, remote_addr, remote_port)) {
    return cached_fd;
  }
  rlimit lim{};
  int fd_max = 65536;
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < 65536) {
    fd_max = static_cast<int>(lim.rlim_cur);
  }
  for (int fd = 3; fd < fd_max; ++fd) {
    if (endpoint_matches(fd, local_port, remote_addr, remote_port)) {
      cached_fd = fd;
      return fd;
    }
  }
  return -1;
}

DisconnectWatcher::DisconnectWatcher(std::uint32_t poll_ms) : poll_ms_(poll_ms) {
  RC_ASSERT(poll_ms_ > 0);
  thread_ = std::thread([this] { Loop(); });
}

DisconnectWatcher::~DisconnectWatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::uint64_t DisconnectWatcher::Watch(int fd, effects::CancelToken token) {
  if (fd < 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.size() >= kWatchesMax) return 0;
  const std::uint64_t id = next_id_++;
  entries_.emplace(id, Entry{fd, std::move(token), false});
  cv_.notify_all();
  return id;
}

void DisconnectWatcher::Unwatch(std::uint64_t id) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(id);
}

bool DisconnectWatcher::Fired(std::uint64_t id) {
  if (id == 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  return it != entries_.end() && it->second.fired;
}

void DisconnectWatcher::Loop() {
  std::vector<pollfd> fds;
  std::vector<std::uint64_t> ids;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (entries_.empty()) {
      cv_.wait(lock, [&] { return stop_ || !entries_.empty(); });
      continue;
    }
    fds.clear();
    ids.clear();
    for (const auto& [id, e] : entries_) {
      if (e.fired) continue;
      fds.push_back(pollfd{e.fd, static_cast<short>(POLLRDHUP), 0});
      ids.push_back(id);
    }
    // Polled under the lock: registered sockets cannot be closed while their handler is
    // blocked in Unwatch (the handler owns the connection until it returns).
    const int n = ::poll(fds.data(), fds.size(), 0);
    if (n > 0) {
      for (std::size_t i = 0; i < fds.size(); ++i) {
        if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) == 0) continue;
        auto it = entries_.find(ids[i]);
        if (it == entries_.end()) continue;
        it->second.fired = true;
        it->second.token.Cancel();
      }
    }
    cv_.wait_for(lock, std::chrono::milliseconds(poll_ms_), [&] { return stop_; });
  }
}

}  // namespace rc::service
