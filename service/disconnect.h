// DisconnectWatcher: notices that a proxied client hung up while its request is still being served
// and cancels the upstream engine call.
//
// cpp-httplib 0.11 gives handlers no access to their socket, so the socket is found by its
// addresses (local port = our listener, peer = the request's remote addr/port). A worker thread
// serves one connection at a time, so the last match is cached per thread and re-checked with one
// getpeername(); a scan of the descriptor table happens once per new connection. One background
// thread poll()s every registered socket for POLLRDHUP/POLLHUP (peer closed) every poll_ms and
// cancels the registered token. Registrations are bounded (kWatchesMax); beyond that a request is
// simply not watched (its abort is then noticed when a streamed write fails).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "effects/http/engine_client.h"

namespace rc::service {

inline constexpr std::size_t kWatchesMax = 16384;

// cpp-httplib 0.11 listens with a backlog of 5: a burst of a few hundred connects overflows the
// accept queue and clients see resets. Re-issues listen() with `backlog` on this process's
// listening socket bound to `port` (Linux updates the backlog of a listening socket). Returns
// false when no such socket was found.
bool RaiseListenBacklog(int port, int backlog);

// The descriptor of this process's TCP socket with these endpoints, or -1.
int FindPeerSocket(int local_port, const std::string& remote_addr, int remote_port);

class DisconnectWatcher {
 public:
  explicit DisconnectWatcher(std::uint32_t poll_ms = 5);
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

  std::uint32_t poll_ms_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint64_t, Entry> entries_;
  std::uint64_t next_id_ = 1;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace rc::service
