// DisconnectWatcher: notices that a proxied client hung up while its request is still being served
// and cancels the upstream engine call.
//
// cpp-httplib 0.11 gives handlers no access to their socket, so the socket is found by its
// addresses (local port = our listener, peer = the request's remote addr/port). A worker thread
// serves one connection at a time, so the last match is cached per thread and re-checked; new
// connections are looked up in a table that one scan of the descriptor table fills for all. One
// background thread waits in epoll for EPOLLRDHUP/EPOLLHUP (peer closed) on the registered
// sockets (nothing runs while no client hangs up; it used to poll() all of them every 5 ms) and
// cancels the registered token. Registrations are bounded (kWatchesMax); beyond that a request is
// simply not watched (its abort is then noticed when a streamed write fails).
#pragma once

#include <atomic>
#include <cstdint>
#include <unordered_map>
#include <mutex>
#include <string>
#include <thread>

#include "effects/http/engine_client.h"

namespace rc::service {

inline constexpr std::size_t kWatchesMax = 16384;

// The descriptor of this process's TCP socket with these endpoints, or -1. Checked in order:
// the calling thread's last answer (a keep-alive connection stays on one worker), then a
// process-wide table of the sockets the last scan saw, then one scan of the descriptor table
// (serialised, and it refills the table, so a burst of new connections costs about one scan, not
// one per connection). Every answer is re-verified with getpeername/getsockname.
int FindPeerSocket(int local_port, const std::string& remote_addr, int remote_port);

class DisconnectWatcher {
 public:
  DisconnectWatcher();
  ~DisconnectWatcher();

  // Returns a registration id (0 when not watched: socket unknown or too many watches).
  std::uint64_t Watch(int fd, effects::CancelToken token);
  void Unwatch(std::uint64_t id);
  // True when the watcher cancelled this registration's token because the peer hung up.
  bool Fired(std::uint64_t id);

 private:
  struct Entry {
    int fd = -1;
    effects::CancelToken token;
    bool fired = false;
  };
  void Loop();

  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: wakes Loop for the destructor
  std::mutex mu_;
  std::unordered_map<std::uint64_t, Entry> entries_;
  std::uint64_t next_id_ = 1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace rc::service
