// The NCCL weight transfer `serve --transfer nccl` drives: one communicator per engine (the
// sender, rank 0 on cuda_device; the engine's workers after it), for one engine or for each
// member of a fleet. Every member's sender lives on the same device, so a fleet pays the
// sender's link once per member (docs/fleet.md says when that trade is right). A build without
// CUDA and NCCL has none: CheckNcclDevice says so before anything is opened.
#pragma once

#include <cstdint>
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

// How the log and errors name a sender's engine: its name, URL, device, rendezvous and deadline,
// every piece of outside text escaped (one line whatever the configuration holds).
std::string DescribeNcclEngine(const NcclEngine& engine, const ServeConfig& config);
// The startup log's record of a sender ready with an engine (`described` as DescribeNcclEngine
// says it): the engine's own protocol line (its GET /version) escaped, so that an engine cannot
// split the record or forge another.
std::string NcclReadyLine(const std::string& described, const std::string& protocol_version,
                          const std::string& rendezvous_mode, std::uint16_t store_port,
                          std::uint64_t abort_reserve_ms);

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
