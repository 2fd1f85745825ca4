// A minimal C++ c10d TCPStore client (same framing as torch's) for loopback tests of the master.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace rc::effects::nccl::testing {

class StoreClient {
 public:
  explicit StoreClient(std::uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~StoreClient() { ::close(fd_); }
  bool connected() const { return connected_; }

  template <typename T>
  void Pod(T v) {
    buf_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void Str(const std::string& s) {
    Pod<std::uint64_t>(s.size());
    buf_.append(s);
  }
  void Type(std::uint8_t t) { Pod<std::uint8_t>(t); }
  bool Flush() {
    const bool ok =
        ::send(fd_, buf_.data(), buf_.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(buf_.size());
    buf_.clear();
    return ok;
  }
  // Reads exactly n bytes or fails after timeout_ms (false on EOF/timeout).
  bool ReadExact(void* dst, std::size_t n, int timeout_ms = 2000) {
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      pollfd pf{fd_, POLLIN, 0};
      if (::poll(&pf, 1, timeout_ms) != 1) return false;
      const ssize_t got = ::recv(fd_, p, n, 0);
      if (got <= 0) return false;
      p += got;
      n -= static_cast<std::size_t>(got);
    }
    return true;
  }
  template <typename T>
  bool Read(T* v, int timeout_ms = 2000) {
    return ReadExact(v, sizeof(T), timeout_ms);
  }
  bool ReadStr(std::string* s) {
    std::uint64_t n = 0;
    if (!Read(&n)) return false;
    s->resize(n);
    return ReadExact(s->data(), n);
  }
  // True when the server closed the connection (EOF) within timeout_ms.
  bool ClosedByServer(int timeout_ms = 2000) {
    pollfd pf{fd_, POLLIN, 0};
    if (::poll(&pf, 1, timeout_ms) != 1) return false;
    char c;
    return ::recv(fd_, &c, 1, 0) <= 0;
  }
  // Nothing to read within timeout_ms.
  bool Silent(int timeout_ms) {
    pollfd pf{fd_, POLLIN, 0};
    return ::poll(&pf, 1, timeout_ms) == 0;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
  std::string buf_;
};

}  // namespace rc::effects::nccl::testing
