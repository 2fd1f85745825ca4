// Offline audit of a journal: integrity, lifecycle history invariants, provenance of every
// rollout, and re-verification of recorded token/logprob trajectories against an engine.
//
// Everything here reads; nothing writes to the journal or changes the engine (the
// re-verification sends ordinary scoring requests: prompt_logprobs over prompt + output).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "journal/journal.h"
#include "journal/recorded_torn_tails.h"
#include "statemachine/fleet.h"
#include "statemachine/history.h"
#include "statemachine/state.h"

namespace rc::audit {

// A committed generation and where it came from.
struct VersionRecord {
  WeightVersion version;
  WeightIdentity identity;
  std::string update_id;            // empty for the bootstrap generation
  bool restore = false;             // published by a restore with proof, not by an update
  std::uint64_t published_seq = 0;  // seq of the VersionPublished (or of the bootstrap READY)
  std::uint64_t rollouts_admitted = 0;
  std::uint64_t rollouts_finished = 0;
};

// A rollout the audit names: suspect (it may have been served by an engine other than the
// verified one), or informational (it ended expired or abandoned).
struct RolloutNote {
  std::string rollout_id;
  WeightVersion version;  // the version it was bound to
  std::uint64_t admitted_seq = 0;
  std::uint64_t finished_seq = 0;  // 0: no finish in the journal
  std::int64_t finished_wall_ms = 0;
  std::string why;  // raw; escaped when printed
};

// Bounds on what the audit keeps per list; the counts stay exact past them.
inline constexpr std::size_t kRolloutNotesMax = 1u << 16;
// How many rollouts of each list the text report prints before "... and N more".
inline constexpr std::size_t kReportRolloutsMax = 20;

// Whether the engine still serves what the journal committed. A READY->TAINTED taint (the
// monitor or a post-restart probe saw another process, another label, or a pause), or a
// SLEEPING->TAINTED one, opens a window [window_start_wall_ms, taint]: rollouts active at the
// taint or finished inside the window may have been served by the other engine.
struct EngineHealth {
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  bool tainted = false;
  std::uint64_t taint_seq = 0;  // the StateChanged ->TAINTED
  std::int64_t taint_wall_ms = 0;
  Cause taint_cause = Cause::kTransferAmbiguous;
  Lifecycle taint_from = Lifecycle::kUninitialized;
  std::string taint_detail;  // raw
  // The plan the taint struck ("update", "restore", "sleep" or "wake-up") and its id; both empty
  // for a taint of the engine itself (in READY or SLEEPING). Sleeps and wake-ups keep the
  // committed version: they are never counted or named as updates.
  std::string taint_plan;
  std::string taint_update_id;
  bool window_known = false;  // a READY or SLEEPING taint: the window applies
  std::int64_t window_start_wall_ms = 0;
  std::string window_source;         // what the window start was taken from (fixed text)
  std::vector<RolloutNote> suspect;  // first kRolloutNotesMax, in admission order
  std::uint64_t suspect_count = 0;
  std::vector<RolloutNote> expired;  // informational: the lease lapsed
  std::uint64_t expired_count = 0;
  std::vector<RolloutNote> abandoned;  // informational: the client vanished (executor restart)
  std::uint64_t abandoned_count = 0;
  // UpdateEnded{tainted} with no ->TAINTED transition in its group (raw messages naming the seq).
  std::vector<std::string> unexplained_taints;
  // Taints a restore with proof ended (READY again): one line each, first kRolloutNotesMax. The
  // fields above then describe the last taint still open, if any; suspects stay suspect.
  std::vector<std::string> restored;
  std::uint64_t restored_count = 0;
  bool finishes_truncated = false;  // more than kRolloutNotesMax finishes in one READY period
};

// One engine of a fleet's journal, as AuditReport's own fields are for a journal of one engine.
// An engine that left and joined again is one entry: its versions and health span its lives.
struct EngineAudit {
  std::vector<VersionRecord> versions;  // by its own generation numbers
  State state;                          // empty once removed
  bool removed = false;
  EngineHealth health;
};

using journal::kRecordedTornTailsMax;
using journal::RecordedTornTail;  // journal/recorded_torn_tails.h

struct AuditReport {
  bool ok = true;  // the journal is intact (see Verdict for the engine)
  std::vector<std::string>
      failures;  // each names a seq where one applies (raw; escaped when printed)
  std::uint64_t records = 0;
  bool chain_ok = true;      // decode, contiguity, SHA-256 chain (Journal::Scan)
  bool checksums_ok = true;  // RocksDB block checksums of every file
  HistoryReport history;     // lifecycle invariants and decision re-derivation
  // A journal of one engine: its versions, state and health.
  std::vector<VersionRecord> versions;
  State state;
  EngineHealth engine;
  // A journal of named engines (a fleet): `history` is the fleet's check (statemachine/
  // fleet_history.h; its summary sums the engines'), and each engine life is audited on its own,
  // keyed by its name ("e"), or "e (life 2)" after it left and joined again. `engine` is unused
  // (null in VerdictJson: read "engines").
  bool fleet = false;
  std::map<std::string, EngineAudit> engines;
  std::map<FleetOutcome, std::uint64_t> fleet_updates;  // ended, by outcome
  // Torn WAL tails the records say an open found; each kept one is also in `failures`.
  std::vector<RecordedTornTail> torn_tails;  // the first kRecordedTornTailsMax, in journal order
  std::uint64_t torn_tails_count = 0;
};

// Reads the whole journal once, and the rollout index of each rollout it names (a record not
// listed under its rollout, or a listed seq whose record does not name it, is a failure). Holds
// one history entry per record (a trajectory part's without its tokens) and the index seqs of
// the rollouts open at one time. Fails only when it cannot be read at all; every finding lands
// in the report.
[[nodiscard]] Result<AuditReport> AuditJournal(journal::Journal& journal);

// Where one rollout came from: its binding, its end, and the update that published its version.
struct RolloutProvenance {
  std::string rollout_id;
  std::string engine;  // the engine it was admitted to ("" in a journal of one engine)
  RolloutAdmitted binding;
  std::uint64_t admitted_seq = 0;
  std::optional<RolloutFinished> finish;
  std::uint64_t finished_seq = 0;
  VersionRecord version;  // the generation the rollout ran under
};
// Reads the rollout index's seqs for `rollout_id` and scans the journal against them: each must
// hold a record naming the rollout, and each record naming it must be listed (Corruption naming
// the seq otherwise); NotFound when neither the index nor any record names it.
[[nodiscard]] Result<RolloutProvenance> Provenance(journal::Journal& journal,
                                                   const std::string& rollout_id);

// `s` between single quotes, each quote inside doubled (`it's` is 'it''s'): a rollout id, label
// or other outside text in a report line or finding, so that no quote inside it can close the
// field and forge the rest of the line ("REVERIFY 'a'': OK...': FAILED" is rollout "a': OK...").
// Raw otherwise: the line that holds it is escaped (text::escape_line), which leaves quotes be.
std::string Quoted(std::string_view s);

// A recorded trajectory (the proxy writes them; see service/trajectories.h for the format).
struct Trajectory {
  std::string rollout_id;
  std::uint64_t admission_seq = 0;
  WeightVersion version;
  WeightIdentity identity;
  std::vector<std::int32_t> prompt;
  std::vector<std::int32_t> output;  // choice 0's (the journal's parts hold choice 0 only)
  std::vector<std::optional<double>> logprobs;  // per output token, when it was recorded
  // Read from a trajectories file's line only (a journal's trajectory leaves them as they are):
  std::size_t line_no = 0;
  std::string engine;                   // the fleet engine that admitted it ("" of one engine)
  std::uint64_t fleet_generation = 0;   // that engine's fleet generation at the admission
  bool truncated = false;               // the writer kept less than the engine sent
  std::size_t choices = 0;              // choices the line holds, each with its own index
  bool has_choice0 = false;             // one of them is index 0 (`output` is its tokens)
  bool other_tokens = false;            // a choice other than 0 holds token ids
  std::uint64_t output_tokens_all = 0;  // token ids of every choice together
  // What the line says of the rollout's end (each absent when the line does not say it); serve
  // writes them from the values it journals in the rollout's RolloutFinished.
  std::optional<std::string> outcome;
  std::optional<std::uint64_t> prompt_tokens;
  std::optional<std::uint64_t> completion_tokens;
};

// Trajectories one audit re-verifies: all of a trajectories file (a longer file is refused), or
// the most recent of a journal's (a journal may hold any number: see JournalTrajectories).
inline constexpr std::size_t kTrajectoriesMax = 1u << 20;
inline constexpr std::size_t kTrajectoryTokensMax = 1u << 20;
// One line of a trajectories file, at most: the writer's own bound (service/trajectories.h drops
// a longer line, never writes it), so every line it wrote is read and nothing longer is buffered.
inline constexpr std::size_t kTrajectoryLineBytesMax = std::size_t{16} << 20;

// What the audit joins of one rollout's trajectory: at most its writer's bounds
// (service/proxy_stream.h JournalTrajectoryParts: kTrajectoryPartsMax parts of at most
// kTrajectoryTokensPerRecordMax tokens each). Each output token is joined with one logprob slot
// (a 16-byte std::optional<double> for the journal's 4-byte float), never more, so the token bound
// bounds the logprobs too: one joined trajectory holds at most about 20 bytes per token, 20 MiB.
inline constexpr std::size_t kTrajectoryPartsPerRolloutMax =
    kTrajectoryTokensMax / kTrajectoryTokensPerRecordMax + 1;
inline constexpr std::size_t kTrajectoryTokensPerRolloutMax =
    kTrajectoryPartsPerRolloutMax * kTrajectoryTokensPerRecordMax;  // prompt and output together

// The per-rollout bounds a read of a journal's trajectories applies: the ones above, smaller only
// in tests.
struct RolloutTrajectoryBounds {
  std::size_t parts_per_rollout_max = kTrajectoryPartsPerRolloutMax;
  std::size_t tokens_per_rollout_max = kTrajectoryTokensPerRolloutMax;
};

// The trajectories a journal offers for re-verification: every one it holds, or, past the bound,
// the most recent `bound` of them. A long run holds more than any bound; that is no damage.
struct JournalTrajectories {
  std::vector<Trajectory> trajectories;  // in the order of their first part, at most the bound
  std::uint64_t total = 0;               // trajectories the journal holds, exact
  bool partial() const { return trajectories.size() < total; }
};

// The journal's trajectories (TrajectoryRecorded parts joined in seq order), each with its
// rollout's binding from the journal; past `bound`, the most recent `bound` (by the seq of their
// first part), and `total` counts them all. Memory holds at most `bound` trajectories, each within
// `per_rollout`, and the rollouts open at one time, whatever the journal's length. Parts out of
// order, of a rollout not admitted or already finished, or past a bound of `per_rollout` (more
// parts or tokens than one rollout's trajectory may hold) are a Corruption naming the seq, the
// rollout and the bound.
[[nodiscard]] Result<JournalTrajectories> SampleTrajectoriesFromJournal(
    journal::Journal& journal, std::size_t bound = kTrajectoriesMax,
    RolloutTrajectoryBounds per_rollout = {});
// All of the journal's trajectories, or Rejected when they are more than kTrajectoriesMax (then
// SampleTrajectoriesFromJournal reads the most recent and counts the rest).
[[nodiscard]] Result<std::vector<Trajectory>> TrajectoriesFromJournal(journal::Journal& journal);

// A line of a trajectories file that holds no trajectory: skipped, counted, and named in the
// report up to kSkippedLinesNamedMax of each kind (the counts stay exact past it).
struct SkippedLine {
  std::size_t line_no = 0;
  std::string why;  // raw; escaped when printed
};
inline constexpr std::size_t kSkippedLinesNamedMax = 5;

// A trajectories file as read: the trajectories its lines hold, and the lines that hold none.
// A torn line is a JSON document cut short (or only zero bytes): what the writer leaves when its
// process dies inside a write, or when a failed write cannot be cut back off the file; it starts
// the next record on a fresh line (service/trajectories.h). A damaged line is any other line that
// holds no trajectory (not JSON, a document cut elsewhere than its end, JSON of another shape):
// the writer never writes one, so something else changed the file.
struct TrajectoriesFile {
  std::vector<Trajectory> trajectories;
  std::uint64_t torn = 0;
  std::uint64_t damaged = 0;
  std::vector<SkippedLine> torn_lines;     // the first kSkippedLinesNamedMax, in file order
  std::vector<SkippedLine> damaged_lines;  // the first kSkippedLinesNamedMax, in file order
  std::uint64_t skipped() const { return torn + damaged; }
};

// Parses a trajectories JSON-lines file as `audit --trajectories` reads it: lines that hold no
// trajectory are skipped and counted (TrajectoriesFile), the rest read; a line over
// kTrajectoryLineBytesMax among them (read past, unstored: torn when all that follows its first
// kTrajectoryLineBytesMax bytes is zeros, else damaged). A read error is IOError; a file
// of more than kTrajectoriesMax lines is InvalidArgument (the file's limit, nothing said of the
// journal).
[[nodiscard]] Result<TrajectoriesFile> ReadTrajectoriesFile(const std::string& path);
// The same, strictly: a line that holds no trajectory is InvalidArgument naming its number (for a
// file that must be whole, e.g. one a test has just had written).
[[nodiscard]] Result<std::vector<Trajectory>> LoadTrajectories(const std::string& path);

// Checks each trajectory's binding against the journal's RolloutAdmitted for that rollout (same
// version, same identity, same admission seq). Returns one failure message per mismatching
// trajectory, naming every field that differs (version.generation, version.label, identity.*)
// with both values: "trajectory 'ID' differs from its binding at seq S: identity.checkpoint is
// 'A' in the trajectory, 'B' in the journal; ...". Raw text, as every finding: escape it whole
// where it is printed (text::escape_line; RenderAudit and the command's MISMATCH lines do).
std::vector<std::string> CrossCheckTrajectories(journal::Journal& journal,
                                                const std::vector<Trajectory>& trajectories);

// A trajectories file held against the journal's own trajectories, which are the authority
// (audit re-verifies the journal's, never the file's). Serve writes a rollout's line only once its
// parts and RolloutFinished are durable, from the values it journaled. Findings (engine findings,
// exit 1), each naming the rollout, its line and the seq it is held against:
// - a line whose prompt ids, choice 0's token ids or its logprobs differ from the journal's parts
//   (logprobs compared as the journal holds them, float32), or that holds choices but no choice 0
//   while the journal holds the trajectory;
// - a line whose engine or fleet_generation is not the admitting record's (a fleet), or that names
//   an engine in a journal of one engine;
// - a line whose outcome, prompt_tokens or completion_tokens (those it gives) differ from its
//   rollout's RolloutFinished, or that holds more prompt or output token ids (all choices) than
//   those counts (the writer's counts are the engine's usage, never below the ids it kept, or the
//   ids it kept);
// - a line of a rollout the journal has not finished at its head, when the line says anything of
//   its end (an outcome, a count, token ids); a line that holds only its binding says nothing the
//   finish vouches for, and its binding is checked (CrossCheckTrajectories);
// - two or more lines for one (rollout_id, admission_seq);
// - a line that holds token ids for a finished rollout the journal recorded no trajectory for,
//   unless the line says `truncated` or holds more tokens than the parts' bound: the writer then
//   journals none (a cut or untrusted trace, or one too long) and its line keeps what it could,
//   within the counts above. Those are notes, not re-verifiable.
// Notes: the journal's trajectories with no line in the file (a torn or damaged line, a line the
// writer dropped, a rotated file: docs/api.md makes the file a convenience copy), counted and
// the first kSkippedLinesNamedMax named. Choices other than 0 are read (one each index) but the
// journal holds none to compare them with (only their count). One scan; memory holds the
// trajectories of rollouts open at one time that have a line, each within `per_rollout`, and one
// flag per line. A rollout whose parts pass a bound of `per_rollout` is a Corruption naming the
// seq, the rollout and the bound (as SampleTrajectoriesFromJournal).
struct FileComparison {
  std::vector<std::string> findings;  // raw
  std::vector<std::string> notes;     // raw
  std::uint64_t differing = 0;        // lines the journal contradicts (each once, however many)
  std::uint64_t missing = 0;          // journal trajectories with no line
};
[[nodiscard]] Result<FileComparison> CompareTrajectoriesFile(
    journal::Journal& journal, const TrajectoriesFile& file,
    RolloutTrajectoryBounds per_rollout = {});

// A trajectories file's counts, as the text report's summary line and --json's
// `trajectories_file` both give them.
struct TrajectoriesFileCounts {
  std::uint64_t trajectories = 0;        // lines that hold one
  std::uint64_t binding_mismatches = 0;  // lines whose binding is not the journal's
  std::uint64_t torn = 0;                // lines skipped as torn (a note)
  std::uint64_t damaged = 0;             // lines skipped as damaged (a finding)
  std::uint64_t contradicted = 0;        // lines the journal contradicts (FileComparison)
  std::uint64_t without_line = 0;        // journal trajectories with no line
};
// "trajectories file: N, binding mismatches: M, lines skipped: K (torn T, damaged D), lines the
// journal contradicts: C, journal trajectories without a line: W" (no newline).
std::string FormatTrajectoriesFileCounts(const TrajectoriesFileCounts& c);

// One rollout re-scored: each output token's logprob as the engine scores it now (prompt_logprobs
// over prompt + output) against the one recorded when it was sampled.
struct ReverifyResult {
  std::string rollout_id;
  double tolerance = 0;      // the largest accepted |recorded - engine| logprob difference
  bool greedy = false;       // the rollout was sampled greedily: each token must be the top-1
  bool checked = false;      // false: skipped (detail says why, e.g. another version served)
  bool ok = false;           // checked, and nothing below counts against it
  std::size_t tokens = 0;    // output tokens the engine scored
  std::size_t compared = 0;  // of those, with a recorded logprob: |diff| computed
  std::size_t top1 = 0;      // of those scored, the engine's top-1 token
  std::size_t not_top1 = 0;  // scored, not the engine's top-1 (fails only if greedy)
  std::size_t logprob_mismatches = 0;  // |diff| > tolerance
  std::size_t unscored = 0;            // output tokens the engine's answer gave no score for
  // Output tokens without a recorded logprob: nothing to compare, so they fail the rollout
  // unless greedy (then the top-1 check verifies them).
  std::size_t unrecorded = 0;
  double max_abs_diff = 0;
  double sum_abs_diff = 0;  // over `compared` tokens
  std::string detail;       // raw (escaped when printed): why skipped, or the figures
  double mean_abs_diff() const { return compared == 0 ? 0 : sum_abs_diff / compared; }
};

// Re-scores prompt + output on an engine that serves the trajectory's version (checked through
// /weight_info) with prompt_logprobs, and compares each output token's logprob with the recorded
// one (|diff| <= tolerance). `greedy` also requires each output token to be the engine's top-1.
// The engine's answer is outside input: any shape is a skip or a count, never an exception. A
// trajectory of more than kTrajectoryTokensPerRolloutMax tokens (prompt and output) is skipped
// before anything is sent, its detail naming the bound: no scoring request is built for it.
ReverifyResult Reverify(effects::EngineClient& engine, const Trajectory& trajectory,
                        double tolerance, bool greedy);

// Every trajectory re-scored: the per-rollout results and their totals.
struct ReverifySummary {
  double tolerance = 0;
  bool greedy = false;
  std::size_t trajectories = 0;  // offered
  // Trajectories their source holds: more than offered when a journal past kTrajectoriesMax
  // offered its most recent ones only (JournalTrajectories::partial).
  std::uint64_t available = 0;
  std::size_t checked = 0;
  std::size_t failed = 0;          // checked, not ok
  std::size_t over_tolerance = 0;  // rollouts with at least one |diff| > tolerance
  std::size_t tokens = 0, compared = 0, top1 = 0;
  double max_abs_diff = 0;
  double sum_abs_diff = 0;
  std::vector<ReverifyResult> rollouts;  // one per trajectory offered (<= kTrajectoriesMax)
  double mean_abs_diff() const { return compared == 0 ? 0 : sum_abs_diff / compared; }
  // Re-verification proved something, and nothing it checked failed. Never true for 0 checked.
  // A partial one that verified is no failure: what it left out is reported, not counted.
  bool verified() const { return checked > 0 && failed == 0; }
  bool partial() const { return available > trajectories; }
};
ReverifySummary ReverifyAll(effects::EngineClient& engine,
                            const std::vector<Trajectory>& trajectories, double tolerance,
                            bool greedy);
// ReverifyAll over a journal's trajectories; `available` is the journal's total.
ReverifySummary ReverifyFromJournal(effects::EngineClient& engine, const JournalTrajectories& from,
                                    double tolerance, bool greedy);

// One line per rollout ("REVERIFY 'ID': OK|FAILED|SKIPPED: figures"), escaped, no newline.
std::string FormatReverify(const ReverifyResult& r);
// The totals in one line, escaped; "NOTHING VERIFIED" when 0 were checked, never "OK" then. A
// partial one ends "; PARTIAL: C of M trajectories re-verified (only the most recent N ...)".
std::string FormatReverifySummary(const ReverifySummary& s, const std::string& engine_url);
// "trajectories in the journal: M" (", the most recent N offered for re-verification" past the
// bound): the count a report prints before re-verifying them.
std::string FormatJournalTrajectories(const JournalTrajectories& t);
// The engine findings of a re-verification (raw; escaped when printed): each failed rollout,
// and "checked 0 of N" when trajectories were offered and none could be checked.
std::vector<std::string> ReverifyFindings(const ReverifySummary& s);
// The summary and every rollout's result as JSON, never throwing on invalid UTF-8.
nlohmann::json ReverifyJson(const ReverifySummary& s);

// The audit's verdict in two parts: is the journal intact, is the engine healthy. Exit codes
// (docs/audit.md):
// The live engine's weight digest against the journal's (`audit --engine`): a digest that is not
// the one recorded for the label the engine reports means something changed the weights outside
// RolloutCore. `line` is the one-line result; each finding is an engine finding.
struct DigestCheck {
  enum class Result : std::uint8_t { kMatch, kDrift, kUnavailable, kNotRecorded };
  Result result = Result::kNotRecorded;
  std::string line;
  std::vector<std::string> findings;
};
[[nodiscard]] DigestCheck CheckEngineDigest(const State& journal_state,
                                            const std::string& engine_label,
                                            const WeightDigest& live);

inline constexpr int kExitOk = 0;               // journal intact, engine healthy
inline constexpr int kExitEngineUnhealthy = 1;  // journal intact; engine TAINTED / rollouts suspect
inline constexpr int kExitUsage = 2;            // bad arguments, or the journal cannot be opened
inline constexpr int kExitJournalDamaged = 3;   // the journal is damaged or unverifiable
// The report could not be written whole to stdout (cli/main.cc, for `audit` and `replay`): no
// verdict was delivered, whatever the journal and the engine are.
inline constexpr int kExitOutputFailed = 4;
struct Verdict {
  // Raw messages (escaped when printed). Callers add their own journal-level findings (a torn
  // WAL tail, an --expect-head mismatch) to journal_failures and rollout-level ones (trajectory
  // binding mismatches, failed re-verifications) to engine_findings before rendering.
  std::vector<std::string> journal_failures;
  std::vector<std::string> engine_findings;
  // What the audit could not check but that is expected (a torn line of a trajectories file):
  // reported with the verdict, never changing it or the exit code.
  std::vector<std::string> notes;
  // With `audit --trajectories`: the file's counts (--json gives them as `trajectories_file`).
  std::optional<TrajectoriesFileCounts> trajectories_file;
  bool journal_intact() const { return journal_failures.empty(); }
  bool engine_healthy() const { return engine_findings.empty(); }
  // kExitJournalDamaged dominates kExitEngineUnhealthy: an unverifiable journal explains nothing.
  int exit_code() const;
};
[[nodiscard]] Verdict MakeVerdict(const AuditReport& report);

// The skipped lines of the trajectories file at `path`, into the verdict: its torn lines as one
// note, its damaged lines as one engine finding (exit 1), each naming the count and the first
// kSkippedLinesNamedMax line numbers with why.
void AddSkippedLines(const TrajectoriesFile& file, const std::string& path, Verdict& verdict);

struct AuditOutput {
  std::string text;  // every line ends in '\n'; exactly one final "audit: ..." verdict line
  int exit_code = kExitOk;
};
// The report and the verdict lines. `journal_path` appears (escaped) in the `rolloutcore replay`
// command printed when the engine is not healthy.
[[nodiscard]] AuditOutput RenderAudit(const AuditReport& report, const Verdict& verdict,
                                      const std::string& journal_path);

// RenderAudit(report, MakeVerdict(report), "JOURNAL").text. Every string from the journal is
// escaped (rc::text::escape_line), so each version, state, rollout and failure is exactly one
// line and the verdict line is always present.
std::string FormatReport(const AuditReport& report);

// The verdict and the engine section as JSON (for `audit --json`), with the re-verification's
// when one ran, never throwing on invalid UTF-8 in journal strings (replaced by U+FFFD).
std::string VerdictJson(const AuditReport& report, const Verdict& verdict, int indent,
                        const ReverifySummary* reverify = nullptr);

// `rolloutcore audit --rollout`'s JSON (what audit_cmd.cc builds inline today), serialised
// without throwing on invalid UTF-8 in journal strings (replaced by U+FFFD).
std::string ProvenanceJson(const RolloutProvenance& p, int indent);

}  // namespace rc::audit
