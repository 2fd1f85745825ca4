// Value types shared by the fold, the journal codec and the effects. Standard library only.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace rc {

// Bounds on every payload the fold accepts (TigerStyle: put a limit on everything).
inline constexpr std::size_t kIdBytesMax = 128;           // rollout ids, update ids, labels
inline constexpr std::size_t kTextBytesMax = 4096;        // error messages, details, URIs
inline constexpr std::size_t kDigestBytesMax = 128;       // hex digests
inline constexpr std::size_t kActiveRolloutsMax = 65536;  // admissions refused beyond this
inline constexpr std::uint32_t kEffectAttemptsMax = 3;    // retries of one idempotent effect
inline constexpr std::uint32_t kLeaseMsMax = 3600000;     // an explicit rollout's lease, at most
inline constexpr std::size_t kLabelsMax = 65536;          // distinct labels one journal commits

// What a freshly started engine reports as its weight-version label (vLLM's own default, and
// the worker extension's): bootstrap names such an engine; any other label is someone's.
inline constexpr const char* kFreshEngineLabel = "default";

// The lifecycle states. Values are part of the journal format: append only.
enum class Lifecycle : std::uint8_t {
  kUninitialized = 0,
  kReady = 1,
  kDraining = 2,
  kQuiesced = 3,
  kUpdating = 4,
  kInvalidating = 5,
  kValidating = 6,
  kResuming = 7,
  kTainted = 8,
  // Colocated mode: the engine released GPU memory (vLLM's /sleep) so a trainer can use it; it
  // admits nothing until an update or a wake-up brings it back through validation.
  kSleeping = 9,
};
inline constexpr std::uint8_t kLifecycleMax = 9;

// vLLM's sleep levels: 1 keeps the weights in host memory (a wake-up restores them), 2 discards
// them (only an update covering every tensor makes the engine servable again).
inline constexpr std::uint8_t kSleepLevelMax = 2;

// The memory pools vLLM's /wake_up?tags= names, woken one at a time: the weights before an
// update writes them, the KV cache last (waking it is what resumes the engine's scheduler).
enum class WakeTag : std::uint8_t { kWeights = 0, kKvCache = 1 };
inline constexpr std::uint8_t kWakeTagMax = 1;
const char* wake_tag_name(WakeTag t);

const char* lifecycle_name(Lifecycle s);

// Which committed generation the engine serves: generation 0 is the bootstrap weights.
struct WeightVersion {
  std::uint64_t generation = 0;
  std::string label;  // e.g. "rc-3"; what the engine reports in /weight_info.
  bool operator==(const WeightVersion&) const = default;
};

// What a generation was meant to contain. Two checkpoints of one architecture share a
// manifest digest; checkpoint/run/step (and a content digest where known) tell them apart.
struct WeightIdentity {
  std::string manifest_digest;  // sha256 hex of (name, dtype, shape) list
  std::string content_digest;   // sha256 hex of the bytes, empty when unknown
  std::string checkpoint;       // declared source, e.g. a path or URI
  std::string run;              // trainer run id
  std::int64_t step = -1;       // training step, -1 when unknown
  bool operator==(const WeightIdentity&) const = default;
};

// A digest of the weights an engine holds, computed by the engine on its own memory (the worker
// extension's "rcd1": python/rolloutcore/digest.py). Integrity, not authenticity: it tells
// a complete update from a partial or missing one, not an adversary's forgery.
inline constexpr std::size_t kTensorDigestsMax = 1024;     // tensors one digest names (a record)
inline constexpr std::size_t kTensorNameBytesMax = 256;    // one tensor's name
inline constexpr std::size_t kDigestTensorsNamedMax = 16;  // tensors a failure names, at most
struct TensorDigest {
  std::string name;    // the engine's parameter name ("r<rank>/" first when several workers)
  std::string digest;  // lowercase hex
  bool operator==(const TensorDigest&) const = default;
};
struct WeightDigest {
  std::string algorithm;              // e.g. "rcd1"; "" when none was computed
  std::string combined;               // lowercase hex over every tensor; "" when none
  std::vector<TensorDigest> tensors;  // sorted by name, unique
  std::uint64_t bytes = 0;            // bytes digested
  std::string error;                  // why none was computed (bounded, escaped on output)
  bool operator==(const WeightDigest&) const = default;
  bool present() const { return !combined.empty(); }
};

// The caches a new version must never reuse from the old one.
enum class CacheKind : std::uint8_t { kPrefix = 0, kEncoder = 1, kMultimodal = 2 };
inline constexpr std::uint8_t kCacheKinds = 3;
inline constexpr std::uint8_t kAllCachesMask = 0b111;
const char* cache_name(CacheKind c);

// What a failed or finished transfer may have changed in the engine's weights.
enum class MutationClass : std::uint8_t {
  kNone = 0,      // proven: nothing reached the engine (e.g. connection refused before sending)
  kPossible = 1,  // some bytes may have landed: ambiguous
  kComplete = 2,  // every byte was sent and the receiver acknowledged
};
const char* mutation_name(MutationClass m);

// How an HTTP exchange ended at the transport level; the fold decides what it means.
enum class Transport : std::uint8_t {
  kOk = 0,             // a response with a status code arrived
  kConnectFailed = 1,  // no connection: the request never reached the engine
  kTimeout = 2,        // deadline passed after the request may have been sent
  kBroken = 3,         // connection dropped mid-exchange
};
const char* transport_name(Transport t);

// Typed evidence of one HTTP exchange.
struct HttpEvidence {
  Transport transport = Transport::kOk;
  std::int32_t http_status = 0;  // 0 when no response
  bool body_parsed = false;      // the body parsed as the JSON the route promises
  std::uint64_t latency_us = 0;
  std::string error;  // transport or parse error text, bounded
  bool operator==(const HttpEvidence&) const = default;

  // True when a well-formed 2xx response arrived.
  bool ok_2xx() const {
    return transport == Transport::kOk && http_status >= 200 && http_status < 300 && body_parsed;
  }
  // True when the request provably never reached the engine.
  bool never_sent() const { return transport == Transport::kConnectFailed; }
};

enum class RolloutOutcome : std::uint8_t {
  kCompleted = 0,
  kAborted = 1,    // the client or the engine aborted it
  kAbandoned = 2,  // its client vanished (executor restart); recorded, never dropped
  kExpired = 3,    // an explicit rollout whose client stopped renewing its lease
};
inline constexpr std::uint8_t kRolloutOutcomeMax = 3;
const char* outcome_name(RolloutOutcome o);

// What the runner must do next; derived from state by next_effect().
enum class EffectKind : std::uint8_t {
  kNone = 0,
  kProbeEngine = 1,    // /health, /version, /weight_info
  kDrain = 2,          // POST /pause?mode=wait&clear_cache=false
  kAwaitRollouts = 3,  // no I/O: wait for local bindings to finish (bounded)
  kPreflight = 4,      // identity/device/memory checks before any mutation
  kTransfer = 5,       // start/update/finish weight update (+ NCCL)
  kResetCache = 6,     // one of /reset_prefix_cache, /reset_encoder_cache, /reset_mm_cache
  kValidate = 7,       // GET /weight_info (+ optional checks) while paused
  kResume = 8,         // POST /resume then GET /is_paused
  kSleep = 9,          // POST /sleep?level=L&mode=wait, the device memory read around it
  kWake = 10,          // POST /wake_up?tags=<tag> (+ GET /is_paused after the KV cache)
};
inline constexpr std::uint8_t kEffectKindMax = 10;
const char* effect_name(EffectKind e);

}  // namespace rc
