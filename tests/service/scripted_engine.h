// An engine that misbehaves where a test says: a loopback front for the vLLM double that passes
// every request to the double and its answer back (so serve starts, bootstraps and monitors as
// against the double itself), except the routes a test scripts, which answer whatever bytes the
// script writes (an SSE stream without [DONE], events after [DONE], a stream that hangs after its
// first event).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include <httplib.h>

namespace rc::service::stack {

class ScriptedEngine {
 public:
  using Script = std::function<void(const httplib::Request&, httplib::Response&)>;

  ScriptedEngine() {
    // Each kept-alive connection holds a worker while idle: serve keeps several open.
    server_.new_task_queue = [] { return new httplib::ThreadPool(64); };
    server_.set_keep_alive_timeout(1);
    // Routes, not a pre-routing handler: cpp-httplib reads a request's body only on its way to
    // a route.
    const auto serve = [this](const httplib::Request& req, httplib::Response& res) {
      const Script script = ScriptOf(req.path);
      if (script) return script(req, res);
      Forward(req, res);
    };
    server_.Get(".*", serve);
    server_.Post(".*", serve);
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 500 && !server_.is_running(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  ~ScriptedEngine() {
    Release();
    server_.stop();
    thread_.join();
  }
  ScriptedEngine(const ScriptedEngine&) = delete;
  ScriptedEngine& operator=(const ScriptedEngine&) = delete;

  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // Where unscripted requests go: the double's base URL ("http://host:port").
  void ForwardTo(const std::string& base_url) {
    std::lock_guard<std::mutex> lock(mu_);
    target_ = base_url;
  }
  void Set(const std::string& path, Script script) {
    std::lock_guard<std::mutex> lock(mu_);
    scripts_[path] = std::move(script);
  }
  void Clear(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    scripts_.erase(path);
  }

  // For scripts that hang: Hold() waits until Release() (or 10 s: never a hung test).
  void Hold() const {
    for (int i = 0; i < 2000 && !released_.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  void Release() { released_.store(true); }

 private:
  Script ScriptOf(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = scripts_.find(path);
    return it == scripts_.end() ? Script() : it->second;
  }

  void Forward(const httplib::Request& req, httplib::Response& res) {
    std::string target;
    {
      std::lock_guard<std::mutex> lock(mu_);
      target = target_;
    }
    httplib::Client c(target);
    c.set_read_timeout(60, 0);
    c.set_url_encode(false);  // the target as serve sent it
    httplib::Headers headers;
    if (req.has_header("Authorization")) {
      headers.emplace("Authorization", req.get_header_value("Authorization"));
    }
    const std::string type = req.get_header_value("Content-Type");
    httplib::Result r = req.method == "POST" ? c.Post(req.target, headers, req.body,
                                                      type.empty() ? "application/json" : type)
                                             : c.Get(req.target, headers);
    if (!r) {
      res.status = 502;
      return;
    }
    res.status = r->status;
    const std::string answered_type = r->get_header_value("Content-Type");
    res.set_content(r->body, answered_type.empty() ? "text/plain" : answered_type);
  }

  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::mutex mu_;
  std::string target_;
  std::map<std::string, Script> scripts_;
  std::atomic<bool> released_{false};
};

}  // namespace rc::service::stack
