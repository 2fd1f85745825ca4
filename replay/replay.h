// Replay: refold a journal, re-verify every recorded decision, verify the hash chain, and
// explain TAINTED incidents from the evidence that led to them.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "journal/journal.h"
#include "journal/recorded_torn_tails.h"
#include "statemachine/fleet.h"
#include "statemachine/state.h"

namespace rc::replay {

struct ReplayOptions {
  // 0: the whole journal. Otherwise the fold ends with the decision group that holds this seq
  // (see FoldEnd); a seq past the journal's head is InvalidArgument.
  std::uint64_t until_seq = 0;
};

// Where a fold asked to stop at a seq stops. An input and the decisions decide() derived from it
// are one group, appended in one batch: no reader ever saw a state between its records, and
// decide()'s decisions can only be compared whole. A seq inside a group (its input, or any record
// before its last decision) therefore folds through the end of that group, which includes it.
struct FoldEnd {
  std::uint64_t requested = 0;  // the seq asked for; 0: the whole journal
  std::uint64_t input_seq = 0;  // the input of the group that holds it; 0: unknown or none asked
  std::uint64_t end_seq = 0;    // the last record the fold visits; 0: the head
};
// Reads forward from `until_seq` to the end of its group (point reads: the fold's scan verifies
// them). A record that cannot be read there ends the span on it, so the scan meets and reports
// it. InvalidArgument when `until_seq` lies past the journal's head.
[[nodiscard]] Result<FoldEnd> ResolveUntil(journal::Journal& journal, std::uint64_t until_seq);

// One TAINTED incident: the update's records from its request to the taint, and a reading.
struct TaintIncident {
  std::string engine;  // "" in a journal of one engine
  std::uint64_t taint_seq = 0;
  std::string update_id;
  std::vector<journal::Record> timeline;
  std::string explanation;
};

// One restore that brought a TAINTED engine back: what it restored, the proof, the taint it ended.
struct RestoreProof {
  std::string engine;
  std::uint64_t publish_seq = 0;
  std::string restore_id;
  std::string explanation;
};

// Colocated mode, one line each: a sleep, a wake-up, or an update or restore that woke a sleeping
// engine: what it asked, the device memory the engine's workers reported around /sleep and
// /wake_up, and how it ended. Sleeps and wake-ups keep the committed version: never updates.
struct ColocatedStep {
  std::string engine;
  std::uint64_t request_seq = 0;
  std::uint64_t end_seq = 0;  // the transition that ended it; 0: in flight where replay stopped
  std::string plan_id;
  std::string kind;  // "sleep", "wake-up", "update from sleep", "restore from sleep"
  std::string line;  // escaped: one line whatever the journal holds
};
// The last ones are kept (a trainer sleeps once per step); colocated_count stays exact.
inline constexpr std::size_t kColocatedStepsMax = 1024;

using journal::kRecordedTornTailsMax;
using journal::RecordedTornTail;  // journal/recorded_torn_tails.h

struct ReplayReport {
  FleetState fleet;           // folded at until_seq (or head); a journal of one engine holds ""
  State state;                // the unnamed engine's state (empty for a fleet of named engines)
  std::uint64_t records = 0;  // records visited
  std::uint64_t inputs = 0;   // inputs whose decisions were re-derived
  std::uint64_t last_seq = 0;
  FoldEnd until;   // what ReplayOptions::until_seq asked for, and where the fold ended for it
  bool ok = true;  // chain verified, every record legal, decisions reproduced
  std::uint64_t first_bad_seq = 0;
  std::string error;  // what is wrong at first_bad_seq
  // The journal's own error while it was read (Corruption: damaged; IOError: unreadable), kOk
  // when every record was read: a damaged journal explains nothing, whatever else the report says.
  Code read_failure = Code::kOk;
  std::vector<TaintIncident> incidents;
  std::vector<RestoreProof> restores;
  std::deque<ColocatedStep> colocated;  // the last kColocatedStepsMax, in journal order
  std::uint64_t colocated_count = 0;
  // Torn WAL tails the records say an open found (a journal-level incident, whatever `ok` says:
  // `rolloutcore replay` fails its verdict on one, as on a torn tail its own open finds).
  std::vector<RecordedTornTail> torn_tails;  // the first kRecordedTornTailsMax, in journal order
  std::uint64_t torn_tails_count = 0;
};

// Streams the journal once. Never fails on bad content: a broken chain, an illegal record or a
// decision that decide() does not reproduce is reported in the report (ok=false, first_bad_seq).
// Fails only when the journal cannot be read at all, or until_seq lies past its head
// (InvalidArgument: a usage error, never a verification failure).
[[nodiscard]] Result<ReplayReport> Replay(journal::Journal& journal, const ReplayOptions& options);

// Text output: every string taken from the journal is escaped (rc::text::escape_line), so each
// report line is one line whatever the records hold, and the verdict line is always present.
// `journal_failure` (a torn WAL tail found at this open, already one line) fails a verdict the
// records alone would pass: the verdict line is decided here, never found in the text, which
// holds the journal's own strings.
std::string FormatReport(const ReplayReport& report, const std::string& journal_failure = "");
// JSON output; strings keep their content, invalid UTF-8 becomes U+FFFD (never throws).
std::string ReportJson(const ReplayReport& report);

// One record as one line for `replay --events`: "%8llu [  -> ]<escaped describe(event)>".
std::string FormatRecordLine(const journal::Record& r);
// One record as one line of JSON (RecordToJson, serialised without throwing).
std::string RecordJsonLine(const journal::Record& r);

}  // namespace rc::replay
