// The enforcing proxy: /v1/completions, /v1/chat/completions, /inference/v1/generate.
//
// Per request: parse (400 on malformed JSON, nothing journaled) -> Admit (RolloutAdmitted durable
// before anything reaches the engine; waits up to admit_wait_ms for READY, else 503 +
// Retry-After; TAINTED -> 503 with the taint) -> forward with the version's cache_salt and
// return_token_ids -> respond (binding in X-RolloutCore-* headers) -> record the trajectory ->
// RolloutFinished (completed with usage counts, or aborted). A client that hangs up cancels the
// engine call (DisconnectWatcher, or a failed streamed write) and its rollout is finished as
// aborted. Fields the proxy added (token ids, usage chunks) are removed from what the client
// sees unless the client asked for them.
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <thread>

#include <httplib.h>
#include <spdlog/spdlog.h>

#include "journal/json.h"
#include "service/connection_gate.h"
#include "service/http_util.h"
#include "service/proxy_stream.h"
#include "service/service.h"
#include "statemachine/text.h"

namespace rc::service {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// Engine calls that provably never left (connect refused / timed out) are retried this often.
inline constexpr std::uint32_t kConnectAttemptsMax = 4;
inline constexpr std::size_t kRolloutIdHeaderBytesMax = 128;
constexpr const char* kRolloutIdHeader = "X-RolloutCore-Rollout-Id";

std::uint64_t us_since(Clock::time_point t) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t).count());
}

std::uint32_t clamp_u32(std::uint64_t v) {
  return v > UINT32_MAX ? UINT32_MAX : static_cast<std::uint32_t>(v);
}

const char* route_path(int route) {
  switch (route) {
    case 0: return "/v1/completions";
    case 1: return "/v1/chat/completions";
    default: return "/inference/v1/generate";
  }
}

// The client's X-RolloutCore-Rollout-Id, taken verbatim from the request head the gate saw
// (cpp-httplib 0.11 percent-decodes header values: "zz%00yy" would become "zz"). "" when absent;
// InvalidArgument unless it is one printable UTF-8 value of at most kRolloutIdHeaderBytesMax.
Result<std::string> client_rollout_id(const httplib::Request& req) {
  const std::string_view head = CurrentRequestHead();
  RawHeader h;
  if (!head.empty()) {
    h = FindRawHeader(head, kRolloutIdHeader);
  } else if (req.has_header(kRolloutIdHeader)) {
    // Not gated (never in serve): only the decoded value exists; a '%' means it was altered.
    h.value = req.get_header_value(kRolloutIdHeader);
    h.duplicate = req.get_header_value_count(kRolloutIdHeader) > 1 ||
                  h.value->find('%') != std::string::npos;
  }
  if (!h.value) return std::string();
  if (h.duplicate || h.value->empty() || h.value->size() > kRolloutIdHeaderBytesMax ||
      !text::printable_utf8(*h.value)) {
    return Status::InvalidArgument(std::string(kRolloutIdHeader) + " must be one printable UTF-8 "
                                   "value of 1.." + std::to_string(kRolloutIdHeaderBytesMax) +
                                   " bytes, sent verbatim");
  }
  return *h.value;
}

}  // namespace

struct ProxyCall {
  int route = 0;
  bool stream = false;
  Admission admission;
  std::string cache_salt;
  json upstream;  // the body sent to the engine
  bool strip_token_ids = false;
  bool strip_usage = false;
  Trajectory trace;
  effects::CancelToken cancel;
  std::uint64_t watch_id = 0;
  std::uint64_t in_flight_id = 0;  // InFlightCalls registration (Shutdown cancels through it)
  Clock::time_point t0;
  std::uint64_t upstream_us = 0;
  bool finished = false;
  bool client_gone = false;
};

// Calls the engine, retrying only what provably never reached it (a connect refused or timed out
// under a burst) up to kConnectAttemptsMax times with a short backoff.
template <class Fn>
effects::HttpReply CallWithConnectRetry(const ProxyCall& call, Fn&& fn) {
  effects::HttpReply reply;
  for (std::uint32_t attempt = 0;; ++attempt) {
    reply = fn();
    if (!reply.http.never_sent() || call.cancel.cancelled() ||
        attempt + 1 >= kConnectAttemptsMax) {
      return reply;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10 << attempt));
  }
}

void Service::HandleProxy(Route route_kind, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = Clock::now();
  const int route = static_cast<int>(route_kind);
  auto parsed = parse_object(req.body, false);
  Status bad = parsed.ok() ? Status::OK() : parsed.status();
  json body = parsed.ok() ? std::move(parsed.value()) : json();
  bool stream = false;
  std::string client_salt;
  if (bad.ok()) {
    auto s = body.find("stream");
    if (s != body.end() && !s->is_null()) {
      if (!s->is_boolean()) bad = Status::InvalidArgument("'stream' must be a boolean");
      else stream = s->get<bool>();
    }
  }
  if (bad.ok()) {
    auto cs = body.find("cache_salt");
    if (cs != body.end() && !cs->is_null()) {
      if (!cs->is_string() || cs->get<std::string>().empty()) {
        bad = Status::InvalidArgument("'cache_salt' must be a non-empty string");
      } else {
        client_salt = cs->get<std::string>();
      }
    }
  }
  if (bad.ok() && route_kind == Route::kGenerate) {
    auto ids = body.find("token_ids");
    if (ids == body.end() || !ids->is_array()) {
      bad = Status::InvalidArgument("'token_ids' (array of ints) is required");
    }
    auto sp = body.find("sampling_params");
    if (bad.ok() && sp != body.end() && !sp->is_object() && !sp->is_null()) {
      bad = Status::InvalidArgument("'sampling_params' must be an object");
    }
  }
  std::string rollout_id;
  if (bad.ok()) {
    auto given = client_rollout_id(req);
    if (given.ok()) rollout_id = std::move(given.value()); else bad = given.status();
  }
  if (!bad.ok()) {
    metrics_.bad_requests++;
    send_status(res, bad);
    return;
  }
  if (rollout_id.empty()) rollout_id = NextRolloutId();

  AdmitResult a = Admit(rollout_id, config_.admit_wait_ms);
  if (!a.admitted) {
    if (a.refusal.retry_after_s > 0) {
      res.set_header("Retry-After", std::to_string(a.refusal.retry_after_s));
    }
    send_error(res, a.refusal.http_status, a.refusal.type, a.refusal.message);
    return;
  }
  metrics_.proxy_in_flight++;

  auto call = std::make_shared<ProxyCall>();
  call->route = route;
  call->stream = stream;
  call->admission = *a.admitted;
  call->t0 = t0;
  call->cache_salt = DeriveCacheSalt(call->admission.binding, client_salt);
  call->upstream = std::move(body);
  json& up = call->upstream;
  up["cache_salt"] = call->cache_salt;
  if (route_kind != Route::kGenerate) {
    call->strip_token_ids = !(up.value("return_token_ids", json(false)) == json(true));
    up["return_token_ids"] = true;
    if (stream) {
      json& so = up["stream_options"];
      if (!so.is_object()) so = json::object();
      call->strip_usage = !(so.value("include_usage", json(false)) == json(true));
      so["include_usage"] = true;
    }
  } else if (up.value("sampling_params", json()).is_null()) {
    up["sampling_params"] = json::object();
  }

  const RolloutAdmitted& b = call->admission.binding;
  res.set_header("X-RolloutCore-Rollout-Id", b.rollout_id);
  res.set_header("X-RolloutCore-Version", b.version.label);
  res.set_header("X-RolloutCore-Generation", std::to_string(b.version.generation));
  res.set_header("X-RolloutCore-Manifest", b.identity.manifest_digest);
  res.set_header("X-RolloutCore-Checkpoint", b.identity.checkpoint);
  res.set_header("X-RolloutCore-Step", std::to_string(b.identity.step));
  res.set_header("X-RolloutCore-Admission-Seq", std::to_string(call->admission.seq));
  res.set_header("X-RolloutCore-Cache-Salt", call->cache_salt);

  // The gate tells the worker its socket; the descriptor scan is only for ungated servers.
  int fd = CurrentConnectionFd();
  if (fd < 0) fd = FindPeerSocket(req.local_port, req.remote_addr, req.remote_port);
  call->watch_id = watcher_->Watch(fd, call->cancel);
  call->in_flight_id = in_flight_calls_.Add(call->cancel);

  // Finishes the rollout: trajectory line, then its journal parts and RolloutFinished, durably.
  // Every path of an admitted request calls it exactly once (the streamed provider and releaser
  // test `finished` first; anything else is a bug, not a second finish to ignore).
  auto finish = [this](ProxyCall& c, RolloutOutcome outcome, std::string note) {
    RC_CHECK(!c.finished);
    c.finished = true;
    in_flight_calls_.Remove(c.in_flight_id);
    c.in_flight_id = 0;
    if (outcome == RolloutOutcome::kAborted && !c.client_gone && in_flight_calls_.cancelled()) {
      note = "shutdown grace expired; " + note;
    }
    if (c.watch_id != 0) {
      if (watcher_->Fired(c.watch_id)) c.client_gone = true;
      watcher_->Unwatch(c.watch_id);
      c.watch_id = 0;
    }
    if (c.client_gone) metrics_.client_disconnects++;
    const RolloutAdmitted& bb = c.admission.binding;
    json outputs = json::array();
    for (auto& [index, ch] : c.trace.choices) {
      outputs.push_back({{"index", index}, {"token_ids", ch.token_ids},
                         {"logprobs", std::move(ch.logprobs)},
                         {"finish_reason", ch.finish_reason}});
    }
    json prompt = c.trace.prompt_token_ids;
    if (prompt.is_null() && c.route == 2) prompt = c.upstream.value("token_ids", json());
    json line = {{"rollout_id", bb.rollout_id},
                 {"admission_seq", c.admission.seq},
                 {"route", route_path(c.route)},
                 {"stream", c.stream},
                 {"version", journal::WeightVersionToJson(bb.version)},
                 {"identity", journal::WeightIdentityToJson(bb.identity)},
                 {"cache_salt", c.cache_salt},
                 {"outcome", outcome_name(outcome)},
                 {"note", note},
                 {"prompt_token_ids", prompt},
                 {"outputs", std::move(outputs)},
                 {"prompt_tokens", c.trace.prompt_count()},
                 {"completion_tokens", c.trace.completion_count()},
                 {"truncated", c.trace.truncated}};
    if (trajectories_.Append(line)) {
      metrics_.trajectories_written++;
    } else {
      metrics_.trajectories_dropped++;
    }
    // The journal's record of the trajectory (choice 0), in parts of bounded size, submitted in
    // order before the RolloutFinished and durable with it. FinishDurably never drops a finish:
    // it retries a full queue and fail-stops the executor when the journal cannot make it
    // durable, so a non-OK answer here is only logged (the restart records the rollout).
    Status st = FinishDurably(bb.rollout_id, outcome, clamp_u32(c.trace.prompt_count()),
                              clamp_u32(c.trace.completion_count()),
                              JournalTrajectoryParts(bb.rollout_id, c.trace));
    if (!st.ok()) {
      spdlog::error("proxy: finish of rollout {} not durable: {}", bb.rollout_id,
                    st.ToString());
    }
    const std::uint64_t total_us = us_since(c.t0);
    metrics_.proxy_total.ObserveUs(total_us);
    metrics_.proxy_upstream.ObserveUs(c.upstream_us);
    metrics_.proxy_added.ObserveUs(total_us > c.upstream_us ? total_us - c.upstream_us : 0);
    metrics_.proxy_in_flight--;
  };

  effects::CallOptions opts;
  opts.cancel = call->cancel;
  // Generation may run twice without harm (the rollout is bound once, by its admission): reuse
  // pooled keep-alive connections instead of a TCP connect per request.
  opts.reuse_connection = true;

  if (!stream) {
    const auto tu = Clock::now();
    effects::HttpReply reply = CallWithConnectRetry(*call, [&] {
      switch (route_kind) {
        case Route::kCompletions: return proxy_client_->Completions(up, opts);
        case Route::kChat: return proxy_client_->ChatCompletions(up, opts);
        case Route::kGenerate: break;
      }
      return proxy_client_->Generate(up, opts);
    });
    call->upstream_us = us_since(tu);
    if (call->watch_id != 0 && watcher_->Fired(call->watch_id)) call->client_gone = true;
    if (call->client_gone) {
      finish(*call, RolloutOutcome::kAborted, "client disconnected");
      send_error(res, 499, "client_closed", "client closed the connection");
      return;
    }
    if (reply.http.transport != Transport::kOk) {
      metrics_.upstream_errors++;
      finish(*call, RolloutOutcome::kAborted,
             std::string("engine ") + transport_name(reply.http.transport) + ": " +
                 reply.http.error);
      spdlog::warn("proxy: rollout {}: engine call failed ({}): {}", b.rollout_id,
                   transport_name(reply.http.transport), reply.http.error);
      send_error(res, 502, "upstream", std::string("engine call failed (") +
                                           transport_name(reply.http.transport) +
                                           "): " + reply.http.error);
      return;
    }
    if (reply.http.http_status < 200 || reply.http.http_status >= 300 || !reply.http.body_parsed) {
      metrics_.upstream_errors++;
      finish(*call, RolloutOutcome::kAborted,
             "engine answered HTTP " + std::to_string(reply.http.http_status));
      res.status = reply.http.http_status >= 200 && reply.http.http_status < 300
                       ? 502
                       : reply.http.http_status;
      res.set_content(reply.raw, "application/json");
      return;
    }
    call->trace.absorb(reply.body);
    finish(*call, RolloutOutcome::kCompleted, "");
    strip_added(reply.body, call->strip_token_ids, false);
    send_json(res, 200, reply.body);
    return;
  }

  auto provider = [this, call, finish, route_kind](std::size_t, httplib::DataSink& sink) {
    if (call->finished) return false;
    effects::CallOptions o;
    o.cancel = call->cancel;
    o.reuse_connection = true;  // as above: generation, not a weight call
    effects::EngineClient::ChunkFn on_chunk = [&](const json& chunk) {
      const std::optional<std::string> event =
          pass_chunk(call->trace, chunk, call->strip_token_ids, call->strip_usage);
      if (!event) return true;  // the usage-only chunk the client did not ask for
      if (!sink.write(event->data(), event->size())) {
        call->client_gone = true;
        call->cancel.Cancel();
        return false;
      }
      return true;
    };
    const auto tu = Clock::now();
    effects::HttpReply reply = CallWithConnectRetry(*call, [&] {
      switch (route_kind) {
        case Route::kCompletions:
          return proxy_client_->CompletionsStream(call->upstream, on_chunk, o);
        case Route::kChat:
          return proxy_client_->ChatCompletionsStream(call->upstream, on_chunk, o);
        case Route::kGenerate: break;
      }
      return proxy_client_->GenerateStream(call->upstream, on_chunk, o);
    });
    call->upstream_us = us_since(tu);
    if (call->watch_id != 0 && watcher_->Fired(call->watch_id)) call->client_gone = true;
    if (call->client_gone) {
      finish(*call, RolloutOutcome::kAborted, "client disconnected");
      return false;
    }
    const bool ok = reply.http.transport == Transport::kOk && reply.http.http_status >= 200 &&
                    reply.http.http_status < 300 && reply.http.body_parsed;
    if (ok) {
      finish(*call, RolloutOutcome::kCompleted, "");
      static const std::string kDone = "data: [DONE]\n\n";
      sink.write(kDone.data(), kDone.size());
    } else {
      metrics_.upstream_errors++;
      const std::string why =
          reply.http.transport != Transport::kOk
              ? std::string("engine ") + transport_name(reply.http.transport) + ": " +
                    reply.http.error
              : "engine answered HTTP " + std::to_string(reply.http.http_status) +
                    (reply.http.error.empty() ? "" : ": " + reply.http.error);
      finish(*call, RolloutOutcome::kAborted, why);
      json err = {{"error", {{"message", why}, {"type", "upstream"},
                             {"code", reply.http.http_status == 0 ? 502 : reply.http.http_status}}}};
      if (reply.http.transport == Transport::kOk && !reply.raw.empty() &&
          reply.http.http_status >= 400) {
        json engine_body = json::parse(reply.raw, nullptr, false);
        if (!engine_body.is_discarded()) err["error"]["engine"] = engine_body;
      }
      // `why` and the engine body are outside text (a body may be cut inside a UTF-8
      // character): a throwing dump here would terminate the process from httplib's provider.
      const std::string event = "data: " + dump_safe(err) + "\n\ndata: [DONE]\n\n";
      sink.write(event.data(), event.size());
    }
    sink.done();
    return true;
  };
  auto releaser = [call, finish](bool) {
    // The provider never ran to the end (the client vanished before or during the headers).
    if (!call->finished) {
      call->client_gone = true;
      finish(*call, RolloutOutcome::kAborted, "response not delivered");
    }
  };
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider("text/event-stream", provider, releaser);
}

}  // namespace rc::service
