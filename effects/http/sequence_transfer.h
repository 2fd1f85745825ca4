// HttpSequenceTransfer: the GPU-free WeightTransfer. It drives vLLM's start/update/finish
// sequence over HTTP with no data plane (tests, the demo, the vLLM double). The NCCL sender
// (effects/nccl/) is the real one.
//
// Source URIs understood: "synthetic:<n_tensors>x<dim>[:seed]" -> n bf16 tensors named
// "model.layers.<i>.weight", i = 0..n-1, each of shape [dim, dim]. The manifest (and its digest)
// does not depend on the seed: the seed names the values, which a GPU-free transfer never has.
// After /start_weight_update it names the source URI to the engine (kDataPlaneRoute), so a double
// that models content holds the same values for the same source; a real engine ignores it.
//
// Mutation classification of Transfer():
//   kNone      the source or update_info could not be built, the deadline passed before the
//              first request, or /start_weight_update provably never reached the engine
//              (HttpEvidence::never_sent()).
//   kPossible  any other failure once /start_weight_update may have reached the engine, a start
//              refused for a weight session someone else left open included (only a restore
//              finishes such a session: StaleSession).
//   kComplete  start, update and finish all answered well-formed 2xx (acknowledged = true).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "effects/http/engine_client.h"
#include "effects/http/protocol.h"
#include "effects/manifest.h"
#include "effects/thread_start.h"
#include "effects/transfer.h"

namespace rc::effects {

inline constexpr std::uint64_t kSyntheticTensorsMax = 100000;
// Where the transfer names its source for an engine that models weight content (the double):
// the stand-in for the data plane this transfer does not have (see announce_content).
inline constexpr char kDataPlaneRoute[] = "/_double/data_plane";
inline constexpr std::uint64_t kSyntheticDimMax = 1u << 20;

// Parses "synthetic:<n>x<dim>[:seed]" into its manifest.
[[nodiscard]] Result<Manifest> synthetic_manifest(const std::string& source_uri);

class HttpSequenceTransfer : public WeightTransfer {
 public:
  // `protocol` picks where packed* go in update_info; the default is the >= 0.28 line.
  explicit HttpSequenceTransfer(EngineClient& client, EngineProtocol protocol = DefaultProtocol(),
                                PackingParams packing = {});

  PreflightObserved Preflight(const TransferTarget& target) override;
  TransferObserved Transfer(const TransferTarget& target, std::uint64_t deadline_ms) override;

  static EngineProtocol DefaultProtocol() {
    EngineProtocol p;
    p.line = ProtocolLine::kPackedInInitInfo;
    return p;
  }

  using StepFailed = TransferStepFailed;

  // How the /update_weights thread is started (std::thread's constructor when unset). Tests set
  // one that refuses it, as the system does when out of threads: the transfer then fails.
  void set_thread_starter(ThreadStarter starter) { thread_starter_ = std::move(starter); }

 private:
  // /get_world_size then /init_weight_transfer_engine (once per engine), both ending by
  // deadline_at_ms (on steady_now_ms()'s clock).
  [[nodiscard]] Status Initialize(std::uint64_t deadline_at_ms);
  // Initialize unless done; deadline_at_ms is on steady_now_ms()'s clock.
  std::optional<StepFailed> InitializeOnce(std::uint64_t deadline_at_ms);
  // The source, then the engine steps in order; nullopt when every one succeeded.
  std::optional<StepFailed> RunSequence(const TransferTarget& target, std::uint64_t deadline_at_ms,
                                        TransferObserved& out);

  EngineClient& client_;
  EngineProtocol protocol_;
  PackingParams packing_;
  // The engine process the transfer engine was initialized on; "" until then, or when its read
  // failed. A restarted engine, or one not known to be the same, is initialized again.
  std::string initialized_on_;
  ThreadStarter thread_starter_;  // empty: std::thread
};

}  // namespace rc::effects
