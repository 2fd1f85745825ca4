#include "service/proxy_exchange.h"

#include <algorithm>
#include <chrono>

#include <openssl/crypto.h>

#include <boost/asio/bind_executor.hpp>
#include <boost/beast/core/read_size.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>
#include <spdlog/spdlog.h>

#include "effects/clock.h"
#include "journal/json.h"
#include "effects/http/response_parsers.h"
#include "service/balancer.h"
#include "service/answer_relay.h"
#include "service/api_parse.h"
#include "service/http_util.h"
#include "service/service_internal.h"
#include "service/trajectory_line.h"
#include "statemachine/text.h"

namespace rc::service {

namespace asio = boost::asio;
namespace beast = boost::beast;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kRolloutIdHeader = "X-RolloutCore-Rollout-Id";

// What of `text` fits the prefix's first `bytes`: a long string costs the prefix's copy, never
// its own.
void AppendUpTo(std::string_view text, std::size_t bytes, std::string& out) {
  if (out.size() >= bytes) return;
  out.append(text.substr(0, bytes - out.size()));
}

// A chat message's content as affinity text, up to `bytes`: a string as it is, or the text of
// each text part (an image part adds nothing: its bytes would cost a dump and say nothing of the
// prefix).
void AppendContent(const json& content, std::size_t bytes, std::string& out) {
  if (content.is_string()) return AppendUpTo(content.get_ref<const std::string&>(), bytes, out);
  if (!content.is_array()) return;
  for (const json& part : content) {
    if (out.size() >= bytes) return;
    if (!part.is_object()) continue;
    const auto text = part.find("text");
    if (text != part.end() && text->is_string()) {
      AppendUpTo(text->get_ref<const std::string&>(), bytes, out);
    }
  }
}

// A batch's prompt of token ids as affinity text: its scalars, comma-separated, up to `bytes`.
void AppendScalars(const json& list, std::size_t bytes, std::string& out) {
  for (const json& x : list) {
    if (out.size() >= bytes) return;
    if (x.is_primitive()) out += DumpSafe(x);
    out += ',';
  }
}

// One element of a prompt as affinity text, then a newline: a string as it is, a chat message as
// role ':' content, a token id (or any other scalar) as its JSON, a list of token ids as its ids.
// Nothing is dumped or copied whole.
void AppendPromptElement(const json& e, std::size_t bytes, std::string& out) {
  if (e.is_string()) {
    AppendUpTo(e.get_ref<const std::string&>(), bytes, out);
  } else if (e.is_object()) {
    const auto role = e.find("role");
    if (role != e.end() && role->is_string()) {
      AppendUpTo(role->get_ref<const std::string&>(), bytes, out);
    }
    out += ':';
    const auto content = e.find("content");
    if (content != e.end()) AppendContent(*content, bytes, out);
  } else if (e.is_primitive()) {
    out += DumpSafe(e);
  } else if (e.is_array()) {
    AppendScalars(e, bytes, out);
  }
  out += '\n';
}

// The prompt's first `bytes` as affinity text, built element by element: a long prompt costs
// what its prefix costs, never a dump of the whole.
std::string PromptPrefix(const json& prompt, std::size_t bytes) {
  std::string out;
  if (!prompt.is_array()) {
    AppendPromptElement(prompt, bytes, out);
  } else {
    for (const json& e : prompt) {
      if (out.size() >= bytes) break;
      AppendPromptElement(e, bytes, out);
    }
  }
  if (out.size() > bytes) out.resize(bytes);
  return out;
}
const std::string kDoneEvent = "data: [DONE]\n\n";

// The engine's answer read into a tree is held against the body budget before it is built, as a
// client's request is (Parse): 16 MiB of "[{},{},...]" is hundreds of MB of nodes.
constexpr const char* kAnswerOverBudget =
    "the engine's answer, parsed, would take more of serve's memory budget than is left "
    "(body_memory_bytes_max)";
// The client's answer made of it is held in the engine body's place until the client took it.
constexpr const char* kClientAnswerOverBudget =
    "the client's answer would take more of serve's memory budget than is left "
    "(body_memory_bytes_max)";

// Makes room in `text` for `n` more bytes, `hold` (which holds text's capacity) taking the new
// capacity before it is allocated. It grows as an append does, doubling, so a body read piece by
// piece is copied about once; but never past `bytes_max` (at least text.size() + n), where an
// append's own doubling would take up to twice the bound. An answer is held as allocated, not by
// its length: the whole buffer waits on the client. False when the budget cannot give it (text as
// it was; the caller ends the call).
bool ReserveHeld(std::string& text, std::size_t n, std::size_t bytes_max, BudgetHold& hold) {
  const std::size_t need = text.size() + n;
  RC_CHECK(need <= bytes_max);
  if (need <= text.capacity()) return true;
  const std::size_t capacity = std::min(std::max(need, 2 * text.capacity()), bytes_max);
  if (!hold.ResizeTo(capacity)) return false;
  std::string grown;
  grown.reserve(capacity);  // from an empty string: exactly that (at least 30, past SSO's 15)
  if (!hold.ResizeTo(grown.capacity())) return false;  // a library that rounds it up
  grown.append(text);
  text.swap(grown);
  return true;
}

// The trace's entries as the body budget holds them: the token ids and logprobs it kept, and the
// prompt's token ids (the request's on generate, the engine's copy on completions and chat).
std::uint64_t TraceEntries(const Trajectory& trace) {
  const std::uint64_t prompt_ids =
      trace.prompt_token_ids.is_array() ? trace.prompt_token_ids.size() : 0;
  return trace.entries + prompt_ids;
}

std::uint32_t ClampU32(std::uint64_t v) {
  return v > UINT32_MAX ? UINT32_MAX : static_cast<std::uint32_t>(v);
}

bool Is2xx(unsigned status) { return status >= 200 && status < 300; }

// An engine status a client is answered with as it is: an error (400..599). Any other would
// mislead it: a 3xx without the Location it needs, a 304 to a request that sent no validator, a
// code outside HTTP's 100..599; a 2xx reaches here only when it is not the route's answer.
bool IsRelayedError(unsigned status) { return status >= 400 && status <= 599; }

// Why an engine answer's head was refused: a bound it passed, or what its read or parse met.
std::string HeadFailure(HeadState state, boost::system::error_code ec) {
  if (state == HeadState::kTooManyFields) {
    return "response head has more than " + std::to_string(kHeaderFieldsMax) + " fields";
  }
  if (ec == beast::http::error::header_limit) {
    return "response head exceeds " + std::to_string(kUpstreamHeadBytesMax) + " bytes";
  }
  return "response head: " + ec.message();
}

// A chunked answer's trailer adds fields to its head's: they are bounded together, as a
// request's are (its text is bounded by the connection's buffer).
bool TrailerFieldsOver(const beast::http::fields& fields) {
  return FieldsOver(fields, kHeaderFieldsMax);
}

std::string TrailerFailure() {
  return "response has more than " + std::to_string(kHeaderFieldsMax) +
         " header and trailer fields";
}

static_assert(kUpstreamHeadBytesMax < kUpstreamBufferBytesMax);

// More of an engine answer's head, read into `conn`'s buffer; `done(ec, n)` runs on `executor`.
// HeadRead refuses a head once its buffered bytes pass kUpstreamHeadBytesMax, so an incomplete
// head leaves the buffer room.
template <class Done>
void ReadHeadBytes(UpstreamConn& conn, const asio::any_io_executor& executor, Done&& done) {
  const std::size_t room = beast::read_size(conn.buffer, kUpstreamReadHintBytes);
  RC_CHECK(room > 0);
  conn.socket.async_read_some(conn.buffer.prepare(room),
                              asio::bind_executor(executor, std::forward<Done>(done)));
}

// The optional boolean `stream`; the optional non-empty `cache_salt`.
Status ParseStreamAndSalt(const json& body, bool& stream, std::string& salt) {
  auto s = body.find("stream");
  if (s != body.end() && !s->is_null()) {
    if (!s->is_boolean()) return Status::InvalidArgument("'stream' must be a boolean");
    stream = s->get<bool>();
  }
  auto cs = body.find("cache_salt");
  if (cs == body.end() || cs->is_null()) return Status::OK();
  if (!cs->is_string() || cs->get<std::string>().empty()) {
    return Status::InvalidArgument("'cache_salt' must be a non-empty string");
  }
  salt = cs->get<std::string>();
  return Status::OK();
}

Status CheckGenerateBody(const json& body) {
  auto ids = body.find("token_ids");
  if (ids == body.end() || !ids->is_array()) {
    return Status::InvalidArgument("'token_ids' (array of ints) is required");
  }
  auto sp = body.find("sampling_params");
  if (sp != body.end() && !sp->is_object() && !sp->is_null()) {
    return Status::InvalidArgument("'sampling_params' must be an object");
  }
  return Status::OK();
}

}  // namespace

const char* ProxyRoutePath(ProxyRoute route) {
  switch (route) {
    case ProxyRoute::kCompletions:
      return "/v1/completions";
    case ProxyRoute::kChat:
      return "/v1/chat/completions";
    case ProxyRoute::kGenerate:
      return "/inference/v1/generate";
  }
  return "/v1/completions";
}

ProxyExchange::ProxyExchange(Service& service, ProxyRoute route, Exchange exchange)
    : svc_(service),
      route_(route),
      ex_(std::move(exchange)),
      body_hold_(&ex_.body_budget()),
      answer_hold_(&ex_.body_budget()),
      tree_hold_(&ex_.body_budget()),
      event_hold_(&ex_.body_budget()),
      stream_hold_(&ex_.body_budget()),
      deadline_(ex_.executor()) {
  on_chunk_ = [this](const json& chunk) {
    const std::optional<std::string> event = PassChunk(trace_, chunk, added_);
    if (event) out_ += *event;  // nullopt: the usage-only chunk the client did not ask for
    if (!HoldTrace()) trace_over_budget_ = true;
    return !client_gone_ && !trace_over_budget_;
  };
  sse_.on_chunk = &on_chunk_;
  // Each streamed event's trees are held against the body budget before they are built.
  before_parse_ = [this](std::string_view data) { return event_hold_.Take(data); };
  sse_.before_parse = &before_parse_;
}

// ---- parse and admit ----

void ProxyExchange::Start() {
  t0_ = Clock::now();
  Step("parse", [this] {
    if (Status bad = Parse(); !bad.ok()) {
      if (bad.code() != Code::kBusy) svc_.metrics_.bad_requests++;
      return ex_.Respond(ErrorResponse(HttpStatusFor(bad), code_name(bad.code()), bad.message()));
    }
    if (rollout_id_.empty()) rollout_id_ = svc_.NextRolloutId();
    WatchClient();  // from here: a client that leaves while its admission waits is not admitted
    abandon_admission_ = svc_.AdmitAsync(
        rollout_id_, svc_.config_.admit_wait_ms, ex_.executor(),
        [self = shared_from_this()](Service::AdmitResult a) {
          if (a.admitted) self->TakeAdmission(std::move(*a.admitted));  // before anything throws
          self->Step("admitted", [&] { self->OnAdmitted(a.refusal); });
        },
        AffinityKeyOf());
  });
}

// Weak: the session keeps the watcher, and the exchange keeps the session.
void ProxyExchange::WatchClient() {
  ex_.WatchClient([weak = weak_from_this()] {
    if (auto self = weak.lock()) self->Step("client gone", [&] { self->OnClientGone(); });
  });
}

// With fleet_affinity_prefix_bytes, the key of the prompt's first bytes as the engine sees them
// (the completion's prompt, the chat's messages, the generate route's token ids).
std::optional<std::uint64_t> ProxyExchange::AffinityKeyOf() const {
  const std::uint64_t prefix_bytes = svc_.config_.fleet_affinity_prefix_bytes;
  if (prefix_bytes == 0 || svc_.config_.engines.empty()) return std::nullopt;
  const char* field = route_ == ProxyRoute::kCompletions ? "prompt"
                      : route_ == ProxyRoute::kChat      ? "messages"
                                                         : "token_ids";
  const auto it = upstream_body_.find(field);
  if (it == upstream_body_.end()) return std::nullopt;
  RC_CHECK(prefix_bytes <= kAffinityPrefixBytesMax);  // ValidateConfig
  const auto bytes = static_cast<std::size_t>(prefix_bytes);
  return AffinityKey(PromptPrefix(*it, bytes), bytes);
}

Status ProxyExchange::Parse() {
  const std::string& body = ex_.request().body();
  // The parsed tree and the engine's copy outweigh the body many times over: they are held
  // against the body budget before either is built, so the budget bounds what clients hold.
  if (!body_hold_.Grow(ParsedBytesBound(body))) {
    return Status::Busy(
        "the bodies other requests hold take serve's memory budget (body_memory_bytes_max)");
  }
  Result<json> parsed = ParseObject(body, false);
  if (!parsed.ok()) return parsed.status();
  upstream_body_ = std::move(parsed.value());
  RC_RETURN_IF_ERROR(ParseStreamAndSalt(upstream_body_, stream_, client_salt_));
  if (route_ == ProxyRoute::kGenerate) RC_RETURN_IF_ERROR(CheckGenerateBody(upstream_body_));
  // Before the admission: an answer whose choices a trace cannot record is never journaled. An
  // `n` vLLM reads as an integer from another form is rewritten as that integer here, in the
  // body PrepareUpstream sends, so the engine and the trace count the same choices.
  RC_RETURN_IF_ERROR(CheckRequestChoices(route_, upstream_body_));
  return ParseRolloutId();
}

// The client's own rollout id: one printable UTF-8 value of 1..kRolloutIdHeaderBytesMax bytes,
// taken verbatim (never percent-decoded).
Status ProxyExchange::ParseRolloutId() {
  bool duplicate = false;
  const std::optional<std::string_view> v = ex_.header(kRolloutIdHeader, &duplicate);
  if (!v) return Status::OK();
  if (duplicate || v->empty() || v->size() > kRolloutIdHeaderBytesMax ||
      !text::printable_utf8(std::string(*v))) {
    return Status::InvalidArgument(std::string(kRolloutIdHeader) +
                                   " must be one printable UTF-8 "
                                   "value of 1.." +
                                   std::to_string(kRolloutIdHeaderBytesMax) +
                                   " bytes, sent verbatim");
  }
  rollout_id_ = std::string(*v);
  return CheckClientRolloutId(rollout_id_);
}

// A durable admission is the exchange's before any step can throw: Failed and the destructor
// then know there is a rollout to finish.
void ProxyExchange::TakeAdmission(Admission&& admission) noexcept {
  RC_CHECK(admission.binding.rollout_id == rollout_id_ && !admitted());
  admission_ = std::move(admission);
  svc_.metrics_.proxy_in_flight++;
}

void ProxyExchange::OnAdmitted(const AdmitRefusal& refusal) {
  if (!admitted()) {
    HttpResponse res = ErrorResponse(refusal.http_status, refusal.type, refusal.message);
    if (refusal.retry_after_s > 0) {
      SetHeader(res, "Retry-After", std::to_string(refusal.retry_after_s));
    }
    return ex_.Respond(std::move(res));
  }
  in_flight_id_ = svc_.in_flight_calls_.Add([weak = weak_from_this(), ex = ex_] {
    ex.Post([weak] {
      if (auto self = weak.lock()) self->Step("cancel", [&] { self->Cancel(); });
    });
  });
  if (failed_) return Abort("internal error before the admission was answered");
  if (client_gone_) return Abort("client disconnected");  // left once it was submitted
  PrepareUpstream();
  if (!stream_) return Connect();
  HttpResponse head = BindingHead(200);
  SetHeader(head, "Content-Type", "text/event-stream");
  SetHeader(head, "Cache-Control", "no-cache");
  stream_started_ = true;
  ex_.StartStream(std::move(head), [self = shared_from_this()](bool delivered) {
    self->Next("stream head", [&] { self->OnStreamHeadSent(delivered); });
  });
}

void ProxyExchange::PrepareUpstream() {
  cache_salt_ = DeriveCacheSalt(admission_.binding, client_salt_);
  json& up = upstream_body_;
  up["cache_salt"] = cache_salt_;
  added_ = AddTraceFields(route_, stream_, up);
  // Token in, token out: the engine answers without the prompt, which is the request's.
  if (route_ == ProxyRoute::kGenerate) trace_.Absorb(json{{"prompt_token_ids", up["token_ids"]}});
  namespace bhttp = beast::http;
  const UpstreamTarget& t = svc_.TargetOf(admission_.engine);
  upstream_request_ = {bhttp::verb::post, t.base_path + ProxyRoutePath(route_), 11};
  upstream_request_.set(bhttp::field::host, t.authority);
  upstream_request_.set(bhttp::field::content_type, "application/json");
  if (stream_) upstream_request_.set(bhttp::field::accept, "text/event-stream");
  if (!svc_.config_.engine_api_key.empty()) {
    upstream_request_.set(bhttp::field::authorization, "Bearer " + svc_.config_.engine_api_key);
  }
  upstream_request_.keep_alive(true);
  upstream_request_.body() = DumpSafe(up);
  upstream_request_.prepare_payload();
  RC_CHECK(!cache_salt_.empty() && up.contains("cache_salt"));  // never sent unsalted
  upstream_body_ = json();  // the engine's copy is all that is sent from here
  // What stays held until the end: the engine's copy, and the trace (on generate its prompt ids).
  trace_entries_held_ = TraceEntries(trace_);
  // The copy as allocated: a dump grows by appending, up to twice its length.
  body_hold_.ShrinkTo(upstream_request_.body().capacity() + kTraceEntryBytes * trace_entries_held_);
}

// The trace's entries held against the body budget as it grows, a batch of entries at a time.
bool ProxyExchange::HoldTrace() {
  const std::uint64_t kept = TraceEntries(trace_);
  if (kept <= trace_entries_held_) return true;
  const std::uint64_t entries =
      std::max<std::uint64_t>(kept - trace_entries_held_, kTraceEntriesPerHold);
  if (!body_hold_.Grow(entries * kTraceEntryBytes)) return false;
  trace_entries_held_ += entries;
  return true;
}

HttpResponse ProxyExchange::BindingHead(int status) const {
  HttpResponse res;
  res.result(static_cast<unsigned>(status));
  const RolloutAdmitted& b = admission_.binding;
  SetHeader(res, "X-RolloutCore-Rollout-Id", b.rollout_id);
  SetHeader(res, "X-RolloutCore-Version", b.version.label);
  SetHeader(res, "X-RolloutCore-Generation", std::to_string(b.version.generation));
  SetHeader(res, "X-RolloutCore-Manifest", b.identity.manifest_digest);
  SetHeader(res, "X-RolloutCore-Checkpoint", b.identity.checkpoint);
  SetHeader(res, "X-RolloutCore-Step", std::to_string(b.identity.step));
  SetHeader(res, "X-RolloutCore-Admission-Seq", std::to_string(admission_.seq));
  SetHeader(res, "X-RolloutCore-Cache-Salt", cache_salt_);
  if (!admission_.engine.empty()) {
    SetHeader(res, "X-RolloutCore-Engine", admission_.engine);
    SetHeader(res, "X-RolloutCore-Fleet-Generation", std::to_string(admission_.fleet_generation));
  }
  return res;
}

void ProxyExchange::OnStreamHeadSent(bool delivered) {
  if (!delivered) {
    client_gone_ = true;
    return Finish(RolloutOutcome::kAborted, "response not delivered", [] {});
  }
  Connect();
}

// ---- the engine call ----

void ProxyExchange::Connect() {
  if (client_gone_ || cancelled_) return Abort("before the engine call");
  if (timed_out_) return UpstreamFailed(Transport::kTimeout, "");  // during a retry's wait
  if (connect_attempts_ == 0) {
    upstream_t0_ = Clock::now();
    deadline_.expires_after(std::chrono::milliseconds(svc_.config_.request_timeout_ms));
    deadline_.async_wait([self = shared_from_this()](error_code ec) {
      if (ec) return;  // cancelled: the call ended first
      self->timed_out_ = true;
      self->Step("deadline", [&] { self->CloseUpstream(); });
    });
  }
  ++connect_attempts_;
  RC_CHECK(connect_attempts_ <= kConnectAttemptsMax);
  AcquireUpstream(/*fresh_only=*/false);
}

void ProxyExchange::AcquireUpstream(bool fresh_only) {
  svc_.UpstreamOf(admission_.engine)
      .Acquire(
          ex_.executor(), svc_.config_.connect_timeout_ms,
          [self = shared_from_this()](Status st, std::unique_ptr<UpstreamConn> c, bool reused) {
            self->Next("connected",
                       [&] { self->OnConnected(std::move(st), std::move(c), reused); });
          },
          fresh_only);
}

void ProxyExchange::OnConnected(Status st, std::unique_ptr<UpstreamConn> conn, bool reused) {
  if (!st.ok()) {
    if (!Abandoned() && connect_attempts_ < kConnectAttemptsMax) {
      auto retry = std::make_shared<asio::steady_timer>(ex_.executor());
      retry->expires_after(std::chrono::milliseconds(10u << connect_attempts_));
      retry->async_wait([self = shared_from_this(), retry](error_code) {
        self->Next("connect again", [&] { self->Connect(); });
      });
      return;
    }
    return UpstreamFailed(Transport::kConnectFailed, st.message());
  }
  conn_ = std::move(conn);
  conn_reused_ = reused;
  if (client_gone_ || cancelled_) {
    conn_.reset();
    return Abort("before the engine call");
  }
  if (timed_out_) return UpstreamFailed(Transport::kTimeout, "");  // a 502, never a 499
  Send();
}

void ProxyExchange::Send() {
  RC_CHECK(conn_ != nullptr);
  parser_.emplace();
  parser_->header_limit(kUpstreamHeadBytesMax);
  parser_->body_limit(boost::none);  // streams are unbounded; each read is bounded
  body_.clear();
  beast::http::async_write(
      conn_->socket, upstream_request_,
      asio::bind_executor(ex_.executor(), [self = shared_from_this()](error_code ec, std::size_t) {
        self->Next("sent", [&] { self->OnSent(ec); });
      }));
}

void ProxyExchange::OnSent(error_code ec) {
  if (ec) {
    if (RetryAfterFailure(/*reused_and_silent=*/conn_reused_)) return;
    return UpstreamFailed(Transport::kBroken, "send: " + ec.message());
  }
  ReadHead();
}

// The engine's head is parsed read by read against kUpstreamHeadBytesMax and kHeaderFieldsMax
// (head_limits.h), as a client's is: async_read_header let a head of many small fields past its
// byte limit, and kept any number of fields for the whole answer. A head past a bound ends the
// rollout as the engine's protocol error.
void ProxyExchange::ReadHead() {
  head_read_.emplace(kUpstreamHeadBytesMax);
  ParseHead();
}

void ProxyExchange::ParseHead() {
  error_code ec;
  const HeadState state = head_read_->Parse(*parser_, conn_->buffer, ec);
  if (state == HeadState::kComplete) return OnHead({});
  if (state == HeadState::kIncomplete) {
    return ReadHeadBytes(*conn_, ex_.executor(),
                         [self = shared_from_this()](error_code rec, std::size_t n) {
                           self->Next("response head", [&] { self->OnHeadBytes(rec, n); });
                         });
  }
  if (state == HeadState::kTooManyFields || ec == beast::http::error::header_limit) {
    return UpstreamFailed(Transport::kOk, HeadFailure(state, ec));
  }
  OnHead(ec);
}

void ProxyExchange::OnHeadBytes(error_code ec, std::size_t n) {
  if (ec) return OnHead(HeadReadError(ec, parser_->got_some()));
  conn_->buffer.commit(n);
  ParseHead();
}

void ProxyExchange::OnHead(error_code ec) {
  if (ec) {
    const bool silent = conn_reused_ && !parser_->got_some();
    if (RetryAfterFailure(silent)) return;
    return UpstreamFailed(timed_out_ ? Transport::kTimeout : Transport::kBroken,
                          HeadFailure(HeadState::kFailed, ec));
  }
  // The upstream request never asks for one (no Expect, no Upgrade): an interim 1xx relayed as
  // the answer would leave the client waiting for a final one.
  if (parser_->get().result_int() < 200) {
    return UpstreamFailed(Transport::kOk, "the engine answered an interim status " +
                                              std::to_string(parser_->get().result_int()));
  }
  ReadBody();
}

void ProxyExchange::ReadBody() {
  if (parser_->is_done()) return UpstreamDone();
  if (read_buf_ == nullptr) read_buf_.reset(new char[kUpstreamReadBytes]);
  auto& body = parser_->get().body();
  body.data = read_buf_.get();
  body.size = kUpstreamReadBytes;
  beast::http::async_read_some(
      conn_->socket, conn_->buffer, *parser_,
      asio::bind_executor(ex_.executor(), [self = shared_from_this()](error_code ec, std::size_t) {
        self->Next("response body", [&] { self->OnBody(ec); });
      }));
}

void ProxyExchange::OnBody(error_code ec) {
  if (ec == beast::http::error::need_buffer) ec = {};
  const std::size_t got = kUpstreamReadBytes - parser_->get().body().size;
  if (ec) {
    return UpstreamFailed(timed_out_ ? Transport::kTimeout : Transport::kBroken,
                          "response body: " + ec.message());
  }
  if (got > 0 && !Absorb(read_buf_.get(), got)) return;
  if (!out_.empty()) {
    const auto read_at = Clock::now();
    return ex_.Write(std::move(out_), [self = shared_from_this(), read_at](bool delivered) {
      if (delivered) self->svc_.metrics_.proxy_relay.ObserveUs(effects::elapsed_us(read_at));
      self->Next("client took", [&] { self->OnClientTook(delivered); });
    });
  }
  ReadBody();
}

// Streamed 2xx bodies go through the SSE reader; anything else is kept, bounded.
bool ProxyExchange::Absorb(const char* data, std::size_t n) {
  const bool relay = stream_ && Is2xx(parser_->get().result_int());
  if (relay) {
    const bool go_on = sse_.Feed(data, n);
    event_hold_.Release();  // the trees of the events fed are gone
    if (go_on) {
      if (HoldStreamBuffers()) return true;
      UpstreamFailed(Transport::kOk, kStreamBufferOverBudget);
      return false;
    }
    if (client_gone_) return true;  // OnClientTook/OnClientGone finish it
    if (trace_over_budget_) {
      UpstreamFailed(Transport::kOk, kTraceOverBudget);
      return false;
    }
    if (event_hold_.refused()) {
      UpstreamFailed(Transport::kOk, kStreamEventOverBudget);
      return false;
    }
    UpstreamFailed(Transport::kOk, "one SSE event exceeds " +
                                       std::to_string(effects::kSseEventBytesMax) + " bytes");
    return false;
  }
  if (body_.size() + n > effects::kResponseBytesMax) {
    UpstreamFailed(Transport::kOk, "response body exceeds " +
                                       std::to_string(effects::kResponseBytesMax) + " bytes");
    return false;
  }
  if (!ReserveHeld(body_, n, effects::kResponseBytesMax, answer_hold_)) {
    UpstreamFailed(Transport::kOk,
                   "the bodies other requests hold take serve's memory budget "
                   "(body_memory_bytes_max)");
    return false;
  }
  body_.append(data, n);
  RC_CHECK(body_.size() <= effects::kResponseBytesMax);
  return true;
}

void ProxyExchange::OnClientTook(bool delivered) {
  if (!delivered) {
    client_gone_ = true;
    CloseUpstream();
    return Abort("client disconnected");
  }
  // The events written are freed: what stays held is what the stream still buffers.
  if (!HoldStreamBuffers()) return UpstreamFailed(Transport::kOk, kStreamBufferOverBudget);
  ReadBody();
}

static_assert(kStreamBufferUnheldBytesMax == kUpstreamReadBytes);  // its ground (proxy_stream.h)

// The bytes the stream buffers, as allocated: the SSE bytes of the event being received, and the
// client events not yet handed to the client's connection. The pending buffer a large event left
// is given back first (TrimSsePending): else the rest of the stream would hold it, and pay the
// hold's atomics on every token read.
std::uint64_t ProxyExchange::StreamBuffered() {
  TrimSsePending(sse_.pending);
  return sse_.pending.capacity() + out_.capacity();
}

bool ProxyExchange::HoldStreamBuffers() { return stream_hold_.HoldFor(StreamBuffered()); }

// A pooled connection the engine closed between requests fails before any response byte: the
// request is sent again once on a fresh connection (generation may run twice without harm; the
// rollout is bound once, by its admission). A fresh connection is never retried.
bool ProxyExchange::RetryAfterFailure(bool reused_and_silent) {
  if (!reused_and_silent || retried_stale_ || Abandoned()) {
    return false;
  }
  retried_stale_ = true;
  conn_.reset();
  AcquireUpstream(/*fresh_only=*/true);
  return true;
}

// ---- ends ----

void ProxyExchange::UpstreamDone() {
  RC_CHECK(parser_ && parser_->is_done());
  if (TrailerFieldsOver(parser_->get())) return UpstreamFailed(Transport::kOk, TrailerFailure());
  deadline_.cancel();
  const unsigned status = parser_->get().result_int();
  const bool keep = parser_->keep_alive();
  ReleaseUpstream(keep);
  // A client that left while the engine's last bytes arrived stopped the stream's parsing: what
  // it took is not the whole answer, so the rollout is aborted, never completed on a cut trace.
  if (client_gone_) return Abort("client disconnected");
  if (stream_ && Is2xx(status)) return EndStream();
  if (!Is2xx(status)) return AnswerEngineError();
  AnswerCompletion();
}

// The engine's stream ended: its last event (no blank line after it) is taken, then the stream
// is judged; only the engine's [DONE] completes it. A last event whose trace (or parse) the
// budget refused ends the rollout as that refusal does mid-stream (aborted, the client told, the
// event not relayed), never as a stream the proxy chose to stop early.
void ProxyExchange::EndStream() {
  HttpEvidence ev;
  sse_.Finish(ev);
  event_hold_.Release();             // the last event's trees are gone
  std::string().swap(sse_.pending);  // taken: the stream buffers no more of the engine's
  if (trace_over_budget_) return UpstreamFailed(Transport::kOk, kTraceOverBudget);
  if (event_hold_.refused()) return UpstreamFailed(Transport::kOk, kStreamEventOverBudget);
  if (!HoldStreamBuffers()) return UpstreamFailed(Transport::kOk, kStreamBufferOverBudget);
  if (out_.empty()) return AnswerStreamEnd(ev.body_parsed, ev.error);
  // The last event still goes out before [DONE] (or before the error event).
  ex_.Write(std::move(out_), [self = shared_from_this(), ev](bool delivered) {
    self->stream_hold_.Release();  // written (or failed): the stream buffers nothing more
    self->Next("client took the last event", [&] {
      if (!delivered) return self->Abort("client disconnected");
      self->AnswerStreamEnd(ev.body_parsed, ev.error);
    });
  });
}

void ProxyExchange::AnswerCompletion() {
  std::optional<std::string> text = RelayAnswer(body_, trace_, added_);
  if (!text) return AnswerCompletionTree();
  if (!HoldTrace()) return UpstreamFailed(Transport::kOk, kTraceOverBudget);
  AnswerCompleted(std::move(*text));
}

// What simdjson does not read (or reads ambiguously) is read as before, and judged as before;
// its tree is held against the body budget while it lives, until the client's answer is made of
// it (the bound's second copy of the text covers that answer).
void ProxyExchange::AnswerCompletionTree() {
  if (!tree_hold_.Grow(ParsedBytesBound(body_))) {
    return UpstreamFailed(Transport::kOk, kAnswerOverBudget);
  }
  json doc = effects::parse_outside_json(body_);
  if (doc.is_discarded()) {
    tree_hold_.Release();
    transport_error_ = "engine answered HTTP 200 with a body that is not JSON";
    return AnswerEngineError();
  }
  trace_.Absorb(doc);
  const bool trace_held = HoldTrace();
  std::string text;
  if (trace_held) {
    StripAdded(doc, added_);
    text = DumpSafe(doc);
  }
  doc = json();
  tree_hold_.Release();  // the tree is gone
  if (!trace_held) return UpstreamFailed(Transport::kOk, kTraceOverBudget);
  AnswerCompleted(std::move(text));
}

// The completion's answer `text` takes the engine body's place in answer_hold_ before the finish,
// so a budget that cannot hold it aborts the rollout as any refusal of the budget does; once the
// finish is durable it goes with its hold to the client's connection, which gives the hold back
// when the client took the answer or left. It is held as allocated: text made by appending (a
// dump, the fast reader's writer) sits in a buffer up to twice its length, all of which waits.
void ProxyExchange::AnswerCompleted(std::string text) {
  std::string().swap(body_);
  if (!answer_hold_.ResizeTo(text.capacity())) {
    return UpstreamFailed(Transport::kOk, kClientAnswerOverBudget);
  }
  HttpResponse res = BindingHead(200);
  SetBody(res, 200, std::move(text), "application/json");
  Finish(RolloutOutcome::kCompleted, "",
         [self = shared_from_this(), res = std::move(res)]() mutable {
           self->ex_.Respond(std::move(res), std::move(self->answer_hold_));
         });
}

void ProxyExchange::AnswerStreamEnd(bool ok, const std::string& why) {
  if (ok) {
    return Finish(RolloutOutcome::kCompleted, "",
                  [self = shared_from_this()] { self->ex_.End(kDoneEvent); });
  }
  svc_.metrics_.upstream_errors++;
  const std::string reason = "engine stream: " + why;
  Finish(RolloutOutcome::kAborted, reason, [self = shared_from_this(), reason] {
    json err = {{"error", {{"message", reason}, {"type", "upstream"}, {"code", 502}}}};
    self->ex_.End("data: " + DumpSafe(err) + "\n\n" + kDoneEvent);
  });
}

// The engine answered, but not with a completion. An engine error (400..599) is passed on:
// non-streamed its status and body, streamed an error event with its code and [DONE]. Any other
// status (a 2xx that is not the route's JSON, a 3xx, a code outside 100..599) is a 502 naming it.
// The engine's body relayed goes to the client's connection with its hold (answer_hold_, which
// holds its capacity: ReserveHeld).
void ProxyExchange::AnswerEngineError() {
  const unsigned status = parser_->get().result_int();
  const bool relayed = IsRelayedError(status);
  const int code = relayed ? static_cast<int>(status) : 502;
  const std::string why = EngineFailure();
  if (stream_) return AnswerEngineErrorEvent(code, why);
  svc_.metrics_.upstream_errors++;
  HttpResponse res = BindingHead(code);
  if (relayed) {
    SetBody(res, code, std::move(body_), "application/json");
  } else {
    SendError(res, code, "upstream", why);
  }
  std::string().swap(body_);
  if (!relayed) answer_hold_.Release();  // the body is not the answer: it is gone
  Finish(RolloutOutcome::kAborted, why,
         [self = shared_from_this(), res = std::move(res)]() mutable {
           self->ex_.Respond(std::move(res), std::move(self->answer_hold_));
         });
}

// A streamed client gets the engine's body as JSON in its error event: its tree is held while it
// lives, and the event takes the body's place in answer_hold_ (a budget that cannot hold it
// aborts the rollout with the budget's own error event).
void ProxyExchange::AnswerEngineErrorEvent(int code, const std::string& why) {
  if (!tree_hold_.Grow(ParsedBytesBound(body_))) {
    return UpstreamFailed(Transport::kOk, kAnswerOverBudget);
  }
  std::string event;
  {
    json err = {{"error", {{"message", why}, {"type", "upstream"}, {"code", code}}}};
    json engine_body = effects::parse_outside_json(body_);
    if (!engine_body.is_discarded()) err["error"]["engine"] = std::move(engine_body);
    event = "data: " + DumpSafe(err) + "\n\n" + kDoneEvent;
  }
  tree_hold_.Release();  // the tree is gone
  std::string().swap(body_);
  if (!answer_hold_.ResizeTo(event.capacity())) {  // as allocated, as a completion's answer
    return UpstreamFailed(Transport::kOk, kClientAnswerOverBudget);
  }
  svc_.metrics_.upstream_errors++;
  Finish(RolloutOutcome::kAborted, why,
         [self = shared_from_this(), event = std::move(event)]() mutable {
           self->ex_.End(std::move(event), std::move(self->answer_hold_));
         });
}

std::string ProxyExchange::EngineFailure() const {
  if (!transport_error_.empty()) return transport_error_;
  const unsigned status = parser_ ? parser_->get().result_int() : 0;
  return "engine answered HTTP " + std::to_string(status) +
         (body_.empty() ? "" : ": " + text::escape_line(body_.substr(0, 400)));
}

// No usable answer from the engine (or one beyond a bound): 502 non-streamed, an error event
// streamed; a client that left or a shutdown gets its own note.
void ProxyExchange::UpstreamFailed(Transport transport, std::string why) {
  deadline_.cancel();
  CloseUpstream();
  if (client_gone_ || cancelled_) return Abort("engine call ended: " + why);
  if (timed_out_) {
    transport = Transport::kTimeout;
    why = "no complete answer within request_timeout_ms (" +
          std::to_string(svc_.config_.request_timeout_ms) + " ms)";
  }
  svc_.metrics_.upstream_errors++;
  const std::string note = std::string("engine ") + transport_name(transport) + ": " + why;
  spdlog::warn("proxy: rollout {}: {}", text::escape_line(admission_.binding.rollout_id),
               text::escape_line(note));
  Finish(RolloutOutcome::kAborted, note, [self = shared_from_this(), transport, why, note] {
    if (!self->stream_) {
      HttpResponse res = self->BindingHead(502);
      SendError(res, 502, "upstream",
                std::string("engine call failed (") + transport_name(transport) + "): " + why);
      return self->ex_.Respond(std::move(res));
    }
    json err = {{"error", {{"message", note}, {"type", "upstream"}, {"code", 502}}}};
    self->ex_.End("data: " + DumpSafe(err) + "\n\n" + kDoneEvent);
  });
}

// The client left or the shutdown cancelled: finish as aborted; the answer goes nowhere useful
// but is still formed (a cancelled client may still be reading).
void ProxyExchange::Abort(std::string note) {
  if (finished_) return;
  deadline_.cancel();
  CloseUpstream();
  if (!client_gone_ && cancelled_) note = "shutdown grace expired; " + note;
  if (client_gone_) note = "client disconnected";
  Finish(RolloutOutcome::kAborted, note, [self = shared_from_this()] { self->AnswerAborted(); });
}

// A client still connected when the shutdown cancelled its rollout is told so, with when to come
// back (its own disconnect is 499: it reads nothing, but a half-closed client may).
void ProxyExchange::AnswerAborted() {
  const bool shutdown = cancelled_ && !client_gone_;
  const char* why = "the executor is shutting down: the rollout was cancelled at its grace's end";
  if (stream_started_) {
    if (!shutdown) return ex_.End("");
    json err = {{"error", {{"message", why}, {"type", "shutting_down"}, {"code", 503}}}};
    return ex_.End("data: " + DumpSafe(err) + "\n\n" + kDoneEvent);
  }
  if (!shutdown) {
    return ex_.Respond(ErrorResponse(499, "client_closed", "client closed the connection"));
  }
  HttpResponse res = BindingHead(503);  // the rollout was journaled: its ids go with the answer
  SendError(res, 503, "shutting_down", why);
  SetHeader(res, "Retry-After", std::to_string(svc_.config_.retry_after_s));
  ex_.Respond(std::move(res));
}

void ProxyExchange::OnClientGone() {
  client_gone_ = true;
  if (!admitted() && abandon_admission_) return abandon_admission_();
  CloseUpstream();  // the engine sees the disconnect and aborts the generation
}

// Shutdown's cancel ends the rollout now: the engine request closes, and a write that waits on a
// client who stopped reading fails (else it would end only at write_timeout_ms, past the settle).
void ProxyExchange::Cancel() {
  cancelled_ = true;
  CloseUpstream();
  ex_.AbandonWrite();
}

void ProxyExchange::ReleaseUpstream(bool reusable) {
  if (conn_ == nullptr) return;
  if (reusable) svc_.UpstreamOf(admission_.engine).Release(std::move(conn_));
  conn_.reset();
}

void ProxyExchange::CloseUpstream() {
  if (conn_ == nullptr) return;
  error_code ignored;
  conn_->socket.close(ignored);  // pending operations complete with an error on the loop
}

std::uint64_t ProxyExchange::UpstreamElapsedUs() const {
  return connect_attempts_ == 0 ? 0 : effects::elapsed_us(upstream_t0_);
}

// Exactly once per admitted rollout: its journal parts and RolloutFinished; once they are
// durable, the trajectory line and `then` (the client's answer). A finish that is not durable
// is never acknowledged and no line claims it: the client is told (AnswerNotDurable), and the
// executor fail-stops, so a restart records the rollout from what is durable.
void ProxyExchange::Finish(RolloutOutcome outcome, std::string note, std::function<void()> then) {
  RC_CHECK(!finished_ && admitted());
  finished_ = true;
  LeaveCall();
  if (client_gone_) svc_.metrics_.client_disconnects++;
  const std::uint64_t up_us = UpstreamElapsedUs();
  outcome_ = outcome;
  note_ = std::move(note);
  SubmitFinish(outcome, [self = shared_from_this(), then = std::move(then), up_us](Status st) {
    self->ObserveEnded(up_us);
    self->answering_ = true;
    self->finish_durable_ = st.ok();
    self->Step("finished", [&] {
      if (!st.ok()) return self->AnswerNotDurable(st);
      self->WriteTrajectoryLine();
      then();
    });
  });
}

// From FinishAsync's call on, the service owns the finish: `done` runs exactly once (maybe within
// the call), also when the service fails.
// The rollout no longer counts among the calls a shutdown cancels, nor on its fleet engine.
void ProxyExchange::LeaveCall() {
  svc_.in_flight_calls_.Remove(in_flight_id_);
  in_flight_id_ = 0;
  if (!admission_.engine.empty()) svc_.EngineCallEnded(admission_.engine);
}

void ProxyExchange::SubmitFinish(RolloutOutcome outcome, Service::FinishDone done) {
  RC_CHECK(!finish_submitted_);
  const RolloutAdmitted& b = admission_.binding;
  const std::vector<TrajectoryRecorded> parts = JournalTrajectoryParts(b.rollout_id, trace_);
  finish_submitted_ = true;
  svc_.FinishAsync(admission_.engine, b.rollout_id, outcome, ClampU32(trace_.prompt_count()),
                   ClampU32(trace_.completion_count()), parts, ex_.executor(), std::move(done));
}

// ---- a step that threw ----

template <class F>
void ProxyExchange::Step(const char* step, F&& f) noexcept {
  try {
    if (svc_.step_probe_) svc_.step_probe_(step);
    f();
  } catch (const std::exception& e) {
    Failed(step, e.what());
  } catch (...) {
    Failed(step, "an exception not derived from std::exception");
  }
}

// A completion of the rollout's own chain of steps: none goes on once the rollout finished (a
// step that threw finished it while this operation was under way).
template <class F>
void ProxyExchange::Next(const char* step, F&& f) noexcept {
  if (finished_) return;
  Step(step, std::forward<F>(f));
}

// The rollout ends as aborted and the client is answered once that is durable. A finish that
// threw before its writes reached the journal has an unknown end: the executor fail-stops, and
// the restart records the rollout. A step beside the chain (the client leaving, the deadline,
// a cancel) that throws while the finish is on its way leaves the answer to the finish.
void ProxyExchange::Failed(const char* step, const char* what) noexcept {
  try {
    const std::string why = std::string("internal error in step '") + step + "': " + what;
    spdlog::critical("proxy: rollout {}: {}", text::escape_line(rollout_id_),
                     text::escape_line(why));
    svc_.metrics_.proxy_step_failures++;
    const bool again = failed_;
    failed_ = true;
    if (again) {  // what answers the failure failed too
      if (answering_ && finish_durable_ && !line_written_) WriteTrajectoryLine();
      return CloseClient();
    }
    if (!admitted()) {
      // An admission still waiting ends unjournaled; one already submitted OnAdmitted aborts.
      if (abandon_admission_) abandon_admission_();
      return EndFailed(why);
    }
    if (!finished_) return FinishFailed(why);
    if (!finish_submitted_) return FinishThrew(why);
    if (answering_) return AnswerRecorded(why);
  } catch (...) {
    failed_ = true;
    CloseClient();
    if (admitted() && !finish_submitted_) FinishThrew("its end threw too");
  }
}

void ProxyExchange::FinishFailed(const std::string& why) {
  deadline_.cancel();
  CloseUpstream();
  Finish(RolloutOutcome::kAborted, why, [self = shared_from_this(), why] { self->EndFailed(why); });
}

// Its callback never runs: the gauge it would bring down is brought down here.
void ProxyExchange::FinishThrew(const std::string& why) noexcept {
  if (gave_up_) return;
  gave_up_ = true;
  if (!finished_) {  // it threw before Finish began: nothing of the chain goes on
    finished_ = true;
    try {
      deadline_.cancel();
      CloseUpstream();
      LeaveCall();
    } catch (...) {
    }
  }
  svc_.metrics_.proxy_in_flight--;
  try {
    svc_.FailStop("proxy: the finish of rollout '" + text::escape_line(rollout_id_) +
                  "' could not be handed to the journal: " + why);
  } catch (...) {
    try {
      svc_.FailStop("proxy: a rollout's finish could not be handed to the journal");
    } catch (...) {
    }
  }
  CloseClient();
}

// The end is durable and the answer failed: the line is still written, and the client is told
// the outcome that was recorded (its rollout id is in the head).
void ProxyExchange::AnswerRecorded(const std::string& why) {
  if (!finish_durable_) return EndFailed("the rollout's finish is not durable: " + why);
  if (!line_written_) WriteTrajectoryLine();
  EndFailed(std::string("the rollout ended ") + outcome_name(outcome_) +
            " and is recorded, but its answer failed: " + why);
}

// 500, or a cut stream once its head went out (a write may be under way).
void ProxyExchange::EndFailed(const std::string& why) {
  if (stream_started_) return CloseClient();
  HttpResponse res = admitted() ? BindingHead(500) : HttpResponse();
  SendError(res, 500, "internal", why);
  ex_.Respond(std::move(res));
}

void ProxyExchange::CloseClient() noexcept {
  try {
    ex_.Close();  // a no-op once answered
  } catch (...) {
  }
}

// The last guard, on the exchange's loop: a rollout admitted with no finish handed to the
// journal (a step's exception escaped where Step did not see it) is finished as aborted, so its
// binding never stays open, and an unanswered client is closed. At teardown (no loop running)
// the restart records the rollout instead.
ProxyExchange::~ProxyExchange() {
  if (!ex_.OnItsLoop()) return;
  if (admitted() && !finish_submitted_ && !gave_up_) FinishDropped();
  CloseClient();
}

void ProxyExchange::FinishDropped() noexcept {
  try {
    spdlog::critical("proxy: rollout {} was dropped unfinished; finishing it as aborted",
                     text::escape_line(rollout_id_));
    if (!finished_) {
      LeaveCall();
      svc_.metrics_.proxy_in_flight--;
    }
    SubmitFinish(RolloutOutcome::kAborted, [](const Status&) {});
  } catch (...) {
    try {
      svc_.FailStop("proxy: an unfinished rollout could not be finished");
    } catch (...) {
    }
  }
}

void ProxyExchange::ObserveEnded(std::uint64_t upstream_us) {
  const std::uint64_t total_us = effects::elapsed_us(t0_);
  ServiceMetrics& m = svc_.metrics_;
  m.proxy_total.ObserveUs(total_us);
  m.proxy_upstream.ObserveUs(upstream_us);
  m.proxy_added.ObserveUs(total_us > upstream_us ? total_us - upstream_us : 0);
  m.proxy_in_flight--;
}

// A streamed answer ends with the error event and without [DONE]: the stream did not complete.
void ProxyExchange::AnswerNotDurable(const Status& st) {
  const std::string why = "the rollout's finish could not be made durable: " + st.ToString();
  spdlog::error("proxy: rollout {}: {}", text::escape_line(admission_.binding.rollout_id),
                text::escape_line(why));
  if (!stream_started_) {
    HttpResponse res = BindingHead(503);
    SendError(res, 503, "failed", why);
    return ex_.Respond(std::move(res));
  }
  const json err = {{"error", {{"message", why}, {"type", "failed"}, {"code", 503}}}};
  ex_.End("data: " + DumpSafe(err) + "\n\n");
}

void ProxyExchange::WriteTrajectoryLine() {
  line_written_ = true;
  const TrajectoryLineFields line{admission_.binding,
                                  admission_.seq,
                                  ProxyRoutePath(route_),
                                  stream_,
                                  cache_salt_,
                                  outcome_name(outcome_),
                                  note_,
                                  trace_,
                                  admission_.engine,
                                  admission_.fleet_generation};
  (void)svc_.trajectories_.Append(TrajectoryLineText(line));  // counted in its stats()
}

// ---- read-only pass-through ----

constexpr const char* kPassThroughOverBudget =
    "the bodies other requests hold take serve's memory budget (body_memory_bytes_max)";

// An engine route OpenAI clients call that reads nothing RolloutCore governs (models, tokenizer,
// health, version): relayed as is, bounded, without an admission. Nothing else of the engine is
// reachable through the proxy (never the dev-mode routes).
class PassThrough : public std::enable_shared_from_this<PassThrough> {
 public:
  PassThrough(Exchange ex, UpstreamPool& pool, const UpstreamTarget& target,
              const ServeConfig& config, const Service::StepProbe& probe)
      : ex_(std::move(ex)),
        pool_(pool),
        target_(target),
        config_(config),
        probe_(probe),
        deadline_(ex_.executor()),
        request_hold_(&ex_.body_budget()),
        body_hold_(&ex_.body_budget()) {}
  // An unanswered client is never left waiting, whatever ended the chain.
  ~PassThrough() {
    if (!ex_.OnItsLoop()) return;
    try {
      ex_.Close();
    } catch (...) {
    }
  }
  PassThrough(const PassThrough&) = delete;
  PassThrough& operator=(const PassThrough&) = delete;

  void Start() {
    namespace bhttp = beast::http;
    const HttpRequest& in = ex_.request();
    request_ = {in.method(), target_.base_path + std::string(in.target()), 11};
    request_.set(bhttp::field::host, target_.authority);
    if (in.method() == bhttp::verb::post) {
      request_.set(bhttp::field::content_type, "application/json");
      if (!CopyBody(in.body())) return Reply(ErrorResponse(503, "overloaded", kBodyMemoryRefusal));
    }
    if (!config_.engine_api_key.empty()) {
      request_.set(bhttp::field::authorization, "Bearer " + config_.engine_api_key);
    }
    request_.keep_alive(true);
    request_.prepare_payload();
    // call_timeout_ms bounds the whole call, its connect included (as a control call's).
    deadline_.expires_after(std::chrono::milliseconds(config_.call_timeout_ms));
    deadline_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec) return;  // cancelled: the call ended first
      self->Step([&] { self->OnDeadline(); });
    });
    pool_.Acquire(ex_.executor(), config_.connect_timeout_ms,
                  [self = shared_from_this()](Status st, std::unique_ptr<UpstreamConn> c, bool) {
                    self->Step([&] { self->OnConnected(st, std::move(c)); });
                  });
  }

 private:
  // What a step throws ends the call with a 500, never the event loop.
  template <class F>
  void Step(F&& f) noexcept {
    try {
      if (probe_) probe_("pass-through");
      f();
    } catch (...) {
      try {
        spdlog::error("proxy: a pass-through call threw: {}",
                      text::escape_line(internal::CurrentExceptionText()));
        deadline_.cancel();
        conn_.reset();
        Reply(ErrorResponse(500, "internal", "internal error"));
      } catch (...) {
        ex_.Close();
      }
    }
  }
  // The engine's copy of the client's body (the client's own stays held by its connection) is
  // held before it is made, and given back once it is sent. False, nothing copied, when the
  // budget cannot give it.
  [[nodiscard]] bool CopyBody(const std::string& body) {
    if (!request_hold_.Grow(body.size())) return false;
    request_.body() = body;
    return request_hold_.ResizeTo(request_.body().capacity());  // a library that rounds it up
  }
  void DropRequestBody() {
    std::string().swap(request_.body());
    request_hold_.Release();
  }
  // call_timeout_ms passed. What is under way on the connection fails at once, and its failure
  // answers the call. A connect still under way is not waited for (it may take up to
  // connect_timeout_ms): the call is answered now, and the connection goes back unused when it
  // arrives (OnConnected). A deadline whose wait completed as the call was answered is late.
  void OnDeadline() {
    if (answered_) return;
    timed_out_ = true;
    if (conn_) {
      boost::system::error_code ignored;
      conn_->socket.close(ignored);
      return;
    }
    Fail("");
    request_ = {};  // never sent: its copy goes now, not when the connect ends
    request_hold_.Release();
  }
  void OnConnected(const Status& st, std::unique_ptr<UpstreamConn> conn) {
    if (answered_) {  // the deadline answered the call while it connected: nothing is sent
      if (st.ok()) pool_.Release(std::move(conn));  // fresh and unused, as good as an idle one
      return;
    }
    if (!st.ok()) return Fail(st.message());
    conn_ = std::move(conn);
    Send();
  }
  void Send() {
    parser_.emplace();
    parser_->body_limit(effects::kResponseBytesMax);
    beast::http::async_write(
        conn_->socket, request_,
        asio::bind_executor(ex_.executor(),
                            [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                              self->Step([&] {
                                self->DropRequestBody();  // sent, or never to be
                                if (ec) return self->Fail("send: " + ec.message());
                                self->Read();
                              });
                            }));
  }
  // The head read by read, as the proxy's (ProxyExchange::ReadHead).
  void Read() {
    parser_->header_limit(kUpstreamHeadBytesMax);
    head_read_.emplace(kUpstreamHeadBytesMax);
    ParseHead();
  }
  void ParseHead() {
    boost::system::error_code ec;
    const HeadState state = head_read_->Parse(*parser_, conn_->buffer, ec);
    if (state == HeadState::kComplete) return ReadBody();
    if (state != HeadState::kIncomplete) return Fail(HeadFailure(state, ec));
    ReadHeadBytes(*conn_, ex_.executor(),
                  [self = shared_from_this()](boost::system::error_code rec, std::size_t n) {
                    self->Step([&] { self->OnHeadBytes(rec, n); });
                  });
  }
  void OnHeadBytes(boost::system::error_code ec, std::size_t n) {
    if (ec) return Fail(HeadFailure(HeadState::kFailed, HeadReadError(ec, parser_->got_some())));
    conn_->buffer.commit(n);
    ParseHead();
  }
  // The answer's body comes out of the server's body budget before it is allocated: a declared
  // length from the head (Beast reserves it whole as the body starts); an undeclared one (chunked,
  // or ending with the connection) read by read, each read's room held before it is reserved
  // (BodyRoom), so the buffer never grows past its hold.
  void ReadBody() {
    const auto length = parser_->content_length();
    // A share of the budget, so a small budget can still take an answer of undeclared length.
    body_bound_ = std::min<std::uint64_t>(effects::kResponseBytesMax, ex_.body_budget().max() / 4);
    if (length && *length > body_bound_) {
      return Fail("the engine's answer declares " + std::to_string(*length) +
                  " bytes, more than serve takes for one (" + std::to_string(body_bound_) + ")");
    }
    parser_->body_limit(body_bound_);  // what an answer of undeclared length may take
    // One parse step a read: a read then adds at most the connection buffer's bytes to the body
    // (eager, one read could parse chunk after chunk past the room BodyRoom held).
    parser_->eager(false);
    if (length && !body_hold_.Grow(*length)) return Fail(kPassThroughOverBudget);
    ReadBodySome();
  }
  void ReadBodySome() {
    if (parser_->is_done()) return Answer();
    if (!parser_->content_length() && !BodyRoom()) return Fail(kPassThroughOverBudget);
    beast::http::async_read_some(
        conn_->socket, conn_->buffer, *parser_,
        asio::bind_executor(ex_.executor(),
                            [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                              self->Step([&] {
                                if (ec) return self->Fail("response: " + ec.message());
                                self->ReadBodySome();
                              });
                            }));
  }
  // Room in an answer of undeclared length for what one read may add (the connection buffer's
  // bytes, within the bound), held before it is reserved: Beast appends within that capacity and
  // never reallocates past the hold. False when the budget cannot give it.
  [[nodiscard]] bool BodyRoom() {
    std::string& body = parser_->get().body();
    RC_CHECK(body.size() <= body_bound_);  // the parser's body_limit
    const std::size_t room =
        std::min<std::uint64_t>(kUpstreamBufferBytesMax, body_bound_ - body.size());
    return ReserveHeld(body, room, body_bound_, body_hold_);
  }
  void Answer() {
    if (TrailerFieldsOver(parser_->get())) return Fail(TrailerFailure());
    deadline_.cancel();
    auto& msg = parser_->get();
    const unsigned status = msg.result_int();
    if (!Is2xx(status) && !IsRelayedError(status)) {
      return Fail("the engine answered HTTP " + std::to_string(status) +
                  ", neither an answer nor an error serve relays");
    }
    // The body stays held until the client took it, as allocated: its declared length (reserved
    // whole, a few bytes more for a tiny one), or the capacity BodyRoom held for an undeclared one.
    if (!body_hold_.ResizeTo(msg.body().capacity())) return Fail(kPassThroughOverBudget);
    HttpResponse res;
    const auto type = msg[beast::http::field::content_type];
    SetBody(res, static_cast<int>(status), std::move(msg.body()),
            type.empty() ? "application/json" : std::string_view(type.data(), type.size()));
    if (parser_->keep_alive()) pool_.Release(std::move(conn_));
    Reply(std::move(res), std::move(body_hold_));
  }
  // Every failure past the deadline is the deadline's, whatever it cut (the connect, the send or
  // a read): the client is told call_timeout_ms passed.
  void Fail(const std::string& why) {
    deadline_.cancel();
    conn_.reset();
    const std::string failure = timed_out_ ? "no answer within call_timeout_ms (" +
                                                 std::to_string(config_.call_timeout_ms) + " ms)"
                                           : why;
    Reply(ErrorResponse(502, "upstream", "engine call failed: " + failure));
  }
  // The call's one answer; any later one (a step that threw after it) is dropped.
  void Reply(HttpResponse res, BudgetHold hold = BudgetHold()) {
    if (answered_) return;
    answered_ = true;
    ex_.Respond(std::move(res), std::move(hold));
  }

  Exchange ex_;
  UpstreamPool& pool_;
  const UpstreamTarget& target_;
  const ServeConfig& config_;
  const Service::StepProbe& probe_;
  asio::steady_timer deadline_;
  bool timed_out_ = false;  // call_timeout_ms passed: the call fails wherever it stands
  bool answered_ = false;   // Reply ran: the connection that arrives after it is not used
  std::unique_ptr<UpstreamConn> conn_;
  beast::http::request<beast::http::string_body> request_;
  BudgetHold request_hold_;  // request_'s body, the engine's copy of the client's, until sent
  std::optional<beast::http::response_parser<beast::http::string_body>> parser_;
  std::optional<HeadRead> head_read_;
  std::uint64_t body_bound_ = 0;  // the most the answer's body may take (a share of the budget)
  BudgetHold body_hold_;          // the answer's body buffer, as allocated
};

// ---- routes ----

// With proxy_token set, every proxied route wants `Authorization: Bearer <proxy_token>`: each
// admission is a durable write that holds off updates, so anonymous clients get none.
bool Service::ProxyAuthorized(Exchange& ex) {
  if (config_.proxy_token.empty()) return true;
  const std::optional<std::string_view> h = ex.header("Authorization");
  const std::string_view prefix = "Bearer ";
  const bool ok = h && h->substr(0, prefix.size()) == prefix &&
                  h->size() - prefix.size() == config_.proxy_token.size() &&
                  CRYPTO_memcmp(h->data() + prefix.size(), config_.proxy_token.data(),
                                config_.proxy_token.size()) == 0;
  if (ok) return true;
  metrics_.unauthorized++;
  HttpResponse res = ErrorResponse(401, "unauthorized", "missing or wrong proxy token");
  SetHeader(res, "WWW-Authenticate", "Bearer");
  ex.Respond(std::move(res));
  return false;
}

void Service::AddProxyRoutes(HttpRouter& router) {
  using bhttp::verb;
  for (ProxyRoute route : {ProxyRoute::kCompletions, ProxyRoute::kChat, ProxyRoute::kGenerate}) {
    router.Async(verb::post, ProxyRoutePath(route), [this, route](Exchange ex) {
      if (!ProxyAuthorized(ex)) return;
      std::make_shared<ProxyExchange>(*this, route, std::move(ex))->Start();
    });
  }
  const std::pair<verb, const char*> read_only[] = {{verb::get, "/v1/models"},
                                                    {verb::post, "/tokenize"},
                                                    {verb::post, "/detokenize"},
                                                    {verb::get, "/health"},
                                                    {verb::get, "/version"}};
  for (const auto& [method, path] : read_only) {
    router.Async(method, path, [this](Exchange ex) {
      if (!ProxyAuthorized(ex)) return;
      const std::string engine = PassThroughEngine();
      std::make_shared<PassThrough>(std::move(ex), UpstreamOf(engine), TargetOf(engine), config_,
                                    step_probe_)
          ->Start();
    });
  }
}

}  // namespace rc::service
