// The history checker: re-verifies a recorded event history against the fold and the contract.
//
// Input: the journal's entries in seq order, each {seq, cause_seq, event}; cause_seq is 0 for an
// input (or a client binding) and the input's seq for every event decide() derived from it, which
// immediately follow their input. The checker folds from an empty State and reports the FIRST
// violation (its seq and a message): an illegal event, recorded decisions that differ from
// decide(state before the input, input), derived events without their input, a rollout that
// spans two versions, a publish without VALIDATING having seen the label, a transfer intent while
// a binding is active, an admission outside READY, or anything but RecoveryStarted after TAINTED;
// in colocated mode, a transfer into weights still asleep, or READY with the KV cache asleep.
// Used by `rolloutcore replay` and the audit. Standard library only, like the rest of the fold.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "statemachine/events.h"
#include "statemachine/state.h"

namespace rc {

struct HistoryEntry {
  std::uint64_t seq = 0;        // dense in the journal; here strictly increasing and > 0
  std::uint64_t cause_seq = 0;  // 0: an input; else the seq of the input it was derived from
  Event event;
};

// Rollouts bound to one committed generation.
struct VersionRollouts {
  std::string label;
  std::uint64_t admitted = 0;
  std::uint64_t finished = 0;  // completed, aborted or abandoned
};

struct HistorySummary {
  std::uint64_t entries = 0;  // entries checked (up to and excluding the first bad one)
  std::uint64_t inputs = 0;
  std::uint64_t updates_requested = 0;
  std::uint64_t updates_committed = 0;
  std::uint64_t updates_refused = 0;
  std::uint64_t updates_tainted = 0;
  std::uint64_t recoveries = 0;
  std::uint64_t restores_requested = 0;  // their ends count with the updates' outcomes
  std::uint64_t sleeps_requested = 0;    // colocated sleeps and wake-ups: their ends count here,
  std::uint64_t sleeps_committed = 0;    // not with the updates'
  std::uint64_t wakes_requested = 0;
  std::uint64_t wakes_committed = 0;
  std::map<std::uint64_t, VersionRollouts> rollouts_by_generation;
};

struct HistoryReport {
  bool ok = true;
  std::uint64_t first_bad_seq = 0;  // 0 when ok
  std::string message;              // empty when ok
  HistorySummary summary;
  State state;  // the fold after the last accepted group
};

[[nodiscard]] HistoryReport check_history(const std::vector<HistoryEntry>& history);

}  // namespace rc
