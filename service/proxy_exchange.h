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
// What the exchange holds in memory is held against the server's body budget
// (body_memory_bytes_max) before it is made: the request's tree, the engine's body and its tree,
// the trace, a streamed event's trees, and the bytes that wait on the client (a complete answer,
// handed with its hold to the client's connection until written; a stream's buffered events until
// their write ends). What the budget refuses ends the rollout as aborted, the client told why.
//
// A client that goes away closes the engine connection (vLLM aborts the request) and the rollout
// is finished as aborted; so is one the shutdown cancels, or one past request_timeout_ms. The
// client is watched from the admission on: one that leaves while its admission waits for the
// engine is never admitted (nothing journaled).
//
// Every step runs through Step(): whatever a step throws ends the rollout as aborted and the
// client's exchange (500, or a cut stream), never the event loop, and never leaves the binding
// open. An exchange destroyed with its rollout unfinished still finishes it (the destructor).
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
#include "service/head_limits.h"
#include "service/http_server.h"
#include "service/proxy_stream.h"
#include "service/service.h"
#include "service/upstream.h"

namespace rc::service {

const char* ProxyRoutePath(ProxyRoute route);

inline constexpr std::size_t kUpstreamReadBytes = 64 << 10;  // one engine read, one client write
// An engine answer's head: at most this many bytes and kHeaderFieldsMax fields (its trailer's
// fields counted with them), read by read (head_limits.h); past either the rollout ends as an
// engine protocol error (502).
inline constexpr std::size_t kUpstreamHeadBytesMax = 64 << 10;
inline constexpr std::uint32_t kConnectAttemptsMax = 4;  // connects that never reached the engine
inline constexpr std::size_t kRolloutIdHeaderBytesMax = kIdBytesMax;  // a journal rollout id
// A trace entry (a token id or a logprob) as held, with its container's slack; the body budget
// is taken for kTraceEntriesPerHold of them at a time.
inline constexpr std::uint64_t kTraceEntryBytes = 32;
inline constexpr std::uint64_t kTraceEntriesPerHold = 256;
inline constexpr const char* kTraceOverBudget =
    "the rollout's trace would take more of serve's memory budget than is left "
    "(body_memory_bytes_max)";

class ProxyExchange : public std::enable_shared_from_this<ProxyExchange> {
 public:
  ProxyExchange(Service& service, ProxyRoute route, Exchange exchange);
  ~ProxyExchange();
  ProxyExchange(const ProxyExchange&) = delete;
  ProxyExchange& operator=(const ProxyExchange&) = delete;
  void Start();

 private:
  using error_code = boost::system::error_code;

  // Runs `f`, the step named `step`; what it throws goes to Failed.
  template <class F>
  void Step(const char* step, F&& f) noexcept;
  // Step, for a completion of the rollout's own chain: skipped once the rollout finished.
  template <class F>
  void Next(const char* step, F&& f) noexcept;
  void Failed(const char* step, const char* what) noexcept;
  void FinishFailed(const std::string& why);
  void FinishThrew(const std::string& why) noexcept;
  void FinishDropped() noexcept;
  void AnswerRecorded(const std::string& why);
  void EndFailed(const std::string& why);
  void CloseClient() noexcept;
  bool admitted() const { return !admission_.binding.rollout_id.empty(); }

  [[nodiscard]] Status Parse();
  [[nodiscard]] Status ParseRolloutId();
  std::optional<std::uint64_t> AffinityKeyOf() const;
  void TakeAdmission(Admission&& admission) noexcept;
  void OnAdmitted(const AdmitRefusal& refusal);
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
  void ParseHead();
  void OnHeadBytes(error_code ec, std::size_t n);
  void OnHead(error_code ec);
  void ReadBody();
  void OnBody(error_code ec);
  bool Absorb(const char* data, std::size_t n);  // false: stop (client gone, bound exceeded)
  [[nodiscard]] bool HoldTrace();                // false: the body budget refused the trace
  std::uint64_t StreamBuffered();                // the bytes sse_.pending and out_ take
  [[nodiscard]] bool HoldStreamBuffers();        // false: the body budget refused them
  void OnClientTook(bool delivered);
  void UpstreamDone();
  void EndStream();
  void UpstreamFailed(Transport transport, std::string why);
  bool RetryAfterFailure(bool reused_and_silent);
  void AnswerEngineError();
  void AnswerEngineErrorEvent(int code, const std::string& why);
  void AnswerCompletion();
  void AnswerCompletionTree();
  void AnswerCompleted(std::string text);
  void AnswerStreamEnd(bool ok, const std::string& why);
  void Abort(std::string note);
  void AnswerAborted();
  void WatchClient();
  void Finish(RolloutOutcome outcome, std::string note, std::function<void()> then);
  void SubmitFinish(RolloutOutcome outcome, Service::FinishDone done);
  void LeaveCall();
  void ObserveEnded(std::uint64_t upstream_us);
  void AnswerNotDurable(const Status& st);
  void WriteTrajectoryLine();  // outcome_ and note_
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
  std::uint64_t trace_entries_held_ = 0;  // taken from the body budget (body_hold_)
  bool trace_over_budget_ = false;
  std::uint64_t in_flight_id_ = 0;
  Service::AdmitAbandon abandon_admission_;  // until admitted: the client left, stop waiting

  // The engine call.
  std::unique_ptr<UpstreamConn> conn_;
  bool conn_reused_ = false;
  std::uint32_t connect_attempts_ = 0;
  bool retried_stale_ = false;
  boost::beast::http::request<boost::beast::http::string_body> upstream_request_;
  std::optional<boost::beast::http::response_parser<boost::beast::http::buffer_body>> parser_;
  // The answer's head while it is read (kUpstreamHeadBytesMax, kHeaderFieldsMax).
  std::optional<HeadRead> head_read_;
  std::unique_ptr<char[]> read_buf_;  // kUpstreamReadBytes, allocated (not zeroed) on first read
  std::string body_;                  // non-streamed (or error) body, bounded
  // The request's parse, then the engine's copy of it and the trace, of the server's body budget.
  BudgetHold body_hold_;
  // body_'s capacity (ReserveHeld); then the client's answer made of it, as allocated, which
  // takes its place and is handed with it to the client's connection (held until the client took
  // it).
  BudgetHold answer_hold_;
  BudgetHold tree_hold_;  // the engine answer's parsed tree while it lives (bound)
  std::string out_;       // client events of one engine read
  effects::SseState sse_;
  effects::EngineClient::ChunkFn on_chunk_;
  effects::SseState::BeforeParseFn before_parse_;
  StreamEventHold event_hold_;    // the streamed event being parsed, taken from the body budget
  StreamBufferHold stream_hold_;  // sse_.pending and out_ until the client took them
  boost::asio::steady_timer deadline_;
  bool timed_out_ = false;
  std::string transport_error_;

  // End states.
  bool client_gone_ = false;
  bool cancelled_ = false;
  bool stream_started_ = false;    // the stream's head was handed to the client's connection
  bool finished_ = false;          // Finish ran (exactly once)
  bool finish_submitted_ = false;  // its journal writes were handed to the service
  bool answering_ = false;         // the finish's callback ran; the client is being answered
  bool finish_durable_ = false;    // ... and the finish is durable
  bool line_written_ = false;
  bool failed_ = false;   // a step threw
  bool gave_up_ = false;  // the finish could not be handed over: the executor fail-stopped
  RolloutOutcome outcome_ = RolloutOutcome::kAborted;  // what Finish recorded
  std::string note_;
};

}  // namespace rc::service
