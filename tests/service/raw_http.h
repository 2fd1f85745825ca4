// A raw HTTP client over loopback for tests of the server's framing: what a test sends is exactly
// the bytes on the wire, and what it reads is everything the server sent.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "service/http_server.h"
#include "statemachine/status.h"

namespace rc::service::raw_http {

// A connected socket whose reads give up after 30 s: a server that never answers fails the test
// instead of hanging it.
inline int connect_loopback(int port, int receive_buffer_bytes = 0) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  RC_CHECK(fd >= 0);
  // Before the connect: the receive window is negotiated there.
  if (receive_buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer_bytes, sizeof(receive_buffer_bytes));
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  RC_CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  timeval tv{30, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

inline bool send_all(int fd, const std::string& bytes) {
  for (std::size_t at = 0; at < bytes.size();) {
    const ssize_t n = ::send(fd, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
    if (n <= 0) return false;
    at += static_cast<std::size_t>(n);
  }
  return true;
}

// A connection to `port` with the smallest receive buffer the kernel allows, having sent
// `request`: an answer larger than the socket buffers stays in serve's write while the test does
// not read.
inline int send_from_small_window(int port, const std::string& request) {
  const int fd = connect_loopback(port, 4096);
  RC_CHECK(send_all(fd, request));
  return fd;
}

// Everything the server sends until it closes (or goes quiet for the receive timeout).
inline std::string read_to_close(int fd) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) {
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

// Sends raw bytes on a fresh connection and returns everything the server answered until it
// closed.
inline std::string raw_exchange(int port, const std::string& bytes) {
  const int fd = connect_loopback(port);
  RC_CHECK(send_all(fd, bytes));
  std::string out = read_to_close(fd);
  ::close(fd);
  return out;
}

inline int status_of(const std::string& response) {
  if (response.size() < 12 || response.rfind("HTTP/1.1 ", 0) != 0) return 0;
  return std::atoi(response.substr(9, 3).c_str());
}

inline std::string head_of(const std::string& response) {
  return response.substr(0, response.find("\r\n\r\n"));
}

inline std::string body_of(const std::string& response) {
  const std::size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

inline HttpServerOptions OneLoop() {
  HttpServerOptions o;
  o.io_threads = 1;
  return o;
}

// Starts the server and returns its port (a server that cannot start fails the test binary).
inline int StartOrDie(HttpServer& http) {
  Result<int> port = http.Start();
  RC_CHECK(port.ok());
  return *port;
}

}  // namespace rc::service::raw_http
