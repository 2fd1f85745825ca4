// CheckpointReload: the WeightTransfer for an engine that runs beside its checkpoints. The
// engine loads the new version from its own disk through vLLM's native worker method
// `reload_weights` (GPUModelRunner.reload_weights, vLLM 0.25.1), called over the dev route
// POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
// (VLLM_SERVER_DEV_MODE=1): no NCCL, no second GPU, no data plane. It is how a one-GPU
// deployment updates, and how an engine is put back on an earlier checkpoint.
//
// Source URIs: "safetensors:/path", a checkpoint directory or a .safetensors file alone in its
// directory, as the ENGINE sees the path. RolloutCore never opens it; the engine's worker
// extension (python/rolloutcore/vllm_ext.py, rc_checkpoint_manifest) reads the safetensors
// headers and answers the manifest digest of exactly the files vLLM would load, computed as
// effects/manifest.h computes it, and the directory to hand to reload_weights (a file's
// directory: vLLM's loader globs a directory, never one file).
//
// Preflight: rc_checkpoint_manifest, which changes nothing. Refused (empty digest, the detail
// says why) when the URI is not safetensors:, the RPC fails (no extension, no dev mode), the
// path is missing or not a checkpoint vLLM would load, or the engine runs --load-format dummy
// (whose loader has no get_all_weights: reload_weights raises NotImplementedError).
//
// Transfer: rc_checkpoint_manifest again (the checkpoint must still be the declared one), then
// reload_weights with the whole remaining deadline, then the label, set as every transfer sets
// it for this engine line (EngineClient::WriteLabel: the extension's rc_set_weight_version on
// vLLM 0.25.x, POST /update_weight_version on later lines, which have no update in progress to
// finish here).
//
// Why a failed reload_weights is ambiguous: vLLM's loader iterator is lazy, and the first tensor
// is read only inside model.load_weights, AFTER initialize_layerwise_reload has moved every
// layer's parameters to the meta device. Any failure from then on (a missing file included)
// leaves every layer whose weights were complete already holding the new values and the rest
// taken apart, and the answer is the same 500 as a failure before the first layer: vLLM turns
// every worker exception into "Call to collective_rpc method failed: Worker failed with error
// '...'" (docs/vllm-protocol.md, "reload_weights"). A timeout or a dropped connection leaves the
// reload running in the engine. So:
//   kNone      nothing was sent to reload_weights: the URI, the manifest RPC or the checkpoint
//              refused it, the deadline was spent before, or reload_weights never left
//              (HttpEvidence::never_sent()).
//   kPossible  reload_weights may have reached the engine and did not answer vLLM's success
//              (500, timeout, broken connection, an unexpected body), or it succeeded and the
//              label could not be set.
//   kComplete  reload_weights answered {"results": [null, ...]} and every worker reports the
//              label (acknowledged = true); bytes_sent and tensors_sent are the checkpoint's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "effects/transfer.h"
#include "statemachine/status.h"

namespace rc::effects {

inline constexpr char kReloadWeightsMethod[] = "reload_weights";
inline constexpr char kCheckpointManifestMethod[] = "rc_checkpoint_manifest";
inline constexpr char kReloadScheme[] = "safetensors:";
inline constexpr std::size_t kEngineErrorBytesMax = 1024;  // an engine's words in our texts

// What every worker of the engine said about one checkpoint (they must agree).
struct CheckpointManifest {
  std::string digest;         // manifest digest (effects/manifest.h) of what vLLM would load
  std::uint32_t tensors = 0;  // 1..kTensorsMax
  std::uint64_t bytes = 0;
  std::uint32_t files = 0;
  std::string weights_path;  // the directory reload_weights is given
  std::string load_format;   // the engine's load_config.load_format
};

// "safetensors:/path" -> "/path" (ValidateSourceUri's rules); InvalidArgument otherwise.
[[nodiscard]] Result<std::string> ReloadPath(const std::string& source_uri);

// Pure: an rc_checkpoint_manifest 2xx body {"results": [one per worker]} -> the manifest, or
// why not (a worker's error, a malformed or disagreeing answer, load_format dummy). Engine text
// in the message is escaped and bounded.
[[nodiscard]] Result<CheckpointManifest> ParseCheckpointManifestReply(const nlohmann::json& body);

// Pure: whether a reload_weights 2xx body is vLLM's success, {"results": [null, ...]} with one
// null per worker.
bool ReloadAnswered(const nlohmann::json& body);

class CheckpointReload final : public WeightTransfer {
 public:
  explicit CheckpointReload(EngineClient& client) : client_(client) {}

  PreflightObserved Preflight(const TransferTarget& target) override;
  TransferObserved Transfer(const TransferTarget& target, std::uint64_t deadline_ms) override;

  using StepFailed = TransferStepFailed;

 private:
  // rc_checkpoint_manifest over the engine's workers; changes nothing.
  [[nodiscard]] Result<CheckpointManifest> AskManifest(const std::string& source_uri,
                                                       std::uint64_t timeout_ms);
  // The manifest (checked against the declared one), reload_weights, the label; nullopt when
  // every step succeeded.
  std::optional<StepFailed> RunReload(const TransferTarget& target, std::uint64_t deadline_at_ms,
                                      TransferObserved& out);

  EngineClient& client_;
};

}  // namespace rc::effects
