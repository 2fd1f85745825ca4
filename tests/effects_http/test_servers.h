// Loopback servers for the HTTP adapter tests: a scripted cpp-httplib server (exact status codes
// and bodies, slow handlers) and a raw TCP server that misbehaves below HTTP (drops mid-response).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>

namespace rc::testing {

// A cpp-httplib server on 127.0.0.1 and an ephemeral port, run on its own thread.
class ScriptedServer {
 public:
  ScriptedServer() {
    server_.set_keep_alive_timeout(1);
    server_.set_keep_alive_max_count(1000);
    // Recorded before routing, i.e. before the answer leaves: a logger runs after the response
    // is written, so two sequential requests served by two workers could be logged swapped.
    server_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response&) {
      std::lock_guard<std::mutex> lock(mu_);
      paths_.push_back(req.method + " " + req.path);
      ports_.insert(req.remote_port);
      return httplib::Server::HandlerResponse::Unhandled;
    });
  }
  ~ScriptedServer() { Stop(); }

  httplib::Server& server() { return server_; }

  void Start() {
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 500 && !server_.is_running(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  void Stop() {
    release_.store(true);
    if (thread_.joinable()) {
      server_.stop();
      thread_.join();
    }
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }

  // Sleeps up to `ms` in small steps; returns early when the server stops.
  void SlowSleep(int ms) {
    for (int i = 0; i < ms / 5 && !release_.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // The requests served so far ("METHOD /path"). The log entry is written after the response
  // is sent, so this waits (up to 2 s) until at least `at_least` entries exist.
  std::vector<std::string> paths(std::size_t at_least = 0) {
    for (int i = 0; i < 400; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (paths_.size() >= at_least) return paths_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::lock_guard<std::mutex> lock(mu_);
    return paths_;
  }
  std::size_t distinct_client_ports() {
    std::lock_guard<std::mutex> lock(mu_);
    return ports_.size();
  }

 private:
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<bool> release_{false};
  std::mutex mu_;
  std::vector<std::string> paths_;
  std::set<int> ports_;
};

// A TCP listener on 127.0.0.1 whose per-connection behaviour is a function of the socket.
class RawServer {
 public:
  explicit RawServer(std::function<void(int fd)> on_conn) : on_conn_(std::move(on_conn)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    ::listen(fd_, 16);
    socklen_t len = sizeof(a);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      for (;;) {
        int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0 || stop_.load()) {
          if (c >= 0) ::close(c);
          return;
        }
        on_conn_(c);
        ::close(c);
      }
    });
  }
  ~RawServer() {
    stop_.store(true);
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  // Reads the request head (until a blank line) so that the client has sent its request.
  static void ReadHead(int fd) {
    std::string got;
    char buf[4096];
    while (got.find("\r\n\r\n") == std::string::npos) {
      ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) return;
      got.append(buf, static_cast<std::size_t>(n));
    }
  }
  static void Send(int fd, const std::string& s) { ::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

 private:
  std::function<void(int)> on_conn_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A loopback port with nothing listening on it (bound, then closed).
inline int ClosedPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace rc::testing
