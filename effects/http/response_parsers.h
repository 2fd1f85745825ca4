// The pure parts of EngineClient: what it makes of the bytes an engine answered (route body
// checks, the 2xx/non-2xx body interpretation, the SSE event splitter, the collective_rpc label
// normalisation, the instance read from a label reply or from /metrics). No libcurl here, so that
// tests and fuzz targets run the exact parsers the client runs on hostile engine bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "statemachine/status.h"

namespace rc::effects {

bool is_blank(const std::string& s);

// JSON that came from outside (an engine's body, a client's), parsed: discarded when it is not
// JSON or nests deeper than text::kJsonDepthMax. Never throws.
nlohmann::json parse_outside_json(std::string_view text);

// An upper bound on the bytes nlohmann::json takes for the tree `text` parses into, beside the
// text: its strings' contents once and, per structural byte outside strings, the node it makes
// (an array or object with its container, an element's slot with the vector's growth, a member's
// map node and key, a string's heap object). "[]," is 3 bytes of text and 99 here; a
// safetensors header's entry (~110 bytes of text) about 1.1 KB. One pass, no allocation: asked
// before a parse that might not fit.
std::uint64_t json_tree_bytes_bound(std::string_view text);

// The most the parsed JSON of one file a caller names (a safetensors header, an ipc: or
// vllm-ipc: handle file) may take, by json_tree_bytes_bound. These files are parsed on the
// trainer API's threads (the manifest route, an update's or restore's source checks), several at
// once and outside serve's body budget, so each parse is bounded on its own: the text alone
// (a 100 MiB header of "[[],[],...]") would otherwise make ~3 GB of nodes per call. 256 MiB
// takes ~240,000 tensor entries of ~110 bytes of text (a 26 MB header): a checkpoint shard's
// header holds a few thousand, and the largest open models hold under 100,000 tensors in all,
// so even one of them saved as a single file passes with a margin of two and more.
inline constexpr std::uint64_t kFileJsonTreeBytesMax = std::uint64_t{256} << 20;

// OK when `text`, the JSON of `what` (a file's name and kind, as its errors name it), parses
// within kFileJsonTreeBytesMax; else InvalidArgument naming `what` and the bound (never the
// text, nor a figure read from it).
[[nodiscard]] Status check_file_json_tree(std::string_view text, const std::string& what);

// ---- route body checks (2xx JSON objects) ----
bool check_version(const nlohmann::json& j);      // {"version": short string}
bool check_weight_info(const nlohmann::json& j);  // {"weight_version": short string}
bool check_status(const nlohmann::json& j);       // {"status": short string} (/pause, /resume)
bool check_is_paused(const nlohmann::json& j);    // {"is_paused": bool}
bool check_success(const nlohmann::json& j);      // {"success": true}
bool check_is_sleeping(const nlohmann::json& j);  // {"is_sleeping": bool}
// {"results": [{"weight_version": s, ...}, ...]}: at least one worker, all reporting one label.
bool check_rpc_label(const nlohmann::json& j);
bool check_world_size(const nlohmann::json& j);  // {"world_size": integer > 0}

// A complete body of a non-streaming call (reply.raw, http_status already set): sets reply.body
// (null unless it parsed) and http.body_parsed / http.error, by the route's shape and check.
void interpret_body(EngineClient::Shape shape, bool (*check)(const nlohmann::json&),
                    const std::string& path, HttpReply& reply);

// Server-sent events: accumulates bytes, hands each complete event's `data:` payload on, up to
// `data: [DONE]`; what follows it is dropped unread (never passed on, never judged).
struct SseState {
  // Asked with an event's data before it is parsed (when set): false stops the stream there
  // (stopped), the event never parsed. A caller that holds memory for the tree gives it back
  // once Feed or Finish returns: no tree of theirs lives on.
  using BeforeParseFn = std::function<bool(std::string_view data)>;
  const EngineClient::ChunkFn* on_chunk = nullptr;
  const BeforeParseFn* before_parse = nullptr;

  std::string pending;      // bytes of the event being received
  std::size_t scanned = 0;  // no blank line begins in pending[0, scanned - 3)
  bool done = false;        // saw `data: [DONE]`: the stream is complete
  bool stopped = false;     // on_chunk or before_parse returned false
  bool bad_event = false;   // a data payload was not JSON
  bool too_big = false;     // one event exceeded kSseEventBytesMax
  std::size_t events = 0;

  // Returns false to stop the transfer.
  bool Feed(const char* p, std::size_t n);
  bool Dispatch(const std::string& event);
  // The end of a 2xx stream: the last event (without its blank line) and the verdict in ev,
  // body_parsed only when [DONE] ended it, no event was refused JSON and the caller never stopped.
  void Finish(HttpEvidence& ev);
};

// One engine worker's device, as the worker extension's rc_device_info reports it.
inline constexpr std::size_t kDeviceWorkersMax = 1024;  // workers one engine may report
struct WorkerDevice {
  std::string gpu_uuid;  // as torch prints it ("GPU-…"), what vLLM's ipc backend keys handles by
  std::uint64_t free_bytes = 0;
  std::uint64_t total_bytes = 0;
};
// A {"results": [{"gpu_uuid", "free_bytes", "total_bytes", ...}, ...]} reply: one entry per
// worker, each UUID a short printable string, free <= total. Errors say what was wrong.
[[nodiscard]] Result<std::vector<WorkerDevice>> parse_device_info(const nlohmann::json& body);

// A label RPC reply: checks it and normalises the body to {"weight_version", "workers"
// [, "instance"]}; `want` (when set) is the label every worker must report.
HttpReply label_from_rpc(HttpReply r, const std::string& method, const std::string* want);
// The worker extension's per-process nonces, one per worker in answer order ("" when the
// extension predates them). A restarted engine has new workers, hence new nonces.
std::string rpc_instances(const nlohmann::json& results);
// The engine's process start time from its Prometheus text ("" when absent): the instance of an
// engine without the worker extension.
std::string start_time_instance(const std::string& metrics_text);
// The instance a label reply's body names itself (nullopt: ask /metrics).
std::optional<std::string> instance_in_label_body(const nlohmann::json& body);
// ValidationObserved::detail for a label reply's body ("" unless it came from the worker RPC).
std::string label_detail(const nlohmann::json& body);
// ResetCache's reading of a /reset_* reply.
CacheResetObserved reset_observed(CacheKind cache, const HttpReply& r);
const char* cache_path(CacheKind c);

}  // namespace rc::effects
