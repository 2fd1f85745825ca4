// The weight transfer, as the runner sees it: a preflight that changes nothing, then one
// transfer that drives vLLM's start/update/finish sequence and the data plane. Implementations:
// a GPU-free one (HTTP sequence only; tests, demo) and the NCCL sender (effects/nccl/).
#pragma once

#include <cstdint>
#include <string>

#include "statemachine/events.h"
#include "statemachine/types.h"

namespace rc::effects {

struct TransferTarget {
  std::string update_id;
  WeightVersion target;     // target.label goes into /finish_weight_update
  WeightIdentity identity;  // declared; preflight compares its manifest with the source's
  std::string source_uri;   // "safetensors:/path", "ipc:/path/to/handles.json", "synthetic:..."
  // A restore of a TAINTED engine (UpdatePlan::restore). Only a restore may finish a weight
  // session it finds open (StaleSession::kFinish): on an engine trusted to hold its committed
  // version, an open session is someone else's and the transfer fails as a possible mutation.
  bool restore = false;
};

// A step that ended a transfer short: how far the engine may have changed, and why (each
// transfer's Transfer() turns it into the TransferObserved the fold classifies).
struct TransferStepFailed {
  MutationClass mutation = MutationClass::kNone;
  std::string error;
  bool foreign_session = false;  // TransferObserved::foreign_session
};

class WeightTransfer {
 public:
  virtual ~WeightTransfer() = default;
  // Checks before any mutation: computes the source's manifest digest, checks the sender's CUDA
  // device and staging memory. Sends nothing to the engine.
  virtual PreflightObserved Preflight(const TransferTarget& target) = 0;
  // /start_weight_update, /update_weights (concurrently with the data plane),
  // /finish_weight_update {"weight_version": target.label}. Must return by deadline_ms (a
  // duration from the call) and classify what may have changed: MutationClass::kNone only when
  // nothing can have reached the engine.
  virtual TransferObserved Transfer(const TransferTarget& target, std::uint64_t deadline_ms) = 0;
};

}  // namespace rc::effects
