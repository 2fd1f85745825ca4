// EngineClient: the vLLM HTTP adapter (libcurl). Every call returns typed evidence; the fold
// decides what it means. No exception escapes; every call has a connect and a total deadline and
// can be cancelled; every response body is bounded. How an exchange's end becomes
// HttpEvidence::transport: the table at classify_transport() below.
// POSTs use a fresh connection (libcurl would otherwise silently re-send a POST whose reused
// connection closed without a response) unless the caller sets CallOptions::reuse_connection for
// a POST that is safe to run twice (the proxy's generation requests); GETs reuse pooled
// connections. Each pooled handle keeps its own connection cache; how many idle handles are kept
// is per client (idle_handles_max, default kIdleHandlesMax).
// body_parsed is true only when the body is the JSON the route promises on 2xx (for routes that
// answer an empty body: empty or valid JSON). On non-2xx it says whether the body is valid JSON.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "statemachine/events.h"
#include "statemachine/types.h"

namespace rc::effects {

inline constexpr std::size_t kResponseBytesMax = std::size_t{16} << 20;  // per response body
inline constexpr std::size_t kRequestBytesMax = std::size_t{256} << 20;  // per request body
inline constexpr std::size_t kHttpErrorBytesMax = 512;                   // HttpEvidence::error
inline constexpr std::size_t kIdleHandlesMax = 16;       // pooled curl handles (default)
inline constexpr std::size_t kIdleHandlesLimit = 65536;  // largest idle_handles_max accepted
inline constexpr std::size_t kSseEventBytesMax = std::size_t{4} << 20;  // one SSE event

struct EngineDeadlines {
  std::uint64_t connect_timeout_ms = 1000;
  std::uint64_t call_timeout_ms = 10000;     // every call without a more specific deadline
  std::uint64_t drain_timeout_ms = 600000;   // POST /pause?mode=wait
  std::uint64_t update_timeout_ms = 600000;  // /init_weight_transfer_engine, /update_weights
};

// A per-call cancellation flag shared between the caller and the call. Cancel() makes a call that
// holds the token return promptly (within ~50 ms); calls started after Cancel() return at once.
class CancelToken {
 public:
  CancelToken() : flag_(std::make_shared<std::atomic<bool>>(false)) {}
  void Cancel() const { flag_->store(true, std::memory_order_release); }
  bool cancelled() const { return flag_->load(std::memory_order_acquire); }

 private:
  std::shared_ptr<std::atomic<bool>> flag_;
};

struct CallOptions {
  std::optional<std::uint64_t> timeout_ms;  // overrides the call kind's deadline
  std::optional<CancelToken> cancel;        // in addition to EngineClient::Cancel()
  // POST only: allow a pooled keep-alive connection. Only for requests that may run twice
  // without harm (generation): libcurl re-sends a POST whose reused connection dropped before
  // any response byte. Never for weight or lifecycle calls.
  bool reuse_connection = false;
  // A new connection, its host name looked up again, the handle's cached connections closed:
  // every read of a look at the engine (the monitor's, a probe's, the look before a plan, a
  // validation's), so that each reads the process the engine's address reaches now, never one an
  // older kept-alive connection still reaches (a restarted engine behind the same name or a
  // virtual address). Reads of one look that reach two processes disagree (instance, label) and
  // the look vouches for neither. A look is a few GETs every monitor interval: the connects cost
  // little beside what a stale look would hide.
  bool fresh_connection = false;
  // PostJson only: sent as "Authorization: Bearer <token>" (RolloutCore's own API, not an
  // engine). The caller has checked it is printable ASCII without spaces (IsBearerToken).
  std::string bearer_token;
  // The end of the whole operation this call belongs to: the call gets at most what is left of
  // it, so an operation of several calls ends by one deadline, not one per call.
  std::optional<std::chrono::steady_clock::time_point> deadline;
};

// `o` with a deadline for an operation of several calls: its own, else now plus its timeout
// (default_timeout_ms when it names none).
CallOptions WithOperationDeadline(const CallOptions& o, std::uint64_t default_timeout_ms);
// A call of an operation that must end by `deadline_at_ms` (steady_now_ms's clock): it may take
// whatever is left of it when sent, and no more, so calls in a row end by the one deadline.
CallOptions UntilDeadlineMs(std::uint64_t deadline_at_ms);

// A token that can travel in an Authorization header: 1..4096 printable ASCII, no space.
bool IsBearerToken(const std::string& token);

// One raw exchange: the evidence, the parsed JSON (null unless the body parsed) and the raw body
// (bounded by kResponseBytesMax).
struct HttpReply {
  HttpEvidence http;
  nlohmann::json body;
  std::string raw;
  // StartWeightUpdate(StaleSession::kRefuse) found a weight session open that this controller
  // did not start (kForeignWeightSession): someone else may have changed the weights.
  bool foreign_weight_session = false;
};

// ---- Transport classification (HttpEvidence::transport) ----
//   kConnectFailed  the request provably never reached the engine: CURLE_COULDNT_CONNECT,
//                   CURLE_COULDNT_RESOLVE_HOST/PROXY, or a timeout / cancellation that struck
//                   before curl wrote a single request byte (CURLINFO_REQUEST_SIZE == 0), or a
//                   request refused locally (spent deadline, cancelled before start, too large:
//                   refusal_before_sending).
//   kTimeout        CURLE_OPERATION_TIMEDOUT or a cancellation after request bytes were written.
//   kBroken         the connection dropped mid-exchange (RECV_ERROR, SEND_ERROR, GOT_NOTHING,
//                   PARTIAL_FILE), curl finished without a status line, and, conservatively,
//                   every other curl failure (a CURLE_WRITE_ERROR the body sink did not cause
//                   included).
//   kOk             a status line arrived (including a body cut off at kResponseBytesMax, by
//                   the body sink or by CURLE_FILESIZE_EXCEEDED, which is reported with
//                   body_parsed=false).
// A cancellation outranks whatever curl reported.

// What a transfer left behind that its transport depends on (and nothing else).
struct TransferEnd {
  int curl_code = 0;                 // the transfer's CURLcode; 0 is CURLE_OK
  long http_status = 0;              // CURLINFO_RESPONSE_CODE: 0 until a status line arrived
  bool request_bytes_sent = false;   // CURLINFO_REQUEST_SIZE != 0
  bool cancelled_in_flight = false;  // a cancel stopped the transfer before curl ended it
  // The body sink refused bytes on purpose (body over kResponseBytesMax, an SSE event over
  // kSseEventBytesMax, the caller's stop): curl then reports CURLE_WRITE_ERROR.
  bool write_refused = false;
};

// What the reply then records besides the transport.
enum class TransferEnding : std::uint8_t {
  kCancelled = 0,   // a cancel ended it; the error says whether a byte was sent
  kCurlFailed = 1,  // curl failed on its own; its words are the error, the body is dropped
  kNoStatus = 2,    // curl ended cleanly without a status line
  kResponse = 3,    // a status line arrived and curl ended: the body is read
};

struct TransportVerdict {
  Transport transport = Transport::kBroken;
  std::int32_t http_status = 0;  // the status line's code where transport is kOk, else <= 0
  TransferEnding ending = TransferEnding::kCurlFailed;
};

// The table above, for a call that reached curl. Pure.
TransportVerdict classify_transport(const TransferEnd& end);

// The table's local refusals, checked in this order: the error text of a call that must not be
// sent (reported as kConnectFailed), or nullopt. Pure.
std::optional<std::string> refusal_before_sending(std::uint64_t timeout_ms, bool cancelled,
                                                  std::size_t body_bytes);

// Where the engine keeps its weight-version label. Found by the first label call (Probe):
//   kWeightInfoRoute  GET /weight_info, POST /update_weight_version, /finish_weight_update
//                     {"weight_version"} (vLLM after 0.25: PR #49040).
//   kWorkerRpc        vLLM 0.25.x has none of those routes (GET /weight_info answers 404); the
//                     label lives in RolloutCore's worker extension and is read and written through
//                     POST /collective_rpc. vLLM must be started with
//                     --worker-extension-cls rolloutcore.vllm_ext.RolloutCoreWorkerExtension
//                     (python/rolloutcore/vllm_ext.py on the engine's PYTHONPATH).
// The route found is cached per client. An engine restarted onto another line may lack it: when
// the cached route answers that it does not exist (a 404, or the RPC's "Method '...' is not
// implemented"), the call forgets it and probes once more. A timeout, a refused connection or any
// other error says nothing of the route set and keeps it.
enum class LabelRoute : std::uint8_t { kUnknown = 0, kWeightInfoRoute = 1, kWorkerRpc = 2 };
inline constexpr char kWorkerExtensionClass[] = "rolloutcore.vllm_ext.RolloutCoreWorkerExtension";
inline constexpr std::size_t kRpcWorkersMax = 4096;  // entries accepted in a collective_rpc reply

// What a start refused because a weight session is already open ("... Call
// finish_weight_update first.") does with that session. No default: each caller says which.
enum class StaleSession : std::uint8_t {
  // Leave it open and fail the start, the sent refusal its evidence (a possible mutation: the fold
  // taints) and kForeignWeightSession its cause; /finish_weight_update is never sent. An engine
  // trusted to hold its committed version holds no session this controller left, so an open one is
  // someone else's, who may have loaded weights: finishing it (vLLM 0.25.x commits the load) would
  // hide that under the next update.
  kRefuse = 0,
  // Finish it once, then start again: only for a restore. Its engine is TAINTED (the session most
  // likely left by this controller's own failed transfer, its weights unproven either way), and
  // the restore replaces them, then proves them by digest.
  kFinish = 1,
};
// A transfer's choice: a restore (TransferTarget::restore) may finish a stale session, no other.
inline StaleSession StaleSessionFor(bool restore) {
  return restore ? StaleSession::kFinish : StaleSession::kRefuse;
}
inline constexpr char kForeignWeightSession[] =
    "an open weight session this controller did not start: the engine's weights may have been "
    "changed from outside";

// What the pause modes of POST /pause are.
enum class PauseMode : std::uint8_t { kAbort = 0, kWait = 1, kKeep = 2 };
const char* pause_mode_name(PauseMode m);

class EngineClient {
 public:
  // base_url like "http://127.0.0.1:8000" (a trailing '/' is dropped).
  // idle_handles_max: idle curl handles (each with its open connection) kept for reuse; a
  // client with many concurrent calls (the proxy) needs about as many as it has calls in flight,
  // or most calls reconnect. 1..kIdleHandlesLimit.
  explicit EngineClient(std::string base_url, EngineDeadlines deadlines = {},
                        std::size_t idle_handles_max = kIdleHandlesMax);
  ~EngineClient();
  EngineClient(const EngineClient&) = delete;
  EngineClient& operator=(const EngineClient&) = delete;

  const std::string& base_url() const { return base_url_; }
  const EngineDeadlines& deadlines() const { return deadlines_; }
  std::size_t idle_handles_max() const { return idle_handles_max_; }
  std::size_t idle_handles() const;  // handles now in the pool (tests)

  // Makes every in-flight call return promptly and every later call fail at once (never sent)
  // until ClearCancel(). Thread-safe.
  void Cancel();
  void ClearCancel();
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // ---- typed evidence for the runner ----
  // /health, /version, the label (ReadLabel), /is_paused and the engine's instance.
  EngineProbed Probe();
  // The monitor's view: /health, the label, /is_paused, the instance (no /version).
  EngineMonitored Monitor();
  // Which engine process answers: the worker extension's nonces when the label reply carries
  // them, else "start:<process_start_time_seconds>" from /metrics, else "" (unknown).
  std::string Instance(const HttpReply& label_reply, const CallOptions& o = {});
  // The same after a fresh label read; "" (unknown) when that read failed, as a failed read
  // proves nothing about which process answers.
  std::string Instance(const CallOptions& o = {});
  DrainObserved PauseWait();  // POST /pause?mode=wait&clear_cache=false
  CacheResetObserved ResetCache(CacheKind cache);
  ValidationObserved WeightInfo();  // the label (ReadLabel) while paused
  ResumeObserved Resume();  // POST /resume, GET /is_paused, GET /is_sleeping, then the instance

  // ---- raw calls ----
  HttpReply Health(const CallOptions& o = {});
  HttpReply Version(const CallOptions& o = {});
  HttpReply GetWeightInfo(const CallOptions& o = {});
  // The engine's label through whichever route it has; the first call finds the route (GET
  // /weight_info; on 404, /collective_rpc rc_weight_info), and a call whose cached route is gone
  // finds it again (LabelRoute). On success body is {"weight_version": label} (+ "workers": n on
  // the RPC route, every worker agreeing).
  HttpReply ReadLabel(const CallOptions& o = {});
  // Sets the label (/update_weight_version or rc_set_weight_version on every worker). Like
  // ReadLabel and FinishWeightUpdate it may take several calls; all of them end by one deadline.
  HttpReply WriteLabel(const std::string& label, const CallOptions& o = {});
  LabelRoute label_route() const { return label_route_.load(std::memory_order_acquire); }
  void set_label_route(LabelRoute r) { label_route_.store(r, std::memory_order_release); }
  // POST /collective_rpc {"method", "args"}: 2xx body {"results": [...]} (one entry per worker).
  HttpReply CollectiveRpc(const std::string& method, const std::vector<std::string>& args,
                          const CallOptions& o = {});
  // POST `path` with a JSON object body; 2xx body: any JSON object (call_timeout_ms).
  HttpReply PostJson(const std::string& path, const nlohmann::json& body,
                     const CallOptions& o = {});
  HttpReply Pause(PauseMode mode, bool clear_cache, const CallOptions& o = {});
  // Colocated mode (vLLM's development routes). POST /sleep?level=L&mode=M and
  // POST /wake_up?tags=T answer an empty 200; GET /is_sleeping {"is_sleeping": bool}.
  HttpReply Sleep(std::uint8_t level, PauseMode mode, const CallOptions& o = {});
  HttpReply WakeUp(WakeTag tag, const CallOptions& o = {});
  HttpReply IsSleeping(const CallOptions& o = {});
  // The worker extension's rc_device_info: each worker's GPU UUID and device memory.
  HttpReply DeviceInfo(const CallOptions& o = {});
  HttpReply ResumeRaw(const CallOptions& o = {});
  HttpReply IsPaused(const CallOptions& o = {});
  HttpReply ResetCacheRaw(CacheKind cache, const CallOptions& o = {});
  HttpReply UpdateWeightVersion(const std::string& label, const CallOptions& o = {});
  HttpReply GetWorldSize(bool include_dp, const CallOptions& o = {});
  // Deadline: update_timeout_ms unless o.timeout_ms.
  HttpReply InitWeightTransferEngine(const nlohmann::json& init_info, const CallOptions& o = {});
  // POST /start_weight_update; `stale` says what a refusal for an open session leads to. Every
  // call it makes ends by one deadline (call_timeout_ms unless `o` sets one).
  HttpReply StartWeightUpdate(StaleSession stale, const CallOptions& o = {});
  HttpReply UpdateWeights(const nlohmann::json& update_info, const CallOptions& o = {});
  // Body {"weight_version": label} when label is set, no body otherwise. On kWorkerRpc engines
  // (which ignore the body) the label is then set with WriteLabel and the evidences chained.
  HttpReply FinishWeightUpdate(const std::optional<std::string>& label, const CallOptions& o = {});
  // GET /metrics: body stays null; raw is the Prometheus text (read only for Instance()).
  HttpReply MetricsRaw(const CallOptions& o = {});
  struct EngineView {
    HttpEvidence http;
    std::string label;
    bool is_paused_known = false;
    bool is_paused = false;
    std::string instance;
  };
  // The label, /is_paused and the instance, evidence chained (each call within `o`).
  EngineView ObserveView(const CallOptions& o = {});

  HttpReply Completions(const nlohmann::json& request, const CallOptions& o = {});
  HttpReply ChatCompletions(const nlohmann::json& request, const CallOptions& o = {});
  HttpReply Generate(const nlohmann::json& request, const CallOptions& o = {});
  // Streaming (SSE): sets "stream": true, calls on_chunk for each `data:` JSON event until
  // `data: [DONE]`; on_chunk returning false stops the stream (the reply then reports the
  // stop in http.error with transport kOk). raw holds the stream text (bounded by
  // kResponseBytesMax); body_parsed is true only when every event parsed and the engine's
  // `[DONE]` ended the stream (a caller's stop leaves it false, its reason in http.error).
  using ChunkFn = std::function<bool(const nlohmann::json& chunk)>;
  HttpReply CompletionsStream(const nlohmann::json& request, const ChunkFn& on_chunk,
                              const CallOptions& o = {});
  HttpReply ChatCompletionsStream(const nlohmann::json& request, const ChunkFn& on_chunk,
                                  const CallOptions& o = {});
  HttpReply GenerateStream(const nlohmann::json& request, const ChunkFn& on_chunk,
                           const CallOptions& o = {});

  // The request description used by every call; public for tests of the classification.
  enum class Method : std::uint8_t { kGet, kPost };
  enum class Shape : std::uint8_t {
    kEmptyOrJson,  // empty body or any valid JSON (/health, /reset_mm_cache, ...)
    kJsonObject,   // any JSON object
    kText,         // not JSON (e.g. /metrics): body_parsed = a 2xx arrived in full
  };
  struct Request {
    Method method = Method::kGet;
    std::string path;                      // with query string
    std::optional<std::string> json_body;  // POST body; nullopt = no body
    Shape shape = Shape::kJsonObject;
    // Extra check on a 2xx JSON object (e.g. "weight_version" is a string); null = none.
    bool (*check)(const nlohmann::json&) = nullptr;
    std::uint64_t timeout_ms = 0;
    const ChunkFn* on_chunk = nullptr;          // SSE streaming when set
    const std::string* bearer_token = nullptr;  // Authorization: Bearer, when set
  };
  HttpReply Call(const Request& request, const CallOptions& o);

 private:
  struct Handle;
  void ReadSleeping(ResumeObserved& out);
  std::unique_ptr<Handle> Acquire();
  void Release(std::unique_ptr<Handle> h);
  // Call's exchange once the call may be sent: one transfer on a pooled handle, classified.
  HttpReply Send(const Request& req, const CallOptions& o, std::uint64_t timeout_ms);
  HttpReply Stream(const std::string& path, nlohmann::json request, const ChunkFn& on_chunk,
                   const CallOptions& o);
  // The label through `route`: the worker extension's RPC, GET /weight_info, or (kUnknown) the
  // probe that finds the route: GET /weight_info, and on its 404 the RPC. A probe that succeeds
  // caches the route it found, and names it in *found when that is set.
  HttpReply LabelThrough(LabelRoute route, const CallOptions& o);
  HttpReply LabelFromExtension(const CallOptions& o);
  HttpReply ProbeLabel(const CallOptions& o, LabelRoute* found);
  void Found(LabelRoute route, LabelRoute* found);
  // The cached route `gone` answered `refused` (no such route or method): it is forgotten and
  // the route probed again, once.
  void ForgetLabelRoute(LabelRoute gone);
  HttpReply Reprobe(LabelRoute gone, const HttpEvidence& refused, const CallOptions& o,
                    LabelRoute* found);
  HttpReply WriteLabelThrough(LabelRoute route, const std::string& label, const CallOptions& o);
  HttpReply WriteLabelAfter(HttpReply found, LabelRoute route, const std::string& label,
                            const CallOptions& o);
  HttpReply StartOnce(const CallOptions& o);
  // StaleSession::kFinish after `refused`: the stale session finished, then the start again.
  HttpReply FinishStaleThenStart(HttpReply refused, const CallOptions& o);

  std::string base_url_;
  EngineDeadlines deadlines_;
  std::atomic<bool> cancelled_{false};
  std::atomic<LabelRoute> label_route_{LabelRoute::kUnknown};
  mutable std::mutex pool_mu_;
  std::size_t idle_handles_max_ = kIdleHandlesMax;
  std::vector<std::unique_ptr<Handle>> pool_;  // idle handles, at most idle_handles_max_
};

// Bounds a string to kHttpErrorBytesMax bytes.
std::string bound_error(std::string s);

// Whether the process that answers now is known to be the one `instance` names. False for a
// restart, and whenever either is unknown ("": a failed read, or an engine that names none):
// what was set up on an engine is trusted only on that engine, so the caller sets it up again.
// One label read (and /metrics), within timeout_ms; `now` gets what it read ("" when it read
// nothing, `instance` being unknown).
bool SameEngineAs(EngineClient& client, const std::string& instance, std::uint64_t timeout_ms,
                  std::string* now = nullptr);

// The process something was set up on, from the instance read before and after the setup: that
// instance when both name one process, else "" (a restart during the setup, or one unknown).
inline std::string OneInstance(const std::string& before, const std::string& after) {
  return !before.empty() && before == after ? after : std::string();
}

}  // namespace rc::effects
