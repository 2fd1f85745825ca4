// ProxyExchange: one proxied rollout, /v1/completions, /v1/chat/completions or
// /inference/v1/generate, as a chain of small asynchronous steps on its connection's event loop:
//
//   Parse (400, nothing journaled) -> Admit (RolloutAdmitted durable before any byte reaches the
//   engine; 503 + Retry-After while not READY past admit_wait_ms, or TAINTED) -> PrepareUpstream
//   (the version's cache_salt; return_token_ids, include_usage and the sampled tokens' logprobs
//   where the client did not ask, removed again from its answer) -> Connect (pooled keep-alive;
//   a connect that never reached the engine is retried) -> Send -> Relay (non-streamed: bounded
//   body; streamed: each engine read is turned into client events and written before the next
//   read, so a slow client slows the engine stream and nothing accumulates) -> Finish (trajectory
//   line, then the journal parts and RolloutFinished, durably, exactly once) -> Answer.
//
// A client that goes away closes the engine connection (vLLM aborts the request) and the rollout
// is finished as aborted; so is one the shutdown cancels, or one past request_timeout_ms.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/steady_timer.hpp>
#include <boost/beast/http/buffer_body.hpp>
#include <boost/beast/http/parser.hpp>
#include <nlohmann/json.hpp>

#include "effects/http/response_parsers.h"
#include "service/byte_budget.h"
#include "service/http_server.h"
#include "service/proxy_stream.h"
#include "service/service.h"
#include "service/upstream.h"

namespace rc::service {

const char* ProxyRoutePath(ProxyRoute route);

inline constexpr std::size_t kUpstreamReadBytes = 64 << 10;  // one engine read, one client write
inline constexpr std::size_t kUpstreamHeadBytesMax = 64 << 10;
inline constexpr std::uint32_t kConnectAttemptsMax = 4;  // connects that never reached the engine
inline constexpr std::size_t kRolloutIdHeaderBytesMax = kIdBytesMax;  // a journal rollout id

class ProxyExchange : public std::enable_shared_from_this<ProxyExchange> {
 public:
  ProxyExchange(Service& service, ProxyRoute route, Exchange exchange);
  void Start();

 private:
  using error_code = boost::system::error_code;

  [[nodiscard]] Status Parse();
  [[nodiscard]] Status ParseRolloutId();
  std::optional<std::uint64_t> AffinityKeyOf() const;
  void OnAdmitted(Service::AdmitResult admitted);
  void PrepareUpstream();
  HttpResponse BindingHead(int status) const;
  void OnStreamHeadSent(bool delivered);
  void Connect();
  void AcquireUpstream(bool fresh_only);
  // The client left, the shutdown cancelled, or request_timeout_ms passed: no new engine work.
  bool Abandoned() const { return client_gone_ || cancelled_ || timed_out_; }
  void OnConnected(Status status, std::unique_ptr<UpstreamConn> conn, bool reused);
  void Send();
  void OnSent(error_code ec);
  void ReadHead();
  void OnHead(error_code ec);
  void ReadBody();
  void OnBody(error_code ec);
  bool Absorb(const char* data, std::size_t n);  // false: stop (client gone, bound exceeded)
  void OnClientTook(bool delivered);
  void UpstreamDone();
  void UpstreamFailed(Transport transport, std::string why);
  bool RetryAfterFailure(bool reused_and_silent);
  void AnswerEngineError();
  void AnswerCompletion();
  void AnswerStreamEnd(bool ok, const std::string& why);
  void Abort(std::string note);
  void Finish(RolloutOutcome outcome, std::string note, std::function<void()> then);
  void ObserveEnded(std::uint64_t upstream_us);
  void AnswerNotDurable(const Status& st);
  void WriteTrajectoryLine(RolloutOutcome outcome, const std::string& note);
  void ReleaseUpstream(bool reusable);
  void CloseUpstream();
  void OnClientGone();
  void Cancel();
  std::string EngineFailure() const;
  std::uint64_t UpstreamElapsedUs() const;

  Service& svc_;
  const ProxyRoute route_;
  Exchange ex_;
  std::chrono::steady_clock::time_point t0_, upstream_t0_;

  // Parsed request.
  nlohmann::json upstream_body_;
  bool stream_ = false;
  std::string client_salt_;
  std::string rollout_id_;

  // Admission and what the proxy added.
  Admission admission_;
  std::string cache_salt_;
  AddedFields added_;  // asked of the engine for the trace only: removed from the answer
  Trajectory trace_;
  std::uint64_t in_flight_id_ = 0;

  // The engine call.
  std::unique_ptr<UpstreamConn> conn_;
  bool conn_reused_ = false;
  std::uint32_t connect_attempts_ = 0;
  bool retried_stale_ = false;
  boost::beast::http::request<boost::beast::http::string_body> upstream_request_;
  std::optional<boost::beast::http::response_parser<boost::beast::http::buffer_body>> parser_;
  std::unique_ptr<char[]> read_buf_;  // kUpstreamReadBytes, allocated (not zeroed) on first read
  std::string body_;                  // non-streamed (or error) body, bounded
  BudgetHold body_hold_;              // body_'s bytes, taken from the server's body budget
  std::string out_;                   // client events of one engine read
  effects::SseState sse_;
  effects::EngineClient::ChunkFn on_chunk_;
  boost::asio::steady_timer deadline_;
  bool timed_out_ = false;
  std::string transport_error_;

  // End states.
  bool client_gone_ = false;
  bool cancelled_ = false;
  bool finished_ = false;
};

}  // namespace rc::service
