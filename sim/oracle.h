// The simulator's judgements of a pending re-verification (State::engine_recheck) and of a
// SLEEPING fold, as functions of what they judge: the worlds apply them as they run, tests/sim
// applies them to states the real fold reached. Each reads the contract's rule on the look's own
// fields (the process, label and pause it reports, whether its weight digest was read), not the
// fold's predicates, so a fold or an executor that breaks the rule is told apart from one that
// keeps it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sim/engine.h"
#include "statemachine/history.h"
#include "statemachine/state.h"

namespace rc::sim {

// One monitor look (journaled or not) against the state it was taken in; `m.updates_seen` must
// name that state's epoch. `judged`: a re-verification was pending and the fold would record the
// look (a look it refuses, stale or mid-effect, changes nothing).
struct LookJudgement {
  bool judged = false;
  bool cleared = false;  // the fold, given this look, no longer awaits the re-verification
  bool unread = false;   // the look carries no weight digest
  bool vouched = false;  // it names the verified process, the committed label, the pause expected
  std::string broken;    // the rule it breaks ("" when none)
};
// The rules: the executors' predicate look_clears_recheck (by which they journal a look) says
// exactly what the fold then does; under rules 1 (a digest committed) a look without a digest
// never clears the re-verification, and one that vouches with the committed digest does; under
// rules 0 one that vouches clears it without a digest.
LookJudgement JudgeMonitorLook(const State& s, const EngineMonitored& m);

// What a journal's looks did to pending re-verifications (probes, looks before a plan, monitor
// looks alike).
struct RecheckHistoryCounts {
  std::uint64_t clears = 0;                // looks that cleared a pending re-verification
  std::uint64_t unread_kept = 0;           // vouched, read no digest, left it pending (rules 1)
  std::uint64_t rules0_unread_clears = 0;  // read no digest and cleared it (rules 0)
};
// The same rules over a whole history folded from its first record, and with them: no admission
// while a re-verification is pending; every publish carries the digest VALIDATING saw when one is
// in use; the rules the journal reached READY under never change. The first broken rule ("" when
// none); a record the fold refuses ends the walk (the history checker names it).
std::string CheckRecheckHistory(const std::vector<HistoryEntry>& history,
                                RecheckHistoryCounts* counts);

// A SLEEPING fold against the engine's truth. `judged` false while the fold cannot know yet: the
// engine is down or recorded unreachable, or a new process came up, someone outside acted on the
// engine, or the executor (whose monitor watches) came back — the latter two at `outside_us` —
// less than `grace_us` ago. A pending re-verification changes nothing
// here: the monitor compares process, label and pause whether or not one is pending, and no look
// of a sleeper reads the weights, which are all a re-verification adds.
struct SleeperJudgement {
  bool judged = false;
  std::string mismatch;  // "" when the engine is the sleeper the fold records
};
SleeperJudgement JudgeSleeper(const State& s, const SimEngine& e, std::int64_t now_us,
                              std::int64_t outside_us, std::int64_t grace_us);

}  // namespace rc::sim
