#include "service/config.h"

#include <algorithm>
#include <cctype>
#include <array>
#include <fstream>
#include <limits>
#include <sstream>
#include <set>

#include <boost/asio/ip/address.hpp>

#include "effects/http/engine_client.h"
#include "effects/http/response_parsers.h"
#include "effects/nccl/weight_source.h"
#include "service/upstream.h"
#include "statemachine/events.h"
#include "statemachine/quote.h"
#include "statemachine/text.h"

namespace rc::service {
namespace {

using C = ServeConfig;
constexpr std::uint64_t kSecond = 1000;
constexpr std::uint64_t kHour = 3600 * kSecond;
constexpr std::uint64_t kDay = 24 * kHour;
constexpr std::uint64_t kPathBytesMax = 4096;
constexpr std::uint64_t kInt64Max = std::numeric_limits<std::int64_t>::max();
constexpr std::uint64_t kFleetStalenessMax = 1'000'000;
constexpr std::uint64_t kAffinitySlackMax = 1'000'000;
constexpr std::size_t kEngineUrlBytesMax = 2048;
constexpr std::size_t kEngineNameBytesMax = 64;
constexpr std::size_t kKeyEchoBytesMax = 64;  // an unknown key is quoted at most this long

constexpr const char* kWhere = "Where things are";
constexpr const char* kBoot = "Bootstrap (used only while the journal is UNINITIALIZED)";
constexpr const char* kDeadlines = "Deadlines";
constexpr const char* kBounds = "Bounds";
constexpr const char* kTransfer = "Weight transfer";
constexpr const char* kGate = "Connections";
constexpr const char* kTrust = "Trust under faults";
constexpr const char* kFleet = "Fleet (with `engines`; docs/fleet.md)";

// The single definition of every setting. Adding a ServeConfig member means adding its row here;
// the parser, the flags, the validation and docs/config.md follow from it.
const std::array kKeys = {
    ConfigKey{"engine_url",
              "engine-url",
              &C::engine_url,
              0,
              kEngineUrlBytesMax,
              kWhere,
              "vLLM base URL (http://), e.g. http://127.0.0.1:8000; required unless `engines` "
              "names a fleet",
              {}},
    ConfigKey{"journal_path",
              "journal",
              &C::journal_path,
              1,
              kPathBytesMax,
              kWhere,
              "journal directory (RocksDB); its parent directories are created if missing",
              {}},
    ConfigKey{"trajectories_path",
              "trajectories",
              &C::trajectories_path,
              0,
              kPathBytesMax,
              kWhere,
              "trajectories JSON-lines file; empty = <journal>.trajectories.jsonl beside the "
              "journal directory",
              {}},
    ConfigKey{"listen_host", "host", &C::listen_host, 1, 255, kWhere, "listen address", {}},
    ConfigKey{"listen_port",
              "port",
              &C::listen_port,
              0,
              kPortMax,
              kWhere,
              "listen port; 0 = ephemeral (the chosen port is printed on start)",
              {}},
    ConfigKey{"auth_token",
              "auth-token",
              &C::auth_token,
              0,
              4096,
              kWhere,
              "Bearer token required on mutating trainer routes; empty = RC_AUTH_TOKEN from the "
              "environment, else none",
              {}},
    ConfigKey{"proxy_token",
              "proxy-token",
              &C::proxy_token,
              0,
              4096,
              kWhere,
              "Bearer token every proxied request must carry (client authentication, separate "
              "from auth_token); empty = RC_PROXY_TOKEN from the environment, else none",
              {}},
    ConfigKey{"engine_api_key",
              "engine-api-key",
              &C::engine_api_key,
              0,
              4096,
              kWhere,
              "Bearer token sent to the engine on proxied calls (vLLM --api-key); empty = "
              "RC_ENGINE_API_KEY from the environment, else none",
              {}},
    ConfigKey{"executor_id",
              "executor-id",
              &C::executor_id,
              1,
              kIdBytesMax,
              kWhere,
              "executor id recorded on recovery; must not begin with `stalled-plan-retry:` "
              "(reserved: it marks the stalled-plan retry's records)",
              {}},
    ConfigKey{"initial_label",
              "initial-label",
              &C::initial_label,
              1,
              kIdBytesMax,
              kBoot,
              "weight-version label of the bootstrap version (not `default`, what a fresh engine "
              "reports)",
              {}},
    ConfigKey{"initial_manifest_digest",
              "initial-manifest",
              &C::initial_manifest_digest,
              0,
              kDigestBytesMax,
              kBoot,
              "bootstrap identity: manifest digest (or give initial_source)",
              {}},
    ConfigKey{"initial_source",
              "initial-source",
              &C::initial_source,
              0,
              kPathBytesMax,
              kBoot,
              "bootstrap identity: compute the manifest from this source, e.g. synthetic:4x64",
              {}},
    ConfigKey{"initial_checkpoint",
              "initial-checkpoint",
              &C::initial_checkpoint,
              0,
              kPathBytesMax,
              kBoot,
              "bootstrap checkpoint",
              {}},
    ConfigKey{"initial_run",
              "initial-run",
              &C::initial_run,
              0,
              kPathBytesMax,
              kBoot,
              "bootstrap run id",
              {}},
    ConfigKey{"initial_step",
              "initial-step",
              &C::initial_step,
              -1,
              kInt64Max,
              kBoot,
              "bootstrap training step; -1 = none",
              {}},
    ConfigKey{"connect_timeout_ms",
              "connect-timeout-ms",
              &C::connect_timeout_ms,
              1,
              kDay,
              kDeadlines,
              "engine connect deadline (ms)",
              {}},
    ConfigKey{"call_timeout_ms",
              "call-timeout-ms",
              &C::call_timeout_ms,
              1,
              kDay,
              kDeadlines,
              "deadline of one engine control call (ms)",
              {}},
    ConfigKey{"drain_timeout_ms",
              "drain-timeout-ms",
              &C::drain_timeout_ms,
              1,
              kDay,
              kDeadlines,
              "how long an update waits for running requests to finish (ms)",
              {}},
    ConfigKey{"transfer_timeout_ms",
              "transfer-timeout-ms",
              &C::transfer_timeout_ms,
              1,
              kDay,
              kDeadlines,
              "deadline of one whole weight transfer (ms)",
              {}},
    ConfigKey{"sleep_timeout_ms",
              "sleep-timeout-ms",
              &C::sleep_timeout_ms,
              1,
              kDay,
              kDeadlines,
              "colocated mode: deadline of one /sleep (a level-1 sleep copies the weights to host "
              "memory) and of each /wake_up (ms)",
              {}},
    ConfigKey{"request_timeout_ms",
              "request-timeout-ms",
              &C::request_timeout_ms,
              1,
              kDay,
              kDeadlines,
              "deadline of one proxied generation, end to end (ms)",
              {}},
    ConfigKey{"admit_wait_ms",
              "admit-wait-ms",
              &C::admit_wait_ms,
              0,
              kHour,
              kDeadlines,
              "how long a proxied request waits for READY during an update before 503 (ms)",
              {}},
    ConfigKey{"retry_after_s",
              "retry-after-s",
              &C::retry_after_s,
              0,
              3600,
              kDeadlines,
              "Retry-After sent with 503 (s)",
              {}},
    ConfigKey{"shutdown_grace_ms",
              "shutdown-grace-ms",
              &C::shutdown_grace_ms,
              0,
              kHour,
              kDeadlines,
              "SIGTERM/SIGINT: how long in-flight rollouts may take to finish (ms)",
              {}},
    ConfigKey{"watch_timeout_ms_max",
              "watch-timeout-ms-max",
              &C::watch_timeout_ms_max,
              1,
              kDay,
              kDeadlines,
              "upper bound of a /v1/watch long-poll (ms)",
              {}},
    ConfigKey{"body_bytes_max",
              "body-bytes-max",
              &C::body_bytes_max,
              1024,
              std::uint64_t{256} << 20,
              kBounds,
              "request body bound (bytes); larger = 413",
              {}},
    ConfigKey{"body_memory_bytes_max",
              "body-memory-bytes-max",
              &C::body_memory_bytes_max,
              std::uint64_t{1} << 20,
              std::uint64_t{1} << 40,
              kBounds,
              "request and response bodies all connections hold at once (bytes), at least twice "
              "body_bytes_max; a request beyond it is answered 503",
              {}},
    ConfigKey{"http_threads",
              "http-threads",
              &C::http_threads,
              4,
              8192,
              kBounds,
              "threads running trainer calls that may block (updates, long polls); connections "
              "themselves cost no thread",
              {}},
    ConfigKey{"io_threads",
              "io-threads",
              &C::io_threads,
              0,
              256,
              kBounds,
              "event loops (a thread and an io_context each) serving the connections; 0 = one per "
              "core, at most 4",
              {}},
    ConfigKey{"header_bytes_max",
              "header-bytes-max",
              &C::header_bytes_max,
              1024,
              1 << 20,
              kBounds,
              "request line and headers bound (bytes), however many fields; larger, or more than "
              "100 fields (a trailer's included) = 431",
              {}},
    ConfigKey{"engine_connections_max",
              "engine-connections-max",
              &C::engine_connections_max,
              1,
              8192,
              kBounds,
              "idle keep-alive connections kept to the engine (about the number of concurrent "
              "proxied requests; beyond it calls reconnect)",
              {}},
    ConfigKey{"events_page_max",
              "events-page-max",
              &C::events_page_max,
              1,
              100000,
              kBounds,
              "records per /v1/events page",
              {}},
    ConfigKey{"trajectories_bytes_max",
              "trajectories-bytes-max",
              &C::trajectories_bytes_max,
              4096,
              std::uint64_t{1} << 40,
              kBounds,
              "trajectories file size (bytes) at which it is rotated once (to .1)",
              {}},
    ConfigKey{"transfer", "transfer", &C::transfer, 1, 8, kTransfer,
              "http: the GPU-free start/update/finish sequence (tests, demo); nccl: the NCCL "
              "sender (needs a CUDA/NCCL build and a GPU); reload: the engine loads a "
              "safetensors:/path checkpoint from its own disk (vLLM's reload_weights; needs the "
              "worker extension, no NCCL, no second GPU); ipc: colocated mode, the engine reads a "
              "vllm-ipc:/path export of the trainer's CUDA tensors on the same GPU (vLLM's ipc "
              "backend; needs the worker extension)",
              "http|nccl|reload|ipc"},
    ConfigKey{"packed_buffer_size_bytes",
              "packed-buffer-size-bytes",
              &C::packed_buffer_size_bytes,
              static_cast<std::int64_t>(kPackedBufferBytesMin),
              kPackedBufferBytesMax,
              kTransfer,
              "packed chunk size (bytes), announced to the engine",
              {}},
    ConfigKey{"packed_num_buffers",
              "packed-num-buffers",
              &C::packed_num_buffers,
              1,
              kPackedNumBuffersMax,
              kTransfer,
              "packed staging buffers in flight",
              {}},
    ConfigKey{"rendezvous",
              "rendezvous",
              &C::rendezvous,
              0,
              kRendezvousHostBytesMax + 8,
              kTransfer,
              "HOST:PORT (or [IPv6]:PORT) the engine's workers dial for the NCCL rendezvous; "
              "PORT 0 = a fresh ephemeral port per init; required with transfer nccl (http: only "
              "recorded in init_info, empty = 127.0.0.1:29500)",
              {}},
    ConfigKey{"cuda_device",
              "cuda-device",
              &C::cuda_device,
              0,
              kCudaDeviceMax,
              kTransfer,
              "nccl: rank 0's CUDA device",
              {}},
    ConfigKey{"nccl_world_size",
              "nccl-world-size",
              &C::nccl_world_size,
              0,
              kNcclWorldSizeMax,
              kTransfer,
              "nccl: 1 + engine workers; 0 = 1 + GET /get_world_size; 1 is refused",
              {}},
    ConfigKey{"nccl_init_timeout_ms",
              "nccl-init-timeout-ms",
              &C::nccl_init_timeout_ms,
              1,
              kHour,
              kTransfer,
              "nccl: deadline of the startup rendezvous, communicator and warm-up (ms)",
              {}},
    ConfigKey{"nccl_abort_reserve_ms",
              "nccl-abort-reserve-ms",
              &C::nccl_abort_reserve_ms,
              0,
              kHour,
              kTransfer,
              "nccl: kept at the end of every init/transfer deadline for ncclCommAbort (ms); "
              "must be below nccl_init_timeout_ms and transfer_timeout_ms",
              {}},
    ConfigKey{"header_timeout_ms",
              "header-timeout-ms",
              &C::header_timeout_ms,
              1,
              kHour,
              kGate,
              "first byte of a request to its complete head, else 408 (ms)",
              {}},
    ConfigKey{"idle_timeout_ms",
              "idle-timeout-ms",
              &C::idle_timeout_ms,
              1,
              kHour,
              kGate,
              "no byte of a request yet: a new connection gets 408, a kept-alive one is closed "
              "(ms)",
              {}},
    ConfigKey{"body_timeout_ms",
              "body-timeout-ms",
              &C::body_timeout_ms,
              1,
              kHour,
              kGate,
              "complete head to complete body, else 408 (ms)",
              {}},
    ConfigKey{"write_timeout_ms",
              "write-timeout-ms",
              &C::write_timeout_ms,
              1,
              kHour,
              kGate,
              "one response write the client does not take within this closes the connection "
              "(a streamed rollout is then finished as aborted) (ms)",
              {}},
    ConfigKey{"http_connections_max",
              "http-connections-max",
              &C::http_connections_max,
              4,
              65536,
              kGate,
              "open connections; beyond: 503 and closed. Lowered at start (with "
              "engine_connections_max, logged) to what the open-file limit leaves room for: a "
              "client and an engine socket per connection and the engine pools' idle ones, beside "
              "the journal's files and a reserve; past a margin for refusals, connections wait "
              "unaccepted",
              {}},
    ConfigKey{"journal_sync",
              "journal-sync",
              &C::journal_sync,
              0,
              1,
              kTrust,
              "fsync each group commit (turn off only in benchmarks)",
              {}},
    ConfigKey{"journal_commit_stall_timeout_ms",
              "journal-commit-stall-timeout-ms",
              &C::journal_commit_stall_timeout_ms,
              100,
              600 * kSecond,
              kTrust,
              "a group commit not durable within this fail-stops the executor (ms)",
              {}},
    ConfigKey{"journal_commit_window_us",
              "journal-commit-window-us",
              &C::journal_commit_window_us,
              0,
              10000,
              kTrust,
              "the committer waits this long once a group is open before it writes, so more "
              "groups share one fsync (less CPU per request, more latency per durable point) (us)",
              {}},
    ConfigKey{"finish_retry_ms",
              "finish-retry-ms",
              &C::finish_retry_ms,
              1,
              600 * kSecond,
              kTrust,
              "how long a finish that cannot be made durable is retried before fail-stop (ms)",
              {}},
    ConfigKey{"engine_monitor_interval_ms",
              "engine-monitor-interval-ms",
              &C::engine_monitor_interval_ms,
              static_cast<std::int64_t>(kEngineMonitorIntervalMsMin),
              kEngineMonitorIntervalMsMax,
              kTrust,
              "how often the engine is probed while READY (ms)",
              {}},
    ConfigKey{"stalled_plan_retry_ms",
              "stalled-plan-retry-ms",
              &C::stalled_plan_retry_ms,
              100,
              3600000,
              kTrust,
              "a plan stalled at an engine that stopped answering is tried again once the engine "
              "answers the monitor, at most this often; doubled after each try that stalls again, "
              "up to 64 times (ms)",
              {}},
    ConfigKey{"engine_startup_timeout_ms",
              "engine-startup-timeout-ms",
              &C::engine_startup_timeout_ms,
              1,
              kDay,
              kTrust,
              "how long startup waits for the engine to answer, logging progress (ms)",
              {}},
    ConfigKey{"adopt_engine",
              "adopt-engine",
              &C::adopt_engine,
              0,
              1,
              kTrust,
              "bootstrap accepts an engine that reports another label or is paused (relabels or "
              "resumes it; what was found is journaled)",
              {},
              /*is_switch=*/true},
    ConfigKey{"require_weight_digest",
              "require-weight-digest",
              &C::require_weight_digest,
              0,
              1,
              kTrust,
              "bootstrap refuses an engine that computes no weight digest",
              {}},
    ConfigKey{"weight_digest_check_interval_ms",
              "weight-digest-check-interval-ms",
              &C::weight_digest_check_interval_ms,
              0,
              kDay,
              kTrust,
              "how often the monitor digests the READY engine's weights (ms; 0 = never)",
              {}},
    ConfigKey{"rollout_lease_ms",
              "rollout-lease-ms",
              &C::rollout_lease_ms,
              kRolloutLeaseMsMin,
              kRolloutLeaseMsMax,
              kTrust,
              "lease of an explicit rollout whose client names none, renewed by POST "
              "/v1/rollouts/ID/lease (ms)",
              {}},
    ConfigKey{"fleet_staleness_max",
              "fleet-staleness-max",
              &C::fleet_staleness_max,
              0,
              kFleetStalenessMax,
              kFleet,
              "a rollout is admitted only to an engine whose generation is at least the newest "
              "one held minus this (0: none starts on an old generation)",
              {}},
    ConfigKey{"fleet_min_serving",
              "fleet-min-serving",
              &C::fleet_min_serving,
              0,
              kFleetEnginesMax,
              kFleet,
              "engines that keep serving while a rolling update runs",
              {}},
    ConfigKey{"fleet_blocked_timeout_ms",
              "fleet-blocked-timeout-ms",
              &C::fleet_blocked_timeout_ms,
              1,
              kDay,
              kFleet,
              "a fleet update that cannot progress is cancelled after this (ms)",
              {}},
    ConfigKey{"fleet_update_timeout_ms",
              "fleet-update-timeout-ms",
              &C::fleet_update_timeout_ms,
              1,
              kDay,
              kFleet,
              "a fleet update still open this long after its request is cancelled: no member "
              "starts after it, those updating end by their own deadlines (ms)",
              {}},
    ConfigKey{"fleet_affinity_prefix_bytes",
              "fleet-affinity-prefix-bytes",
              &C::fleet_affinity_prefix_bytes,
              0,
              kAffinityPrefixBytesMax,
              kFleet,
              "route by the first this-many bytes of the prompt (rendezvous hash among the engines "
              "of the newest generation), so repeated prefixes meet their cached KV; 0 = by load "
              "only",
              {}},
    ConfigKey{"fleet_affinity_slack",
              "fleet-affinity-slack",
              &C::fleet_affinity_slack,
              0,
              kAffinitySlackMax,
              kFleet,
              "an affine engine with more than this many requests in flight above the least busy "
              "one gives the request to the least busy",
              {}},
};

// ---- JSON values into typed members (no exceptions: every get<> is on a checked type).

template <typename T>
Status AssignInteger(std::string_view key, const nlohmann::json& v, T& slot) {
  const std::string k(key);
  if (!v.is_number_integer()) return Status::InvalidArgument(k + " must be an integer");
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<T>::max())) {
      return Status::InvalidArgument(k + " is too large: " + std::to_string(u));
    }
    slot = static_cast<T>(u);
    return Status::OK();
  }
  const auto s = v.get<std::int64_t>();
  if constexpr (std::is_unsigned_v<T>) {
    return Status::InvalidArgument(k + " must be a non-negative integer");
  } else {
    if (s < std::numeric_limits<T>::min()) {
      return Status::InvalidArgument(k + " is too small: " + std::to_string(s));
    }
    slot = static_cast<T>(s);
    return Status::OK();
  }
}

template <typename T>
Status Assign(std::string_view key, const nlohmann::json& v, T& slot) {
  if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return Status::InvalidArgument(std::string(key) + " must be a string");
    slot = v.get<std::string>();
    return Status::OK();
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) return Status::InvalidArgument(std::string(key) + " must be a bool");
    slot = v.get<bool>();
    return Status::OK();
  } else {
    return AssignInteger(key, v, slot);
  }
}

// ---- Bounds of one row.

std::string FlagOf(const ConfigKey& k) { return "--" + std::string(k.flag); }

bool InChoices(std::string_view choices, std::string_view value) {
  while (!choices.empty()) {
    const auto bar = choices.find('|');
    if (choices.substr(0, bar) == value) return true;
    if (bar == std::string_view::npos) break;
    choices.remove_prefix(bar + 1);
  }
  return false;
}

Status CheckString(const ConfigKey& k, const std::string& v) {
  const std::string name = std::string(k.key) + " (" + FlagOf(k) + ")";
  if (v.empty() && k.min > 0) return Status::InvalidArgument(name + " is required");
  if (v.size() < static_cast<std::uint64_t>(k.min) || v.size() > k.max) {
    return Status::InvalidArgument(name + " must be " + std::to_string(k.min) + ".." +
                                   std::to_string(k.max) + " bytes, got " +
                                   std::to_string(v.size()));
  }
  if (!k.choices.empty() && !InChoices(k.choices, v)) {
    return Status::InvalidArgument(name + " must be one of " + std::string(k.choices) + ", got '" +
                                   v.substr(0, kKeyEchoBytesMax) + "'");
  }
  return Status::OK();
}

template <typename T>
Status CheckNumber(const ConfigKey& k, T v) {
  bool ok = false;
  if constexpr (std::is_signed_v<T>) {
    ok = static_cast<std::int64_t>(v) >= k.min && (v < 0 || static_cast<std::uint64_t>(v) <= k.max);
  } else {
    ok = (k.min <= 0 || static_cast<std::uint64_t>(v) >= static_cast<std::uint64_t>(k.min)) &&
         static_cast<std::uint64_t>(v) <= k.max;
  }
  if (ok) return Status::OK();
  return Status::InvalidArgument(std::string(k.key) + " (" + FlagOf(k) + ") must be in " +
                                 std::to_string(k.min) + ".." + std::to_string(k.max) + ", got " +
                                 std::to_string(v));
}

Status CheckRow(const ConfigKey& k, const ServeConfig& c) {
  return std::visit(
      [&](auto member) -> Status {
        const auto& v = c.*member;
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return CheckString(k, v);
        } else if constexpr (std::is_same_v<T, bool>) {
          return Status::OK();
        } else {
          return CheckNumber(k, v);
        }
      },
      k.field);
}

// ---- Rules that join keys.

// Printable ASCII without spaces: no byte of it ends a header, a request line or a log line.
bool IsPrintableAsciiWord(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) {
    const auto u = static_cast<unsigned char>(ch);
    return u > 0x20 && u < 0x7f;
  });
}

// Start() binds listen_host with make_address only after the journal was recovered or
// bootstrapped: a host name ("localhost") or a malformed literal must stop `serve` here. A
// "%scope" is kept only on a link-local IPv6 address, which cannot be bound without one; on any
// other address asio ignores what follows '%', so the text would be logged but never used.
Status CheckListenHost(const ServeConfig& c) {
  const std::string quoted = "listen_host (--host) '" + text::escape_line(c.listen_host) + "'";
  boost::system::error_code ec;
  const boost::asio::ip::address address = boost::asio::ip::make_address(c.listen_host, ec);
  // make_address stops at a NUL byte: every byte must be one a literal or a scope is made of.
  if (ec || !IsPrintableAsciiWord(c.listen_host)) {
    return Status::InvalidArgument(
        quoted + " is not an IP address (e.g. 127.0.0.1, 0.0.0.0 or ::1; names are not resolved)");
  }
  const bool link_local = address.is_v6() && address.to_v6().is_link_local();
  if (!link_local && c.listen_host.find('%') != std::string::npos) {
    return Status::InvalidArgument(quoted +
                                   ": a %scope is allowed only on a link-local IPv6 address");
  }
  if (link_local && address.to_v6().scope_id() == 0) {
    return Status::InvalidArgument(
        quoted + ": a link-local address needs a %scope naming an interface (e.g. fe80::1%eth0)");
  }
  return Status::OK();
}

// The host of a parsed engine URL: a bracketed IPv6 literal, or a name or IPv4 literal (what the
// resolver takes). ParseEngineUrl alone reads "http://[::1" as host "[:" and "http://::1:80" as
// host "::1", whose authority is no valid Host header.
Status CheckEngineHost(const std::string& what, const UpstreamTarget& t) {
  bool ok = false;
  if (!t.authority.empty() && t.authority.front() == '[') {
    boost::system::error_code ec;
    boost::asio::ip::make_address_v6(t.host, ec);  // only whether it parses
    ok = !ec && t.host.find('%') == std::string::npos;
  } else {
    ok = std::all_of(t.host.begin(), t.host.end(), [](char ch) {
      return std::isalnum(static_cast<unsigned char>(ch)) != 0 || ch == '.' || ch == '-' ||
             ch == '_';
    });
  }
  if (ok) return Status::OK();
  return Status::InvalidArgument(
      what + ": the host '" + t.host +
      "' is neither a name nor an IPv4 address (A-Z, a-z, 0-9, '.', '-', "
      "'_') nor a bracketed IPv6 address such as [::1]");
}

// An engine URL exactly as the control client (curl) and the proxy use it: the proxy copies its
// authority into the Host header and its path into every request line, so it is printable ASCII
// without spaces, and ParseEngineUrl (port 1..65535) reads it, here rather than after the journal
// was opened.
Result<UpstreamTarget> CheckEngineUrl(const std::string& what, const std::string& url) {
  if (url.rfind("http://", 0) != 0) {
    return Status::InvalidArgument(
        what +
        " must start with http:// (the proxy speaks plain HTTP to an engine on loopback or a "
        "private network; see docs/security.md), got '" +
        text::escape_line(url.substr(0, 256)) + "'");
  }
  if (url.size() > kEngineUrlBytesMax) {
    return Status::InvalidArgument(what + " is longer than " + std::to_string(kEngineUrlBytesMax) +
                                   " bytes");
  }
  if (!IsPrintableAsciiWord(url)) {
    return Status::InvalidArgument(what +
                                   " must be printable ASCII without spaces or control "
                                   "characters, got '" +
                                   text::escape_line(url.substr(0, 256)) + "'");
  }
  Result<UpstreamTarget> target = ParseEngineUrl(url);  // its message quotes the URL, printable
  if (!target.ok()) {
    return Status::InvalidArgument(what + " is not http://HOST[:PORT][/PATH] with PORT 1..65535: " +
                                   target.status().message());
  }
  RC_RETURN_IF_ERROR(CheckEngineHost(what, *target));
  return target;
}

// An engine's name travels in URL paths (/v1/fleet/engines/NAME), metric labels and log lines.
bool IsEngineName(const std::string& name) {
  if (name.empty() || name.size() > kEngineNameBytesMax) return false;
  return std::all_of(name.begin(), name.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) != 0 || ch == '.' || ch == '_' || ch == '-';
  });
}

// One engine's URL however it is spelled: the host's case, a default port and trailing slashes
// do not name another engine. (Two names of one host are caught at start, by the process.)
std::string EngineUrlKey(const UpstreamTarget& t) {
  std::string host = t.host;
  std::transform(host.begin(), host.end(), host.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return host + ":" + std::to_string(t.port) + t.base_path;
}

Status CheckFleetEngine(const FleetEngineConfig& e, std::set<std::string>& names,
                        std::set<std::string>& urls) {
  if (!IsEngineName(e.name)) {
    return Status::InvalidArgument(
        "engines: the name '" + text::escape_line(e.name.substr(0, 256)) + "' is not 1.." +
        std::to_string(kEngineNameBytesMax) + " bytes of A-Z, a-z, 0-9, '.', '_', '-'");
  }
  if (!names.insert(e.name).second) {
    return Status::InvalidArgument("engines: the name '" + e.name + "' is given twice");
  }
  Result<UpstreamTarget> target =
      CheckEngineUrl("engines['" + e.name + "'].engine_url", e.engine_url);
  if (!target.ok()) return target.status();
  if (!urls.insert(EngineUrlKey(*target)).second) {
    return Status::InvalidArgument("engines: '" + e.name +
                                   "' has the engine_url of another "
                                   "engine; two runners would drive one engine");
  }
  return Status::OK();
}

}  // namespace

HostPort FleetMemberRendezvous(const ServeConfig& config, std::size_t index) {
  Result<HostPort> base = ParseHostPort(config.rendezvous);
  RC_CHECK(base.ok() && index < config.engines.size());  // ValidateConfig checked both
  if (base->port != 0) base->port = static_cast<std::uint16_t>(base->port + index);
  return *base;
}

namespace {

// With transfer nccl, engine i of a fleet has a communicator of its own, rendezvousing at the
// configured port + i: every such port must exist.
Status CheckFleetRendezvous(const ServeConfig& c) {
  auto base = ParseHostPort(c.rendezvous);
  if (!base.ok()) return Status::OK();  // CheckNccl names it
  const std::uint64_t last = std::uint64_t{base->port} + c.engines.size() - 1;
  if (base->port != 0 && last > 65535) {
    return Status::InvalidArgument("rendezvous: engine i of the fleet rendezvouses at port " +
                                   std::to_string(base->port) + " + i, and " +
                                   std::to_string(last) + " is past 65535");
  }
  return Status::OK();
}

// One engine (engine_url) or a fleet (engines), never both; a fleet's transfer is per engine.
Status CheckEngines(const ServeConfig& c) {
  if (c.engines.empty()) {
    if (c.engine_url.empty()) {
      return Status::InvalidArgument(
          "engine_url (--engine-url) is required, or `engines` (--fleet-engine NAME=URL) for a "
          "fleet");
    }
    return CheckEngineUrl("engine_url", c.engine_url).status();
  }
  if (!c.engine_url.empty()) {
    return Status::InvalidArgument("give engine_url (one engine) or engines (a fleet), not both");
  }
  if (c.engines.size() > kFleetEnginesMax) {
    return Status::InvalidArgument("engines: at most " + std::to_string(kFleetEnginesMax) +
                                   " engines, got " + std::to_string(c.engines.size()));
  }
  if (c.transfer == "nccl") RC_RETURN_IF_ERROR(CheckFleetRendezvous(c));
  std::set<std::string> names, urls;
  for (const FleetEngineConfig& e : c.engines) {
    RC_RETURN_IF_ERROR(CheckFleetEngine(e, names, urls));
  }
  const auto staying = static_cast<std::size_t>(std::count_if(
      c.engines.begin(), c.engines.end(), [](const FleetEngineConfig& e) { return !e.retire; }));
  if (staying == 0) {
    return Status::InvalidArgument("engines: every engine retires; at least one must stay");
  }
  if (c.fleet_min_serving >= staying && c.fleet_min_serving > 0) {
    return Status::InvalidArgument(
        "fleet_min_serving (" + std::to_string(c.fleet_min_serving) + ") must be below the " +
        std::to_string(staying) +
        " engines that stay: a rolling update takes one out of service at a time");
  }
  return Status::OK();
}

Status CheckNccl(const ServeConfig& c) {
  if (!c.rendezvous.empty()) {
    auto hp = ParseHostPort(c.rendezvous);
    if (!hp.ok()) return Status::InvalidArgument("rendezvous: " + hp.status().message());
  }
  if (c.nccl_world_size == 1) {
    return Status::InvalidArgument("nccl_world_size must be 0 (ask the engine) or 2.." +
                                   std::to_string(kNcclWorldSizeMax));
  }
  if (c.transfer != "nccl") return Status::OK();
  if (c.rendezvous.empty()) {
    return Status::InvalidArgument(
        "transfer 'nccl' needs rendezvous HOST:PORT (the address the engine's workers dial; "
        "PORT 0 = ephemeral)");
  }
  // The abort must fit inside every deadline it is reserved from, with time left for work.
  if (c.nccl_abort_reserve_ms >= c.nccl_init_timeout_ms ||
      c.nccl_abort_reserve_ms >= c.transfer_timeout_ms) {
    return Status::InvalidArgument(
        "nccl_abort_reserve_ms (" + std::to_string(c.nccl_abort_reserve_ms) +
        ") must be below nccl_init_timeout_ms (" + std::to_string(c.nccl_init_timeout_ms) +
        ") and transfer_timeout_ms (" + std::to_string(c.transfer_timeout_ms) + ")");
  }
  return Status::OK();
}

// The stalled-plan retry records RecoveryStarted with its executor id behind
// kStalledPlanRetryPrefix, and replay tells a retry from a restart by that prefix alone: an
// executor id of the same shape would make every restart of this executor read as a retry.
// (The table's help names the prefix literally.)
static_assert(std::string_view(kStalledPlanRetryPrefix) == "stalled-plan-retry:");
Status CheckExecutorId(const ServeConfig& c) {
  if (c.executor_id.rfind(kStalledPlanRetryPrefix, 0) != 0) return Status::OK();
  return Status::InvalidArgument(std::string("executor_id (--executor-id) must not begin with '") +
                                 kStalledPlanRetryPrefix +
                                 "': that prefix marks the stalled-plan retry's records");
}

// A fresh engine reports kFreshEngineLabel: committed under that label, a restarted engine (the
// same URL, its weights back to the start) would read as the one verified.
Status CheckInitialLabel(const ServeConfig& c) {
  if (c.initial_label != kFreshEngineLabel) return Status::OK();
  return Status::InvalidArgument(std::string("initial_label (--initial-label) must not be '") +
                                 kFreshEngineLabel +
                                 "', the label every freshly started engine reports: a restart "
                                 "could not be told from the committed weights");
}

// The settings sent or compared as `Authorization: Bearer <token>`, and the environment
// variable `serve` reads each from when it is not configured.
struct TokenKey {
  std::string_view key;
  std::string_view env;
};
constexpr std::array kTokenKeys = {TokenKey{"auth_token", "RC_AUTH_TOKEN"},
                                   TokenKey{"proxy_token", "RC_PROXY_TOKEN"},
                                   TokenKey{"engine_api_key", "RC_ENGINE_API_KEY"}};

// A CR or LF in a token (a key read from a CRLF file) would end its header and let the rest
// forge headers or a second request: every token is IsBearerToken's, as the curl path demands.
// The message names the key, never the value: it is a secret.
Status CheckTokens(const ServeConfig& c) {
  for (const TokenKey& t : kTokenKeys) {
    const ConfigKey* k = FindConfigKey(t.key);
    RC_CHECK(k != nullptr);
    const std::string& token = c.*std::get<std::string ServeConfig::*>(k->field);
    if (token.empty() || effects::IsBearerToken(token)) continue;
    return Status::InvalidArgument(
        std::string(k->key) + " (" + FlagOf(*k) + " or " + std::string(t.env) +
        ") must be printable ASCII without spaces or control characters (a trailing newline read "
        "from a file counts); the value is not shown");
  }
  return Status::OK();
}

Status CheckConnections(const ServeConfig& c) {
  // A chunked body's buffer grows by doubling, so it may reserve twice the bytes it holds.
  if (c.body_memory_bytes_max / 2 < c.body_bytes_max) {
    return Status::InvalidArgument(
        "body_memory_bytes_max (" + std::to_string(c.body_memory_bytes_max) +
        ") is below twice body_bytes_max (" + std::to_string(c.body_bytes_max) +
        "): a chunked request body's buffer may reserve twice its bytes, so the largest "
        "request could never be read");
  }
  if (!c.proxy_token.empty() && c.proxy_token == c.auth_token) {
    return Status::InvalidArgument(
        "proxy_token must differ from auth_token: a rollout client "
        "must not hold the trainer's token");
  }
  return Status::OK();
}

// ---- Unknown keys.

std::size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  RC_CHECK(row[b.size()] <= std::max(a.size(), b.size()));
  return row[b.size()];
}

// Printable ASCII only, bounded: the key came from outside.
std::string Echo(std::string_view text) {
  std::string out;
  for (char ch : text.substr(0, kKeyEchoBytesMax)) {
    out += (ch >= ' ' && ch < 0x7f) ? ch : '?';
  }
  if (text.size() > kKeyEchoBytesMax) out += "...";
  RC_CHECK(out.size() <= kKeyEchoBytesMax + 3);
  return out;
}

Status UnknownKey(std::string_view key) {
  std::string msg = "unknown config key '" + Echo(key) + "'";
  const auto close = ClosestConfigKeys(key, 3);
  if (!close.empty()) {
    msg += "; did you mean";
    for (std::size_t i = 0; i < close.size(); ++i) msg += (i ? ", '" : " '") + close[i] + "'";
    msg += "?";
  } else {
    msg += "; valid keys:";
    for (const auto& k : kKeys) msg += " " + std::string(k.key);
  }
  msg += " (all keys: docs/config.md, or `rolloutcore serve --config-reference`)";
  return Status::InvalidArgument(msg);
}

// Every row has a key, a flag and bounds that admit a value; keys and flags are unique.
bool TableIsWellFormed() {
  for (std::size_t i = 0; i < kKeys.size(); ++i) {
    const ConfigKey& k = kKeys[i];
    if (k.key.empty() || k.flag.empty() || k.help.empty()) return false;
    if (k.min > 0 && static_cast<std::uint64_t>(k.min) > k.max) return false;
    for (std::size_t j = 0; j < i; ++j) {
      if (kKeys[j].key == k.key || kKeys[j].flag == k.flag) return false;
    }
  }
  return true;
}

// ---- Rendezvous addresses.

struct HostPortText {
  std::string host;
  std::string port;
};

// "HOST:PORT" or "[IPv6]:PORT" cut at its colon; a bare IPv6 address is refused (ambiguous).
Result<HostPortText> SplitHostPort(const std::string& text) {
  if (!text.empty() && text.front() == '[') {  // [IPv6]:PORT
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return Status::InvalidArgument("'" + text + "' is not [IPv6]:PORT");
    }
    return HostPortText{text.substr(1, close - 1), text.substr(close + 2)};
  }
  const auto colon = text.rfind(':');
  if (colon == std::string::npos) return Status::InvalidArgument("'" + text + "' is not HOST:PORT");
  HostPortText out{text.substr(0, colon), text.substr(colon + 1)};
  if (out.host.find(':') != std::string::npos) {
    return Status::InvalidArgument("'" + text + "': write an IPv6 host as [addr]:PORT");
  }
  return out;
}

Status CheckRendezvousHost(const std::string& text, const std::string& host) {
  if (host.empty() || host.size() > kRendezvousHostBytesMax) {
    return Status::InvalidArgument("'" + text + "': host must be 1.." +
                                   std::to_string(kRendezvousHostBytesMax) + " bytes");
  }
  for (char ch : host) {
    if (ch <= ' ' || ch == '/' || ch == '[' || ch == ']' ||
        static_cast<unsigned char>(ch) >= 0x7f) {
      return Status::InvalidArgument("'" + text + "': host has a character that is not allowed");
    }
  }
  return Status::OK();
}

// Decimal digits only, 0..kPortMax (std::stoul cannot throw on at most kPortDigitsMax digits).
Result<std::uint16_t> ParsePort(const std::string& text, const std::string& port) {
  constexpr std::size_t kPortDigitsMax = 5;
  if (port.empty() || port.size() > kPortDigitsMax ||
      port.find_first_not_of("0123456789") != std::string::npos || std::stoul(port) > kPortMax) {
    return Status::InvalidArgument("'" + text + "': port must be a number in 0.." +
                                   std::to_string(kPortMax));
  }
  return static_cast<std::uint16_t>(std::stoul(port));
}

}  // namespace

std::span<const ConfigKey> ConfigKeys() {
  static const bool well_formed = TableIsWellFormed();
  RC_CHECK(well_formed);
  return kKeys;
}

const ConfigKey* FindConfigKey(std::string_view key) {
  for (const auto& k : kKeys) {
    if (k.key == key) return &k;
  }
  return nullptr;
}

std::string_view ConfigTypeName(const ConfigKey& key) {
  return std::visit(
      [](auto member) -> std::string_view {
        using T = std::decay_t<decltype(ServeConfig{}.*member)>;
        if constexpr (std::is_same_v<T, std::string>) return "string";
        if constexpr (std::is_same_v<T, bool>) return "bool";
        if constexpr (std::is_signed_v<T>) return "integer";
        return "unsigned integer";
      },
      key.field);
}

nlohmann::json ConfigDefault(const ConfigKey& key) {
  static const ServeConfig defaults;
  return std::visit([](auto member) { return nlohmann::json(defaults.*member); }, key.field);
}

std::vector<std::string> ClosestConfigKeys(std::string_view unknown, std::size_t max) {
  const std::string_view probe = unknown.substr(0, kKeyEchoBytesMax);
  std::vector<std::pair<std::size_t, std::string_view>> scored;
  for (const auto& k : kKeys) {
    const std::size_t d = EditDistance(probe, k.key);
    const bool contains = probe.size() >= 4 && (k.key.find(probe) != std::string_view::npos ||
                                                probe.find(k.key) != std::string_view::npos);
    if (d <= std::max<std::size_t>(2, k.key.size() / 3) || contains) scored.emplace_back(d, k.key);
  }
  std::stable_sort(scored.begin(), scored.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> out;
  for (std::size_t i = 0; i < scored.size() && i < max; ++i) out.emplace_back(scored[i].second);
  RC_CHECK(out.size() <= max);
  return out;
}

Result<HostPort> ParseHostPort(const std::string& text) {
  Result<HostPortText> split = SplitHostPort(text);
  if (!split.ok()) return split.status();
  RC_RETURN_IF_ERROR(CheckRendezvousHost(text, split->host));
  Result<std::uint16_t> port = ParsePort(text, split->port);
  if (!port.ok()) return port.status();
  return HostPort{split->host, *port};
}

namespace {

constexpr const char* kEnginesKey = "engines";

Result<std::string> EngineField(const nlohmann::json& e, const char* field, std::size_t i) {
  const auto it = e.find(field);
  if (it == e.end() || !it->is_string()) {
    return Status::InvalidArgument("engines[" + std::to_string(i) + "]." + field +
                                   " must be a string");
  }
  return it->get<std::string>();
}

Result<FleetEngineConfig> EngineEntry(const nlohmann::json& e, std::size_t i) {
  const bool retire_given = e.is_object() && e.contains("retire");
  if (!e.is_object() || e.size() != (retire_given ? 3U : 2U)) {
    return Status::InvalidArgument(
        "engines[" + std::to_string(i) +
        "] must be {\"name\": ..., \"engine_url\": ...} with an optional \"retire\": true");
  }
  if (retire_given && !e["retire"].is_boolean()) {
    return Status::InvalidArgument("engines[" + std::to_string(i) + "].retire must be a boolean");
  }
  Result<std::string> name = EngineField(e, "name", i);
  if (!name.ok()) return name.status();
  Result<std::string> url = EngineField(e, "engine_url", i);
  if (!url.ok()) return url.status();
  return FleetEngineConfig{*name, *url, retire_given && e["retire"].get<bool>()};
}

Status AssignEngines(const nlohmann::json& v, std::vector<FleetEngineConfig>& out) {
  if (!v.is_array() || v.size() > kFleetEnginesMax) {
    return Status::InvalidArgument("engines must be an array of at most " +
                                   std::to_string(kFleetEnginesMax) + " engines");
  }
  std::vector<FleetEngineConfig> engines;
  for (std::size_t i = 0; i < v.size(); ++i) {
    Result<FleetEngineConfig> e = EngineEntry(v[i], i);
    if (!e.ok()) return e.status();
    engines.push_back(std::move(e.value()));
  }
  out = std::move(engines);
  return Status::OK();
}

}  // namespace

Result<FleetEngineConfig> ParseFleetEngineFlag(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    return Status::InvalidArgument("--fleet-engine takes NAME=URL, got '" +
                                   text::escape_line(text.substr(0, 256)) + "'");
  }
  return FleetEngineConfig{text.substr(0, eq), text.substr(eq + 1)};
}

Status MarkRetiring(const std::vector<std::string>& names, ServeConfig& config) {
  for (const std::string& name : names) {
    const auto it = std::find_if(config.engines.begin(), config.engines.end(),
                                 [&name](const FleetEngineConfig& e) { return e.name == name; });
    if (it == config.engines.end()) {
      return Status::InvalidArgument("--fleet-retire '" + text::escape_line(name.substr(0, 256)) +
                                     "' names no configured engine");
    }
    it->retire = true;
  }
  return Status::OK();
}

Status MergeConfigJson(const nlohmann::json& doc, ServeConfig& config) {
  if (!doc.is_object()) return Status::InvalidArgument("config must be a JSON object");
  ServeConfig merged = config;
  for (const auto& item : doc.items()) {
    if (item.key() == kEnginesKey) {
      RC_RETURN_IF_ERROR(AssignEngines(item.value(), merged.engines));
      continue;
    }
    const ConfigKey* k = FindConfigKey(item.key());
    if (k == nullptr) return UnknownKey(item.key());
    const nlohmann::json& value = item.value();
    RC_RETURN_IF_ERROR(
        std::visit([&](auto member) { return Assign(k->key, value, merged.*member); }, k->field));
  }
  config = std::move(merged);
  return Status::OK();
}

// Read through one descriptor opened without blocking and refused unless it is a regular file:
// a FIFO named as the config would otherwise hold serve's start for ever.
Status MergeConfigFile(const std::string& path, ServeConfig& config) {
  const std::string named = "config file " + text::quoted(path);
  Result<std::string> text = effects::nccl::ReadSmallFile(path, kConfigFileBytesMax);
  if (!text.ok()) return Status(text.status().code(), "config file: " + text.status().message());
  nlohmann::json doc = effects::parse_outside_json(*text);
  if (doc.is_discarded()) {
    return Status::InvalidArgument(named + " is not JSON (or nests deeper than " +
                                   std::to_string(text::kJsonDepthMax) + ")");
  }
  Status st = MergeConfigJson(doc, config);
  if (!st.ok()) return Status::InvalidArgument(text::quoted(path) + ": " + st.message());
  return Status::OK();
}

Status ValidateConfig(const ServeConfig& c) {
  for (const auto& k : kKeys) RC_RETURN_IF_ERROR(CheckRow(k, c));
  RC_RETURN_IF_ERROR(CheckTokens(c));
  RC_RETURN_IF_ERROR(CheckListenHost(c));
  RC_RETURN_IF_ERROR(CheckExecutorId(c));
  RC_RETURN_IF_ERROR(CheckInitialLabel(c));
  RC_RETURN_IF_ERROR(CheckEngines(c));
  RC_RETURN_IF_ERROR(CheckNccl(c));
  return CheckConnections(c);
}

nlohmann::json ConfigToJson(const ServeConfig& c) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& k : kKeys) {
    std::visit([&](auto member) { j[std::string(k.key)] = c.*member; }, k.field);
  }
  if (!c.engines.empty()) {
    nlohmann::json engines = nlohmann::json::array();
    for (const FleetEngineConfig& e : c.engines) {
      engines.push_back({{"name", e.name}, {"engine_url", e.engine_url}});
    }
    j[kEnginesKey] = std::move(engines);
  }
  j["auth_token"] = c.auth_token.empty() ? "" : "<redacted>";
  j["proxy_token"] = c.proxy_token.empty() ? "" : "<redacted>";
  j["engine_api_key"] = c.engine_api_key.empty() ? "" : "<redacted>";
  return j;
}

// ---- The reference (docs/config.md).

namespace {

std::string DefaultText(const ConfigKey& k) {
  const nlohmann::json d = ConfigDefault(k);
  if (d.is_string()) {
    const auto text = d.get<std::string>();
    return text.empty() ? "(empty)" : "`" + text + "`";
  }
  return "`" + d.dump() + "`";
}

std::string BoundsText(const ConfigKey& k) {
  if (ConfigTypeName(k) == "bool") return "true, false";
  if (!k.choices.empty()) {
    std::string out;
    std::string_view rest = k.choices;
    while (!rest.empty()) {
      const auto bar = rest.find('|');
      out += (out.empty() ? "`" : ", `") + std::string(rest.substr(0, bar)) + "`";
      if (bar == std::string_view::npos) break;
      rest.remove_prefix(bar + 1);
    }
    return out;
  }
  const std::string range = std::to_string(k.min) + ".." + std::to_string(k.max);
  if (ConfigTypeName(k) == "string") {
    return (k.min > 0 ? "required, " : "") + std::to_string(k.min) + ".." + std::to_string(k.max) +
           " bytes";
  }
  return range;
}

std::string Row(const ConfigKey& k) {
  const std::string flag = FlagOf(k) + (k.is_switch ? "" : " V");
  return "| `" + std::string(k.key) + "` | `" + flag + "` | " + std::string(ConfigTypeName(k)) +
         " | " + DefaultText(k) + " | " + BoundsText(k) + " | " + std::string(k.help) + " |\n";
}

constexpr const char* kPreamble = R"(# `rolloutcore serve` configuration reference

<!-- Generated by `rolloutcore serve --config-reference`; do not edit by hand.
     tests/service/config_test.cc fails when this file differs from the generated text. -->

Every setting can be given as a command-line flag or as a key of a JSON config file passed with
`--config FILE`. Flags override the file; anything given neither way keeps the default below.
The file is one JSON object (at most 1 MiB); an unknown key, a value of the wrong type or a value
out of bounds stops `serve` before anything starts (exit 2), and an unknown key is answered with
the closest valid names. A complete example with every key: [serve.example.json](serve.example.json).

Bool flags take a value (`--journal-sync false`), except `--adopt-engine`, which is a switch.
Bounds are inclusive; string bounds are lengths in bytes.

Rules that join several keys, checked after the bounds:

- Exactly one of `engine_url` (one engine) and `engines` (a fleet) is given; each engine URL
  is `http://HOST[:PORT][/PATH]` (the engine sits on loopback or a private network; see
  docs/security.md) in printable ASCII without spaces, HOST a name or IPv4 address (`A-Z`,
  `a-z`, `0-9`, `.`, `-`, `_`) or a bracketed IPv6 address, PORT 1..65535.
- `listen_host` is an IP address, not a name (`127.0.0.1`, `0.0.0.0`, `::1`); a `%scope` only
  on a link-local IPv6 address, which needs one.
- `engines` is a list of at most 256 `{"name": NAME, "engine_url": URL}` objects, names unique
  (1..64 bytes of `A-Z`, `a-z`, `0-9`, `.`, `_`, `-`) and URLs unique, or the flag
  `--fleet-engine NAME=URL` given once per engine (the flags replace the file's list). An entry
  may add `"retire": true` (or the flag `--fleet-retire NAME`): that engine leaves the fleet at
  start without having to answer. At least one engine stays, and `fleet_min_serving` is below
  the number of engines that stay. With `transfer` = `nccl`, engine i of the list (from 0) has a
  communicator of its own whose rendezvous is `rendezvous`'s port + i (port 0: each its own
  ephemeral port); the last such port is at most 65535.
- `auth_token`, `proxy_token` and `engine_api_key`, when given (or taken from the
  environment), are printable ASCII without spaces or control characters: each travels in an
  `Authorization: Bearer` header. `proxy_token` differs from `auth_token`.
- `rendezvous`, when given, is `HOST:PORT` or `[IPv6]:PORT` (PORT 0..65535).
- `nccl_world_size` is 0 (ask the engine) or 2 and more.
- With `transfer` = `nccl`: `rendezvous` is required, and `nccl_abort_reserve_ms` is below both
  `nccl_init_timeout_ms` and `transfer_timeout_ms`.

The journal's parent directories are created on start when missing (logged); the journal
directory itself is created by the journal. Settings that are not configurable: the runner waits
10 s after the engine reports drained for rollouts still in transit before it refuses the update
(see the limits in the README).
)";

}  // namespace

std::string ConfigReferenceMarkdown() {
  std::string out = kPreamble;
  std::string_view section;
  for (const auto& k : kKeys) {
    if (k.section != section) {
      section = k.section;
      out += "\n## " + std::string(section) + "\n\n";
      out += "| key | flag | type | default | bounds | meaning |\n|---|---|---|---|---|---|\n";
    }
    out += Row(k);
  }
  return out;
}

}  // namespace rc::service
