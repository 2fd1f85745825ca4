#include "service/disconnect.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace rc::service {
namespace {

inline constexpr std::size_t kPeerTableMax = 65536;  // sockets remembered from the last scan

struct Endpoints {
  int local_port = -1;
  int remote_port = -1;
  char remote_addr[INET6_ADDRSTRLEN] = {0};
};

int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port);
  return -1;
}

// The endpoints of a connected TCP/IP socket; false for anything else (closed fd, not a socket,
// listening or unix socket).
bool endpoints_of(int fd, Endpoints& out) {
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) return false;
  if (peer.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&peer)->sin_addr, out.remote_addr,
                sizeof(out.remote_addr));
  } else if (peer.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&peer)->sin6_addr, out.remote_addr,
                sizeof(out.remote_addr));
  } else {
    return false;
  }
  out.remote_port = port_of(peer);
  sockaddr_storage self{};
  len = sizeof(self);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) != 0) return false;
  out.local_port = port_of(self);
  return true;
}

bool endpoint_matches(int fd, int local_port, const std::string& remote_addr, int remote_port) {
  Endpoints e;
  return endpoints_of(fd, e) && e.remote_port == remote_port && e.local_port == local_port &&
         remote_addr == e.remote_addr;
}

std::string key_of(int local_port, std::string_view remote_addr, int remote_port) {
  std::string k(remote_addr);
  k += '|';
  k += std::to_string(remote_port);
  k += '|';
  k += std::to_string(local_port);
  return k;
}

// Open descriptors of this process, from /proc/self/fd (cost proportional to what is open, not
// to RLIMIT_NOFILE); falls back to 3..min(RLIMIT_NOFILE, 65536).
std::vector<int> open_fds() {
  std::vector<int> fds;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    const int own = ::dirfd(d);
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
      const int fd = std::atoi(e->d_name);
      if (fd > 2 && fd != own) fds.push_back(fd);
    }
    ::closedir(d);
    return fds;
  }
  rlimit lim{};
  int fd_max = 65536;
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < 65536) {
    fd_max = static_cast<int>(lim.rlim_cur);
  }
  for (int fd = 3; fd < fd_max; ++fd) fds.push_back(fd);
  return fds;
}

std::mutex g_table_mu;
std::unordered_map<std::string, int> g_table;  // endpoints key -> fd, as of the last scan

}  // namespace

int FindPeerSocket(int local_port, const std::string& remote_addr, int remote_port) {
  thread_local int cached_fd = -1;
  if (cached_fd >= 0 && endpoint_matches(cached_fd, local_port, remote_addr, remote_port)) {
    return cached_fd;
  }
  const std::string key = key_of(local_port, remote_addr, remote_port);
  // Serialised: a thread that waited here usually finds its socket in the table the previous
  // holder's scan refilled.
  std::lock_guard<std::mutex> lock(g_table_mu);
  if (auto it = g_table.find(key);
      it != g_table.end() && endpoint_matches(it->second, local_port, remote_addr, remote_port)) {
    cached_fd = it->second;
    return cached_fd;
  }
  g_table.clear();
  int found = -1;
  Endpoints e;
  for (int fd : open_fds()) {
    if (!endpoints_of(fd, e)) continue;
    if (g_table.size() < kPeerTableMax) {
      g_table.emplace(key_of(e.local_port, e.remote_addr, e.remote_port), fd);
    }
    if (found < 0 && e.remote_port == remote_port && e.local_port == local_port &&
        remote_addr == e.remote_addr) {
      found = fd;
    }
  }
  if (found >= 0) cached_fd = found;
  return found;
}

DisconnectWatcher::DisconnectWatcher() {
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  RC_CHECK(epoll_fd_ >= 0 && wake_fd_ >= 0);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;  // ids start at 1: 0 is the stop signal
  RC_CHECK(::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) == 0);
  thread_ = std::thread([this] { Loop(); });
}

DisconnectWatcher::~DisconnectWatcher() {
  stop_.store(true, std::memory_order_release);
  const std::uint64_t one = 1;
  RC_CHECK(::write(wake_fd_, &one, sizeof(one)) == static_cast<ssize_t>(sizeof(one)));
  thread_.join();
  ::close(wake_fd_);
  ::close(epoll_fd_);
}

std::uint64_t DisconnectWatcher::Watch(int fd, effects::CancelToken token) {
  if (fd < 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.size() >= kWatchesMax) return 0;
  const std::uint64_t id = next_id_++;
  epoll_event ev{};
  // One-shot: a hung-up socket stays readable; it is reported once, then left disarmed.
  ev.events = EPOLLRDHUP | EPOLLONESHOT;
  ev.data.u64 = id;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) return 0;  // not watched
  entries_.emplace(id, Entry{fd, std::move(token), false});
  return id;
}

void DisconnectWatcher::Unwatch(std::uint64_t id) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  // Before the handler returns, so before httplib can close (and the kernel reuse) the fd.
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->second.fd, nullptr);
  entries_.erase(it);
}

bool DisconnectWatcher::Fired(std::uint64_t id) {
  if (id == 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  return it != entries_.end() && it->second.fired;
}

void DisconnectWatcher::Loop() {
  std::array<epoll_event, 64> events{};
  while (!stop_.load(std::memory_order_acquire)) {
    const int n = ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), -1);
    if (n <= 0) continue;  // EINTR
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = 0; i < n; ++i) {
      const std::uint64_t id = events[i].data.u64;
      if (id == 0) continue;  // stop: checked by the loop condition
      // An id unwatched between epoll_wait and here is gone from entries_: its fd may already
      // belong to another connection, which is why events carry ids, not fds.
      auto it = entries_.find(id);
      if (it == entries_.end() || it->second.fired) continue;
      if ((events[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) == 0) continue;
      it->second.fired = true;
      it->second.token.Cancel();
    }
  }
}

}  // namespace rc::service
