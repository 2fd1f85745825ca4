// JSON views of records, events and states (nlohmann::json), for `rolloutcore replay --json` and
// the service API. Enums are written by name (the *_name functions in statemachine); hashes as hex.
// Output only: JSON is never parsed back into the journal.
#pragma once

#include <nlohmann/json.hpp>

#include "journal/journal.h"
#include "statemachine/events.h"
#include "statemachine/state.h"

namespace rc::journal {

// {"type": "<event_name>", "family": "input|binding|decision", ...every field...}
nlohmann::json EventToJson(const Event& event);
// {"seq", "wall_time_ms", "cause_seq", "prev_hash", "hash", "event": {...}}
nlohmann::json RecordToJson(const Record& record);
// Every field of rc::State; absent optionals are null; active rollouts as an object by id.
nlohmann::json StateToJson(const State& state);
// A fleet: {"engines": {id: {"generation", "state"}}, "leaving", "policy", "generations",
// "update" (null when none), "fleet_updates_ended", "removed" (removed engines' counters, added
// up), "events"}.
nlohmann::json FleetStateToJson(const FleetState& fleet);

nlohmann::json WeightVersionToJson(const WeightVersion& v);
nlohmann::json WeightIdentityToJson(const WeightIdentity& id);
nlohmann::json HttpEvidenceToJson(const HttpEvidence& h);
nlohmann::json WeightDigestToJson(const WeightDigest& d);  // null when there is none

}  // namespace rc::journal
