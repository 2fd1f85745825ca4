// What serve does with an engine before it drives it, for one engine or each engine of a fleet:
// wait until it answers GET /version, make the weight transfer its version speaks, and tell it
// the GPU-free transfer's rendezvous.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "effects/http/engine_client.h"
#include "effects/runner.h"
#include "effects/http/protocol.h"
#include "effects/transfer.h"
#include "service/config.h"
#include "statemachine/status.h"

namespace rc::service {

// Startup: GET /version is tried this often, and the wait logged this often, until it answers.
inline constexpr std::uint64_t kEngineWaitPollMs = 250;
inline constexpr std::uint64_t kEngineWaitLogMs = 5000;

effects::PackingParams PackingOf(const ServeConfig& config);
// The deadlines of the client the runner and the transfer drive an engine with.
effects::EngineDeadlines ControlDeadlines(const ServeConfig& config);
// The runner's options (one engine's, or each fleet member's).
effects::RunnerOptions RunnerOptionsOf(const ServeConfig& config);

struct EngineVersionWait {
  Status status;
  std::string version;  // the engine's, once it answered
};

// Polls GET /version until the engine at `url` answers with a version string, logging progress
// every kEngineWaitLogMs, for at most startup_timeout_ms; then fails saying what the last
// attempt saw.
EngineVersionWait WaitForEngineVersion(effects::EngineClient& client, const std::string& url,
                                       std::uint64_t startup_timeout_ms);

// The version string of a GET /version answer, or nullopt.
std::optional<std::string> VersionOf(const effects::HttpReply& reply);

// A transfer for an engine that is not driven any more (a retiring one that did not answer):
// its preflight refuses with `why`, and its transfer sends nothing (MutationClass::kNone).
std::unique_ptr<effects::WeightTransfer> MakeRefusingTransfer(std::string why);

// The GPU-free weight transfer (`transfer` http, ipc or reload) for an engine of `version`;
// Unavailable when no protocol line of this build speaks that version (http only).
[[nodiscard]] Result<std::unique_ptr<effects::WeightTransfer>> MakeGpuFreeTransfer(
    const ServeConfig& config, effects::EngineClient& client, const std::string& version);

// The GPU-free transfer has no data plane, but the engine still needs its weight-transfer engine
// initialised (rendezvous recorded, no NCCL peer joins). Best effort: a failure is logged and
// surfaces as a refused update, never as a silent success.
void InitHttpWeightTransfer(effects::EngineClient& client, const effects::EngineProtocol& protocol,
                            const ServeConfig& config);

}  // namespace rc::service
