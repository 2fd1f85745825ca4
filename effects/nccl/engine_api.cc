#include "effects/nccl/engine_api.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace rc::effects::nccl {
namespace {

using Clock = std::chrono::steady_clock;

std::int64_t MsLeft(Clock::time_point deadline) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
}

EngineReply Fail(Transport t, std::string error, Clock::time_point start) {
  EngineReply r;
  r.http.transport = t;
  r.http.error = error.substr(0, kTextBytesMax);
  r.http.latency_us = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count());
  return r;
}

}  // namespace

const char* protocol_line_name(ProtocolLine line) {
  switch (line) {
    case ProtocolLine::kPackedInUpdateInfo: return "packed-in-update-info";
    case ProtocolLine::kPackedInInitInfo: return "packed-in-init-info";
    case ProtocolLine::kUniqueIdCapable: return "unique-id-capable";
  }
  return "?";
}

ProtocolLine DetectProtocolLine(const std::string& version) {
  int major = -1, minor = -1;
  if (std::sscanf(version.c_str(), "%d.%d", &major, &minor) != 2 || major < 0 || minor < 0 ||
      version.find("dev") != std::string::npos || version.find("+g") != std::string::npos) {
    return ProtocolLine::kPackedInInitInfo;
  }
  if (major == 0 && minor < 28) return ProtocolLine::kPackedInUpdateInfo;
  if (major == 0 && minor < 30) return ProtocolLine::kPackedInInitInfo;
  return ProtocolLine::kUniqueIdCapable;
}

EngineReply SocketEngineApi::Call(const std::string& method, const std::string& path,
                                  const std::string& body, std::uint64_t timeout_ms) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(timeout_ms);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res) != 0 || !res) {
    return Fail(Transport::kConnectFailed, "cannot resolve " + host_, start);
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    ::freeaddrinfo(res);
    return Fail(Transport::kConnectFailed, "socket failed", start);
  }
  struct Closer { int fd; ~Closer() { ::close(fd); } } closer{fd};
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
  ::freeaddrinfo(res);
  if (rc != 0 && errno != EINPROGRESS) {
    return Fail(Transport::kConnectFailed, std::string("connect: ") + std::strerror(errno), start);
  }
  if (rc != 0) {
    pollfd p{fd, POLLOUT, 0};
    const std::int64_t left = MsLeft(deadline);
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) != 1) {
      return Fail(Transport::kConnectFailed, "connect timed out", start);
    }
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return Fail(Transport::kConnectFailed, std::string("connect: ") + std::strerror(err), start);
  }
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: " + host_ + ":" + std::to_string(port_) +
                    "\r\nConnection: close\r\nAccept: application/json\r\n";
  if (method == "POST") {
    req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  req += "\r\n" + body;
  std::size_t off = 0;
  while (off < req.size()) {
    pollfd p{fd, POLLOUT, 0};
    const std::int64_t left = MsLeft(deadline);
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) != 1) {
      return Fail(Transport::kTimeout, "send timed out", start);
    }
    const ssize_t n = ::send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return Fail(Transport::kBroken, std::string("send: ") + std::strerror(errno), start);
    off += static_cast<std::size_t>(n);
  }
  std::string resp;
  char buf[16384];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const std::int64_t left = MsLeft(deadline);
    if (left <= 0) return Fail(Transport::kTimeout, "response timed out", start);
    const int pr = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left, 1000)));
    if (pr == 0) continue;
    if (pr < 0 && errno == EINTR) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n < 0) return Fail(Transport::kBroken, std::string("recv: ") + std::strerror(errno), start);
    if (n == 0) break;
    resp.append(buf, static_cast<std::size_t>(n));
    if (resp.size() > kHttpResponseBytesMax) return Fail(Transport::kBroken, "response too large", start);
  }
  const std::size_t head_end = resp.find("\r\n\r\n");
  int status = 0;
  if (head_end == std::string::npos || std::sscanf(resp.c_str(), "HTTP/1.%*d %d", &status) != 1) {
    return Fail(Transport::kBroken, "connection closed before a complete response", start);
  }
  EngineReply r;
  r.http.transport = Transport::kOk;
  r.http.http_status = status;
  r.http.latency_us = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count());
  const std::string payload = resp.substr(head_end + 4);
  r.body = nlohmann::json::parse(payload, nullptr, /*allow_exceptions=*/false);
  r.http.body_parsed = !r.body.is_discarded();
  if (!r.http.body_parsed) {
    r.body = nullptr;
    r.http.error = payload.substr(0, 512);
  } else if (status >= 300) {
    r.http.error = r.body.dump().substr(0, 512);
  }
  return r;
}

EngineReply SocketEngineApi::Version(std::uint64_t timeout_ms) { return Call("GET", "/version", "", timeout_ms); }
EngineReply SocketEngineApi::GetWorldSize(std::uint64_t timeout_ms) {
  return Call("GET", "/get_world_size", "", timeout_ms);
}
EngineReply SocketEngineApi::InitWeightTransferEngine(const nlohmann::json& init_info, std::uint64_t timeout_ms) {
  return Call("POST", "/init_weight_transfer_engine", nlohmann::json{{"init_info", init_info}}.dump(), timeout_ms);
}
EngineReply SocketEngineApi::StartWeightUpdate(std::uint64_t timeout_ms) {
  return Call("POST", "/start_weight_update", "", timeout_ms);
}
EngineReply SocketEngineApi::UpdateWeights(const nlohmann::json& update_info, std::uint64_t timeout_ms) {
  return Call("POST", "/update_weights", nlohmann::json{{"update_info", update_info}}.dump(), timeout_ms);
}
EngineReply SocketEngineApi::FinishWeightUpdate(const std::string& label, std::uint64_t timeout_ms) {
  return Call("POST", "/finish_weight_update", nlohmann::json{{"weight_version", label}}.dump(), timeout_ms);
}

}  // namespace rc::effects::nccl
