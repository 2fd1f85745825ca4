// IpcTransfer: the WeightTransfer of colocated mode. The trainer and the engine share the GPU;
// vLLM's `ipc` weight-transfer backend (--weight-transfer-config '{"backend":"ipc"}') reads the
// new weights straight out of the trainer's CUDA memory through CUDA IPC handles, so there is no
// NCCL group and no second GPU (docs/vllm-protocol.md, "Colocated").
//
// Source URIs: "vllm-ipc:/path", a file the trainer wrote (python/rolloutcore/ipc.py,
// export_vllm_ipc) while it holds the tensors alive:
//   {"format": "rolloutcore-vllm-ipc", "version": 1, "gpu_uuids": [str, ...],
//    "names": [str, ...], "dtype_names": [str, ...], "shapes": [[int, ...], ...],
//    "ipc_handles_pickled": "<standard base64 of a Python pickle>"}
// The handles are a pickle of torch objects that only the engine's Python can open: RolloutCore
// never decodes them; it checks everything around them and forwards them as vLLM's update_info
// (unpacked: vLLM reads the trainer's memory without a copy until /finish_weight_update).
//
// Preflight (changes nothing): the file parses within its bounds, its manifest (names, dtypes,
// shapes in file order; effects/manifest.h) is computed for the fold to compare with the declared
// one, and every engine worker's GPU UUID (the worker extension's rc_device_info) is among the
// file's `gpu_uuids` (vLLM looks its handle up by that UUID and checks nothing else). Refused
// when the extension does not answer: nothing else could tell the handles reach this engine.
//
// Transfer: the file and the GPUs again (a file rewritten since the preflight must still hold the
// declared manifest and name every engine GPU), /init_weight_transfer_engine {"init_info": {}}
// once per engine, then /start_weight_update, /update_weights (the handles),
// /finish_weight_update + the label. Preflight keeps no state: /v1/manifest calls it while an
// update may run.
//   kNone      the file cannot be read or no longer holds the declared manifest, an engine GPU is
//              not named, the deadline was spent, the init failed, or /start_weight_update
//              provably never reached the engine.
//   kPossible  any other failure once /start_weight_update may have reached it (vLLM moves every
//              layer to the meta device at start, so from then on the weights are in pieces), a
//              start refused for a weight session someone else left open included (only a
//              restore finishes such a session: StaleSession).
//   kComplete  start, update and finish answered 2xx (acknowledged = true).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "effects/manifest.h"
#include "effects/transfer.h"
#include "statemachine/status.h"

namespace rc::effects {

inline constexpr char kVllmIpcScheme[] = "vllm-ipc:";
inline constexpr char kVllmIpcFormat[] = "rolloutcore-vllm-ipc";
inline constexpr std::size_t kVllmIpcFileBytesMax = std::size_t{64} << 20;
inline constexpr std::size_t kVllmIpcUuidsMax = 1024;  // GPUs one file may name

// One parsed weight-source file.
struct VllmIpcFile {
  Manifest manifest;                   // names, dtypes, shapes in file order
  std::vector<std::string> gpu_uuids;  // sorted, unique
  nlohmann::json update_info;          // what /update_weights receives (unpacked)
  std::string content_sha256;          // of the file's bytes
};

// "vllm-ipc:/path" -> "/path" (an absolute, normal path); InvalidArgument otherwise.
[[nodiscard]] Result<std::string> VllmIpcPath(const std::string& source_uri);
// Pure: the file's text -> its parsed form. Never quotes the file's content in an error.
[[nodiscard]] Result<VllmIpcFile> ParseVllmIpcFile(const std::string& text);
// Reads (bounded by kVllmIpcFileBytesMax) and parses the file behind a vllm-ipc: URI. Only a
// regular file is read: a FIFO, socket or device at the path is refused without waiting on it.
[[nodiscard]] Result<VllmIpcFile> ReadVllmIpcFile(const std::string& source_uri);

class IpcTransfer final : public WeightTransfer {
 public:
  explicit IpcTransfer(EngineClient& client) : client_(client) {}

  PreflightObserved Preflight(const TransferTarget& target) override;
  TransferObserved Transfer(const TransferTarget& target, std::uint64_t deadline_ms) override;

  using StepFailed = TransferStepFailed;

 private:
  // Why the engine's workers cannot open these handles ("" when every worker's GPU is named).
  std::string DeviceMismatch(const VllmIpcFile& file, const CallOptions& o);
  std::optional<StepFailed> InitializeOnce(std::uint64_t deadline_at_ms);
  std::optional<StepFailed> RunUpdate(const TransferTarget& target, std::uint64_t deadline_at_ms,
                                      TransferObserved& out);

  EngineClient& client_;
  // The engine process /init_weight_transfer_engine ran on; "" until then, or when its read
  // failed (initialized again). Touched by Transfer only (the runner's one thread).
  std::string initialized_on_;
};

}  // namespace rc::effects
