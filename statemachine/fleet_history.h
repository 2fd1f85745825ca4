// The fleet's history checker: re-verifies a recorded fleet history (a fleet journal's entries)
// against the fleet fold and, engine by engine, against the single-engine contract.
//
// Input: entries in seq order, each {seq, cause_seq, engine, event}, grouped as the journal
// writes them (an input, then the events decide derived from it, naming its seq). Two passes:
//   1. the fleet: every group's recorded decisions must equal fleet_decide(fleet before, input),
//      every event must apply, and the fleet's invariants must hold after every group;
//   2. each engine (each life of an engine name: removed and joined again is a new life): the
//      projection of its own events is a single-engine history, checked by check_history, so
//      every per-engine rule (no rollout spans two versions, nothing published unvalidated, ...)
//      holds for every engine of the fleet.
// The first violation is reported by seq, with the engine it belongs to.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "statemachine/fleet.h"
#include "statemachine/history.h"

namespace rc {

struct FleetHistoryEntry {
  std::uint64_t seq = 0;
  std::uint64_t cause_seq = 0;  // 0: an input; else the seq of the input it was derived from
  std::string engine;           // "" for a fleet event and for the one unnamed engine
  Event event;
};

struct FleetHistoryReport {
  bool ok = true;
  std::uint64_t first_bad_seq = 0;  // 0 when ok
  std::string message;              // empty when ok
  FleetState state;                 // the fold up to the first refused event (pass 1)
  // Per engine life: {name, 1} for the first, {name, 2} after it left and joined again.
  std::map<std::pair<std::string, std::uint32_t>, HistorySummary> engines;
  std::map<FleetOutcome, std::uint64_t> fleet_updates;  // ended, by outcome
};

[[nodiscard]] FleetHistoryReport check_fleet_history(const std::vector<FleetHistoryEntry>& history);

}  // namespace rc
