// The NCCL weight transfer `serve --transfer nccl` drives: one communicator per engine (the
// sender, rank 0 on cuda_device; the engine's workers after it), for one engine or for each
// member of a fleet. Every member's sender lives on the same device, so a fleet pays the
// sender's link once per member (docs/fleet.md says when that trade is right). A build without
// CUDA and NCCL has none: CheckNcclDevice says so before anything is opened.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "effects/http/engine_client.h"
#include "effects/transfer.h"
#include "service/config.h"
#include "statemachine/status.h"

namespace rc::service {

// Whether `transfer nccl` can run here: a CUDA build and a usable config.cuda_device (made
// current on the calling thread). OK for any other transfer.
[[nodiscard]] Status CheckNcclDevice(const ServeConfig& config);

// The engine one sender serves, as the startup log and errors name it.
struct NcclEngine {
  std::string name;  // "" for the engine of a one-engine serve
  std::string url;
  HostPort rendezvous;  // port 0: a fresh ephemeral port on every init
};

struct NcclTransfer {
  std::unique_ptr<effects::WeightTransfer> transfer;
  // The rendezvous with the engine (its communicator), once the journal is recovered or
  // bootstrapped; bounded by config.nccl_init_timeout_ms.
  std::function<Status()> init;
};

// Requires CheckNcclDevice(config) to have passed; `engine` and `config` outlive the result.
NcclTransfer MakeNcclTransfer(effects::EngineClient& engine, const ServeConfig& config,
                              NcclEngine target);

}  // namespace rc::service
