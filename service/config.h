// ServeConfig: everything `rolloutcore serve` is told, from flags and an optional JSON file.
//
// One table (ConfigKeys(), in config.cc) defines every setting: its JSON key, its flag, its type,
// its bounds and its help. The JSON parser, the CLI flags, ValidateConfig and the generated
// reference (docs/config.md, `rolloutcore serve --config-reference`) are all driven by it. The
// JSON file is an object of those keys (unknown keys are an error naming the closest valid
// ones); flags given on the command line override it. Defaults are the initialisers below.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "statemachine/status.h"
#include "statemachine/types.h"

namespace rc::service {

inline constexpr std::size_t kConfigFileBytesMax = 1 << 20;
inline constexpr std::uint64_t kPackedBufferBytesMin = std::uint64_t{1} << 20;   // 1 MiB
inline constexpr std::uint64_t kPackedBufferBytesMax = std::uint64_t{64} << 30;  // 64 GiB
inline constexpr std::uint32_t kPackedNumBuffersMax = 64;
inline constexpr int kCudaDeviceMax = 1023;
inline constexpr int kNcclWorldSizeMax = 4096;
inline constexpr std::size_t kRendezvousHostBytesMax = 255;
// Bound on fleet_affinity_prefix_bytes: the affinity text a request costs.
inline constexpr std::uint64_t kAffinityPrefixBytesMax = 1 << 20;
inline constexpr std::uint32_t kPortMax = 65535;
// The rendezvous the GPU-free transfer records in the engine's init_info when none is given.
inline constexpr const char* kHttpRendezvousDefault = "127.0.0.1:29500";

// One engine of a fleet (the `engines` list): the name its records carry in the journal, and
// where it listens. A retiring engine is taken out of the fleet at start (its last plan ended,
// its rollouts recovered) without having to answer: the way to drop an engine that died.
struct FleetEngineConfig {
  std::string name;
  std::string engine_url;
  bool retire = false;
  bool operator==(const FleetEngineConfig&) const = default;
};

// A new member needs its row in ConfigKeys() (service/config.cc), then a regenerated
// docs/config.md and a key in docs/serve.example.json (config_test checks both).
struct ServeConfig {
  // Where things are.
  std::string engine_url;  // vLLM (or the double), e.g. http://127.0.0.1:8000
  // A fleet instead of one engine: N named engines (docs/fleet.md). Not a table row (it is a
  // list): the JSON key `engines` ([{"name": ..., "engine_url": ...}]) or the flag
  // `--fleet-engine NAME=URL`, repeated. Exactly one of engine_url and engines is given.
  std::vector<FleetEngineConfig> engines;
  std::string journal_path;       // RocksDB directory
  std::string trajectories_path;  // "" = <journal_path>.trajectories.jsonl, beside the journal
  std::string listen_host = "127.0.0.1";
  int listen_port = 8100;      // 0 = ephemeral (printed on start)
  std::string auth_token;      // Bearer token for mutating trainer routes; "" = none
  std::string proxy_token;     // Bearer token clients must send to the proxy; "" = none
  std::string engine_api_key;  // sent to the engine as a Bearer token; "" = none
  std::string executor_id = "rolloutcore-serve";

  // Bootstrap (only used when the journal is UNINITIALIZED).
  std::string initial_label = "rc-0";
  std::string initial_manifest_digest;  // or computed from initial_source
  std::string initial_source;           // e.g. "synthetic:4x64"
  std::string initial_checkpoint;
  std::string initial_run;
  std::int64_t initial_step = -1;

  // Deadlines.
  std::uint64_t connect_timeout_ms = 1000;
  std::uint64_t call_timeout_ms = 10000;
  std::uint64_t drain_timeout_ms = 120000;
  std::uint64_t transfer_timeout_ms = 600000;
  std::uint64_t sleep_timeout_ms = 300000;
  std::uint64_t request_timeout_ms = 600000;   // one proxied generation, end to end
  std::uint64_t admit_wait_ms = 30000;         // a proxied request waits this long for READY
  std::uint32_t retry_after_s = 2;             // Retry-After on 503
  std::uint64_t shutdown_grace_ms = 30000;     // SIGTERM: in-flight rollouts get this long
  std::uint64_t watch_timeout_ms_max = 60000;  // long-poll bound

  // Bounds.
  std::size_t body_bytes_max = std::size_t{8} << 20;
  // Request and response bodies all connections and proxied exchanges hold at once; beyond: 503.
  std::uint64_t body_memory_bytes_max = std::uint64_t{1} << 30;
  int http_threads = 64;                      // threads for trainer calls that may block
  std::uint64_t io_threads = 0;               // event loops; 0: one per core, at most 4
  std::uint64_t header_bytes_max = 16 << 10;  // request line + headers; larger = 431
  // Idle keep-alive connections (curl handles) the proxy keeps to the engine; about the number
  // of concurrent proxied requests, or calls beyond it reconnect.
  std::size_t engine_connections_max = 512;
  std::uint32_t events_page_max = 1000;
  std::uint64_t trajectories_bytes_max = std::uint64_t{1} << 30;  // then rotated once (.1)

  // Transfer.
  // "http": GPU-free sequence; "nccl": CUDA builds; "reload": the engine reloads from its disk
  std::string transfer = "http";
  std::uint64_t packed_buffer_size_bytes = std::uint64_t{1} << 30;  // kPackedBufferBytes{Min,Max}
  std::uint32_t packed_num_buffers = 2;                             // 1..kPackedNumBuffersMax
  // HOST:PORT. nccl: HOST is what the engine's workers dial for the TCPStore rendezvous (the
  // store binds 0.0.0.0:PORT; PORT 0 = a fresh ephemeral port per init); required with nccl.
  // http: only recorded in the engine's init_info (default 127.0.0.1:29500).
  std::string rendezvous;
  // NCCL sender only (transfer == "nccl").
  int cuda_device = 0;      // rank 0's CUDA device, 0..kCudaDeviceMax
  int nccl_world_size = 0;  // 0: 1 + the engine's GET /get_world_size; else 2..kNcclWorldSizeMax
  std::uint64_t nccl_init_timeout_ms = 120000;  // startup rendezvous + communicator + warm-up
  // Kept at the end of every init/transfer deadline for ncclCommAbort and the kernel drain
  // (the sender uses the larger of this and 5/4 of the longest abort it has measured).
  std::uint64_t nccl_abort_reserve_ms = 1000;

  bool journal_sync = true;  // fsync each group commit (off only in benches)

  // Connections (service/http_server.h).
  std::uint64_t header_timeout_ms = 10000;    // first byte -> complete request head, else 408
  std::uint64_t idle_timeout_ms = 5000;       // no byte of a request yet, else 408 / closed
  std::uint64_t body_timeout_ms = 30000;      // complete head -> complete body, else 408
  std::uint64_t write_timeout_ms = 60000;     // a response write the client does not take
  std::uint64_t http_connections_max = 4096;  // accepted and not yet closed; beyond: 503

  // Trust under faults.
  // The engine monitor probes the engine this often while READY
  // (kEngineMonitorIntervalMs{Min,Max}).
  std::uint64_t engine_monitor_interval_ms = 200;
  // A plan stalled at an engine that stopped answering is tried again once the engine answers
  // the monitor, at most this often; the wait doubles after each try that stalls again, up to
  // kStalledPlanRetryBackoffMax times it.
  std::uint64_t stalled_plan_retry_ms = 5000;
  // Startup waits this long for the engine to answer (GET /version, then bootstrap/recovery),
  // logging progress, then fails saying why (1 ms..24 h).
  std::uint64_t engine_startup_timeout_ms = 300000;
  // Bootstrap accepts an engine that reports another label (relabelled) or is paused (resumed);
  // what was seen is journaled.
  bool adopt_engine = false;
  // Bootstrap refuses an engine that computes no weight digest (docs/lifecycle.md, "Weight
  // digests"); without it a digest is used whenever the engine computes one.
  bool require_weight_digest = false;
  // While READY the monitor also digests the engine's weights this often (0: never); a digest
  // other than the committed one taints (weights_changed).
  std::uint64_t weight_digest_check_interval_ms = 60000;
  // Lease of an explicit rollout (POST /v1/rollouts) when the client names none; renewed by
  // POST /v1/rollouts/<id>/lease. Bounded by kRolloutLeaseMs{Min,Max}.
  std::uint32_t rollout_lease_ms = 30000;
  // A finish (or abandon) that cannot be made durable is retried for this long with a bounded
  // backoff; then the executor fail-stops (1 ms..10 min).
  std::uint64_t finish_retry_ms = 30000;
  // A group commit not durable within this (a stalled fsync) fails the journal: fail-stop
  // (100 ms..10 min).
  std::uint32_t journal_commit_stall_timeout_ms = 10000;
  // The committer waits this long after a group opens before it writes the batch, so that more
  // groups share one fsync: less CPU per request under load, more latency per durable point
  // (0..10 ms).
  std::uint32_t journal_commit_window_us = 0;

  // Fleet (with `engines` only).
  std::uint32_t fleet_staleness_max = 0;  // admit only to generations >= newest - this
  std::uint32_t fleet_min_serving = 0;    // engines kept serving through a rolling update
  // A fleet update that cannot progress (too few serving, every pending member quarantined) is
  // cancelled after this.
  std::uint64_t fleet_blocked_timeout_ms = 30000;
  // A fleet update still open this long after its request is cancelled: members not started are
  // skipped, those updating end by their own deadlines.
  std::uint64_t fleet_update_timeout_ms = 3600000;
  // Prefix affinity: a request goes to the engine its prompt's first this-many bytes hash to
  // (among the engines of the newest generation that admit), so repeated prefixes meet their
  // cached KV; 0: the least busy engine always.
  std::uint64_t fleet_affinity_prefix_bytes = 0;
  // ... unless that engine has more than this many requests in flight above the least busy one.
  std::uint32_t fleet_affinity_slack = 8;
};

inline constexpr std::uint64_t kEngineMonitorIntervalMsMin = 10;
inline constexpr std::uint64_t kEngineMonitorIntervalMsMax = 60000;
inline constexpr std::uint64_t kStalledPlanRetryBackoffMax = 64;
inline constexpr std::uint32_t kRolloutLeaseMsMin = 1000;
inline constexpr std::uint32_t kRolloutLeaseMsMax = kLeaseMsMax;

// Which ServeConfig member a table row sets. std::size_t members are std::uint64_t here.
static_assert(std::is_same_v<std::size_t, std::uint64_t>, "size_t fields are bound as uint64");
using ConfigField = std::variant<std::string ServeConfig::*, bool ServeConfig::*,
                                 int ServeConfig::*, std::int64_t ServeConfig::*,
                                 std::uint32_t ServeConfig::*, std::uint64_t ServeConfig::*>;

// One row of the configuration table: the single definition of a setting.
struct ConfigKey {
  std::string_view key;   // JSON key, and the ServeConfig member's name
  std::string_view flag;  // long command-line flag, without the leading "--"
  ConfigField field;
  std::int64_t min;  // numbers: inclusive bounds; strings: length in bytes
  std::uint64_t max;
  std::string_view section;  // heading in the reference
  std::string_view help;
  std::string_view choices;  // strings: "a|b" = the only accepted values; empty = any
  bool is_switch = false;    // bools: a flag without a value (--adopt-engine)
};

// Every setting, in reference order.
std::span<const ConfigKey> ConfigKeys();
// The row for a JSON key, or nullptr.
const ConfigKey* FindConfigKey(std::string_view key);
// "string", "bool", "integer" or "unsigned integer".
std::string_view ConfigTypeName(const ConfigKey& key);
// The value a default ServeConfig holds for the row, as JSON.
nlohmann::json ConfigDefault(const ConfigKey& key);
// Up to `max` valid keys closest to `unknown` (edit distance), closest first.
std::vector<std::string> ClosestConfigKeys(std::string_view unknown, std::size_t max);
// The configuration reference in Markdown (committed as docs/config.md).
std::string ConfigReferenceMarkdown();

// A rendezvous address, "HOST:PORT" or "[IPv6]:PORT".
struct HostPort {
  std::string host;
  std::uint16_t port = 0;
};
[[nodiscard]] Result<HostPort> ParseHostPort(const std::string& text);
// Where engine `index` of a fleet rendezvouses with its own NCCL communicator: `rendezvous` with
// its port + index (port 0 stays 0: an ephemeral port each). Requires a valid configuration.
HostPort FleetMemberRendezvous(const ServeConfig& config, std::size_t index);

// Merges the keys of `doc` into `config`. Unknown keys, wrong types and values the member's type
// cannot hold are InvalidArgument; ranges are ValidateConfig's.
[[nodiscard]] Status MergeConfigJson(const nlohmann::json& doc, ServeConfig& config);
// "NAME=URL" (the --fleet-engine flag) as one engine of a fleet.
[[nodiscard]] Result<FleetEngineConfig> ParseFleetEngineFlag(const std::string& text);
// Marks each named engine of `config.engines` as retiring (the --fleet-retire flag); a name that
// is not configured is InvalidArgument.
[[nodiscard]] Status MarkRetiring(const std::vector<std::string>& names, ServeConfig& config);
// Reads and merges a JSON file (bounded by kConfigFileBytesMax).
[[nodiscard]] Status MergeConfigFile(const std::string& path, ServeConfig& config);
// Checks a complete configuration: every row's bounds, then the rules that join keys.
[[nodiscard]] Status ValidateConfig(const ServeConfig& config);
nlohmann::json ConfigToJson(const ServeConfig& config);  // auth_token redacted

}  // namespace rc::service
