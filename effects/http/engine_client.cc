#include "effects/http/engine_client.h"
#include "effects/clock.h"
#include "effects/http/response_parsers.h"
#include "statemachine/status.h"

#include <curl/curl.h>

#include <cctype>
#include <chrono>
#include <mutex>
#include <utility>

namespace rc::effects {

using nlohmann::json;

namespace {

constexpr long kPollIntervalMs = 20;  // how often an in-flight call looks at its cancel flags

std::once_flag g_curl_once;

void curl_global_once() {
  std::call_once(g_curl_once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct WriteCtx {
  CURL* easy = nullptr;
  std::string* body = nullptr;
  bool overflow = false;
  SseState* sse = nullptr;  // streaming when set
};

size_t write_cb(char* ptr, size_t size, size_t nmemb, void* userdata) {
  auto* ctx = static_cast<WriteCtx*>(userdata);
  const size_t n = size * nmemb;
  if (ctx->body->size() + n > kResponseBytesMax) {
    ctx->overflow = true;
    return 0;  // CURLE_WRITE_ERROR
  }
  ctx->body->append(ptr, n);
  if (ctx->sse != nullptr) {
    long code = 0;
    curl_easy_getinfo(ctx->easy, CURLINFO_RESPONSE_CODE, &code);
    if (code >= 200 && code < 300 && !ctx->sse->Feed(ptr, n)) return 0;
  }
  return n;
}

// Folds a later step's evidence into an accumulated one (latencies add up).
HttpEvidence chain(const HttpEvidence& earlier, HttpEvidence later) {
  later.latency_us += earlier.latency_us;
  return later;
}

}  // namespace

const char* pause_mode_name(PauseMode m) {
  switch (m) {
    case PauseMode::kAbort:
      return "abort";
    case PauseMode::kWait:
      return "wait";
    case PauseMode::kKeep:
      return "keep";
  }
  return "abort";
}

std::string bound_error(std::string s) {
  if (s.size() > kHttpErrorBytesMax) {
    s.resize(kHttpErrorBytesMax - 3);
    s += "...";
  }
  RC_CHECK(s.size() <= kHttpErrorBytesMax);
  return s;
}

struct EngineClient::Handle {
  CURLM* multi = nullptr;  // owns the connection cache this handle reuses
  CURL* easy = nullptr;
  char errbuf[CURL_ERROR_SIZE] = {0};
  Handle() : multi(curl_multi_init()), easy(curl_easy_init()) {
    RC_CHECK(multi != nullptr && easy != nullptr);
    curl_multi_setopt(multi, CURLMOPT_MAXCONNECTS, 4L);
  }
  ~Handle() {
    curl_easy_cleanup(easy);
    curl_multi_cleanup(multi);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  // Ready for the next call; keeps the connection cache (it lives in multi).
  void Reset() {
    curl_easy_reset(easy);
    errbuf[0] = '\0';
  }
  // Closes the cached connections (between transfers only: no easy handle is in multi), so the
  // next call connects anew and the calls after it reuse that one connection.
  void DropConnections() {
    curl_multi_cleanup(multi);
    multi = curl_multi_init();
    RC_CHECK(multi != nullptr);
    curl_multi_setopt(multi, CURLMOPT_MAXCONNECTS, 4L);
  }
};

EngineClient::EngineClient(std::string base_url, EngineDeadlines deadlines,
                           std::size_t idle_handles_max)
    : base_url_(std::move(base_url)), deadlines_(deadlines), idle_handles_max_(idle_handles_max) {
  RC_CHECK(!base_url_.empty());
  RC_CHECK(idle_handles_max_ >= 1 && idle_handles_max_ <= kIdleHandlesLimit);
  curl_global_once();
  while (!base_url_.empty() && base_url_.back() == '/') base_url_.pop_back();
  RC_CHECK(deadlines_.connect_timeout_ms > 0 && deadlines_.call_timeout_ms > 0);
  RC_CHECK(deadlines_.drain_timeout_ms > 0 && deadlines_.update_timeout_ms > 0);
}

EngineClient::~EngineClient() = default;

void EngineClient::Cancel() { cancelled_.store(true, std::memory_order_release); }
void EngineClient::ClearCancel() { cancelled_.store(false, std::memory_order_release); }

std::unique_ptr<EngineClient::Handle> EngineClient::Acquire() {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (!pool_.empty()) {
      std::unique_ptr<Handle> h = std::move(pool_.back());
      pool_.pop_back();
      RC_CHECK(h != nullptr);
      return h;
    }
  }
  return std::make_unique<Handle>();
}

void EngineClient::Release(std::unique_ptr<Handle> h) {
  RC_CHECK(h != nullptr);
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (pool_.size() < idle_handles_max_) pool_.push_back(std::move(h));
  // else: h is destroyed here, closing its connections.
  RC_CHECK(pool_.size() <= idle_handles_max_);
}

std::size_t EngineClient::idle_handles() const {
  std::lock_guard<std::mutex> lock(pool_mu_);
  return pool_.size();
}

// ---- one call: refuse, configure, transfer, classify, read ----

std::optional<std::string> refusal_before_sending(std::uint64_t timeout_ms, bool cancelled,
                                                  std::size_t body_bytes) {
  // A spent deadline is the caller's evidence, not a crash: nothing is sent (0 would also mean
  // "no deadline" to curl).
  if (timeout_ms == 0) return "deadline spent before sending";
  if (cancelled) return "cancelled before sending";
  if (body_bytes > kRequestBytesMax) {
    return "request body of " + std::to_string(body_bytes) + " bytes exceeds " +
           std::to_string(kRequestBytesMax) + "; not sent";
  }
  return std::nullopt;
}

namespace {

bool is_connect_failure(int curl_code) {
  return curl_code == CURLE_COULDNT_CONNECT || curl_code == CURLE_COULDNT_RESOLVE_HOST ||
         curl_code == CURLE_COULDNT_RESOLVE_PROXY;
}

// A curl failure other than the body sink's own refusal.
Transport curl_failure_transport(int curl_code, bool request_bytes_sent) {
  if (is_connect_failure(curl_code)) return Transport::kConnectFailed;
  switch (curl_code) {
    case CURLE_OPERATION_TIMEDOUT:
      return request_bytes_sent ? Transport::kTimeout : Transport::kConnectFailed;
    case CURLE_FILESIZE_EXCEEDED:  // Content-Length announced a body over the bound
      return Transport::kOk;
    default:  // RECV_ERROR, SEND_ERROR, GOT_NOTHING, PARTIAL_FILE, and anything unexpected
      return Transport::kBroken;
  }
}

TransportVerdict classify_unchecked(const TransferEnd& end) {
  const auto status = static_cast<std::int32_t>(end.http_status);
  if (end.cancelled_in_flight) {
    const Transport t = end.request_bytes_sent ? Transport::kTimeout : Transport::kConnectFailed;
    return {t, 0, TransferEnding::kCancelled};
  }
  const bool sink_stopped = end.curl_code == CURLE_WRITE_ERROR && end.write_refused;
  if (end.curl_code != CURLE_OK && !sink_stopped) {
    const Transport t = curl_failure_transport(end.curl_code, end.request_bytes_sent);
    return {t, t == Transport::kOk ? status : 0, TransferEnding::kCurlFailed};
  }
  if (status <= 0) return {Transport::kBroken, status, TransferEnding::kNoStatus};
  return {Transport::kOk, status, TransferEnding::kResponse};
}

}  // namespace

TransportVerdict classify_transport(const TransferEnd& end) {
  const TransportVerdict v = classify_unchecked(end);
  // Only a request that left can time out; only one that never left (or never connected) is a
  // refusal; a cancel outranks curl; a body is read only behind a status line.
  RC_CHECK(v.transport != Transport::kTimeout || end.request_bytes_sent);
  RC_CHECK(v.transport != Transport::kConnectFailed || !end.request_bytes_sent ||
           is_connect_failure(end.curl_code));
  RC_CHECK(end.cancelled_in_flight == (v.ending == TransferEnding::kCancelled));
  RC_CHECK(v.ending != TransferEnding::kResponse ||
           (v.transport == Transport::kOk && v.http_status > 0));
  RC_CHECK(v.transport == Transport::kOk || v.http_status <= 0);
  return v;
}

namespace {

bool call_cancelled(const EngineClient& client, const CallOptions& o) {
  return client.cancelled() || (o.cancel && o.cancel->cancelled());
}

curl_slist* request_headers(const EngineClient::Request& req) {
  curl_slist* headers = nullptr;
  headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip
  headers = curl_slist_append(
      headers, req.on_chunk ? "Accept: text/event-stream" : "Accept: application/json");
  if (req.json_body) headers = curl_slist_append(headers, "Content-Type: application/json");
  if (req.bearer_token != nullptr) {
    RC_CHECK(IsBearerToken(*req.bearer_token));  // no header can be injected through it
    const std::string line = "Authorization: Bearer " + *req.bearer_token;
    headers = curl_slist_append(headers, line.c_str());
  }
  return headers;
}

// Where and how long one transfer runs, and where its bytes go.
struct TransferSetup {
  std::string url;
  std::uint64_t connect_timeout_ms = 0;
  std::uint64_t timeout_ms = 0;
  char* errbuf = nullptr;
  WriteCtx* sink = nullptr;
  curl_slist* headers = nullptr;
};

void set_transfer_options(CURL* e, const TransferSetup& s) {
  curl_easy_setopt(e, CURLOPT_URL, s.url.c_str());
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(s.connect_timeout_ms));
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, static_cast<long>(s.timeout_ms));
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, s.errbuf);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &write_cb);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, s.sink);
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, s.headers);
  curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(e, CURLOPT_MAXFILESIZE_LARGE, static_cast<curl_off_t>(kResponseBytesMax));
}

// Name lookups are kept as long as the proxy's upstream pool keeps its addresses (it looks again
// every 5 s), so the monitor and the proxy do not reach different processes for long when the
// engine's name moves; a fresh connection looks again at once.
constexpr long kDnsCacheSeconds = 5;

void set_connection_reuse(CURL* e, bool fresh) {
  curl_easy_setopt(e, CURLOPT_DNS_CACHE_TIMEOUT, fresh ? 0L : kDnsCacheSeconds);
}

void set_method(CURL* e, const EngineClient::Request& req, bool reuse_connection) {
  if (req.method != EngineClient::Method::kPost) {
    curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
    return;
  }
  // Never on a reused connection: libcurl silently re-sends a request when a reused connection
  // closes without a response, which would run a non-idempotent POST (/update_weights,
  // /start_weight_update) twice and hide the ambiguity from the evidence. Only a caller whose
  // POST may run twice (generation through the proxy) opts into reuse.
  if (!reuse_connection) curl_easy_setopt(e, CURLOPT_FRESH_CONNECT, 1L);
  curl_easy_setopt(e, CURLOPT_POST, 1L);
  // curl keeps the pointer: it must stay valid until the transfer ends (req outlives it).
  static const char kEmpty[] = "";
  curl_easy_setopt(e, CURLOPT_POSTFIELDS, req.json_body ? req.json_body->c_str() : kEmpty);
  curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE,
                   static_cast<curl_off_t>(req.json_body ? req.json_body->size() : 0));
}

struct LoopEnd {
  CURLcode result = CURLE_OK;
  bool cancelled = false;
};

// The result of e's transfer when curl reports it done.
std::optional<CURLcode> take_done(CURLM* multi, CURL* e) {
  std::optional<CURLcode> result;
  int queued = 0;
  while (CURLMsg* msg = curl_multi_info_read(multi, &queued)) {
    if (msg->msg == CURLMSG_DONE && msg->easy_handle == e) result = msg->data.result;
  }
  return result;
}

// Drives the transfer ourselves so that a cancel is noticed within kPollIntervalMs. Bounded by
// the transfer's CURLOPT_TIMEOUT_MS.
LoopEnd drive_transfer(CURLM* multi, CURL* e, const EngineClient& client, const CallOptions& o) {
  if (curl_multi_add_handle(multi, e) != CURLM_OK) return {CURLE_FAILED_INIT, false};
  for (;;) {
    int running = 0;
    if (curl_multi_perform(multi, &running) != CURLM_OK) return {CURLE_FAILED_INIT, false};
    if (std::optional<CURLcode> done = take_done(multi, e)) return {*done, false};
    if (call_cancelled(client, o)) return {CURLE_OK, true};
    curl_multi_poll(multi, nullptr, 0, kPollIntervalMs, nullptr);
  }
}

// What one transfer left: the classifier's inputs and curl's own words for a failure.
struct Transferred {
  TransferEnd end;
  std::string curl_text;
  std::uint64_t latency_us = 0;
};

// Runs one transfer on a configured handle and detaches it again. Frees s.headers.
Transferred run_transfer(CURLM* multi, CURL* e, const TransferSetup& s, const EngineClient& client,
                         const CallOptions& o) {
  const SteadyTime start = std::chrono::steady_clock::now();
  const LoopEnd loop = drive_transfer(multi, e, client, o);
  Transferred t;
  t.latency_us = elapsed_us(start);
  curl_off_t request_bytes = 0;
  curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &t.end.http_status);
  curl_easy_getinfo(e, CURLINFO_REQUEST_SIZE, &request_bytes);
  curl_multi_remove_handle(multi, e);  // an unfinished transfer's connection is closed
  curl_slist_free_all(s.headers);
  t.curl_text =
      s.errbuf[0] != '\0' ? std::string(s.errbuf) : std::string(curl_easy_strerror(loop.result));
  t.end.curl_code = loop.result;
  t.end.request_bytes_sent = request_bytes != 0;
  t.end.cancelled_in_flight = loop.cancelled;
  const SseState* sse = s.sink->sse;
  t.end.write_refused = s.sink->overflow || (sse != nullptr && (sse->stopped || sse->too_big));
  return t;
}

// A non-2xx body: kept as JSON when it is JSON, and quoted in the error.
void read_error_body(std::int32_t status, HttpReply& reply) {
  reply.body = parse_outside_json(reply.raw);
  reply.http.body_parsed = !reply.body.is_discarded();
  if (!reply.http.body_parsed) reply.body = nullptr;
  reply.http.error =
      bound_error("HTTP " + std::to_string(status) + ": " + reply.raw.substr(0, 400));
}

void finish_stream(SseState& sse, HttpEvidence& ev) {
  RC_CHECK(sse.on_chunk != nullptr);
  if (sse.too_big) {
    ev.body_parsed = false;
    ev.error = "one SSE event exceeds " + std::to_string(kSseEventBytesMax) + " bytes";
    return;
  }
  sse.Finish(ev);
}

// The body behind a status line (verdict kResponse).
void read_response(const EngineClient::Request& req, const WriteCtx& sink, HttpReply& reply) {
  const std::int32_t status = reply.http.http_status;
  RC_CHECK(reply.http.transport == Transport::kOk && status > 0);
  if (sink.overflow) {
    reply.http.body_parsed = false;
    reply.http.error = "response body exceeds " + std::to_string(kResponseBytesMax) + " bytes";
    return;
  }
  if (status < 200 || status >= 300) return read_error_body(status, reply);
  if (req.on_chunk != nullptr) return finish_stream(*sink.sse, reply.http);
  interpret_body(req.shape, req.check, req.path, reply);
}

HttpReply never_sent(std::string error) {
  HttpReply reply;
  reply.http.transport = Transport::kConnectFailed;
  reply.http.error = std::move(error);
  return reply;
}

void record_curl_failure(const Transferred& t, HttpReply& reply) {
  const char* code_text = curl_easy_strerror(static_cast<CURLcode>(t.end.curl_code));
  reply.http.body_parsed = false;
  reply.http.error = bound_error(std::string(code_text) + ": " + t.curl_text);
  reply.raw.clear();
}

// Records the verdict in the reply, and reads the body where there is one to read.
void conclude(const TransportVerdict& v, const Transferred& t, const EngineClient::Request& req,
              const WriteCtx& sink, HttpReply& reply) {
  HttpEvidence& ev = reply.http;
  ev.latency_us = t.latency_us;
  ev.transport = v.transport;
  ev.http_status = v.http_status;
  switch (v.ending) {
    case TransferEnding::kCancelled:
      ev.error = t.end.request_bytes_sent ? "cancelled in flight"
                                          : "cancelled before the request was sent";
      return;
    case TransferEnding::kCurlFailed:
      return record_curl_failure(t, reply);
    case TransferEnding::kNoStatus:  // CURLE_OK without a status line: a broken exchange
      ev.error = "no HTTP status";
      return;
    case TransferEnding::kResponse:
      return read_response(req, sink, reply);
  }
}

}  // namespace

CallOptions WithOperationDeadline(const CallOptions& o, std::uint64_t default_timeout_ms) {
  if (o.deadline) return o;
  CallOptions bounded = o;
  bounded.deadline = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(o.timeout_ms.value_or(default_timeout_ms));
  return bounded;
}

CallOptions UntilDeadlineMs(std::uint64_t deadline_at_ms) {
  constexpr std::int64_t kSteadyMsMax =
      std::chrono::duration_cast<std::chrono::milliseconds>(SteadyTime::duration::max()).count();
  const std::uint64_t at_ms = std::min(deadline_at_ms, static_cast<std::uint64_t>(kSteadyMsMax));
  const auto now_ms = static_cast<std::uint64_t>(steady_now_ms());
  CallOptions o;
  o.timeout_ms = std::max<std::uint64_t>(1, at_ms > now_ms ? at_ms - now_ms : 0);
  o.deadline = SteadyTime(std::chrono::milliseconds(static_cast<std::int64_t>(at_ms)));
  return o;
}

HttpReply EngineClient::Call(const Request& req, const CallOptions& o) {
  RC_CHECK(!req.path.empty() && req.path.front() == '/');
  std::uint64_t timeout_ms = o.timeout_ms.value_or(req.timeout_ms);
  if (o.deadline) timeout_ms = std::min(timeout_ms, remaining_ms(*o.deadline));
  const std::size_t body_bytes = req.json_body ? req.json_body->size() : 0;
  std::optional<std::string> refused =
      refusal_before_sending(timeout_ms, call_cancelled(*this, o), body_bytes);
  if (refused) return never_sent(std::move(*refused));
  HttpReply reply = Send(req, o, timeout_ms);
  RC_CHECK(reply.raw.size() <= kResponseBytesMax && !reply.body.is_discarded());
  RC_CHECK(reply.http.error.size() <= kHttpErrorBytesMax);
  return reply;
}

HttpReply EngineClient::Send(const Request& req, const CallOptions& o, std::uint64_t timeout_ms) {
  RC_CHECK(timeout_ms > 0);
  HttpReply reply;
  SseState sse;
  sse.on_chunk = req.on_chunk;
  WriteCtx sink{nullptr, &reply.raw, false, req.on_chunk ? &sse : nullptr};
  std::unique_ptr<Handle> h = Acquire();
  h->Reset();
  if (o.fresh_connection) h->DropConnections();
  sink.easy = h->easy;
  const TransferSetup setup{
      base_url_ + req.path, deadlines_.connect_timeout_ms, timeout_ms, h->errbuf, &sink,
      request_headers(req)};
  set_transfer_options(h->easy, setup);
  set_method(h->easy, req, o.reuse_connection);
  set_connection_reuse(h->easy, o.fresh_connection);
  const Transferred t = run_transfer(h->multi, h->easy, setup, *this, o);
  Release(std::move(h));
  conclude(classify_transport(t.end), t, req, sink, reply);
  return reply;
}

// ---- raw calls ----

namespace {
EngineClient::Request get(std::string path, EngineClient::Shape shape, bool (*check)(const json&),
                          std::uint64_t timeout_ms) {
  RC_CHECK(!path.empty() && path.front() == '/' && timeout_ms > 0);
  EngineClient::Request r;
  r.method = EngineClient::Method::kGet;
  r.path = std::move(path);
  r.shape = shape;
  r.check = check;
  r.timeout_ms = timeout_ms;
  return r;
}
EngineClient::Request post(std::string path, std::optional<std::string> body,
                           EngineClient::Shape shape, bool (*check)(const json&),
                           std::uint64_t timeout_ms) {
  EngineClient::Request r = get(std::move(path), shape, check, timeout_ms);
  r.method = EngineClient::Method::kPost;
  r.json_body = std::move(body);
  return r;
}
std::string dump(const json& j) {
  // Replace invalid UTF-8 instead of throwing.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}
// /is_paused's answer in a 2xx reply (check_is_paused made it a boolean).
bool is_paused_in(const HttpReply& paused) {
  RC_CHECK(paused.http.ok_2xx());
  auto it = paused.body.find("is_paused");
  RC_CHECK(it != paused.body.end() && it->is_boolean());
  return it->get<bool>();
}
bool has_string(const json& body, const char* key) {
  if (!body.is_object()) return false;
  auto it = body.find(key);
  return it != body.end() && it->is_string();
}
}  // namespace

HttpReply EngineClient::Health(const CallOptions& o) {
  return Call(get("/health", Shape::kEmptyOrJson, nullptr, deadlines_.call_timeout_ms), o);
}
HttpReply EngineClient::Version(const CallOptions& o) {
  return Call(get("/version", Shape::kJsonObject, &check_version, deadlines_.call_timeout_ms), o);
}
HttpReply EngineClient::GetWeightInfo(const CallOptions& o) {
  return Call(
      get("/weight_info", Shape::kJsonObject, &check_weight_info, deadlines_.call_timeout_ms), o);
}
HttpReply EngineClient::CollectiveRpc(const std::string& method,
                                      const std::vector<std::string>& args, const CallOptions& o) {
  RC_CHECK(!method.empty());
  return Call(post("/collective_rpc", dump(json{{"method", method}, {"args", args}}),
                   Shape::kJsonObject, nullptr, deadlines_.call_timeout_ms),
              o);
}
HttpReply EngineClient::PostJson(const std::string& path, const json& body, const CallOptions& o) {
  RC_CHECK(!path.empty() && path[0] == '/' && body.is_object());
  Request r = post(path, dump(body), Shape::kJsonObject, nullptr, deadlines_.call_timeout_ms);
  if (!o.bearer_token.empty()) r.bearer_token = &o.bearer_token;
  return Call(r, o);
}

bool IsBearerToken(const std::string& token) {
  if (token.empty() || token.size() > 4096) return false;
  for (unsigned char c : token) {
    if (c <= 0x20 || c >= 0x7f) return false;
  }
  return true;
}
namespace {

// vLLM's answer to a collective_rpc naming a method no worker has (run_method's
// NotImplementedError through the API server: docs/vllm-protocol.md, "Answers").
bool UnknownRpcMethod(const HttpReply& r, const std::string& method) {
  const bool status = r.http.http_status == 500 || r.http.http_status == 501;
  return status && r.raw.find("Method '" + method + "' is not implemented") != std::string::npos;
}

// The engine answered that it has no such route or method: its route set is not the one the
// route was found on (a restart onto another vLLM line). A timeout, a refused connection, a 5xx
// or any other answer says nothing of the route set and keeps the route.
bool RouteGone(LabelRoute route, const HttpReply& r, const std::string& rpc_method) {
  if (route == LabelRoute::kUnknown || r.http.transport != Transport::kOk) return false;
  if (r.http.http_status == 404) return true;
  return route == LabelRoute::kWorkerRpc && UnknownRpcMethod(r, rpc_method);
}

const char* route_name(LabelRoute route) {
  switch (route) {
    case LabelRoute::kWeightInfoRoute:
      return "the /weight_info route";
    case LabelRoute::kWorkerRpc:
      return "the worker extension's RPC";
    case LabelRoute::kUnknown:
      break;
  }
  return "no route";
}

}  // namespace

HttpReply EngineClient::ReadLabel(const CallOptions& options) {
  const CallOptions o = WithOperationDeadline(options, deadlines_.call_timeout_ms);
  const LabelRoute route = label_route();
  HttpReply r = LabelThrough(route, o);
  if (RouteGone(route, r, "rc_weight_info")) r = Reprobe(route, r.http, o, nullptr);
  // ObserveView, WeightInfo and the runner read it without another check.
  RC_CHECK(!r.http.ok_2xx() || has_string(r.body, "weight_version"));
  return r;
}
HttpReply EngineClient::LabelThrough(LabelRoute route, const CallOptions& o) {
  switch (route) {
    case LabelRoute::kWorkerRpc:
      return LabelFromExtension(o);
    case LabelRoute::kWeightInfoRoute:
      return GetWeightInfo(o);
    case LabelRoute::kUnknown:
      break;
  }
  return ProbeLabel(o, nullptr);
}
HttpReply EngineClient::LabelFromExtension(const CallOptions& o) {
  return label_from_rpc(CollectiveRpc("rc_weight_info", {}, o), "rc_weight_info", nullptr);
}
HttpReply EngineClient::ProbeLabel(const CallOptions& o, LabelRoute* found) {
  HttpReply info = GetWeightInfo(o);
  const bool absent = info.http.transport == Transport::kOk && info.http.http_status == 404;
  if (!absent) {
    if (info.http.ok_2xx()) Found(LabelRoute::kWeightInfoRoute, found);
    return info;
  }
  // No /weight_info: vLLM 0.25.x. The label must come from the worker extension.
  HttpReply rpc = LabelFromExtension(o);
  rpc.http = chain(info.http, rpc.http);
  if (rpc.http.ok_2xx()) {
    Found(LabelRoute::kWorkerRpc, found);
  } else {
    rpc.http.error = bound_error(
        "GET /weight_info answered 404 (vLLM 0.25.x has no label "
        "route); " +
        rpc.http.error);
  }
  return rpc;
}
void EngineClient::Found(LabelRoute route, LabelRoute* found) {
  RC_CHECK(route != LabelRoute::kUnknown);
  set_label_route(route);
  if (found != nullptr) *found = route;
}
// Another thread may have found the route again meanwhile: only `gone` itself is forgotten.
void EngineClient::ForgetLabelRoute(LabelRoute gone) {
  LabelRoute expected = gone;
  label_route_.compare_exchange_strong(expected, LabelRoute::kUnknown, std::memory_order_acq_rel);
}
// The one probe a call makes after its route proved gone; never a loop.
HttpReply EngineClient::Reprobe(LabelRoute gone, const HttpEvidence& refused, const CallOptions& o,
                                LabelRoute* found) {
  ForgetLabelRoute(gone);
  HttpReply again = ProbeLabel(o, found);
  again.http = chain(refused, again.http);
  if (!again.http.ok_2xx()) {
    again.http.error = bound_error(std::string(route_name(gone)) + " is gone (it answered " +
                                   std::to_string(refused.http_status) +
                                   ": no such route or method; the engine restarted onto another "
                                   "vLLM line?); probed again: " +
                                   again.http.error);
  }
  return again;
}
HttpReply EngineClient::WriteLabel(const std::string& label, const CallOptions& options) {
  const CallOptions o = WithOperationDeadline(options, deadlines_.call_timeout_ms);
  const LabelRoute cached = label_route();
  LabelRoute route = LabelRoute::kUnknown;
  if (cached == LabelRoute::kUnknown) {
    HttpReply found = ProbeLabel(o, &route);
    return WriteLabelAfter(std::move(found), route, label, o);
  }
  HttpReply w = WriteLabelThrough(cached, label, o);
  if (!RouteGone(cached, w, "rc_set_weight_version")) return w;
  HttpReply found = Reprobe(cached, w.http, o, &route);
  return WriteLabelAfter(std::move(found), route, label, o);
}
// The write once a probe found `route` (its reply `found`); the probe's failure otherwise.
HttpReply EngineClient::WriteLabelAfter(HttpReply found, LabelRoute route, const std::string& label,
                                        const CallOptions& o) {
  if (!found.http.ok_2xx()) return found;
  RC_CHECK(route != LabelRoute::kUnknown);  // a probe that succeeded named its route
  HttpReply w = WriteLabelThrough(route, label, o);
  w.http = chain(found.http, w.http);
  return w;
}
HttpReply EngineClient::WriteLabelThrough(LabelRoute route, const std::string& label,
                                          const CallOptions& o) {
  RC_CHECK(route != LabelRoute::kUnknown);
  if (route == LabelRoute::kWorkerRpc) {
    return label_from_rpc(CollectiveRpc("rc_set_weight_version", {label}, o),
                          "rc_set_weight_version", &label);
  }
  return UpdateWeightVersion(label, o);
}
HttpReply EngineClient::Pause(PauseMode mode, bool clear_cache, const CallOptions& o) {
  std::string path = std::string("/pause?mode=") + pause_mode_name(mode) +
                     "&clear_cache=" + (clear_cache ? "true" : "false");
  const std::uint64_t t =
      mode == PauseMode::kWait ? deadlines_.drain_timeout_ms : deadlines_.call_timeout_ms;
  return Call(post(std::move(path), std::nullopt, Shape::kJsonObject, &check_status, t), o);
}
HttpReply EngineClient::Sleep(std::uint8_t level, PauseMode mode, const CallOptions& o) {
  RC_CHECK(level >= 1 && level <= kSleepLevelMax);
  std::string path = "/sleep?level=" + std::to_string(level) + "&mode=" + pause_mode_name(mode);
  return Call(
      post(std::move(path), std::nullopt, Shape::kEmptyOrJson, nullptr, deadlines_.call_timeout_ms),
      o);
}
HttpReply EngineClient::WakeUp(WakeTag tag, const CallOptions& o) {
  return Call(post(std::string("/wake_up?tags=") + wake_tag_name(tag), std::nullopt,
                   Shape::kEmptyOrJson, nullptr, deadlines_.call_timeout_ms),
              o);
}
HttpReply EngineClient::IsSleeping(const CallOptions& o) {
  return Call(
      get("/is_sleeping", Shape::kJsonObject, &check_is_sleeping, deadlines_.call_timeout_ms), o);
}
HttpReply EngineClient::DeviceInfo(const CallOptions& o) {
  return CollectiveRpc("rc_device_info", {}, o);
}
HttpReply EngineClient::ResumeRaw(const CallOptions& o) {
  return Call(
      post("/resume", std::nullopt, Shape::kJsonObject, &check_status, deadlines_.call_timeout_ms),
      o);
}
HttpReply EngineClient::IsPaused(const CallOptions& o) {
  return Call(get("/is_paused", Shape::kJsonObject, &check_is_paused, deadlines_.call_timeout_ms),
              o);
}
// Every reset route may answer an empty 200 (vLLM 0.25.x: all three; later: mm/encoder) or JSON
// ({"success": bool} from /reset_prefix_cache after 0.25); ResetCache interprets the body.
HttpReply EngineClient::ResetCacheRaw(CacheKind cache, const CallOptions& o) {
  return Call(post(cache_path(cache), std::nullopt, Shape::kEmptyOrJson, nullptr,
                   deadlines_.call_timeout_ms),
              o);
}
HttpReply EngineClient::UpdateWeightVersion(const std::string& label, const CallOptions& o) {
  HttpReply r = Call(post("/update_weight_version", dump(json{{"new_version", label}}),
                          Shape::kJsonObject, &check_success, deadlines_.call_timeout_ms),
                     o);
  // The body check refused a 2xx: say so plainly when the engine reported a failed relabel.
  const bool answered_2xx =
      r.http.transport == Transport::kOk && r.http.http_status >= 200 && r.http.http_status < 300;
  if (!answered_2xx || r.http.body_parsed || !r.body.is_object()) return r;
  const auto success = r.body.find("success");
  if (success != r.body.end() && success->is_boolean() && !success->get<bool>()) {
    r.http.error =
        "/update_weight_version answered {\"success\": false}: the engine did not set "
        "the label";
  }
  return r;
}
HttpReply EngineClient::GetWorldSize(bool include_dp, const CallOptions& o) {
  return Call(get(std::string("/get_world_size?include_dp=") + (include_dp ? "true" : "false"),
                  Shape::kJsonObject, &check_world_size, deadlines_.call_timeout_ms),
              o);
}
HttpReply EngineClient::InitWeightTransferEngine(const json& init_info, const CallOptions& o) {
  return Call(post("/init_weight_transfer_engine", dump(json{{"init_info", init_info}}),
                   Shape::kJsonObject, nullptr, deadlines_.update_timeout_ms),
              o);
}
namespace {

// vLLM's refusal to start while an earlier session is open ("... already active. Call
// finish_weight_update first."; the double says the same).
bool StaleSessionRefusal(const HttpReply& start) {
  if (start.http.transport != Transport::kOk || start.http.http_status < 500) return false;
  std::string lower = start.raw;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower.find("finish_weight_update first") != std::string::npos;
}

// StaleSession::kRefuse: the sent refusal stays the evidence (never "not sent", so the caller
// classes it a possible mutation), its error led by the cause so a bound cuts the engine's words
// first.
HttpReply ForeignSession(HttpReply refused) {
  RC_CHECK(!refused.http.never_sent() && !refused.http.ok_2xx());
  refused.http.error = bound_error(std::string(kForeignWeightSession) + "; " + refused.http.error);
  refused.foreign_weight_session = true;
  return refused;
}

}  // namespace

HttpReply EngineClient::StartOnce(const CallOptions& o) {
  return Call(post("/start_weight_update", std::nullopt, Shape::kJsonObject, nullptr,
                   deadlines_.call_timeout_ms),
              o);
}

HttpReply EngineClient::StartWeightUpdate(StaleSession stale, const CallOptions& options) {
  const CallOptions o = WithOperationDeadline(options, deadlines_.call_timeout_ms);
  HttpReply first = StartOnce(o);
  if (!StaleSessionRefusal(first)) return first;
  if (stale == StaleSession::kRefuse) return ForeignSession(std::move(first));
  return FinishStaleThenStart(std::move(first), o);
}

// A transfer that failed after its start (the engine kept alive) leaves the session open, and the
// restore that follows the taint is refused until it is finished. The engine already holds
// unproven weights, so finishing the stale session changes nothing the restore does not replace;
// done once, and every byte after it is judged as before.
HttpReply EngineClient::FinishStaleThenStart(HttpReply refused, const CallOptions& o) {
  HttpReply fin = FinishWeightUpdate(std::nullopt, o);
  if (!fin.http.ok_2xx()) return refused;
  HttpReply second = StartOnce(o);
  if (!second.http.never_sent()) return second;
  // The finish sent above may have changed the weights (0.25.x commits the reload it ends): a
  // start not sent after it is no proof that nothing changed, so the sent refusal is the evidence.
  refused.http.error = bound_error(
      "the stale weight session was finished, then the start was not "
      "sent: " +
      second.http.error);
  return refused;
}
HttpReply EngineClient::UpdateWeights(const json& update_info, const CallOptions& o) {
  return Call(post("/update_weights", dump(json{{"update_info", update_info}}), Shape::kJsonObject,
                   nullptr, deadlines_.update_timeout_ms),
              o);
}
HttpReply EngineClient::FinishWeightUpdate(const std::optional<std::string>& label,
                                           const CallOptions& options) {
  const CallOptions o = WithOperationDeadline(options, deadlines_.call_timeout_ms);
  // Finish is always sent first: an engine left without it keeps layers mid-reload (0.25.x) and
  // refuses the next start. The body carries the label unless the engine is known to ignore it.
  std::optional<std::string> body;
  if (label && label_route() != LabelRoute::kWorkerRpc) {
    body = dump(json{{"weight_version", *label}});
  }
  HttpReply fin = Call(post("/finish_weight_update", std::move(body), Shape::kJsonObject, nullptr,
                            deadlines_.call_timeout_ms),
                       o);
  if (!label || !fin.http.ok_2xx() || label_route() == LabelRoute::kWeightInfoRoute) return fin;
  if (label_route() == LabelRoute::kUnknown) {
    HttpReply found = ReadLabel(o);  // which route: the finish body set it, or the RPC must
    found.http = chain(fin.http, found.http);
    if (!found.http.ok_2xx() || label_route() == LabelRoute::kWeightInfoRoute) return found;
    fin.http = found.http;
  }
  HttpReply set = WriteLabel(*label, o);
  set.http = chain(fin.http, set.http);
  return set;
}
HttpReply EngineClient::MetricsRaw(const CallOptions& o) {
  return Call(get("/metrics", Shape::kText, nullptr, deadlines_.call_timeout_ms), o);
}
HttpReply EngineClient::Completions(const json& request, const CallOptions& o) {
  return Call(post("/v1/completions", dump(request), Shape::kJsonObject, nullptr,
                   deadlines_.call_timeout_ms),
              o);
}
HttpReply EngineClient::ChatCompletions(const json& request, const CallOptions& o) {
  return Call(post("/v1/chat/completions", dump(request), Shape::kJsonObject, nullptr,
                   deadlines_.call_timeout_ms),
              o);
}
HttpReply EngineClient::Generate(const json& request, const CallOptions& o) {
  return Call(post("/inference/v1/generate", dump(request), Shape::kJsonObject, nullptr,
                   deadlines_.call_timeout_ms),
              o);
}
HttpReply EngineClient::Stream(const std::string& path, json request, const ChunkFn& on_chunk,
                               const CallOptions& o) {
  RC_CHECK(static_cast<bool>(on_chunk));  // Dispatch calls it
  if (!request.is_object()) request = json::object();
  request["stream"] = true;
  Request r = post(path, dump(request), Shape::kJsonObject, nullptr, deadlines_.call_timeout_ms);
  r.on_chunk = &on_chunk;
  return Call(r, o);
}
HttpReply EngineClient::CompletionsStream(const json& request, const ChunkFn& on_chunk,
                                          const CallOptions& o) {
  return Stream("/v1/completions", request, on_chunk, o);
}
HttpReply EngineClient::ChatCompletionsStream(const json& request, const ChunkFn& on_chunk,
                                              const CallOptions& o) {
  return Stream("/v1/chat/completions", request, on_chunk, o);
}
HttpReply EngineClient::GenerateStream(const json& request, const ChunkFn& on_chunk,
                                       const CallOptions& o) {
  return Stream("/inference/v1/generate", request, on_chunk, o);
}

// ---- typed evidence ----

namespace {
// A read of a look at the engine, on a new connection (CallOptions::fresh_connection).
CallOptions FreshLook() {
  CallOptions o;
  o.fresh_connection = true;
  return o;
}
}  // namespace

EngineProbed EngineClient::Probe() {
  EngineProbed p;
  HttpReply health = Health(FreshLook());
  p.http = health.http;
  if (!health.http.ok_2xx()) return p;
  HttpReply version = Version(FreshLook());
  p.http = chain(p.http, version.http);
  if (!version.http.ok_2xx()) return p;
  RC_CHECK(has_string(version.body, "version"));  // check_version passed
  p.engine_version = version.body["version"].get<std::string>();
  EngineView view = ObserveView(FreshLook());
  p.http = chain(p.http, view.http);
  p.reported_label = std::move(view.label);
  p.is_paused_known = view.is_paused_known;
  p.is_paused = view.is_paused;
  p.engine_instance = std::move(view.instance);
  return p;
}

std::string EngineClient::Instance(const HttpReply& label_reply, const CallOptions& o) {
  if (std::optional<std::string> named = instance_in_label_body(label_reply.body)) return *named;
  HttpReply metrics = MetricsRaw(o);
  return metrics.http.ok_2xx() ? start_time_instance(metrics.raw) : std::string();
}

std::string EngineClient::Instance(const CallOptions& options) {
  const CallOptions o = WithOperationDeadline(options, deadlines_.call_timeout_ms);
  HttpReply info = ReadLabel(o);
  return info.http.ok_2xx() ? Instance(info, o) : std::string();
}

EngineClient::EngineView EngineClient::ObserveView(const CallOptions& o) {
  EngineView v;
  HttpReply info = ReadLabel(o);
  v.http = info.http;
  if (!info.http.ok_2xx()) return v;
  v.label = info.body["weight_version"].get<std::string>();
  HttpReply paused = IsPaused(o);
  v.http = chain(v.http, paused.http);
  if (paused.http.ok_2xx()) {
    v.is_paused_known = true;
    v.is_paused = is_paused_in(paused);
  }
  v.instance = Instance(info, o);
  return v;
}

EngineMonitored EngineClient::Monitor() {
  EngineMonitored m;
  HttpReply health = Health(FreshLook());
  m.http = health.http;
  if (!health.http.ok_2xx()) return m;
  EngineView view = ObserveView(FreshLook());
  m.http = chain(m.http, view.http);
  m.reported_label = std::move(view.label);
  m.is_paused_known = view.is_paused_known;
  m.is_paused = view.is_paused;
  m.engine_instance = std::move(view.instance);
  return m;
}

DrainObserved EngineClient::PauseWait() {
  DrainObserved d;
  HttpReply r = Pause(PauseMode::kWait, /*clear_cache=*/false);
  d.http = r.http;
  d.paused = r.http.ok_2xx() && r.body["status"] == "paused";
  return d;
}

CacheResetObserved EngineClient::ResetCache(CacheKind cache) {
  return reset_observed(cache, ResetCacheRaw(cache));
}

ValidationObserved EngineClient::WeightInfo() {
  ValidationObserved v;
  HttpReply r = ReadLabel();
  v.http = r.http;
  if (r.http.ok_2xx()) {
    v.reported_label = r.body["weight_version"].get<std::string>();
    v.detail = label_detail(r.body);
    v.engine_instance = Instance(r);
  }
  v.checks_passed = true;  // no optional checks configured here
  return v;
}

ResumeObserved EngineClient::Resume() {
  ResumeObserved out;
  HttpReply resume = ResumeRaw();
  out.http = resume.http;
  if (!resume.http.ok_2xx()) return out;
  HttpReply paused = IsPaused();
  out.http = chain(resume.http, paused.http);
  if (paused.http.ok_2xx()) {
    out.is_paused_known = true;
    out.is_paused = is_paused_in(paused);
  }
  // vLLM reports a paused engine as sleeping too: only an unpaused one's answer tells.
  if (out.is_paused_known && !out.is_paused) ReadSleeping(out);
  out.engine_instance = Instance();
  return out;
}

// A failed read leaves it unknown, as an engine without the route: the resume stands on the
// rest of its evidence.
void EngineClient::ReadSleeping(ResumeObserved& out) {
  HttpReply sleeping = IsSleeping();
  if (!sleeping.http.ok_2xx()) return;
  out.is_sleeping_known = true;
  out.is_sleeping = sleeping.body.at("is_sleeping").get<bool>();
}

bool SameEngineAs(EngineClient& client, const std::string& instance, std::uint64_t timeout_ms,
                  std::string* now) {
  if (instance.empty()) return false;
  const std::string read = client.Instance(CallOptions{timeout_ms, std::nullopt});
  if (now != nullptr) *now = read;
  return !read.empty() && read == instance;
}

}  // namespace rc::effects
