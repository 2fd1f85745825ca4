// The deterministic simulator: the REAL fold, runner and journal (over a fault-injecting
// in-memory Env) against a simulated vLLM engine, weight transfer, clients and clock.
//
// One seed = one run of `cycles` update cycles, possibly over several "worlds" (a TAINTED engine
// is replaced by a fresh journal and engine). Everything random derives from the seed through
// std::mt19937_64; the fault schedule is an explicit list (FaultPlan) so that a failing run can
// be replayed exactly and shrunk fault by fault.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "statemachine/status.h"

namespace rc::sim {

// Values are part of the --faults syntax (by name): append only.
enum class FaultKind : std::uint8_t {
  kHttp5xx,             // one engine call answers 500, nothing done
  kHttpTimeout,         // one engine call times out (b odd: the engine did it anyway)
  kHttpDrop,            // one engine call's connection drops (b odd: done anyway)
  kHttpRefused,         // one engine call: connection refused, nothing done
  kHttpGarbage,         // one engine call answers 200 with an unparsable body (b odd: done)
  kSuccessFalse,        // prefix resets answer {"success": false} (blocks held), 1 + b%3 times
  kDelay,               // every engine call of the cycle takes b%40 ms more
  kEngineDeath,         // the engine dies at call a%16 of the cycle, back b%200 ms later
  kEngineRestartReady,  // the engine restarts while READY (after the update)
  kRelabel,             // someone relabels the engine b%60 ms into the cycle
  kExternalPause,       // someone pauses the engine b%60 ms into the cycle
  kWalFault,            // WAL append/sync EIO/ENOSPC after a%12 successes: fail-stop
  kFsyncStall,          // WAL syncs stall past the commit stall timeout: fail-stop
  kExecutorCrash,       // the executor dies at its (1 + a%24)-th durable event of the cycle
  kClockJump,           // the wall clock jumps by +-b%3600 s (monotonic never goes back)
  kPreflightRefuse,     // the source's manifest differs (b even) or the device is wrong
  kTransferFail,        // b%4: refused before sending / start fails / mid-chunk / finish fails
  kDisconnect,          // a client disconnects mid-request (aborted)
  kLeaseStop,           // an explicit client vanishes: its lease must be expired
  kSlowRollout,         // a rollout runs 300..2300 ms: may outlive the drain
  kSilentLoss,          // the data plane drops chunks yet every call answers 2xx: weights partial
  kExternalUpdate,      // someone replaces the READY engine's weights (same process and label)
  // Colocated faults: they act only while the engine sleeps (drawn from their own stream, so the
  // kinds above are scheduled for a seed exactly as before they existed).
  kSleepDeath,    // the sleeping engine dies a%100 ms into its sleep, back b%200 ms later
  kExternalWake,  // someone wakes the sleeper a%100 ms into its sleep: /resume (b even) or /wake_up
  // Partial answers (their own stream too): the next 1 + b%2 answers that would name the engine
  // process (probe, validation, resume, KV wake-up) name none, as when the read of /metrics
  // fails; with a death in the cycle, the process that answers may be a new one.
  kInstanceUnread,
  // Outside sleeps (their own stream too): someone sleeps the engine at level 1 + a%2, b%60 ms
  // into the cycle, if a plan in RESUMING holds it paused then (hidden from the monitor).
  kExternalSleep,
  // Restarts behind the executor's back (their own stream too): b%60 ms into the cycle the engine
  // dies and is back 50 ms later under the label it had, with its initial weights (b even: a
  // launcher that sets the old label) or the weights it had (b odd: one that reloads them).
  kRestartKeepsLabel,
  // Re-verification faults (their own stream too). Weight-digest reads of the cycle fail with
  // probability (1 + b%4)/4, as a timeout (a%3 == 0), an HTTP 5xx (1) or a malformed body (2);
  // the rest of each answer is read. (a/3)%4 picks the reads: 0 every one, 1 validations (while
  // paused), 2 probes (a restarted executor's re-verification, the look before a plan), 3 the
  // monitor's looks. Armed for the whole cycle, the monitor's looks after the plan included.
  kDigestUnread,
  // a%100 ms into the engine's sleep the executor restarts (crash, recovery) while it sleeps: the
  // sleeper's re-verification is pending until a plan from sleep validates it (rules 1).
  kExecutorRestartAsleep,
  kCount
};
inline constexpr FaultKind kFirstColocatedFault = FaultKind::kSleepDeath;
inline constexpr FaultKind kFirstAnswerFault = FaultKind::kInstanceUnread;
inline constexpr FaultKind kFirstOutsideSleepFault = FaultKind::kExternalSleep;
inline constexpr FaultKind kFirstLabelRestartFault = FaultKind::kRestartKeepsLabel;
inline constexpr FaultKind kFirstRecheckFault = FaultKind::kDigestUnread;
const char* FaultName(FaultKind k);

struct Fault {
  FaultKind kind = FaultKind::kHttp5xx;
  std::uint32_t cycle = 0;
  std::uint32_t a = 0;
  std::uint32_t b = 0;
  bool operator==(const Fault&) const = default;
};
using FaultPlan = std::vector<Fault>;

// "kind@cycle:a:b,..." (empty: no faults). ParsePlan is FormatPlan's inverse.
std::string FormatPlan(const FaultPlan& plan);
[[nodiscard]] Result<FaultPlan> ParsePlan(const std::string& text);
// The swarm: the seed picks a subset of fault kinds and an intensity for each.
FaultPlan PlanForSeed(std::uint64_t seed, std::uint32_t cycles);

struct SimOptions {
  std::uint64_t seed = 1;
  std::uint32_t cycles = 200;            // update cycles in this run
  std::uint32_t cycles_per_world = 100;  // a world is retired after this many (bounded checks)
  std::uint32_t check_every = 25;        // full journal checks every N cycles (and at world end)
  bool verbose = false;
  // The engine monitor also acts while a restarted runner recovers, as in the real executor
  // (--no-monitor-during-recovery pauses it there, to tell such interleavings apart).
  bool monitor_during_recovery = true;
  // Colocated mode: one cycle in `colocated_one_in` that starts READY puts the engine to sleep
  // first, then wakes it or updates it from sleep (0: never, every cycle is a plain update).
  std::uint32_t colocated_one_in = 3;
  // A fleet of this many engines (RunFleet; 0: one engine, Run). Each cycle is one fleet update.
  std::uint32_t fleet_engines = 0;
  // One world in `legacy_one_in` (a seeded draw; 0: none) starts from a journal an earlier
  // RolloutCore began: its BootstrapRequested recorded no fold rules (they read 0). An odd world
  // index is taken over by this build's recovery and folds by rules 0 for its life; an even one is
  // bootstrapped again by this build before it was READY, and folds by the current rules.
  std::uint32_t legacy_one_in = 4;
};

// Weight-digest reads that failed, and what the fold did with the re-verifications they touched.
// The journal's figures are counted once per world, from its final journal.
struct RecheckStats {
  std::uint64_t digest_reads_failed = 0;  // probes, looks, validations and monitor reads
  std::uint64_t validations_unread = 0;   // validations whose digest read failed (none publishes)
  // Monitor looks, journaled or not, that vouched for the process but read no digest while a
  // re-verification was pending under rules 1: each must leave it pending.
  std::uint64_t monitor_looks_kept_pending = 0;
  // Journaled looks (probes, looks before a plan, monitor looks) while one was pending: those
  // that cleared it; those that read no digest and, under rules 1, left it pending; those that
  // read no digest and, under rules 0, cleared it by the process and label alone.
  std::uint64_t journaled_clears = 0, journaled_unread_kept = 0, rules0_unread_clears = 0;
  std::uint64_t admissions_refused_pending = 0;  // admissions tried while one was pending
  std::uint64_t rules0_worlds = 0, rebootstrapped_worlds = 0;
  std::uint64_t rules_changes_refused = 0;  // bootstraps naming other rules once READY
  void Add(const RecheckStats& o);
};

// What the colocated cycles did (sleep, the asleep interval, the plan from sleep).
struct ColocatedStats {
  std::uint64_t cycles = 0, began_asleep = 0, ended_asleep = 0;
  std::uint64_t sleeps = 0, slept = 0, wakes = 0, woken = 0;
  std::uint64_t updates_from_sleep = 0, committed_from_sleep = 0, refused_from_sleep = 0;
  std::uint64_t admissions_refused = 0;  // admissions tried while SLEEPING (every one refused)
  std::uint64_t refusals_probed = 0;     // a wake or a wrong-manifest update after level 2
  std::uint64_t sleep_deaths = 0, external_wakes = 0;
  std::uint64_t external_sleeps = 0;  // engines slept from outside while a plan held them paused
  std::uint64_t executor_restarts_asleep = 0;  // kExecutorRestartAsleep faults that restarted it
  // Sleepers judged against the engine's truth while their re-verification was pending (an
  // executor restart while asleep: no look of a sleeper carries the digest rules 1 ask for).
  std::uint64_t sleepers_checked_pending = 0;
  // Publishes validated on an unpaused engine (each also a violation): by a restore, or by an
  // update from sleep (someone woke the sleeper meanwhile). The validation reads /is_paused, so
  // both stay 0; they are counted apart to say which kind of plan broke the rule.
  std::uint64_t restores_published_unpaused = 0, updates_published_unpaused = 0;
  std::map<std::string, std::uint64_t> taints;  // taints in colocated cycles, by cause
  void Add(const ColocatedStats& o);
};

struct SimStats {
  std::uint64_t cycles = 0, worlds = 0, committed = 0, refused = 0, tainted = 0;
  std::uint64_t update_errors = 0, restarts = 0, admissions_acked = 0, events = 0;
  std::uint64_t full_checks = 0, faults = 0;
  std::uint64_t stalled = 0;                    // fleet members that ended a fleet update stalled
  std::uint64_t restores = 0, restored = 0;     // restores of a TAINTED engine; those committed
  std::map<std::string, std::uint64_t> taints;  // by cause
  ColocatedStats colocated;
  RecheckStats recheck;
  void Add(const SimStats& o);
};

struct SimResult {
  SimStats stats;
  std::vector<std::string> violations;  // empty: the run passed
  std::string head;                     // "worlds:last head seq:hash" (determinism checks)
};

// Runs one seed with the given fault plan. Never throws; an invariant violated inside the fold
// aborts the process (assertions stay on), which the caller reports with the replay command.
SimResult Run(const SimOptions& options, const FaultPlan& plan);
// The same for a fleet (options.fleet_engines > 0; sim/fleet_world.cc).
SimResult RunFleet(const SimOptions& options, const FaultPlan& plan);

// The command that replays a run exactly, and its arguments (without the program name).
std::string ReplayCommand(const SimOptions& options, const FaultPlan& plan);
std::vector<std::string> ReplayArgs(const SimOptions& options, const FaultPlan& plan);

// Removes faults while the run still fails (each trial a new process of the simulator at
// `sim_path`, so that an aborting fold is a failure too, not the end of the shrink); returns a
// minimal failing plan.
FaultPlan Shrink(const std::string& sim_path, const SimOptions& options, const FaultPlan& plan,
                 std::uint32_t trials_max = 64);

}  // namespace rc::sim
