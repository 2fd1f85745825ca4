#include "service/http_server.h"

#include <pthread.h>
#include <poll.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <utility>

#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/read_size.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/http/chunk_encode.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <spdlog/spdlog.h>

#include "service/http_util.h"
#include "statemachine/hex.h"
#include "statemachine/text.h"

namespace rc::service {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;
// A loop's executor. Each loop is one io_context run by one thread, so a connection's handlers
// are serialised by running on its loop alone: no strand (one more queue and lock per handler).
using LoopExecutor = asio::io_context::executor_type;
using std::chrono::milliseconds;

namespace {

constexpr std::size_t kReadChunkBytes = 4096;
constexpr std::uint64_t kAcceptRetryMs = 50;   // after a failed accept
constexpr std::uint64_t kHangupCheckMs = 200;  // a watch whose buffer is full polls this often
constexpr std::uint64_t kStopFlushMs = 1000;   // Stop: each loop runs what it queued, at most
// Beast's limits count a request's head and its body, not a chunk-size line or a trailer: the
// read buffer's own bound caps those (and so each connection's buffer).
constexpr std::size_t kFramingSlackBytes = 64 << 10;
// Sockets beyond connections_max a server keeps for refusals (503) and lingering closes, at
// least.
constexpr std::size_t kRefusalSocketsMin = 16;
// Accepting pauses as often as a connection closes and another waits at the socket bound: its
// warnings are one line per pause, at most one this often.
constexpr std::uint64_t kAcceptPauseLogIntervalMs = 10000;

std::string_view SplitPath(std::string_view target) {
  const std::size_t q = target.find('?');
  return q == std::string_view::npos ? target : target.substr(0, q);
}

std::vector<std::string_view> SegmentsOf(std::string_view path) {
  std::vector<std::string_view> out;
  std::size_t pos = 0;
  while (pos <= path.size()) {
    std::size_t next = path.find('/', pos);
    if (next == std::string_view::npos) next = path.size();
    out.push_back(path.substr(pos, next - pos));
    pos = next + 1;
  }
  return out;
}

std::optional<std::string_view> QueryValue(std::string_view target, std::string_view key) {
  const std::size_t q = target.find('?');
  if (q == std::string_view::npos) return std::nullopt;
  for (std::string_view rest = target.substr(q + 1); !rest.empty();) {
    const std::size_t amp = rest.find('&');
    const std::string_view pair = rest.substr(0, amp);
    rest = amp == std::string_view::npos ? std::string_view() : rest.substr(amp + 1);
    const std::size_t eq = pair.find('=');
    if (pair.substr(0, eq) != key) continue;
    return eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1);
  }
  return std::nullopt;
}

// %XX decoded (and '+' as a space in queries); a malformed escape is kept as it is.
std::string PercentDecode(std::string_view in, bool plus_is_space) {
  std::string out;
  out.reserve(in.size());
  const auto hex = [](char c) { return rc::hex::digit_value(c); };
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '%' && i + 2 < in.size() && hex(in[i + 1]) >= 0 && hex(in[i + 2]) >= 0) {
      out.push_back(static_cast<char>(hex(in[i + 1]) * 16 + hex(in[i + 2])));
      i += 2;
    } else {
      out.push_back(plus_is_space && in[i] == '+' ? ' ' : in[i]);
    }
  }
  RC_CHECK(out.size() <= in.size());
  return out;
}

// Microseconds since `t` on the steady clock (never negative).
std::uint64_t UsSince(std::chrono::steady_clock::time_point t) {
  const auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t);
  return static_cast<std::uint64_t>(std::max<std::int64_t>(0, us.count()));
}

// Takes what `body`'s buffer holds beyond what `hold` holds once it passes kAnswerUnheldBytesMax
// (a hold that holds nothing is made one of `budget`'s); false, holding what it held, when the
// budget cannot give it. An answer that `must_answer` is held past the bound instead.
bool HoldAnswer(const std::string& body, ByteBudget& budget, BudgetHold& hold,
                bool must_answer = false) {
  const std::uint64_t bytes = body.capacity();
  if (bytes <= kAnswerUnheldBytesMax || bytes <= hold.held()) return true;
  if (hold.held() == 0) hold = BudgetHold(&budget);
  if (hold.Grow(bytes - hold.held())) return true;
  if (!must_answer) return false;
  hold.GrowPastBound(bytes - hold.held());
  return true;
}

// Whether a trainer request's answer reports effects already run (an update, a restore, a fleet
// change): refusing it for memory would hide their outcome from the caller, so it is held past
// the bound. Such answers are at most one per blocking thread at a time.
bool AnswersEffects(const HttpRequest& request) {
  return request.method() != bhttp::verb::get && request.method() != bhttp::verb::head;
}

// The answer in place of one the body budget cannot hold, as a request body over it gets: small
// and fixed, held nowhere. Nothing was done for the request, so the client may retry it.
HttpResponse AnswerOverBudget() {
  HttpResponse res = ErrorResponse(503, "overloaded", kBodyMemoryRefusal);
  res.set(bhttp::field::retry_after, "1");
  return res;
}

}  // namespace

std::size_t SocketsMaxFor(std::size_t connections_max) {
  return connections_max + std::max(kRefusalSocketsMin, connections_max / 8);
}

HttpResponse MakeResponse(int status, std::string body, std::string_view content_type) {
  HttpResponse res;
  SetBody(res, status, std::move(body), content_type);
  return res;
}

void SetBody(HttpResponse& res, int status, std::string body, std::string_view content_type) {
  res.result(static_cast<unsigned>(status));
  res.set(bhttp::field::content_type, content_type);
  res.body() = std::move(body);
}

// ---- Session: one connection ----

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(HttpServer& server, tcp::socket socket, LoopExecutor executor)
      : server_(server),
        executor_(std::move(executor)),
        socket_(std::move(socket)),
        timer_(executor_),
        buffer_(server.options().header_bytes_max + kFramingSlackBytes),
        body_hold_(&server.body_budget()) {}
  ~Session() {
    Uncount();
    server_.SessionClosed(this);
  }

  void Start() { ReadRequest(); }
  void Close();
  // A connection-level refusal (before any exchange): answered, then closed.
  void Refuse(int status, const std::string& type, const std::string& message);

  // Exchange operations; all on the connection's loop.
  bool Live(std::uint64_t serial) const { return serial == serial_ && !answered_ && !closed_; }
  const HttpRequest& request() const { return request_; }
  void Respond(std::uint64_t serial, HttpResponse res, BudgetHold hold = BudgetHold());
  void StartStream(std::uint64_t serial, HttpResponse head, Exchange::WriteDone done);
  void Write(std::uint64_t serial, std::string bytes, Exchange::WriteDone done);
  void End(std::uint64_t serial, std::string last_bytes, BudgetHold hold);
  void AbandonWrite(std::uint64_t serial);
  void CloseUnanswered(std::uint64_t serial) {
    if (Live(serial)) Close();
  }
  void WatchClient(std::uint64_t serial, std::function<void()> on_gone);
  const LoopExecutor& executor() const { return executor_; }
  HttpServer& server() const { return server_; }

 private:
  void ReadRequest();
  void OnFirstBytes(beast::error_code ec, std::size_t n);
  void ReadHead();
  void ParseHead();
  void OnHeadBytes(beast::error_code ec, std::size_t n);
  void RefuseFields();
  void OnHead(beast::error_code ec, std::size_t);
  void ReadBody();
  void ReadBodySome();
  bool TakeDeclaredBody();
  bool TakeBodyBudget();
  void RefuseOverBudget();
  void OnBody(beast::error_code ec, std::size_t);
  void OnRequest();
  void Linger();
  void DrainUntilEof();
  // Releases this connection's place in connections_max: at close, or once it only lingers.
  void Uncount() {
    if (counted_) {
      const std::int64_t open = --server_.mutable_counters().open_connections;
      RC_CHECK(open >= 0);
    }
    counted_ = false;
  }
  void OnResponseWritten(beast::error_code ec);
  void OnStreamWritten(beast::error_code ec);
  void AfterExchange();
  void WatchAgain();
  void WatchHangup();
  bool PeerHungUp();
  void ClientGone();
  std::size_t WatchRoom() const;
  void OnWatch(beast::error_code ec, std::size_t n);
  void StopWatching();
  void WriteChunk(std::string bytes, std::function<void(beast::error_code)> then);
  bool KeepReading() const { return keep_alive_ && !peer_closed_ && !closed_; }

  // Deadlines: one deadline, armed for one phase at a time. A read phase that expires cancels the
  // read (its handler answers 408); a write that expires closes the socket. The timer is lazy, as
  // nginx's: a wait already due no later than the new deadline stays, and when it fires early it
  // waits on for the deadline then armed. Re-arming it for every phase cost each request four
  // cancelled waits run as handlers and, whenever it was the loop's earliest, a timerfd_settime.
  enum class Phase : std::uint8_t { kIdle, kHead, kBody, kWrite };
  using DeadlineClock = asio::steady_timer::clock_type;
  void Arm(Phase phase, std::uint64_t ms);
  void WaitUntil(DeadlineClock::time_point due);
  void OnTimer(std::uint64_t wait);
  bool ReadFailed(beast::error_code ec, Phase phase);
  void Disarm() { armed_ = false; }
  bool Expired(Phase phase) const { return expired_ && expired_phase_ == phase; }

  HttpServer& server_;
  LoopExecutor executor_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  DeadlineClock::time_point deadline_{};
  Phase deadline_phase_ = Phase::kIdle;
  bool armed_ = false;  // deadline_ applies
  // A wait on timer_ is pending, due at timer_.expiry(). Only WaitUntil sets timer_'s expiry:
  // Arm's shortcut (keep a wait due first) relies on it.
  bool timer_waiting_ = false;
  std::uint64_t timer_wait_ = 0;  // the pending wait's number; earlier ones complete stale
  Phase expired_phase_ = Phase::kIdle;
  bool expired_ = false;
  beast::flat_buffer buffer_;
  BudgetHold body_hold_;  // the body budget the request being read or answered holds
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::optional<HeadRead> head_read_;  // the head being read: header_bytes_max, kHeaderFieldsMax
  HttpRequest request_;
  std::uint64_t serial_ = 0;
  bool answered_ = true;  // no exchange open
  bool first_request_ = true;
  bool keep_alive_ = true;
  bool closed_ = false;
  bool peer_closed_ = false;  // the client's half is closed: answer, then close
  bool counted_ = true;       // holds a place in connections_max

  std::unique_ptr<HttpResponse> out_;  // the response being written
  // The body budget the answer being written holds (its maker's, handed over with it): given back
  // once the answer is written or the connection closes.
  BudgetHold out_hold_;
  std::unique_ptr<bhttp::response<bhttp::empty_body>> stream_head_;
  std::unique_ptr<bhttp::response_serializer<bhttp::empty_body>> stream_sr_;
  std::string out_chunk_;
  // The stream's head or a chunk of it is being written: a write a stalled client holds.
  bool stream_write_pending_ = false;
  // The stream's body is chunked (HTTP/1.1), or ends where the connection does (HTTP/1.0).
  bool stream_chunked_ = true;

  // Client watch: a read of the socket while the handler works (watch_buf_ is its only buffer).
  std::array<char, kReadChunkBytes> watch_buf_{};
  bool watch_pending_ = false;
  bool read_after_watch_ = false;  // the next request's read waits for the watch read's end
  std::function<void()> on_gone_;
  // With the buffer full the watch cannot read on; it polls for the peer's hang-up instead.
  std::unique_ptr<asio::steady_timer> hangup_timer_;
};

void Session::ReadRequest() {
  RC_CHECK(answered_ && !watch_pending_);
  if (closed_) return;
  parser_.emplace();
  parser_->header_limit(static_cast<std::uint32_t>(server_.options().header_bytes_max));
  parser_->body_limit(server_.options().body_bytes_max);
  if (buffer_.size() > 0) return ReadHead();
  Arm(Phase::kIdle, server_.options().idle_timeout_ms);
  socket_.async_read_some(buffer_.prepare(kReadChunkBytes),
                          beast::bind_front_handler(&Session::OnFirstBytes, shared_from_this()));
}

void Session::OnFirstBytes(beast::error_code ec, std::size_t n) {
  Disarm();
  if (Expired(Phase::kIdle)) {
    server_.mutable_counters().idle_timeouts++;
    // A keep-alive connection idles out silently; a fresh one that never spoke is told.
    if (first_request_) return Refuse(408, "timeout", "no request within idle_timeout_ms");
    return Close();
  }
  if (ec) return Close();
  buffer_.commit(n);
  ReadHead();
}

void Session::ReadHead() {
  Arm(Phase::kHead, server_.options().header_timeout_ms);
  head_read_.emplace(server_.options().header_bytes_max);
  ParseHead();
}

// The head is parsed here read by read rather than by async_read_header, whose header_limit a
// head of many small fields passed (head_limits.h): every byte the parser consumed counts
// against header_bytes_max, and its fields against kHeaderFieldsMax.
void Session::ParseHead() {
  beast::error_code ec;
  switch (head_read_->Parse(*parser_, buffer_, ec)) {
    case HeadState::kTooManyFields:
      Disarm();
      return RefuseFields();
    case HeadState::kComplete:
    case HeadState::kFailed:
      return OnHead(ec, head_read_->bytes());
    case HeadState::kIncomplete:
      break;
  }
  const std::size_t room = beast::read_size(buffer_, kReadChunkBytes);  // within max_size
  if (room == 0) return OnHead(bhttp::error::buffer_overflow, head_read_->bytes());
  socket_.async_read_some(buffer_.prepare(room),
                          beast::bind_front_handler(&Session::OnHeadBytes, shared_from_this()));
}

// A read that completed as the deadline expired (the cancel found nothing to cancel) ends the
// head as a timeout: the next read would have no deadline. A head cut by the close is malformed,
// as in Beast's own read.
void Session::OnHeadBytes(beast::error_code ec, std::size_t n) {
  if (Expired(Phase::kHead)) return OnHead(asio::error::operation_aborted, head_read_->bytes());
  if (ec) return OnHead(HeadReadError(ec, parser_->got_some()), head_read_->bytes());
  buffer_.commit(n);
  ParseHead();
}

void Session::RefuseFields() {
  server_.mutable_counters().bad_requests++;
  Refuse(431, "too_large",
         "request has more than " + std::to_string(kHeaderFieldsMax) + " header fields");
}

// Ends the connection on a failed read of a request (a deadline, a bound, a malformed or cut
// request) with the answer it deserves; false when `ec` is no failure.
bool Session::ReadFailed(beast::error_code ec, Phase phase) {
  if (Expired(phase)) {
    auto& timeouts = phase == Phase::kHead ? server_.mutable_counters().header_timeouts
                                           : server_.mutable_counters().body_timeouts;
    timeouts++;
    Refuse(408, "timeout",
           phase == Phase::kHead ? "request head not complete within header_timeout_ms"
                                 : "request body not complete within body_timeout_ms");
  } else if (ec == bhttp::error::header_limit) {
    Refuse(431, "too_large",
           "request head exceeds " + std::to_string(server_.options().header_bytes_max) + " bytes");
  } else if (ec == bhttp::error::body_limit) {
    Refuse(413, "too_large", "request body exceeds body_bytes_max");
  } else if (ec == bhttp::error::buffer_overflow) {
    server_.mutable_counters().bad_requests++;
    Refuse(431, "too_large",
           "a request head, chunk-size line or trailer exceeds " +
               std::to_string(server_.options().header_bytes_max + kFramingSlackBytes) + " bytes");
  } else if (ec == bhttp::error::end_of_stream || ec == asio::error::eof ||
             ec == asio::error::connection_reset) {
    Close();
  } else if (ec) {
    server_.mutable_counters().bad_requests++;
    Refuse(400, "bad_request", "malformed HTTP request: " + ec.message());
  } else {
    return false;
  }
  return true;
}

void Session::OnHead(beast::error_code ec, std::size_t) {
  Disarm();
  if (ReadFailed(ec, Phase::kHead)) return;
  if (!TakeDeclaredBody()) return RefuseOverBudget();  // before a 100 Continue invites the body
  const auto& head = parser_->get();
  if (head[bhttp::field::expect] == "100-continue" && !parser_->is_done()) {
    out_chunk_ = "HTTP/1.1 100 Continue\r\n\r\n";
    Arm(Phase::kWrite, server_.options().write_timeout_ms);
    asio::async_write(socket_, asio::buffer(out_chunk_),
                      [self = shared_from_this()](beast::error_code wec, std::size_t) {
                        self->Disarm();
                        if (wec) return self->Close();
                        self->ReadBody();
                      });
    return;
  }
  ReadBody();
}

// Beast's string body reserves a declared Content-Length whole as the body's first byte is
// parsed: the budget takes it from the head, so clients that declare large bodies and send them
// slowly (or never) cannot make the process reserve memory the budget never saw.
bool Session::TakeDeclaredBody() {
  RC_CHECK(body_hold_.held() == 0);  // the previous exchange gave its body back
  const boost::optional<std::uint64_t> declared = parser_->content_length();
  return !declared || body_hold_.Grow(*declared);
}

// The body is charged what its string has reserved, not its length: a chunked body's string
// grows by doubling, so it may reserve up to twice the bytes received. A growth is charged once
// the read that made it returns; one that does not fit ends the request with the memory.
bool Session::TakeBodyBudget() {
  const std::uint64_t reserved = parser_->get().body().capacity();
  return reserved <= body_hold_.held() || body_hold_.Grow(reserved - body_hold_.held());
}

void Session::RefuseOverBudget() {
  server_.mutable_counters().body_memory_refused++;
  Refuse(503, "overloaded", kBodyMemoryRefusal);
}

// One deadline for the whole body, read piece by piece so each piece is budgeted as it comes.
void Session::ReadBody() {
  if (parser_->is_done()) return OnRequest();
  Arm(Phase::kBody, server_.options().body_timeout_ms);
  ReadBodySome();
}

void Session::ReadBodySome() {
  bhttp::async_read_some(socket_, buffer_, *parser_,
                         beast::bind_front_handler(&Session::OnBody, shared_from_this()));
}

void Session::OnBody(beast::error_code ec, std::size_t) {
  if (ec) Disarm();
  if (ReadFailed(ec, Phase::kBody)) return;
  if (!TakeBodyBudget()) {
    Disarm();
    return RefuseOverBudget();
  }
  if (!parser_->is_done()) return ReadBodySome();
  Disarm();
  // A chunked body's trailer adds fields to the head's.
  if (FieldsOver(parser_->get(), kHeaderFieldsMax)) return RefuseFields();
  OnRequest();
}

void Session::OnRequest() {
  RC_CHECK(parser_ && parser_->is_done() && answered_);  // the previous exchange was answered
  request_ = parser_->release();
  parser_.reset();
  first_request_ = false;
  keep_alive_ = request_.keep_alive();
  answered_ = false;
  ++serial_;
  server_.Dispatch(Exchange(shared_from_this(), serial_));
}

void Session::Refuse(int status, const std::string& type, const std::string& message) {
  RC_CHECK(answered_);
  request_ = HttpRequest();  // the answer is to a request that never formed, not the last one
  parser_.reset();           // nor is a body read in part kept past its charge (AfterExchange)
  keep_alive_ = false;
  answered_ = false;
  ++serial_;
  Respond(serial_, ErrorResponse(status, type, message));
}

void Session::Respond(std::uint64_t serial, HttpResponse res, BudgetHold hold) {
  if (!Live(serial)) return;  // the hold goes back with the answer nobody takes
  if (!HoldAnswer(res.body(), server_.body_budget(), hold)) {
    server_.mutable_counters().body_memory_refused++;
    res = AnswerOverBudget();  // the answer refused is freed here, its partial hold below
    hold.Release();
  }
  answered_ = true;
  StopWatching();
  out_ = std::make_unique<HttpResponse>(std::move(res));
  out_hold_ = std::move(hold);
  out_->version(11);
  out_->keep_alive(KeepReading());
  out_->prepare_payload();
  if (request_.method() == bhttp::verb::head) {
    // The head a GET would get, without its body: a client reads no body after HEAD, and any
    // byte sent would be taken for the next response.
    const std::size_t bytes = out_->body().size();
    out_->body().clear();
    out_->content_length(bytes);
  }
  Arm(Phase::kWrite, server_.options().write_timeout_ms);
  bhttp::async_write(socket_, *out_,
                     [self = shared_from_this()](beast::error_code ec, std::size_t) {
                       self->Disarm();
                       self->OnResponseWritten(ec);
                     });
}

void Session::OnResponseWritten(beast::error_code ec) {
  out_.reset();
  out_hold_.Release();
  if (Expired(Phase::kWrite)) server_.mutable_counters().write_timeouts++;
  if (ec) return Close();
  AfterExchange();
}

void Session::AfterExchange() {
  request_ = HttpRequest();  // the answered request's body is no longer held
  body_hold_.Release();
  if (!KeepReading()) return Linger();
  if (watch_pending_) {
    read_after_watch_ = true;  // OnWatch continues once the cancelled read has returned
    return;
  }
  ReadRequest();
}

// Closing a socket with unread input sends a reset that can destroy the answer before the
// client read it: half-close, then drain what the client still sends for a bounded time. The
// connection no longer counts against connections_max, so the bound is on the whole linger,
// however the client trickles: linger_ms, then closed.
void Session::Linger() {
  Uncount();
  beast::error_code ignored;
  socket_.shutdown(tcp::socket::shutdown_send, ignored);
  if (closed_ || peer_closed_ || watch_pending_) return Close();
  Arm(Phase::kIdle, server_.options().linger_ms);
  DrainUntilEof();
}

void Session::DrainUntilEof() {
  socket_.async_read_some(asio::buffer(watch_buf_),
                          [self = shared_from_this()](beast::error_code ec, std::size_t) {
                            if (ec || self->expired_) return self->Close();
                            self->DrainUntilEof();
                          });
}

void Session::StartStream(std::uint64_t serial, HttpResponse head, Exchange::WriteDone done) {
  if (!Live(serial)) return done(false);  // the caller still finishes what it started
  RC_CHECK(stream_sr_ == nullptr);        // one stream per exchange
  // HTTP/1.0 has no chunked coding (RFC 9112 6.1: no Transfer-Encoding to a 1.0 request): its
  // stream's body ends with the connection, which is then the connection's last answer.
  stream_chunked_ = request_.version() >= 11;
  if (!stream_chunked_) keep_alive_ = false;
  stream_head_ = std::make_unique<bhttp::response<bhttp::empty_body>>();
  stream_head_->base() = head.base();
  stream_head_->version(11);  // as every answer (RFC 9110 6.2): a 1.0 client reads 1.1 heads
  stream_head_->keep_alive(KeepReading());
  stream_head_->chunked(stream_chunked_);
  stream_sr_ = std::make_unique<bhttp::response_serializer<bhttp::empty_body>>(*stream_head_);
  Arm(Phase::kWrite, server_.options().write_timeout_ms);
  stream_write_pending_ = true;  // a head a stalled client holds is abandoned as a chunk is
  bhttp::async_write_header(socket_, *stream_sr_,
                            [self = shared_from_this(), serial, done = std::move(done)](
                                beast::error_code ec, std::size_t) {
                              self->stream_write_pending_ = false;
                              self->Disarm();
                              if (self->Expired(Phase::kWrite))
                                self->server_.mutable_counters().write_timeouts++;
                              done(!ec && self->Live(serial));
                            });
}

void Session::WriteChunk(std::string bytes, std::function<void(beast::error_code)> then) {
  out_chunk_ = std::move(bytes);
  Arm(Phase::kWrite, server_.options().write_timeout_ms);
  stream_write_pending_ = true;
  auto written = [self = shared_from_this(), then = std::move(then)](beast::error_code ec,
                                                                     std::size_t) {
    self->stream_write_pending_ = false;
    std::string().swap(self->out_chunk_);  // freed before `then`: a hold on it may go back there
    self->Disarm();
    if (self->Expired(Phase::kWrite)) {
      self->server_.mutable_counters().write_timeouts++;
    }
    then(ec);
  };
  if (stream_chunked_) {
    asio::async_write(socket_, bhttp::make_chunk(asio::buffer(out_chunk_)), std::move(written));
  } else {
    asio::async_write(socket_, asio::buffer(out_chunk_), std::move(written));
  }
}

void Session::Write(std::uint64_t serial, std::string bytes, Exchange::WriteDone done) {
  if (!Live(serial) || stream_sr_ == nullptr) return done(false);
  RC_CHECK(!bytes.empty());  // an empty chunk would end the chunked body
  WriteChunk(std::move(bytes),
             [self = shared_from_this(), serial, done = std::move(done)](beast::error_code ec) {
               if (ec) self->Close();
               done(!ec && self->Live(serial));
             });
}

void Session::End(std::uint64_t serial, std::string last_bytes, BudgetHold hold) {
  if (!Live(serial) || stream_sr_ == nullptr) return;
  if (!HoldAnswer(last_bytes, server_.body_budget(), hold)) {
    // A stream's head is sent: no other answer can take its place, and the client sees it cut.
    server_.mutable_counters().body_memory_refused++;
    return Close();
  }
  answered_ = true;
  StopWatching();
  out_hold_ = std::move(hold);
  auto finish = [self = shared_from_this()](beast::error_code ec) {
    if (ec) return self->Close();
    // A close-delimited body ends as the connection is shut (not kept alive: Linger).
    if (!self->stream_chunked_) return self->OnStreamWritten(ec);
    self->Arm(Phase::kWrite, self->server_.options().write_timeout_ms);
    asio::async_write(self->socket_, bhttp::make_chunk_last(),
                      [self](beast::error_code wec, std::size_t) {
                        self->Disarm();
                        self->OnStreamWritten(wec);
                      });
  };
  if (last_bytes.empty()) return finish(beast::error_code());
  WriteChunk(std::move(last_bytes), std::move(finish));
}

void Session::OnStreamWritten(beast::error_code ec) {
  RC_CHECK(stream_chunked_ || !keep_alive_);  // nothing follows a close-delimited body
  stream_sr_.reset();
  stream_head_.reset();
  OnResponseWritten(ec);
}

// A stream's write (its head or a chunk) that waits on a client who stopped reading ends only at
// write_timeout_ms: a shutdown that must end the stream now closes the connection, and the write
// fails at once.
void Session::AbandonWrite(std::uint64_t serial) {
  if (Live(serial) && stream_write_pending_) Close();
}

void Session::WatchClient(std::uint64_t serial, std::function<void()> on_gone) {
  if (!Live(serial) || watch_pending_ || peer_closed_) return;
  on_gone_ = std::move(on_gone);
  WatchAgain();
}

// What a watch read may take: the bytes it reads are kept, so never more than the read buffer's
// bound leaves room for (0: the buffer is full, and the watch waits for the request's own read).
std::size_t Session::WatchRoom() const {
  return std::min(watch_buf_.size(), buffer_.max_size() - buffer_.size());
}

// Bytes the watch reads are the client's next request, early: kept for it, and the watch goes on
// (a client that pipelines and then leaves is still seen leaving) while they fit the header
// bound; beyond it the watch reads no more (back-pressure) and looks for the hang-up alone.
void Session::OnWatch(beast::error_code ec, std::size_t n) {
  watch_pending_ = false;
  if (n > 0) {
    auto dst = buffer_.prepare(n);
    asio::buffer_copy(dst, asio::buffer(watch_buf_.data(), n));
    buffer_.commit(n);
  }
  const bool watching = !ec && !read_after_watch_ && !answered_ && on_gone_;
  if (watching) return WatchAgain();
  if (ec && ec != asio::error::operation_aborted) ClientGone();
  on_gone_ = nullptr;
  if (read_after_watch_) {
    read_after_watch_ = false;
    if (KeepReading()) return ReadRequest();
    return Close();
  }
}

void Session::ClientGone() {
  peer_closed_ = true;
  std::function<void()> gone = std::move(on_gone_);
  on_gone_ = nullptr;
  if (!answered_ && gone) gone();
}

void Session::WatchAgain() {
  RC_CHECK(!watch_pending_ && on_gone_);
  const std::size_t room = buffer_.size() < server_.options().header_bytes_max ? WatchRoom() : 0;
  if (room == 0) return WatchHangup();
  watch_pending_ = true;
  socket_.async_read_some(asio::buffer(watch_buf_.data(), room),
                          beast::bind_front_handler(&Session::OnWatch, shared_from_this()));
}

void Session::WatchHangup() {
  if (!hangup_timer_) hangup_timer_ = std::make_unique<asio::steady_timer>(executor_);
  hangup_timer_->expires_after(milliseconds(kHangupCheckMs));
  hangup_timer_->async_wait([self = shared_from_this()](beast::error_code ec) {
    if (ec || self->answered_ || self->closed_ || !self->on_gone_) return;
    if (!self->PeerHungUp()) return self->WatchHangup();
    self->ClientGone();
  });
}

// POLLRDHUP is the peer's FIN even behind unread bytes; POLLHUP/POLLERR a reset or a dead socket.
bool Session::PeerHungUp() {
  pollfd p{socket_.native_handle(), POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

void Session::StopWatching() {
  on_gone_ = nullptr;
  if (hangup_timer_) hangup_timer_->cancel();
  if (!watch_pending_) return;
  beast::error_code ignored;
  socket_.cancel(ignored);
}

void Session::Close() {
  if (closed_) return;
  closed_ = true;
  on_gone_ = nullptr;
  if (hangup_timer_) hangup_timer_->cancel();
  Disarm();
  timer_.cancel();
  Uncount();
  out_hold_.Release();  // the answer's write, if any, fails now
  beast::error_code ignored;
  socket_.close(ignored);
}

void Session::Arm(Phase phase, std::uint64_t ms) {
  deadline_ = DeadlineClock::now() + milliseconds(ms);
  deadline_phase_ = phase;
  armed_ = true;
  expired_ = false;
  if (timer_waiting_ && timer_.expiry() <= deadline_) return;  // fires first, then waits on
  WaitUntil(deadline_);
}

// The wait holds the session weakly: a deadline never keeps a finished connection alive.
void Session::WaitUntil(DeadlineClock::time_point due) {
  timer_.expires_at(due);  // a pending later wait completes, stale
  const std::uint64_t wait = ++timer_wait_;
  timer_waiting_ = true;
  timer_.async_wait([weak = weak_from_this(), wait](beast::error_code) {
    if (auto self = weak.lock()) self->OnTimer(wait);
  });
}

void Session::OnTimer(std::uint64_t wait) {
  if (wait != timer_wait_) return;  // replaced by a wait for an earlier deadline
  timer_waiting_ = false;
  if (!armed_ || closed_) return;
  if (DeadlineClock::now() < deadline_) return WaitUntil(deadline_);  // re-armed later meanwhile
  armed_ = false;
  expired_ = true;
  expired_phase_ = deadline_phase_;
  if (deadline_phase_ == Phase::kWrite) return Close();
  beast::error_code ignored;
  socket_.cancel(ignored);  // the read completes with operation_aborted
}

// ---- Exchange ----

Exchange::Exchange(std::shared_ptr<Session> session, std::uint64_t serial)
    : session_(std::move(session)), serial_(serial) {}

const HttpRequest& Exchange::request() const { return session_->request(); }

std::string_view Exchange::path() const {
  const auto t = request().target();
  return SplitPath(std::string_view(t.data(), t.size()));
}

std::optional<std::string_view> Exchange::header(std::string_view name, bool* duplicate) const {
  const auto range = request().equal_range(beast::string_view(name.data(), name.size()));
  if (range.first == range.second) return std::nullopt;
  const bool dup = std::next(range.first) != range.second;
  if (duplicate != nullptr) *duplicate = dup;
  const auto v = range.first->value();
  return std::string_view(v.data(), v.size());
}

void Exchange::Respond(HttpResponse response) {
  RC_CHECK(session_->executor().running_in_this_thread());
  session_->Respond(serial_, std::move(response));
}

void Exchange::Respond(HttpResponse response, BudgetHold hold) {
  RC_CHECK(session_->executor().running_in_this_thread());
  session_->Respond(serial_, std::move(response), std::move(hold));
}

void Exchange::StartStream(HttpResponse head, WriteDone done) {
  RC_CHECK(session_->executor().running_in_this_thread());
  session_->StartStream(serial_, std::move(head), std::move(done));
}

void Exchange::Write(std::string bytes, WriteDone done) {
  RC_CHECK(session_->executor().running_in_this_thread());
  session_->Write(serial_, std::move(bytes), std::move(done));
}

void Exchange::End(std::string last_bytes) {
  RC_CHECK(session_->executor().running_in_this_thread());
  session_->End(serial_, std::move(last_bytes), BudgetHold());
}

void Exchange::End(std::string last_bytes, BudgetHold hold) {
  RC_CHECK(session_->executor().running_in_this_thread());
  session_->End(serial_, std::move(last_bytes), std::move(hold));
}

void Exchange::AbandonWrite() {
  RC_CHECK(session_->executor().running_in_this_thread());
  session_->AbandonWrite(serial_);
}

void Exchange::Close() {
  RC_CHECK(session_->executor().running_in_this_thread());
  session_->CloseUnanswered(serial_);
}

void Exchange::WatchClient(std::function<void()> on_gone) {
  RC_CHECK(session_->executor().running_in_this_thread());
  session_->WatchClient(serial_, std::move(on_gone));
}

asio::any_io_executor Exchange::executor() const { return session_->executor(); }
bool Exchange::OnItsLoop() const { return session_->executor().running_in_this_thread(); }
ByteBudget& Exchange::body_budget() const { return session_->server().body_budget(); }

void Exchange::Post(std::function<void()> fn) const {
  asio::post(session_->executor(), std::move(fn));
}

std::optional<std::string> ApiRequest::query(std::string_view key) const {
  const auto t = message.target();
  auto v = QueryValue(std::string_view(t.data(), t.size()), key);
  if (!v) return std::nullopt;
  return PercentDecode(*v, /*plus_is_space=*/true);
}

std::string ApiRequest::header(std::string_view name) const {
  const auto it = message.find(beast::string_view(name.data(), name.size()));
  return it == message.end() ? std::string() : std::string(it->value());
}

// ---- HttpRouter ----

void HttpRouter::Async(bhttp::verb method, std::string pattern, AsyncHandler handler) {
  RC_CHECK(!pattern.empty() && pattern.front() == '/' && handler != nullptr);
  Route r{method, {}, std::move(handler), nullptr};
  for (auto s : SegmentsOf(pattern)) r.segments.emplace_back(s);
  routes_.push_back(std::move(r));
}

void HttpRouter::Blocking(bhttp::verb method, std::string pattern, BlockingHandler handler) {
  RC_CHECK(!pattern.empty() && pattern.front() == '/' && handler != nullptr);
  Route r{method, {}, nullptr, std::move(handler)};
  for (auto s : SegmentsOf(pattern)) r.segments.emplace_back(s);
  routes_.push_back(std::move(r));
}

HttpRouter::Match HttpRouter::Find(bhttp::verb method, std::string_view path) const {
  Match m;
  const std::vector<std::string_view> segs = SegmentsOf(path);
  for (const Route& r : routes_) {
    if (r.segments.size() != segs.size()) continue;
    std::vector<std::string> captures;
    bool ok = true;
    for (std::size_t i = 0; ok && i < segs.size(); ++i) {
      if (r.segments[i] == "*") {
        ok = !segs[i].empty();
        captures.push_back(PercentDecode(segs[i], /*plus_is_space=*/false));
      } else {
        ok = r.segments[i] == segs[i];
      }
    }
    if (!ok) continue;
    m.path_known = true;
    if (r.method != method) continue;
    m.async = r.async ? &r.async : nullptr;
    m.blocking = r.blocking ? &r.blocking : nullptr;
    m.captures = std::move(captures);
    return m;
  }
  // A path some route has, asked with another method, is a 405, never the fallback's.
  if (fallback_ && !m.path_known) m.async = &fallback_;
  return m;
}

// ---- HttpServer ----

// The threads that run blocking routes: one io_context that they all run, its threads started by
// Start (asio::thread_pool starts its own in its constructor, where a refusal cannot be a Status,
// and one refused after the first leaves the others waiting for work that never ends: a hang).
struct HttpServer::BlockingPool {
  explicit BlockingPool(std::size_t n)
      : threads_max(n), context(n == 1 ? 1 : 0), work(asio::make_work_guard(context)) {}
  ~BlockingPool() { Stop(); }
  BlockingPool(const BlockingPool&) = delete;
  BlockingPool& operator=(const BlockingPool&) = delete;

  Status Start(const effects::ThreadStarter& starter) {
    RC_CHECK(threads.empty());
    threads.reserve(threads_max);  // no allocation between a thread's start and its keeping
    for (std::size_t i = 0; i < threads_max; ++i) {
      Result<std::thread> t = effects::StartThread(
          "HTTP handler thread " + std::to_string(i),
          [this, i] {
            const std::string name = "rc-api-" + std::to_string(i);  // 15 bytes for the kernel
            pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
            context.run();
          },
          starter);
      if (!t.ok()) return t.status();
      threads.push_back(std::move(t).value());
    }
    return Status::OK();
  }
  // Returns once every handler queued has run and the threads ended.
  void Join() {
    work.reset();
    JoinThreads();
  }
  // Handlers not started are dropped; those running are waited for.
  void Stop() {
    context.stop();
    JoinThreads();
  }
  void JoinThreads() {
    for (std::thread& t : threads) t.join();
    threads.clear();
  }

  const std::size_t threads_max;
  asio::io_context context;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::vector<std::thread> threads;
  std::mutex mu;
  std::condition_variable idle_cv;
  std::size_t in_flight = 0;  // queued or running
};

namespace {

// Each loop is run by exactly one thread (RunLoop): a connection's handlers rely on that to never
// run at once (they have no strand).
std::vector<std::unique_ptr<asio::io_context>> MakeLoops(std::size_t n) {
  RC_CHECK(n >= 1);
  std::vector<std::unique_ptr<asio::io_context>> loops;
  for (std::size_t i = 0; i < n; ++i) loops.push_back(std::make_unique<asio::io_context>(1));
  return loops;
}

}  // namespace

HttpServer::HttpServer(HttpServerOptions options, HttpRouter router)
    : options_(std::move(options)),
      router_(std::move(router)),
      sockets_max_(SocketsMaxFor(options_.connections_max)),
      body_budget_(options_.body_memory_bytes_max),
      loops_(MakeLoops(options_.io_threads)),
      acceptor_(std::in_place, *loops_.front()),
      accept_retry_(std::in_place, *loops_.front()),
      blocking_(std::make_unique<BlockingPool>(options_.blocking_threads)) {
  RC_CHECK(options_.io_threads >= 1 && options_.blocking_threads >= 1);
  RC_CHECK(options_.connections_max >= 1 && options_.body_bytes_max >= 1);
}

HttpServer::~HttpServer() {
  if (!io_threads_.empty()) (void)Stop(0);
  // The blocking pool goes before the loops, while every loop still exists (stopped: nothing runs
  // on them): its threads are joined first (a handler Stop left running past its deadline posts
  // its answer to a loop, and uses blocking_, as it returns), then the handlers its queue dropped
  // are destroyed, each holding a Session whose socket and timer are a loop's.
  blocking_->Stop();
  blocking_.reset();
  // The first loop's queue may hold the accept handler with the executor of another loop: the
  // acceptor and that loop go first, then the others, each before anything it refers to.
  acceptor_.reset();
  accept_retry_.reset();
  guards_.clear();
  for (auto& loop : loops_) loop.reset();
}

Result<int> HttpServer::Start() {
  RC_CHECK(io_threads_.empty());
  RC_RETURN_IF_ERROR(Listen());
  const int port = acceptor_->local_endpoint().port();
  Accept();
  // A loop with no connection yet has no work: the guard keeps it running until Stop.
  for (auto& loop : loops_) guards_.push_back(asio::make_work_guard(*loop));
  if (Status started = StartThreads(); !started.ok()) {
    AbandonStart();
    return started;
  }
  RC_CHECK(io_threads_.size() == options_.io_threads && loops_.size() == options_.io_threads);
  return port;
}

// The blocking pool's threads, then the event loops'; the first the system refuses ends it.
// The pool's first: only a loop's handler posts to the pool, so a pool thread refused before any
// loop runs leaves no blocking call queued in a pool that will never run it (a connection already
// in the backlog is never accepted). A loop refused later may have posted calls, which the
// started pool runs or drops; either way each answer's Session is let go while the loops exist
// (AbandonStart, the destructor).
Status HttpServer::StartThreads() {
  RC_RETURN_IF_ERROR(blocking_->Start(options_.thread_starter));
  io_threads_.reserve(loops_.size());  // no allocation between a thread's start and its keeping
  for (std::size_t i = 0; i < loops_.size(); ++i) {
    Result<std::thread> t = effects::StartThread(
        "HTTP event loop thread " + std::to_string(i), [this, i] { RunLoop(i); },
        options_.thread_starter);
    if (!t.ok()) return t.status();
    io_threads_.push_back(std::move(t).value());
  }
  return Status::OK();
}

// A Start that failed part-way: the threads it started are stopped and joined (no connection was
// announced, so nothing is drained), and the listening socket is closed. The loops stop first,
// so nothing posts to the pool while it stops; the blocking calls a loop posted before then are
// dropped with the pool's queue, before the loops go (the destructor). The server is stopping
// from here: Stop returns at once, the destructor releases the rest.
void HttpServer::AbandonStart() {
  stopping_.store(true);
  for (auto& loop : loops_) loop->stop();
  for (auto& t : io_threads_) t.join();
  io_threads_.clear();
  guards_.clear();
  blocking_->Stop();
  beast::error_code ignored;
  acceptor_->close(ignored);  // no loop runs now: its pending accept is destroyed with the loop
  RC_CHECK(io_threads_.empty() && blocking_->threads.empty());
}

Status HttpServer::Listen() {
  beast::error_code ec;
  const auto address = asio::ip::make_address(options_.host, ec);
  if (ec) return Status::InvalidArgument("listen_host '" + options_.host + "': " + ec.message());
  const tcp::endpoint endpoint(address, static_cast<std::uint16_t>(options_.port));
  if (acceptor_->open(endpoint.protocol(), ec); ec) {
    return Status::Unavailable("cannot open a socket: " + ec.message());
  }
  acceptor_->set_option(asio::socket_base::reuse_address(true), ec);
  if (acceptor_->bind(endpoint, ec); ec) {
    return Status::Unavailable("cannot bind " + options_.host + ":" +
                               std::to_string(options_.port) + ": " + ec.message());
  }
  if (acceptor_->listen(asio::socket_base::max_listen_connections, ec); ec) {
    return Status::Unavailable("cannot listen: " + ec.message());
  }
  return Status::OK();
}

// One io thread: runs its loop until it is stopped; a handler bug must not take the loop down,
// whatever it throws (logged on one line). A proxied rollout's steps catch their own exceptions
// and finish the rollout (ProxyExchange::Step): the loop cannot tell which rollout one was.
void HttpServer::RunLoop(std::size_t loop) {
  const std::string name = "rc-io-" + std::to_string(loop);  // at most 15 bytes for the kernel
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  for (;;) {
    try {
      loops_[loop]->run();
      return;
    } catch (const std::exception& e) {
      spdlog::critical("http: exception escaped a handler: {}", text::escape_line(e.what()));
    } catch (...) {
      spdlog::critical("http: an exception not derived from std::exception escaped a handler");
    }
  }
}

// At sockets_max_ sessions the server accepts no more until one closes (SessionClosed accepts
// again): the connections wait in the listen backlog, and the descriptors the rest of the
// process needs (the engine monitor's, the journal's) are never taken by clients.
void HttpServer::Accept() {
  {
    std::unique_lock<std::mutex> g(sessions_mu_);
    if (sessions_.size() >= sockets_max_) {
      const std::optional<std::uint64_t> unlogged = PauseAccepting();
      g.unlock();
      if (unlogged) LogAcceptPause(*unlogged);
      return;
    }
  }
  // Only this handler (on the first loop) advances next_loop_.
  const LoopExecutor loop = loops_[next_loop_++ % loops_.size()]->get_executor();
  acceptor_->async_accept(loop, [this, loop](beast::error_code ec, tcp::socket socket) {
    if (stopping_.load() || !acceptor_->is_open()) return;
    if (!ec) {
      counters_.accepted++;
      beast::error_code option_ec;  // a socket option failing is no accept error
      socket.set_option(tcp::no_delay(true), option_ec);
      auto session = std::make_shared<Session>(*this, std::move(socket), loop);
      const bool over = counters_.open_connections.fetch_add(1) >=
                        static_cast<std::int64_t>(options_.connections_max);
      {
        std::lock_guard<std::mutex> g(sessions_mu_);
        sessions_.emplace(session.get(), session);
      }
      if (over) counters_.refused_over_budget++;
      asio::dispatch(loop, [session, over] {
        if (over)
          return session->Refuse(503, "overloaded",
                                 "too many connections "
                                 "(http_connections_max)");
        session->Start();
      });
    }
    if (ec) return AcceptLater();
    Accept();
  });
}

// An accept failed (most likely out of file descriptors): tried again after a pause, since
// trying at once would spin the first loop while nothing frees a descriptor.
void HttpServer::AcceptLater() {
  counters_.accept_errors++;
  accept_retry_->expires_after(milliseconds(kAcceptRetryMs));
  accept_retry_->async_wait([this](beast::error_code ec) {
    if (ec || stopping_.load() || !acceptor_->is_open()) return;
    Accept();
  });
}

// Under sessions_mu_, from Accept, which never runs while paused (none is pending then, and only
// SessionClosed starts one again). The pauses not logged since the last warning when this pause
// is to be logged; nullopt when the last warning is too recent.
std::optional<std::uint64_t> HttpServer::PauseAccepting() {
  RC_CHECK(!accept_paused_);
  accept_paused_ = true;
  counters_.accept_pauses++;
  paused_since_ = std::chrono::steady_clock::now();
  if (pause_logged_ && paused_since_ - *pause_logged_ < milliseconds(kAcceptPauseLogIntervalMs)) {
    pauses_unlogged_++;
    return std::nullopt;
  }
  pause_logged_ = paused_since_;
  return std::exchange(pauses_unlogged_, 0);
}

void HttpServer::LogAcceptPause(std::uint64_t unlogged) const {
  const std::string since =
      unlogged == 0 ? ""
                    : " (" + std::to_string(unlogged) + " more pauses since the last such line)";
  spdlog::warn(
      "http: accepting paused: {} client sockets are open, the most serve keeps "
      "(http_connections_max {} and a margin for refusals); new connections wait in the listen "
      "backlog until one closes (rolloutcore_http_accept_pauses_total){}",
      sockets_max_, options_.connections_max, since);
}

HttpServer::AcceptPaused HttpServer::accept_paused() const {
  std::lock_guard<std::mutex> g(sessions_mu_);
  AcceptPaused out{paused_us_, accept_paused_};
  if (accept_paused_) out.paused_us += UsSince(paused_since_);
  return out;
}

void HttpServer::SessionClosed(Session* session) {
  std::lock_guard<std::mutex> g(sessions_mu_);
  sessions_.erase(session);
  if (!accept_paused_ || sessions_.size() >= sockets_max_ || stopping_.load()) return;
  accept_paused_ = false;  // one Accept: none is pending while paused
  paused_us_ += UsSince(paused_since_);
  asio::post(*loops_.front(), [this] {
    if (!stopping_.load() && acceptor_ && acceptor_->is_open()) Accept();
  });
}

// HEAD is answered as GET without the body (Session::Respond drops it), on the blocking routes
// the server answers itself; an async route (proxied or relayed to an engine, which would answer
// HEAD without the body its parser waits for) answers it 405, the fallback 404.
HttpRouter::Match HttpServer::RouteOf(const Exchange& ex) const {
  if (ex.request().method() != bhttp::verb::head) {
    return router_.Find(ex.request().method(), ex.path());
  }
  HttpRouter::Match m = router_.Find(bhttp::verb::get, ex.path());
  m.async = nullptr;
  return m;
}

void HttpServer::Dispatch(const Exchange& exchange) {
  Exchange ex = exchange;
  const HttpRouter::Match m = RouteOf(ex);
  if (m.blocking != nullptr) return RunBlocking(m.blocking, m.captures, ex);
  if (m.async == nullptr) {
    const std::string route = text::escape_line(std::string(ex.request().method_string())) + " " +
                              text::escape_line(std::string(ex.path()));
    if (m.path_known) {
      return ex.Respond(ErrorResponse(405, "method_not_allowed", "no route " + route));
    }
    return ex.Respond(ErrorResponse(404, "not_found", "no route " + route));
  }
  try {
    (*m.async)(ex);
  } catch (const std::exception& e) {
    spdlog::error("http: handler failed: {}", text::escape_line(e.what()));
    ex.Respond(ErrorResponse(500, "internal", "internal error"));
  } catch (...) {
    spdlog::error("http: handler failed: an exception not derived from std::exception");
    ex.Respond(ErrorResponse(500, "internal", "internal error"));
  }
}

void HttpServer::RunBlocking(const BlockingHandler* handler, std::vector<std::string> captures,
                             Exchange exchange) {
  const BlockingSlot slot = TakeBlockingSlot();
  if (slot != BlockingSlot::kTaken) {
    HttpResponse res =
        slot == BlockingSlot::kStopping
            ? ErrorResponse(503, "shutting_down", "the server is stopping")
            : ErrorResponse(503, "overloaded", "too many trainer API calls in flight");
    res.set(bhttp::field::retry_after, "1");
    return exchange.Respond(std::move(res));
  }
  asio::post(blocking_->context, [this, handler, captures = std::move(captures), exchange] {
    RunHandler(handler, captures, exchange);
  });
}

// A place among the blocking_queue_max calls queued or running; kFull (counted) when all are
// taken. Stop is seen under the pool's lock: Stop waits for every slot taken before it began,
// and none is taken after.
HttpServer::BlockingSlot HttpServer::TakeBlockingSlot() {
  std::lock_guard<std::mutex> g(blocking_->mu);
  if (stopping_.load()) return BlockingSlot::kStopping;
  if (blocking_->in_flight >= options_.blocking_queue_max) {
    counters_.blocking_refused++;
    return BlockingSlot::kFull;
  }
  blocking_->in_flight++;
  RC_CHECK(blocking_->in_flight <= options_.blocking_queue_max);
  return BlockingSlot::kTaken;
}

// On a pool thread: the handler's answer goes back to the exchange's loop, then the slot is
// given back. A handler that throws is answered 500; an exception out of a plan's runner call
// never comes here (Service::DrivePlan answers it 503 outcome_unknown). An answer past
// kAnswerUnheldBytesMax (a page of /v1/events, a full /v1/state) is held against the body budget
// here, before it is queued for its loop, and its hold goes with it to the connection (held until
// the client took it); one the budget cannot hold is freed here, and the client gets 503.
void HttpServer::RunHandler(const BlockingHandler* handler,
                            const std::vector<std::string>& captures, const Exchange& exchange) {
  HttpResponse res;
  try {
    const ApiRequest api{exchange.request(), captures, exchange};
    (*handler)(api, res);
  } catch (const std::exception& e) {
    spdlog::error("http: handler failed: {}", text::escape_line(e.what()));
    res = ErrorResponse(500, "internal", "internal error");
  } catch (...) {
    spdlog::error("http: handler failed: an exception not derived from std::exception");
    res = ErrorResponse(500, "internal", "internal error");
  }
  auto hold = std::make_shared<BudgetHold>(&body_budget_);  // a posted function is copyable
  if (!HoldAnswer(res.body(), body_budget_, *hold, AnswersEffects(exchange.request()))) {
    counters_.body_memory_refused++;
    res = AnswerOverBudget();
    hold->Release();
  }
  exchange.Post([exchange, res = std::move(res), hold]() mutable {
    Exchange ex = exchange;
    ex.Respond(std::move(res), std::move(*hold));
  });
  std::lock_guard<std::mutex> g(blocking_->mu);
  RC_CHECK(blocking_->in_flight > 0);
  blocking_->in_flight--;
  blocking_->idle_cv.notify_all();
}

bool HttpServer::Stop(std::uint64_t deadline_ms) {
  std::lock_guard<std::mutex> one_stop(stop_mu_);
  if (stopping_.exchange(true)) return JoinBlocking(deadline_ms);
  asio::post(*loops_.front(), [this] {
    beast::error_code ignored;
    acceptor_->close(ignored);
  });
  // Blocking handlers end first, their connections still open: each posts its answer to its
  // connection's loop before it gives its place back, so once none runs, every answer is queued
  // ahead of the closes below and its write starts before its connection closes (an update's
  // answer given as serve shuts down reaches the trainer). Calls that come meanwhile get 503.
  const bool drained = WaitBlockingIdle(deadline_ms);
  CloseSessions();
  if (!io_threads_.empty()) FlushLoops(kStopFlushMs);  // loops that never ran flush nothing
  for (auto& loop : loops_) loop->stop();
  for (auto& t : io_threads_) t.join();
  guards_.clear();
  io_threads_.clear();
  // Not drained: the pool's threads still run handlers, not joined here. Each posts its answer to
  // its connection's loop as it returns, which is safe while the loops exist: the destructor
  // joins the pool before it destroys them.
  if (!drained) return false;
  blocking_->Join();
  return true;
}

// A Stop after the first, or after a Start that failed (AbandonStart stopped the pool): the
// handlers an earlier Stop left running get `deadline_ms` more, then the pool is joined. A pool
// joined already (or never started) has nothing left to run: true at once.
bool HttpServer::JoinBlocking(std::uint64_t deadline_ms) {
  if (blocking_->threads.empty()) return true;
  if (!WaitBlockingIdle(deadline_ms)) return false;
  blocking_->Join();
  return true;
}

bool HttpServer::WaitBlockingIdle(std::uint64_t timeout_ms) {
  std::unique_lock<std::mutex> l(blocking_->mu);
  return blocking_->idle_cv.wait_for(l, milliseconds(timeout_ms),
                                     [&] { return blocking_->in_flight == 0; });
}

void HttpServer::CloseSessions() {
  std::vector<std::shared_ptr<Session>> open;
  {
    std::lock_guard<std::mutex> g(sessions_mu_);
    for (auto& [raw, weak] : sessions_) {
      if (auto s = weak.lock()) open.push_back(std::move(s));
    }
  }
  for (auto& s : open) asio::post(s->executor(), [s] { s->Close(); });
}

// Each loop runs what was queued on it before this call (answers, then closes), or `timeout_ms`
// passes. Called off the loops (a loop waiting on itself would wait out the timeout).
void HttpServer::FlushLoops(std::uint64_t timeout_ms) {
  struct Flush {
    std::mutex mu;
    std::condition_variable cv;
    std::size_t left = 0;
  };
  auto flush = std::make_shared<Flush>();
  flush->left = loops_.size();
  for (auto& loop : loops_) {
    asio::post(*loop, [flush] {
      std::lock_guard<std::mutex> g(flush->mu);
      RC_CHECK(flush->left > 0);
      flush->left--;
      flush->cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> l(flush->mu);
  flush->cv.wait_for(l, milliseconds(timeout_ms), [&] { return flush->left == 0; });
}

}  // namespace rc::service
