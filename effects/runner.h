// The effects runner: executes next_effect(state) with write-ahead journaling.
//
// For each effect: journal the EffectStarted intent (durable) -> perform it -> journal the typed
// observation (durable; the journal folds it and derives the decisions) -> repeat. The runner
// decides nothing: it only performs what the fold names and records what it saw. Every effect
// has a deadline; retries of idempotent effects are bounded by the fold (kEffectAttemptsMax)
// and spaced by a bounded backoff here.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "effects/clock.h"
#include "effects/engine.h"
#include "effects/transfer.h"
#include "journal/journal.h"
#include "statemachine/state.h"

namespace rc::effects {

struct RunnerOptions {
  std::string executor_id = "rolloutcore";
  // The fleet engine this runner drives (statemachine/fleet.h); "": the one engine of a journal
  // that names none. Every input it journals names this engine, and it reads this engine's state.
  std::string engine;
  std::uint64_t drain_timeout_ms = 600000;  // pause(mode=wait): running requests finish
  // After the engine reported drained, how long local bindings may stay active. A binding whose
  // request is still in transit (or queued behind the pause) cannot finish while the engine is
  // paused; after this the update is refused and the engine resumes on the old version.
  std::uint64_t await_rollouts_timeout_ms = 10000;
  std::uint64_t transfer_timeout_ms = 600000;  // the whole transfer, data plane included
  std::uint64_t call_timeout_ms = 10000;       // recorded deadline of the other effects
  // Colocated mode: a sleep (level 1 copies the weights to host memory) and each wake-up.
  std::uint64_t sleep_timeout_ms = 300000;
  std::uint32_t backoff_ms_min = 20;  // between retries of a failed idempotent effect
  std::uint32_t backoff_ms_max = 1000;
  std::uint32_t await_poll_ms = 1;            // polling interval while awaiting bindings
  std::uint32_t effects_per_drive_max = 256;  // bound on one Drive() call
  std::uint32_t startup_poll_ms = 250;        // between /health probes while the engine starts
  std::uint32_t startup_report_ms = 5000;     // between progress reports while it starts
};

// How a bootstrap treats the engine it finds.
struct BootstrapOptions {
  bool adopt = false;                    // accept another label (relabel) or a paused engine
  bool require_digest = false;           // refuse an engine that computes no weight digest
  std::string expected_digest;           // refuse an engine whose combined digest is not this
  std::uint64_t startup_timeout_ms = 0;  // wait this long for /health first (0: no wait)
  // Told what the runner is waiting for (one line each, at most every startup_report_ms).
  std::function<void(const std::string&)> progress;
};

// Where one update cycle spent its time (microseconds), for the article's phase split.
struct PhaseTimings {
  std::uint64_t drain_us = 0;  // pause(wait) + awaiting bindings
  std::uint64_t preflight_us = 0;
  std::uint64_t transfer_us = 0;
  std::uint64_t invalidate_us = 0;  // the three cache resets
  std::uint64_t validate_us = 0;
  std::uint64_t resume_us = 0;
  std::uint64_t sleep_us = 0;         // colocated: /sleep (+ the memory read around it)
  std::uint64_t wake_weights_us = 0;  // colocated: /wake_up?tags=weights before the transfer
  std::uint64_t wake_kv_us = 0;       // colocated: /wake_up?tags=kv_cache, the resume
  std::uint64_t journal_us = 0;       // durable appends (intents, observations, decisions)
  std::uint64_t total_us = 0;
  void clear() { *this = PhaseTimings{}; }
};

// What a look at the engine before a plan compared it with (Runner::LookBeforePlan): its answer
// holds while the engine's monitor epoch, lifecycle and committed label are these.
struct EngineLooked {
  std::uint64_t epoch = 0;
  Lifecycle lifecycle = Lifecycle::kUninitialized;
  std::string committed_label;
  bool operator==(const EngineLooked&) const = default;
};

// The RecoveryStarted an executor's start journals: its id, and what the journal's open found
// (`opened`: how the run before ended, a torn WAL tail's bytes and sentence, bounded to valid
// UTF-8 of kTextBytesMax). The journal's WAL shows a torn tail only until it is written on; the
// record tells it for good (replay and audit report it).
RecoveryStarted RecoveryStartedAfter(const std::string& executor_id,
                                     const journal::Recovery& opened);

// The journal idempotency key of an update request (fixed size whatever the id's length).
std::string UpdateIdempotencyKey(const std::string& update_id);
// The same for a restore (its own key space: a restore never answers as an earlier update).
std::string RestoreIdempotencyKey(const std::string& restore_id);
// The same for a sleep and a wake-up (each its own key space).
std::string SleepIdempotencyKey(const std::string& sleep_id);
std::string WakeIdempotencyKey(const std::string& wake_id);

class Runner {
 public:
  using Observer = std::function<void(std::uint64_t seq, const Event& event)>;

  Runner(journal::Journal& journal, EngineControl& engine, WeightTransfer& transfer, Clock& clock,
         RunnerOptions options);

  // Journals RecoveryStarted (abandons bindings whose clients are gone, classifies a crash in
  // UPDATING), recording what the journal's open found (`opened`: the journal's recovery()), and
  // redoes whatever idempotent step was interrupted.
  [[nodiscard]] Status Recover(const journal::Recovery& opened);
  // Recover() in two halves: journal RecoveryStarted (no I/O) now, Drive() later — for an executor
  // that must be reachable by its clients (leased rollouts finishing) before an interrupted
  // update can go on.
  [[nodiscard]] Status BeginRecovery(const journal::Recovery& opened);
  // Recover() while this executor runs, for a plan that stalled: the same RecoveryStarted (the
  // plan gets its attempts back), its executor id prefixed with kStalledPlanRetryPrefix and no
  // journal open recorded (JournalEnding::kNotRecorded).
  [[nodiscard]] Status RetryStalledPlan();
  // UNINITIALIZED -> READY once the engine reports `label`: a fresh engine (label "default") is
  // labelled; one that reports another label or is paused is refused unless adopted. Errors say
  // what the engine answered and what to do.
  [[nodiscard]] Status Bootstrap(const std::string& label, const WeightIdentity& identity,
                                 const BootstrapOptions& options = {});
  // Submits the request and drives the update to its end (committed, refused or tainted).
  [[nodiscard]] Result<UpdateEnded> Update(const UpdateRequested& request);
  // Update() in two halves, for a fleet executor that journals its members' requests in the
  // order the fleet fold allows and drives each on its own thread: StartUpdate journals the
  // request (a refusal changes nothing); FinishUpdate drives it to its end.
  [[nodiscard]] Status StartUpdate(const UpdateRequested& request);
  // The look every plan but a restore makes before its request is journaled (an engine found
  // changed is TAINTED; one that could not be read refuses the plan), taken on its own: a fleet
  // executor looks at every member it starts before it journals any of their requests, so an
  // `all` update still starts them all before any ends.
  [[nodiscard]] Result<EngineLooked> LookBeforePlan(const UpdateRequested& request);
  // StartUpdate after LookBeforePlan: the look is made again unless the engine is still as it
  // was compared then.
  [[nodiscard]] Status StartUpdate(const UpdateRequested& request, const EngineLooked& looked);
  [[nodiscard]] Result<UpdateEnded> FinishUpdate(const std::string& update_id);
  // The same for a restore of a TAINTED engine: committed (READY on the restored version, its
  // digest proven), refused (still TAINTED, nothing changed) or tainted (the reload failed).
  [[nodiscard]] Result<UpdateEnded> Restore(const RestoreRequested& request);
  // Colocated mode: drains and puts the engine to sleep (committed: SLEEPING), or wakes a level-1
  // sleeper on its weights after validating them (committed: READY). Ends like an update.
  [[nodiscard]] Result<UpdateEnded> Sleep(const SleepRequested& request);
  [[nodiscard]] Result<UpdateEnded> Wake(const WakeRequested& request);
  // Performs effects until none is due.
  [[nodiscard]] Status Drive();

  const PhaseTimings& last_timings() const { return timings_; }
  // The seq of the last plan's request when the journal held it already (a re-submitted id), else
  // 0: where that request's record, and its end after it, are found.
  std::uint64_t resubmitted_seq() const { return resubmitted_seq_; }
  // The device memory the last sleep observed around /sleep (unknown before any).
  const DeviceMemory& last_sleep_memory() const { return last_sleep_memory_; }
  // Called for every event the runner journals (inputs and their decisions), in seq order, once
  // it is durable: an observer never reports what a crash could still take back.
  void set_observer(Observer observer) { observer_ = std::move(observer); }
  // Called with each fleet decision (named "", e.g. FleetUpdateEnded) an input of this runner's
  // engine caused, once journaled (not yet durable): the fleet executor learns a fleet update's
  // end without reading the journal back.
  using FleetDecisionFn = std::function<void(const Event& decision)>;
  void set_fleet_decisions(FleetDecisionFn fn) { fleet_decisions_ = std::move(fn); }
  // Asked while a drain waits for admitted rollouts to end: true (the executor is shutting down)
  // gives up on them at once, as await_rollouts_timeout_ms does (the update ends refused and the
  // engine resumes, nothing mutated). Asked too after a mutation the engine never received:
  // true makes that refusal the stop's (plan_stopped).
  void set_stop_waiting(std::function<bool()> stop) { stop_waiting_ = std::move(stop); }
  // Whether the last plan gave something up to stop_waiting: a drain or a wait for rollouts it cut
  // short, or a mutation (transfer, label, sleep, wake-up of the weights) the engine never
  // received while stop_waiting said true. A refusal of that plan is the stop's, not its own.
  bool plan_stopped() const { return plan_stopped_; }
  // The engine monitor's schedule of weight digests, which a look before a plan follows so that
  // it reads, and journals, what the monitor would. `due` is asked once per look that would read
  // the digest (an awake engine whose committed version has one): whether a check is due now; a
  // true answer takes the read (the schedule lets no one else read until it is told), so every
  // `due` that answered true is followed by one `looked`, told what the look got (present, or
  // absent with why): the schedule decides whether that counts as the check, so a digest that
  // could not be read is not taken as read. Unset: every such look reads the digest.
  struct DigestSchedule {
    std::function<bool()> due;
    std::function<void(const WeightDigest&)> looked;
  };
  void set_digest_schedule(DigestSchedule schedule) { digest_schedule_ = std::move(schedule); }

 private:
  enum class Durability { kNow, kWithNext };
  [[nodiscard]] Result<std::vector<Event>> submit(const Event& input,
                                                  const std::string& client_event_id = "",
                                                  Durability durability = Durability::kNow);
  // Waits until everything this runner submitted is durable.
  [[nodiscard]] Status sync();
  std::size_t active_rollouts() const;
  Effect due_effect() const;
  // This runner's engine in the journal's fold: read under its lock, or copied.
  void read_state(const std::function<void(const State&)>& read) const;
  State current_state() const;
  // A request's idempotency key, made distinct per engine (a fleet's members share update ids).
  std::string engine_key(const std::string& key) const;
  // What one step of Drive() reads of the engine's state, under the journal's lock and without
  // copying the state (O(the labels it committed and its rollouts in flight)): the effect due,
  // and what performing it sends.
  struct Step {
    Effect effect;
    std::uint32_t attempts = 0;
    Lifecycle lifecycle = Lifecycle::kUninitialized;
    std::optional<BootstrapRequested> bootstrap;  // a bootstrap's probe
    // A plan's preflight, transfer or sleep: the fields they send (never its observed digest).
    std::optional<UpdatePlan> plan;
  };
  Step next_step() const;
  [[nodiscard]] Status perform(const Step& step);
  [[nodiscard]] Status await_rollouts();
  [[nodiscard]] Status time_out_rollouts(std::int64_t waited_ms);
  Event observe(const Step& step);
  EngineProbed probe_for_bootstrap(const BootstrapRequested& bootstrap);
  PreflightObserved adopt_preflight();
  TransferObserved label_only(const UpdatePlan& plan);
  [[nodiscard]] Result<UpdateEnded> run_to_end(const Event& request, const std::string& id,
                                               const std::string& key);
  // `looked`: the plan's look, already made (nullptr: make it now).
  [[nodiscard]] Status start_plan(const Event& request, const std::string& key,
                                  const EngineLooked* looked = nullptr);
  EngineLooked looked_now() const;
  // Whether the plan's look is due: not for a restore (no committed engine to compare with),
  // nor for a request the fold refuses whatever a look could find (its refusal answers).
  bool look_due(const Event& request) const;
  // The look before a request whose key the journal does not hold yet (see look_due).
  [[nodiscard]] Status look_unless_held(const Event& request, const std::string& key);
  bool digest_due() const;
  void digest_looked(const WeightDigest& digest) const;
  // Notes a mutation the engine never received while stop_waiting says true (plan_stopped).
  void note_stopped_mutation(const Event& observation);
  // Before a plan's request, the engine the monitor watches (READY, or SLEEPING) is looked at as
  // the monitor looks at it (the weight digest only when digest_due), and what the fold must
  // know is journaled as the monitor's observation: an engine that is not the committed one is
  // TAINTED before anything is sent. Rejected when it is not, or when the look could not read
  // what the fold compares.
  [[nodiscard]] Status check_engine_before_plan();
  // The fields of this engine's state a look at the engine is judged against.
  State watched_state() const;
  // Up to kEffectAttemptsMax looks within the deadline of a probe.
  EngineMonitored look_at_engine(const State& before, bool with_digest);
  // Journals the look (durable before the plan's answer); `taint` gets the taint it caused.
  [[nodiscard]] Status journal_engine_look(const State& before, EngineMonitored seen,
                                           std::string* taint);
  [[nodiscard]] Result<UpdateEnded> finish_plan(const std::string& id);
  std::int64_t pause_reserve_ms() const;
  DrainObserved drain();
  [[nodiscard]] Status wait_for_engine(const BootstrapOptions& options);
  std::uint64_t elapsed_us(std::int64_t since_us) const;
  std::uint64_t deadline_for(EffectKind kind) const;

  journal::Journal& journal_;
  EngineControl& engine_;
  WeightTransfer& transfer_;
  Clock& clock_;
  RunnerOptions options_;
  PhaseTimings timings_;
  Observer observer_;
  FleetDecisionFn fleet_decisions_;
  std::function<bool()> stop_waiting_;
  DigestSchedule digest_schedule_;
  bool plan_stopped_ = false;                // since the last plan's start (plan_stopped)
  std::vector<UpdateEnded> ended_;           // UpdateEnded decisions seen since the last Update()
  std::optional<journal::Ticket> unsynced_;  // the last ticket not yet known durable
  // Events journaled but not yet known durable, for the observer: (seq, event).
  std::vector<std::pair<std::uint64_t, Event>> unobserved_;
  std::optional<EngineProbed> last_probe_;  // the last probe's evidence (bootstrap errors)
  std::int64_t plan_start_us_ = 0;          // when the plan in flight was journaled
  // The seq at which the journal first recorded the plan's request when start_plan resubmitted
  // it (its idempotency key answered with the original); 0 for a new request.
  std::uint64_t resubmitted_seq_ = 0;
  [[nodiscard]] Status RefuseEndedResubmission(const std::string& id) const;
  DeviceMemory last_sleep_memory_;
};

}  // namespace rc::effects
