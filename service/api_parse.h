// The trainer API's request-body parsers and validation (POST /v1/updates, POST /v1/rollouts,
// DELETE /v1/rollouts/{id}, POST /v1/rollouts/{id}/lease), as the route handlers run them: a
// malformed body is an InvalidArgument Status (a 400, nothing journaled), never an exception.
// Separate from service.cc so that tests and fuzz targets run the exact same code.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "statemachine/events.h"
#include "statemachine/status.h"

namespace rc::service {

// Who reads a source's files: the executor (NCCL and HTTP transfers: the file must be readable
// here) or the engine (the reload transfer: only the syntax is checked here, the engine's
// preflight reads the files).
enum class SourceReader : std::uint8_t { kExecutor = 0, kEngine = 1 };

// A source URI from a client, checked before anything is journaled or the engine touched: a bad
// one is a 400 with zero journal events. Messages name the URI (escaped), never file contents.
Status ValidateSource(const std::string& uri, SourceReader reader = SourceReader::kExecutor);

// POST /v1/updates: the already-parsed JSON object.
Result<UpdateRequested> ParseUpdate(const nlohmann::json& body,
                                    SourceReader reader = SourceReader::kExecutor);
// POST /v1/updates: the raw body (not JSON, not an object, or ParseUpdate's refusal).
Result<UpdateRequested> ParseUpdateBody(const std::string& body,
                                        SourceReader reader = SourceReader::kExecutor);

// POST /v1/fleet/updates: ParseUpdate's fields, plus "mode" ("all" or "rolling", default all),
// "batch_max" (rolling: members updating at once, 1..kFleetEnginesMax, default 1) and
// "min_healthy" (members needed, else refused as a whole: 0..kFleetEnginesMax, default 1).
Result<FleetUpdateRequested> ParseFleetUpdateBody(const std::string& body,
                                                  SourceReader reader = SourceReader::kExecutor);
// POST /v1/fleet/updates/{id}/cancel: {"reason"?} (an empty body is allowed).
Result<std::string> ParseFleetCancelBody(const std::string& body);

// POST /v1/restores: {"restore_id", "label", "source"?, "adopt"?} — exactly one of a source and
// adopt: true.
Result<RestoreRequested> ParseRestoreBody(const std::string& body,
                                          SourceReader reader = SourceReader::kExecutor);

// POST /v1/sleep: {"sleep_id", "level": 1|2}. POST /v1/wake: {"wake_id"}.
Result<SleepRequested> ParseSleepBody(const std::string& body);
Result<WakeRequested> ParseWakeBody(const std::string& body);

// POST /v1/rollouts: {"rollout_id"?, "wait_ms"?, "lease_ms"?} ("" allowed: all defaults).
struct AdmitBody {
  std::string rollout_id;  // "" = the executor names it
  std::int64_t wait_ms = 0;
  std::int64_t lease_ms = 0;
};
// Ids serve generates for its rollouts begin with this. A client's own id may not: every answer
// shows a generated id, so a client could otherwise take the ids serve is about to give others.
inline constexpr std::string_view kGeneratedRolloutIdPrefix = "px-";
[[nodiscard]] Status CheckClientRolloutId(const std::string& id);

Result<AdmitBody> ParseAdmitBody(const std::string& body, std::uint64_t admit_wait_ms,
                                 std::uint32_t rollout_lease_ms);

// DELETE /v1/rollouts/{id}: {"outcome"?, "prompt_tokens"?, "completion_tokens"?}.
struct FinishBody {
  RolloutOutcome outcome = RolloutOutcome::kCompleted;
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;
};
Result<FinishBody> ParseFinishBody(const std::string& body);

// POST /v1/rollouts/{id}/lease: an empty body or {}.
Status ParseLeaseBody(const std::string& body);

}  // namespace rc::service
