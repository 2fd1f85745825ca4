// One seed's run: worlds of (in-memory journal over FaultEnv, real runner, simulated engine and
// clients), update cycles with the seed's faults, and the checks after every step.
#include <rocksdb/env.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <set>

#include "effects/runner.h"
#include "journal/journal.h"
#include "journal/testing/fault_env.h"
#include "replay/replay.h"
#include "sim/engine.h"
#include "sim/oracle.h"
#include "statemachine/describe.h"
#include "statemachine/history.h"

namespace rc::sim {
namespace {

using journal::testing::FaultEnv;
using journal::testing::FileKind;
using journal::testing::FileOp;
using journal::testing::Torn;

constexpr std::uint32_t kStallTimeoutMs = 200;   // the journal's commit stall bound (real time)
constexpr std::uint32_t kStallMs = 260;          // an fsync stall past it
constexpr std::int64_t kUpdateBudgetMs = 40000;  // every deadline and backoff of one update, summed
constexpr int kRestartsPerCycleMax = 8;          // an update must end within this many restarts
constexpr std::size_t kViolationsMax = 16;
constexpr std::uint32_t kLeaseMs = 300;
constexpr std::uint32_t kFinishRetriesMax = 200;  // an explicit client retries its finish (bounded)
constexpr std::uint32_t kRestoresPerWorldMax = 3;  // failed restores in a row before retiring
constexpr std::int64_t kTickUs = 10000;            // the monitor's and the reaper's period
// The virtual time a colocated engine sleeps before it is woken or updated (the trainer's step).
constexpr std::uint32_t kAsleepMsMin = 10;
constexpr std::uint32_t kAsleepMsSpread = 140;
constexpr std::uint32_t kAsleepAdmissionsMax = 4;  // clients that try to admit meanwhile
// The monitor's looks (one a tick) a READY engine may need, once its digest reads succeed, to
// clear a pending re-verification; and the ticks it may take to see an outside change.
constexpr std::int64_t kRecheckTicksMax = 3;
constexpr std::int64_t kMonitorGraceUs = 2 * kTickUs;
const std::string kDigest(64, 'a');

// Every checkpoint has the same manifest (one model, same tensors): after a level-2 sleep an
// update carries the committed manifest, as the fold requires.
WeightIdentity IdentityFor(const std::string& checkpoint, std::int64_t step) {
  return WeightIdentity{kDigest, "", checkpoint, "sim-run", step};
}

// The id a plan's request names ("" for any other event).
std::string RequestId(const Event& e) {
  if (const auto* u = std::get_if<UpdateRequested>(&e)) return u->update_id;
  if (const auto* r = std::get_if<RestoreRequested>(&e)) return r->restore_id;
  if (const auto* s = std::get_if<SleepRequested>(&e)) return s->sleep_id;
  if (const auto* w = std::get_if<WakeRequested>(&e)) return w->wake_id;
  return {};
}

// How one plan (an update, a restore, a sleep or a wake-up) ended for the world.
struct PlanEnd {
  bool world_ok = false;                 // false: a violation, or no journal to go on with
  std::optional<UpdateOutcome> outcome;  // absent: the runner answered an error
  bool is(UpdateOutcome o) const { return outcome == o; }
};

struct Client {
  std::string id;
  std::uint32_t lease_ms = 0;  // > 0: explicit
  std::uint32_t requests_left = 1;
  std::uint32_t duration_ms = 5;
  bool disconnect = false;  // aborts mid-request
  bool vanish = false;      // an explicit client that stops renewing after admission
  bool alive = true;
  bool admitted = false;  // its admission was acknowledged
  bool finish_acked = false;
  std::uint64_t transfer_epoch = 0;  // the engine's weights when it was admitted
  std::uint64_t request = 0;
  std::int64_t last_renew_us = 0;
  std::uint32_t finish_tries = 0;
};

class World {
 public:
  World(const SimOptions& o, std::uint64_t index, Line line, SimResult& result)
      : o_(o),
        index_(index),
        result_(result),
        clock_(sched_),
        engine_(sched_, line, result.violations),
        ctl_(engine_, sched_),
        mem_(rocksdb::NewMemEnv(rocksdb::Env::Default())),
        faults_(std::make_unique<FaultEnv>(mem_.get())),
        path_("/sim/world-" + std::to_string(index)),
        rng_(o.seed * 1000003 + index),
        colocated_rng_(o.seed * 0x2545F4914F6CDD1Dull + index) {}

  ~World() {
    runner_.reset();
    journal_.reset();
  }

  // A journal an earlier RolloutCore began (SimOptions::legacy_one_in): taken over by this
  // build's recovery (rules 0), or bootstrapped again by this build before it was READY.
  enum class Legacy : std::uint8_t { kNone, kTakenOver, kBootstrappedAgain };

  bool Boot();
  void RunCycle(std::uint32_t cycle, const std::vector<Fault>& faults);
  void Close();
  bool tainted() { return journal_ && journal_->state().lifecycle == Lifecycle::kTainted; }
  // Still TAINTED after this many restores in a row: the world is retired.
  bool restores_exhausted() const { return restores_failed_ >= kRestoresPerWorldMax; }
  std::uint32_t cycles() const { return cycles_; }
  std::string head() const { return head_; }

 private:
  void Violate(const std::string& what);
  void ExternalUpdate(int attempts_left);
  Legacy LegacyFor() const;
  [[nodiscard]] Status JournalLegacyBootstrap();
  [[nodiscard]] Status TakeOverLegacy();
  [[nodiscard]] bool ProbeRulesChange();
  bool Open();
  void NewRunner();
  void Ack(const journal::Journal::Submitted& s, const Event& input);
  bool SubmitAcked(const Event& e, Status* why = nullptr);
  void OnDurable(std::uint64_t seq, const Event& e);
  void CheckPublish(const VersionPublished& v);

  void Tick();
  void Monitor();
  void JudgeLook(const State& s, const EngineMonitored& m);
  void Reap();
  void Arm(const Fault& f, std::vector<Client>& spawn);
  void Spawn(std::mt19937_64& rng, std::vector<Client>& out, std::uint32_t cycle);
  void ClientAdmit(const std::string& id);
  void ClientSend(const std::string& id);
  void ClientDone(const std::string& id, bool ok);
  void ClientFinish(const std::string& id, RolloutOutcome outcome);

  void RunPlans(std::uint32_t cycle);
  void RunUpdate(std::uint32_t cycle);
  UpdateRequested UpdateFor(std::uint32_t cycle) const;
  void CountUpdate(const PlanEnd& end);
  void RunRestore(std::uint32_t cycle);
  RestoreRequested PlanRestore(const State& s, std::uint32_t cycle);
  PlanEnd RunPlan(const std::string& id, const std::function<Result<UpdateEnded>()>& run);
  [[nodiscard]] bool FinishEffect(const std::string& id, bool crashed, bool ok);
  void EndPlan();
  void CheckAdmissionsDuring(const std::string& id, std::uint64_t after_seq);
  bool Restart();
  void Sleep(std::uint32_t ms) { clock_.sleep_ms(ms); }
  void EndOfCycleChecks(std::uint32_t cycle);
  std::string CommittedWeights(const State& s) const;
  bool EngineIsCommitted(const State& s) const;
  void CheckReadyEngine(const State& s);
  void CheckRecheckProgress(const State& s);
  void CheckSleeper(const State& s);
  void FullChecks(bool with_replay);

  // Colocated mode (docs/lifecycle.md "Colocated mode: sleep and wake-up").
  void RunColocated(std::uint32_t cycle);
  void ContinueAsleep(std::uint32_t cycle);
  void AsleepThenWake(std::uint32_t cycle, const std::string& sleep_id, std::uint64_t after_seq);
  [[nodiscard]] bool AsleepInterval(std::uint32_t cycle);
  [[nodiscard]] bool RestartAsleep();
  void ArmAsleep();
  void ExternalSleep(const Fault& f);
  [[nodiscard]] bool RunFromSleep(std::uint32_t cycle, const State& s);
  void ProbeLevel2Refusals(std::uint32_t cycle);
  void EndColocated(const std::string& sleep_id, std::uint64_t after_seq);
  bool HealthySleeper(const State& s);
  void CheckReadyAwake(const State& s);
  void NoteTaint(const Event& e);
  void Trace(std::uint64_t seq, const Event& e);

  const SimOptions& o_;
  std::uint64_t index_;
  SimResult& result_;
  Scheduler sched_;
  SimClock clock_;
  SimEngine engine_;
  SimControl ctl_;
  std::unique_ptr<rocksdb::Env> mem_;
  std::unique_ptr<FaultEnv> faults_;
  std::string path_;
  std::mt19937_64 rng_;
  std::unique_ptr<journal::Journal> journal_;
  std::unique_ptr<effects::Runner> runner_;

  std::vector<std::pair<std::uint64_t, Event>> acked_;  // every acknowledged (seq, event)
  std::map<std::string, UpdateOutcome> answers_;        // update id -> outcome answered
  std::map<std::string, Client> clients_;
  std::map<std::string, std::int64_t> lease_seen_us_;  // leased bindings nobody renews
  std::uint64_t observed_ = 0, crash_at_ = 0;
  bool update_open_ = false;
  std::vector<std::pair<std::string, std::uint64_t>> admitted_during_update_;  // id, seq
  bool recovering_ = false;  // Runner::Recover() is running
  bool restart_engine_ready_ = false;
  std::uint32_t restores_failed_ = 0;    // restores in a row that left the engine TAINTED
  std::set<std::string> wrong_sources_;  // restore ids sent the wrong checkpoint on purpose
  std::uint32_t cycles_ = 0, cycle_ = 0;
  std::string head_;
  // Colocated choices draw from their own stream, so the other draws stay what they were.
  std::mt19937_64 colocated_rng_;
  bool colocated_ = false;  // a colocated plan is under way, or the engine sleeps
  std::optional<Fault> sleep_death_, external_wake_;  // this cycle's, for the asleep interval
  std::optional<Fault> restart_asleep_;               // this cycle's kExecutorRestartAsleep
  bool ready_asleep_reported_ = false;
  Legacy legacy_ = Legacy::kNone;
  std::uint32_t fold_rules_ = kFoldRulesCurrent;  // the rules the journal must fold by once READY
  std::int64_t last_restart_us_ = 0;              // the last executor restart's end
  std::int64_t outside_us_ = 0;  // the last outside action the monitor must see (relabel, wake)
};

// Someone updates the engine through its own routes, as a careful outsider would: once no
// rollout is open and no update runs, new weights, caches reset; same process, same label. Only
// the weight digest shows it. (Amid rollouts or our own update the outsider would make a rollout
// span two weight states or change what was validated, which no executor can prevent, only
// report: the oracle keeps those rules strict instead.)
void World::ExternalUpdate(int attempts_left) {
  if (!engine_.truth().alive || attempts_left <= 0) return;
  bool quiet = false;
  if (journal_) {
    journal_->ReadState([&quiet](const State& st) {
      quiet = st.lifecycle == Lifecycle::kReady && !st.update.has_value() && st.active.empty();
    });
  }
  if (engine_.running() > 0 || !quiet) {
    sched_.After(5000, [this, attempts_left] { ExternalUpdate(attempts_left - 1); });
    return;
  }
  engine_.Mutate("external:" + engine_.truth().weights);
  for (CacheKind c : {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal}) {
    (void)engine_.ResetCache(c);
  }
}

void World::Violate(const std::string& what) {
  if (result_.violations.size() >= kViolationsMax) return;
  result_.violations.push_back("world " + std::to_string(index_) + " cycle " +
                               std::to_string(cycle_) + ": " + what);
}

bool World::Open() {
  journal::Options jo;
  jo.env = faults_->env();
  jo.rocksdb_log_to_stderr = false;
  jo.snapshot_every = 64;  // small: reopening restores from a snapshot + tail
  jo.commit_stall_timeout_ms = kStallTimeoutMs;
  jo.scan_pipelined = false;  // no reader thread: the simulator stays single-threaded
  auto j = journal::Journal::Open(path_, jo);
  if (!j.ok()) {
    Violate("journal open: " + j.status().ToString());
    return false;
  }
  journal_ = std::move(j.value());
  return true;
}

void World::NewRunner() {
  effects::RunnerOptions ro;
  ro.executor_id = "sim";
  ro.drain_timeout_ms = 2000;
  ro.await_rollouts_timeout_ms = 500;
  ro.transfer_timeout_ms = 3000;
  ro.call_timeout_ms = 500;
  runner_ = std::make_unique<effects::Runner>(*journal_, ctl_, ctl_, clock_, ro);
  runner_->set_observer([this](std::uint64_t seq, const Event& e) { OnDurable(seq, e); });
}

// The runner's observer: told of each event once durable. Where the executor "dies" on command.
void World::OnDurable(std::uint64_t seq, const Event& e) {
  acked_.emplace_back(seq, e);
  Trace(seq, e);
  NoteTaint(e);
  if (const auto* v = std::get_if<VersionPublished>(&e)) CheckPublish(*v);
  if (crash_at_ > 0 && ++observed_ == crash_at_) faults_->Crash();
}

// Nothing published without every reset and validation, judged from the engine's own truth.
void World::CheckPublish(const VersionPublished& v) {
  const EngineTruth& t = engine_.truth();
  const auto& val = ctl_.validated();
  // Every plan of this world names the digest it expects (updates, restores): a validation
  // whose digest read failed proves nothing, whatever else it read.
  if ((val && !val->digest_read) || v.engine_digest.empty()) {
    Violate("'" + v.update_id + "' published '" + v.version.label + "' without a weight digest (" +
            (v.engine_digest.empty() ? "none journaled" : "the validation's read failed") +
            "), though its plan names the digest it expects");
  }
  // An engine restarted, or relabelled by someone else, after it answered the validation is
  // the monitor's to taint (checked at the end of the cycle): judge what validation vouched for.
  if (!t.alive || !val || val->instance != t.instance) return;
  if (val->weights != v.identity.checkpoint || val->label != v.version.label) {
    Violate("published '" + v.version.label + "' (" + v.identity.checkpoint +
            ") but at validation the engine held '" + val->weights + "' labelled '" + val->label +
            "'");
  }
  if (ctl_.mutation_op_at_resume() != val->mutation_op) {
    Violate("published '" + v.version.label +
            "' though the weights changed between the validation " +
            "and the resume that published them");
  }
  if (!val->caches_reset) {
    Violate("published '" + v.version.label + "' without every cache reset after the mutation");
  }
  if (!val->paused) {
    ColocatedStats& st = result_.stats.colocated;
    (v.update_id[0] == 'x' ? st.restores_published_unpaused : st.updates_published_unpaused)++;
    Violate("'" + v.update_id + "' published '" + v.version.label +
            "' on a validation the engine answered unpaused");
  }
}

void World::Ack(const journal::Journal::Submitted& s, const Event& input) {
  acked_.emplace_back(s.ticket.result.first_seq, input);
  Trace(s.ticket.result.first_seq, input);
  for (std::size_t i = 0; i < s.decisions.size(); ++i) {
    acked_.emplace_back(s.ticket.result.first_seq + 1 + i, s.decisions[i]);
    Trace(s.ticket.result.first_seq + 1 + i, s.decisions[i]);
    NoteTaint(s.decisions[i]);
  }
}

// --verbose: every acknowledged event, as replay would print it, with the engine's truth.
void World::Trace(std::uint64_t seq, const Event& e) {
  if (!o_.verbose) return;
  const EngineTruth& t = engine_.truth();
  std::printf("w%lu c%u t=%ldms seq %lu %s  [engine %s%s %s '%s'%s%s]\n", index_, cycle_,
              sched_.now_us() / 1000, seq, describe(e).c_str(), engine_.instance_name().c_str(),
              t.alive ? "" : " dead", t.weights.c_str(), t.label.c_str(), t.paused ? " paused" : "",
              engine_.asleep() ? " asleep" : "");
}

void World::NoteTaint(const Event& e) {
  const auto* c = std::get_if<StateChanged>(&e);
  if (colocated_ && c != nullptr && c->to == Lifecycle::kTainted) {
    result_.stats.colocated.taints[cause_name(c->cause)]++;
  }
}

bool World::SubmitAcked(const Event& e, Status* why) {
  if (!journal_ || journal_->failed()) return false;
  auto s = journal_->Submit(e, clock_.wall_ms());
  if (!s.ok()) {
    if (why) *why = s.status();
    return false;
  }
  if (!journal_->Wait(s->ticket).ok()) return false;
  Ack(*s, e);
  return true;
}

// The files of a freshly created, cleanly closed, empty journal: creating one costs most of a
// world's set-up (RocksDB writes and re-parses its OPTIONS file per column family), so each world
// starts from a copy. The copy is the same journal the real Open would have made.
struct JournalTemplate {
  std::vector<std::pair<std::string, std::string>> files;  // name, bytes

  static const JournalTemplate& Get() {
    static const JournalTemplate t = Make();
    return t;
  }
  static JournalTemplate Make() {
    std::unique_ptr<rocksdb::Env> mem(rocksdb::NewMemEnv(rocksdb::Env::Default()));
    const std::string dir = "/template";
    journal::Options jo;
    jo.env = mem.get();
    jo.rocksdb_log_to_stderr = false;
    jo.scan_pipelined = false;
    {
      auto j = journal::Journal::Open(dir, jo);
      RC_CHECK(j.ok());
    }  // closed cleanly
    JournalTemplate t;
    std::vector<std::string> names;
    RC_CHECK(mem->GetChildren(dir, &names).ok());
    for (const std::string& name : names) {
      if (name == "." || name == ".." || name == "LOCK") continue;
      std::string bytes;
      RC_CHECK(rocksdb::ReadFileToString(mem.get(), dir + "/" + name, &bytes).ok());
      t.files.emplace_back(name, std::move(bytes));
    }
    return t;
  }
  void CopyTo(rocksdb::Env* env, const std::string& dir) const {
    RC_CHECK(env->CreateDirIfMissing(dir).ok());
    for (const auto& [name, bytes] : files) {
      RC_CHECK(rocksdb::WriteStringToFile(env, bytes, dir + "/" + name, /*should_sync=*/true).ok());
    }
  }
};

bool World::Boot() {
  result_.stats.worlds++;
  JournalTemplate::Get().CopyTo(faults_->env(), path_);
  if (!Open()) return false;
  NewRunner();
  sched_.After(kTickUs, [this] { Tick(); });
  legacy_ = LegacyFor();
  fold_rules_ = legacy_ == Legacy::kTakenOver ? 0 : kFoldRulesCurrent;
  Status st = legacy_ == Legacy::kNone ? Status::OK() : JournalLegacyBootstrap();
  if (st.ok() && legacy_ == Legacy::kTakenOver) {
    st = TakeOverLegacy();
  } else if (st.ok()) {
    st = runner_->Bootstrap("rc-0", IdentityFor(kInitialWeights, 0));
  }
  if (!st.ok()) {
    Violate("bootstrap: " + st.ToString());
    return false;
  }
  result_.stats.recheck.rules0_worlds += legacy_ == Legacy::kTakenOver ? 1 : 0;
  result_.stats.recheck.rebootstrapped_worlds += legacy_ == Legacy::kBootstrappedAgain ? 1 : 0;
  return ProbeRulesChange();
}

// A draw of its own (every other choice of the seed stays what it was); the world's index picks
// which of the two legacy journals it is.
World::Legacy World::LegacyFor() const {
  if (o_.legacy_one_in == 0) return Legacy::kNone;
  std::mt19937_64 pick(o_.seed * 0x9FB21C651E98DF25ull + index_);
  if (pick() % o_.legacy_one_in != 0) return Legacy::kNone;
  return index_ % 2 == 1 ? Legacy::kTakenOver : Legacy::kBootstrappedAgain;
}

// What an earlier RolloutCore journaled first: the bootstrap request, without fold rules (a
// record without the field reads 0).
Status World::JournalLegacyBootstrap() {
  BootstrapRequested legacy{"rc-0", IdentityFor(kInitialWeights, 0)};
  legacy.fold_rules = 0;
  Status why;
  if (SubmitAcked(legacy, &why)) return Status::OK();
  return why.ok() ? Status::Unavailable("the journal failed") : why;
}

// This build's executor starts on that journal as after a restart: its recovery drives the
// bootstrap's probe, and the journal folds by the rules its request recorded.
Status World::TakeOverLegacy() {
  RC_RETURN_IF_ERROR(runner_->Recover(journal_->recovery()));
  const Lifecycle l = journal_->state().lifecycle;
  if (l == Lifecycle::kReady) return Status::OK();
  return Status::Unavailable(std::string("the legacy bootstrap ended in ") + lifecycle_name(l));
}

// A journal folds by the rules it reached READY under, for its life: a bootstrap naming other
// rules is refused once READY, with nothing written. False (a violation) otherwise.
bool World::ProbeRulesChange() {
  if (journal_->state().fold_rules != fold_rules_) {
    Violate("the journal folds by rules " + std::to_string(journal_->state().fold_rules) +
            ", not the " + std::to_string(fold_rules_) + " it was bootstrapped under");
    return false;
  }
  BootstrapRequested other{"rc-0", IdentityFor(kInitialWeights, 0)};
  other.fold_rules = fold_rules_ == 0 ? kFoldRulesCurrent : 0;
  const std::uint64_t head = journal_->head_seq();
  auto submitted = journal_->Submit(other, clock_.wall_ms());
  if (submitted.ok()) (void)journal_->Wait(submitted->ticket);
  if (submitted.ok() || journal_->head_seq() != head ||
      journal_->state().fold_rules != fold_rules_) {
    Violate("a bootstrap naming fold rules " + std::to_string(other.fold_rules) +
            " was accepted on a READY journal of rules " + std::to_string(fold_rules_));
    return false;
  }
  result_.stats.recheck.rules_changes_refused++;
  return true;
}

// Every 10 ms of virtual time: renewals, the lease reaper, the engine monitor.
void World::Tick() {
  for (auto& [id, c] : clients_) {
    if (c.alive && c.admitted && c.lease_ms > 0) c.last_renew_us = sched_.now_us();
  }
  if (journal_ && !journal_->failed()) {
    Reap();
    Monitor();
  }
  sched_.After(kTickUs, [this] { Tick(); });
}

// The executor's lease reaper: an explicit rollout whose client stopped renewing is expired.
void World::Reap() {
  const State s = journal_->state();
  for (const auto& [id, r] : s.active) {
    if (r.lease_ms == 0) continue;
    auto c = clients_.find(id);
    std::int64_t renewed = c != clients_.end() && c->second.alive ? c->second.last_renew_us : 0;
    if (renewed == 0) renewed = lease_seen_us_.emplace(id, sched_.now_us()).first->second;
    if (sched_.now_us() - renewed <= std::int64_t{r.lease_ms} * 1000) continue;
    SubmitAcked(RolloutFinished{id, RolloutOutcome::kExpired, 0, 0});
  }
}

// The engine monitor: submits EngineMonitored only when something changed. While SLEEPING it
// watches too, without a weight digest (a sleeper's weights are not mapped), as serve does.
void World::Monitor() {
  const State s = journal_->state();
  CheckReadyAwake(s);
  const bool asleep = s.lifecycle == Lifecycle::kSleeping;
  if ((s.lifecycle != Lifecycle::kReady && !asleep) || s.update.has_value()) return;
  if (recovering_ && !o_.monitor_during_recovery) return;
  EngineMonitored m = ctl_.Monitor(!asleep);
  m.updates_seen = monitor_epoch(s);
  m.last_ok_wall_ms = clock_.wall_ms();
  JudgeLook(s, m);
  const bool reachable = m.http.ok_2xx();
  const bool drifted = !weights_match(s, m.digest);
  const bool differs = asleep ? !engine_matches(s, m.reported_label, m.is_paused_known, m.is_paused,
                                                m.engine_instance)
                              : m.reported_label != s.committed.label || m.is_paused ||
                                    m.engine_instance != s.engine_instance || drifted;
  const bool changed = reachable ? (!s.engine_reachable || look_clears_recheck(s, m) || differs)
                                 : s.engine_reachable;
  if (!changed) return;
  const bool healthy_sleeper = asleep && HealthySleeper(s);
  SubmitAcked(m);  // a refusal (stale, an effect in flight) is the fold's word
  if (healthy_sleeper && tainted()) {
    Violate("the monitor tainted a healthy sleeper (same process and label, asleep, paused): " +
            journal_->state().taint->detail);
  }
}

// Every look, journaled or not, against the rules for a pending re-verification (sim/oracle.h).
void World::JudgeLook(const State& s, const EngineMonitored& m) {
  const LookJudgement j = JudgeMonitorLook(s, m);
  if (!j.broken.empty()) return Violate("monitor look: " + j.broken);
  // Awake and READY, a look reads the digest: one without it is a read that failed.
  const bool failed_read = s.lifecycle == Lifecycle::kReady && j.unread;
  if (j.judged && failed_read && j.vouched && !j.cleared && s.fold_rules >= 1) {
    result_.stats.recheck.monitor_looks_kept_pending++;
  }
}

// The engine's truth while SLEEPING: the process, the label and the sleep the fold knows.
bool World::HealthySleeper(const State& s) {
  const EngineTruth& t = engine_.truth();
  return t.alive && engine_.instance_name() == s.engine_instance && t.label == s.committed.label &&
         t.paused && engine_.asleep();
}

// READY never on an engine whose weights or KV cache sleep: it would serve from released memory.
void World::CheckReadyAwake(const State& s) {
  const EngineTruth& t = engine_.truth();
  if (s.lifecycle != Lifecycle::kReady || s.update.has_value() || !t.alive) return;
  if (!engine_.asleep() || ready_asleep_reported_) return;
  ready_asleep_reported_ = true;
  Violate("READY on '" + s.committed.label + "' while the engine's " +
          (t.weights_asleep ? "weights sleep" : "KV cache sleeps") + " (level " +
          std::to_string(t.sleep_level) + ")");
}

void World::ClientAdmit(const std::string& id) {
  Client& c = clients_.at(id);
  if (!journal_ || journal_->failed()) {
    c.alive = false;
    return;
  }
  const State before = journal_->state();
  const bool asleep = before.lifecycle == Lifecycle::kSleeping;
  const RolloutAdmitted a = make_admission(before, id, c.lease_ms);
  if (!SubmitAcked(a)) {  // 503: refused while updating, asleep or tainted, or the journal failed
    if (asleep && !journal_->failed()) result_.stats.colocated.admissions_refused++;
    if (before.engine_recheck && !journal_->failed()) {
      result_.stats.recheck.admissions_refused_pending++;
    }
    c.alive = false;
    return;
  }
  if (asleep) Violate("admission of '" + id + "' acknowledged while SLEEPING");
  if (before.engine_recheck) {
    Violate("admission of '" + id +
            "' acknowledged while the engine's re-verification was pending");
  }
  result_.stats.admissions_acked++;
  // Judged once the update is over: it may have ended (refused, say) inside a recovery that ran
  // before this admission, which is legal.
  if (update_open_) admitted_during_update_.emplace_back(id, acked_.back().first);
  c.admitted = true;
  c.transfer_epoch = engine_.truth().transfer_epoch;
  c.last_renew_us = sched_.now_us();
  if (c.vanish) {
    c.alive = false;  // never renews, never finishes: its lease must be expired
    return;
  }
  ClientSend(id);
}

void World::ClientSend(const std::string& id) {
  Client& c = clients_.at(id);
  if (journal_->state().lifecycle == Lifecycle::kSleeping) {
    Violate("rollout '" + id + "' sent a request to the engine while SLEEPING");
  }
  // 0.25.x relies on the proxy's per-version cache_salt; the newer line on the resets.
  const std::string key =
      (engine_.line() == Line::k025 ? "salt-" + journal_->state().committed.label : std::string()) +
      "/prefix-" + std::to_string(rng_() % 4);
  c.request = engine_.Start(id, key, c.duration_ms, [this, id](bool ok) { ClientDone(id, ok); });
  if (c.request == 0) {
    ClientFinish(id, RolloutOutcome::kAborted);
    return;
  }
  if (c.disconnect) {
    const std::uint64_t req = c.request;
    sched_.After(std::int64_t{c.duration_ms} * 500, [this, id, req] {
      Client& cl = clients_.at(id);
      if (!cl.alive || cl.request != req) return;
      engine_.Abort(req);
      ClientFinish(id, RolloutOutcome::kAborted);
    });
  }
}

void World::ClientDone(const std::string& id, bool ok) {
  Client& c = clients_.at(id);
  if (!c.alive) return;
  c.request = 0;
  if (engine_.truth().transfer_epoch != c.transfer_epoch) {
    Violate("rollout '" + id + "' spans two weight states (transfer epoch " +
            std::to_string(c.transfer_epoch) + " -> " +
            std::to_string(engine_.truth().transfer_epoch) + ")");
  }
  if (ok && --c.requests_left > 0) {
    sched_.After(2000, [this, id] {
      if (clients_.at(id).alive) ClientSend(id);
    });
    return;
  }
  ClientFinish(id, ok ? RolloutOutcome::kCompleted : RolloutOutcome::kAborted);
}

void World::ClientFinish(const std::string& id, RolloutOutcome outcome) {
  Client& c = clients_.at(id);
  Status why;
  if (SubmitAcked(RolloutFinished{id, outcome, 0, 0}, &why)) {
    c.finish_acked = true;
    c.alive = false;
    return;
  }
  if (!why.ok()) {  // refused: an acknowledged binding must still be active
    Violate("finish of acknowledged rollout '" + id + "' refused: " + why.ToString());
    c.alive = false;
    return;
  }
  // The journal failed: a proxied client died with the executor; an explicit one retries.
  if (c.lease_ms == 0 || ++c.finish_tries > kFinishRetriesMax) {
    c.alive = false;
    return;
  }
  sched_.After(50000, [this, id, outcome] {
    if (clients_.at(id).alive) ClientFinish(id, outcome);
  });
}

void World::Arm(const Fault& f, std::vector<Client>& spawn) {
  result_.stats.faults++;
  if (ArmCallFault(f, ctl_.faults())) return;
  switch (f.kind) {
    case FaultKind::kEngineRestartReady:
      restart_engine_ready_ = true;
      break;
    case FaultKind::kRelabel:
      sched_.After(std::int64_t{f.b % 60} * 1000, [this, f] {
        if (!engine_.truth().alive) return;
        engine_.SetLabel("intruder-" + std::to_string(f.a));
        outside_us_ = sched_.now_us();
      });
      break;
    case FaultKind::kExternalPause:
      sched_.After(std::int64_t{f.b % 60} * 1000, [this] {
        if (engine_.truth().alive) engine_.Pause();
      });
      break;
    case FaultKind::kWalFault:
      faults_->Inject(FileKind::kWal, f.a % 2 ? FileOp::kSync : FileOp::kAppend,
                      f.b % 2 ? journal::testing::Fault::kEio : journal::testing::Fault::kEnospc,
                      f.a % 12);
      break;
    case FaultKind::kFsyncStall:
      faults_->StallSync(FileKind::kWal, kStallMs);
      break;
    case FaultKind::kExecutorCrash:
      crash_at_ = observed_ + 1 + f.a % 24;
      break;
    case FaultKind::kClockJump:
      clock_.Jump((f.b % 2 ? 1 : -1) * std::int64_t{f.b % 3600} * 1000);
      break;
    case FaultKind::kDisconnect:
      if (!spawn.empty()) spawn[f.a % spawn.size()].disconnect = true;
      break;
    case FaultKind::kLeaseStop:
      if (!spawn.empty()) {
        Client& c = spawn[f.a % spawn.size()];
        c.lease_ms = kLeaseMs;
        c.vanish = true;
      }
      break;
    case FaultKind::kExternalUpdate:
      sched_.After(std::int64_t{f.b % 60} * 1000, [this] { ExternalUpdate(50); });
      break;
    case FaultKind::kSlowRollout:
      if (!spawn.empty()) spawn[f.a % spawn.size()].duration_ms = 300 + f.b % 2000;
      break;
    case FaultKind::kSleepDeath:
      sleep_death_ = f;
      break;
    case FaultKind::kExternalWake:
      external_wake_ = f;
      break;
    case FaultKind::kExternalSleep:
      sched_.After(std::int64_t{f.b % 60} * 1000, [this, f] { ExternalSleep(f); });
      break;
    case FaultKind::kRestartKeepsLabel:
      sched_.After(std::int64_t{f.b % 60} * 1000,
                   [this, f] { engine_.Die(50, LabelKeepingComeback(f)); });
      break;
    case FaultKind::kDigestUnread:
      ctl_.ArmDigestFaults(f);
      break;
    case FaultKind::kExecutorRestartAsleep:
      restart_asleep_ = f;
      break;
    default:  // ArmCallFault's, and kCount
      break;
  }
}

void World::Spawn(std::mt19937_64& rng, std::vector<Client>& out, std::uint32_t cycle) {
  const int n = 1 + static_cast<int>(rng() % 6);
  for (int i = 0; i < n; ++i) {
    Client c;
    c.id = "r" + std::to_string(cycle) + "-" + std::to_string(i);
    if (rng() % 3 == 0) {
      c.lease_ms = kLeaseMs;
      c.requests_left = 1 + static_cast<std::uint32_t>(rng() % 3);
    }
    c.duration_ms = 1 + static_cast<std::uint32_t>(rng() % 20);
    out.push_back(c);
  }
}

void World::RunCycle(std::uint32_t cycle, const std::vector<Fault>& faults) {
  cycle_ = cycle;
  cycles_++;
  result_.stats.cycles++;
  ctl_.faults() = CycleFaults{};
  ctl_.DisarmDigestFaults();
  restart_engine_ready_ = false;
  sleep_death_.reset();
  external_wake_.reset();
  restart_asleep_.reset();
  std::mt19937_64 rng(o_.seed * 0x100000001B3ull ^ (std::uint64_t{cycle} << 20));
  std::vector<Client> spawn;
  Spawn(rng, spawn, cycle);
  for (const Fault& f : faults) Arm(f, spawn);
  for (Client& c : spawn) {
    const std::string id = c.id;
    const std::int64_t at = static_cast<std::int64_t>(rng() % 30) * 1000;
    clients_[id] = std::move(c);
    sched_.After(at, [this, id] { ClientAdmit(id); });
  }
  Sleep(static_cast<std::uint32_t>(rng() % 20));
  RunPlans(cycle);
  Sleep(60);  // rollouts finish, the monitor looks
  if (restart_engine_ready_ && journal_ && journal_->state().lifecycle == Lifecycle::kReady) {
    engine_.Die(static_cast<std::uint32_t>(rng() % 50));
    Sleep(120);
  }
  Sleep(40);
  for (int k = 0; journal_ && journal_->failed() && k < kRestartsPerCycleMax; ++k) {
    if (!Restart()) return;  // a client's append met the fault after the update
  }
  EndOfCycleChecks(cycle);
  if (cycles_ % o_.check_every == 0) FullChecks(false);
}

// The cycle's plan: a restore of a TAINTED engine, a plan from sleep when the engine sleeps, a
// colocated cycle (sleep, then a wake-up or an update from sleep) one time in colocated_one_in
// when it is READY, else an update.
void World::RunPlans(std::uint32_t cycle) {
  const State s = journal_->state();
  if (s.lifecycle == Lifecycle::kSleeping) return ContinueAsleep(cycle);
  const bool can_sleep =
      s.lifecycle == Lifecycle::kReady && !s.engine_recheck && !s.update.has_value();
  if (can_sleep && o_.colocated_one_in > 0 && colocated_rng_() % o_.colocated_one_in == 0) {
    return RunColocated(cycle);
  }
  RunUpdate(cycle);
}

// The trainer digests the checkpoint in the engine's layout: VALIDATING must see exactly it.
UpdateRequested World::UpdateFor(std::uint32_t cycle) const {
  const std::string ckpt = "ckpt/c" + std::to_string(cycle);
  return UpdateRequested{"u" + std::to_string(index_) + "-" + std::to_string(cycle),
                         "rc-c" + std::to_string(cycle), IdentityFor(ckpt, cycle),
                         "synthetic:" + ckpt, SimDigest(ckpt).combined};
}

void World::CountUpdate(const PlanEnd& end) {
  result_.stats.committed += end.is(UpdateOutcome::kCommitted);
  result_.stats.refused += end.is(UpdateOutcome::kRefused);
  result_.stats.tainted += end.is(UpdateOutcome::kTainted);
}

void World::RunUpdate(std::uint32_t cycle) {
  const State before = journal_->state();
  if (before.lifecycle == Lifecycle::kTainted) return RunRestore(cycle);
  if (before.lifecycle != Lifecycle::kReady || before.engine_recheck) return;
  const UpdateRequested request = UpdateFor(cycle);
  update_open_ = true;
  const std::uint64_t request_after_seq = journal_->head_seq();
  const PlanEnd end = RunPlan(request.update_id, [&] { return runner_->Update(request); });
  CountUpdate(end);
  if (!end.world_ok) return;
  EndPlan();
  CheckAdmissionsDuring(request.update_id, request_after_seq);
}

// Runs one plan to its end: the answer is recorded, its virtual time held to the budget, and the
// executor restarted (when it died or failed) until nothing is in flight.
PlanEnd World::RunPlan(const std::string& id, const std::function<Result<UpdateEnded>()>& run) {
  const std::int64_t start_ms = clock_.now_ms();
  Result<UpdateEnded> ended = run();
  if (clock_.now_ms() - start_ms > kUpdateBudgetMs) {
    Violate("'" + id + "' ran " + std::to_string(clock_.now_ms() - start_ms) +
            " ms of virtual time (budget " + std::to_string(kUpdateBudgetMs) + ")");
  }
  const bool crashed = crash_at_ > 0 && observed_ >= crash_at_;
  if (crashed) crash_at_ = 0;
  PlanEnd end;
  if (ended.ok()) {
    answers_[id] = ended->outcome;
    end.outcome = ended->outcome;
  } else {
    result_.stats.update_errors++;
  }
  end.world_ok = FinishEffect(id, crashed, ended.ok());
  return end;
}

// After an update or a restore: restarts until nothing is in flight. False when the world cannot
// go on (a violation, or no journal).
bool World::FinishEffect(const std::string& id, bool crashed, bool ok) {
  bool restart = crashed || journal_->failed() || !ok;
  for (int k = 0; restart; ++k) {
    if (k >= kRestartsPerCycleMax) {
      Violate("'" + id + "' did not end after " + std::to_string(k) + " restarts");
      return false;
    }
    if (k > 0) Sleep(250);  // an engine that is down comes back
    if (!Restart()) return false;
    restart = journal_->state().update.has_value() || journal_->failed();
  }
  return true;
}

// The cycle's last plan is over: what did not fire of its faults is disarmed.
void World::EndPlan() {
  update_open_ = false;
  crash_at_ = 0;
  ctl_.faults() = CycleFaults{};
  sleep_death_.reset();
  external_wake_.reset();
  restart_asleep_.reset();
  if (!journal_->failed()) faults_->Clear();
}

// A colocated cycle: the trainer puts the READY engine to sleep (level 1 or 2), trains while it
// sleeps, then wakes it or updates it from sleep. The cycle's faults stay armed across both plans.
void World::RunColocated(std::uint32_t cycle) {
  ColocatedStats& st = result_.stats.colocated;
  st.cycles++;
  st.sleeps++;
  const std::string id = "s" + std::to_string(index_) + "-" + std::to_string(cycle);
  const auto level = static_cast<std::uint8_t>(1 + colocated_rng_() % 2);
  const std::uint64_t after_seq = journal_->head_seq();
  colocated_ = true;
  update_open_ = true;
  const PlanEnd slept = RunPlan(id, [&] { return runner_->Sleep(SleepRequested{id, level}); });
  if (!slept.world_ok) return;
  st.slept += slept.is(UpdateOutcome::kCommitted);
  if (!journal_->failed() && journal_->state().lifecycle == Lifecycle::kSleeping) {
    return AsleepThenWake(cycle, id, after_seq);
  }
  EndColocated(id, after_seq);
}

// The engine still sleeps from an earlier cycle (its plan from sleep was refused, or the journal
// failed while it slept): this cycle wakes or updates it.
void World::ContinueAsleep(std::uint32_t cycle) {
  result_.stats.colocated.cycles++;
  result_.stats.colocated.began_asleep++;
  colocated_ = true;
  update_open_ = true;
  AsleepThenWake(cycle, "", journal_->head_seq());
}

void World::AsleepThenWake(std::uint32_t cycle, const std::string& sleep_id,
                           std::uint64_t after_seq) {
  if (!AsleepInterval(cycle)) return;
  if (!journal_->failed() && journal_->state().lifecycle == Lifecycle::kSleeping) {
    if (!RunFromSleep(cycle, journal_->state())) return;
  }
  EndColocated(sleep_id, after_seq);
}

// Virtual time passes with the engine asleep: clients keep trying to admit (each must be
// refused), the monitor keeps watching, and the cycle's colocated faults strike. False when the
// world cannot go on.
bool World::AsleepInterval(std::uint32_t cycle) {
  const auto interval_ms =
      static_cast<std::uint32_t>(kAsleepMsMin + colocated_rng_() % kAsleepMsSpread);
  const auto tries = static_cast<std::uint32_t>(1 + colocated_rng_() % kAsleepAdmissionsMax);
  for (std::uint32_t i = 0; i < tries; ++i) {
    Client c;
    c.id = "z" + std::to_string(cycle) + "-" + std::to_string(i);
    const std::string id = c.id;
    const auto at_us = static_cast<std::int64_t>(colocated_rng_() % interval_ms) * 1000;
    clients_[id] = std::move(c);
    sched_.After(at_us, [this, id] { ClientAdmit(id); });
  }
  ArmAsleep();
  if (!restart_asleep_) {
    Sleep(interval_ms);
    return true;
  }
  const std::uint32_t restart_ms = std::min(interval_ms, restart_asleep_->a % 100);
  restart_asleep_.reset();
  Sleep(restart_ms);
  if (!RestartAsleep()) return false;
  Sleep(interval_ms - restart_ms);
  if (!journal_->failed() && journal_->state().lifecycle == Lifecycle::kSleeping) {
    CheckSleeper(journal_->state());  // its re-verification pending, unless rules 0 cleared it
  }
  return true;
}

// kExecutorRestartAsleep: the executor restarts (as after a crash) while the engine sleeps and no
// plan runs. False when the world cannot go on.
bool World::RestartAsleep() {
  if (journal_->failed() || journal_->state().lifecycle != Lifecycle::kSleeping) return true;
  result_.stats.colocated.executor_restarts_asleep++;
  return Restart();
}

// Someone sleeps the engine while a plan in RESUMING holds it paused (a validated update, or a
// refused one on its way back): the monitor sees only "paused", which the plan expects, so only
// the resume's own reads can tell. Earlier in a plan such a sleep is not drawn: the transfer would
// write into released memory, and a validation that fails on it taints without the sleep level
// (docs/lifecycle.md: not handled yet).
void World::ExternalSleep(const Fault& f) {
  if (!journal_ || !engine_.truth().alive || !engine_.truth().paused || engine_.asleep()) return;
  const State s = journal_->state();
  if (!s.update || s.lifecycle != Lifecycle::kResuming || s.update->from_sleep) return;
  result_.stats.colocated.external_sleeps++;
  engine_.Sleep(static_cast<std::uint8_t>(1 + f.a % 2));
}

// The colocated faults act on a sleeping engine only: one that was woken meanwhile is left be.
void World::ArmAsleep() {
  if (sleep_death_) {
    const Fault f = *sleep_death_;
    sched_.After(std::int64_t{f.a % 100} * 1000, [this, f] {
      if (!engine_.truth().alive || !engine_.asleep()) return;
      result_.stats.colocated.sleep_deaths++;
      engine_.Die(f.b % 200);
    });
  }
  if (external_wake_) {
    const Fault f = *external_wake_;
    sched_.After(std::int64_t{f.a % 100} * 1000, [this, f] {
      if (!engine_.truth().alive || !engine_.asleep()) return;
      result_.stats.colocated.external_wakes++;
      outside_us_ = sched_.now_us();
      if (f.b % 2 == 0) {
        engine_.Resume();  // POST /resume: the scheduler runs on released memory
      } else {
        engine_.WakeAll();  // POST /wake_up without tags
      }
    });
  }
}

// A wake-up (level 1 only, half the time) or an update from sleep; after level 2, one time in
// four the refusals are probed first. False when the world cannot go on.
bool World::RunFromSleep(std::uint32_t cycle, const State& s) {
  ColocatedStats& st = result_.stats.colocated;
  if (s.sleep_level >= 2 && colocated_rng_() % 4 == 0) ProbeLevel2Refusals(cycle);
  if (s.sleep_level == 1 && colocated_rng_() % 2 == 0) {
    const std::string id = "w" + std::to_string(index_) + "-" + std::to_string(cycle);
    st.wakes++;
    const PlanEnd woken = RunPlan(id, [&] { return runner_->Wake(WakeRequested{id}); });
    st.woken += woken.is(UpdateOutcome::kCommitted);
    return woken.world_ok;
  }
  const UpdateRequested request = UpdateFor(cycle);
  st.updates_from_sleep++;
  const PlanEnd end = RunPlan(request.update_id, [&] { return runner_->Update(request); });
  CountUpdate(end);
  st.committed_from_sleep += end.is(UpdateOutcome::kCommitted);
  st.refused_from_sleep += end.is(UpdateOutcome::kRefused);
  return end.world_ok;
}

// After a level-2 sleep the weights are garbage: a wake-up, and an update that does not carry the
// committed manifest, must be refused with nothing journaled and the engine left asleep.
void World::ProbeLevel2Refusals(std::uint32_t cycle) {
  result_.stats.colocated.refusals_probed++;
  const std::uint64_t head = journal_->head_seq();
  const std::string wake_id = "w" + std::to_string(index_) + "-" + std::to_string(cycle) + "-l2";
  const Result<UpdateEnded> woken = runner_->Wake(WakeRequested{wake_id});
  UpdateRequested partial = UpdateFor(cycle);
  partial.update_id += "-partial";
  partial.identity.manifest_digest = std::string(64, 'b');
  const Result<UpdateEnded> updated = runner_->Update(partial);
  if (journal_->failed()) return;
  const bool still_asleep = journal_->state().lifecycle == Lifecycle::kSleeping;
  if (woken.ok() || updated.ok() || journal_->head_seq() != head || !still_asleep) {
    Violate(std::string("after a level-2 sleep ") +
            (woken.ok() ? "a wake-up" : "an update without the committed manifest") +
            " was not refused (head " + std::to_string(head) + " -> " +
            std::to_string(journal_->head_seq()) + ")");
  }
}

// The colocated cycle is over (the engine may sleep on into the next one).
void World::EndColocated(const std::string& sleep_id, std::uint64_t after_seq) {
  EndPlan();
  CheckAdmissionsDuring(sleep_id, after_seq);
  colocated_ = !journal_->failed() && journal_->state().lifecycle == Lifecycle::kSleeping;
}

// The operator's restore of a TAINTED engine to the committed version: adopt (half the time)
// when the monitor saw a restarted engine, else reload the version's checkpoint; one reload in
// eight names the wrong checkpoint, which must never be published.
RestoreRequested World::PlanRestore(const State& s, std::uint32_t cycle) {
  RestoreRequested r;
  r.restore_id = "x" + std::to_string(index_) + "-" + std::to_string(cycle);
  r.label = s.committed.label;
  r.adopt = s.taint->cause == Cause::kEngineReplaced && rng_() % 2 == 0;
  if (r.adopt) return r;
  const bool wrong = rng_() % 8 == 0;
  r.source_uri = "synthetic:" + (wrong ? "ckpt/elsewhere" : s.committed_identity.checkpoint);
  if (wrong) wrong_sources_.insert(r.restore_id);
  return r;
}

void World::RunRestore(std::uint32_t cycle) {
  const State before = journal_->state();
  const RestoreRequested request = PlanRestore(before, cycle);
  update_open_ = true;
  const std::uint64_t request_after_seq = journal_->head_seq();
  const PlanEnd end = RunPlan(request.restore_id, [&] { return runner_->Restore(request); });
  const bool committed = end.is(UpdateOutcome::kCommitted);
  result_.stats.restores++;
  result_.stats.restored += committed;
  if (committed && wrong_sources_.count(request.restore_id)) {
    Violate("restore '" + request.restore_id + "' from the wrong checkpoint was published");
  }
  if (!end.world_ok) return;
  EndPlan();
  restores_failed_ = tainted() ? restores_failed_ + 1 : 0;
  CheckAdmissionsDuring(request.restore_id, request_after_seq);
}

// No admission while a plan, or the sleep it began, is open: the window opens at the request
// named `id` (none: the cycle began asleep, so right after after_seq) and closes when the engine
// is READY or TAINTED again (a committed sleep, or a refused plan from sleep, keeps it open).
void World::CheckAdmissionsDuring(const std::string& id, std::uint64_t after_seq) {
  std::vector<std::pair<std::string, std::uint64_t>> admitted;
  admitted.swap(admitted_during_update_);
  if (admitted.empty() || !journal_ || journal_->failed()) return;
  std::uint64_t opened = id.empty() ? after_seq : 0, closed = 0;
  Status st = journal_->Scan(after_seq + 1, 0, [&](const journal::Record& r) {
    if (opened == 0 && !id.empty() && RequestId(r.event) == id) opened = r.seq;
    const auto* c = std::get_if<StateChanged>(&r.event);
    const bool awake = c != nullptr && (c->to == Lifecycle::kReady || c->to == Lifecycle::kTainted);
    if (opened != 0 && closed == 0 && awake) closed = r.seq;
    return Status::OK();
  });
  if (!st.ok() || opened == 0) return;  // refused before anything was journaled
  for (const auto& [rollout_id, seq] : admitted) {
    if (seq > opened && (closed == 0 || seq < closed)) {
      Violate("admission of '" + rollout_id + "' (seq " + std::to_string(seq) +
              ") acknowledged while '" + (id.empty() ? std::string("the sleep") : id) +
              "' was open");
    }
  }
}

// The executor process dies (or fail-stopped) and restarts from what is durable.
bool World::Restart() {
  result_.stats.restarts++;
  faults_->Crash();
  runner_.reset();
  journal_.reset();
  std::uint64_t kept = 0;
  const Torn torn = rng_() % 2 ? Torn::kRandomPrefix : Torn::kNone;
  rocksdb::Status ds = faults_->DropUnsyncedData(torn, rng_(), &kept);
  if (!ds.ok()) Violate("drop unsynced: " + ds.ToString());
  faults_->Restart();
  crash_at_ = 0;
  if (!Open()) return false;
  // Proxied clients were the dead executor's connections; explicit ones are other processes.
  for (auto& [id, c] : clients_) {
    if (!c.alive) continue;
    if (c.lease_ms == 0) {
      if (c.request) engine_.Abort(c.request);
      c.alive = false;
    } else {
      c.last_renew_us = sched_.now_us();
    }
  }
  lease_seen_us_.clear();
  NewRunner();
  recovering_ = true;
  Status rec = runner_->Recover(journal_->recovery());
  recovering_ = false;
  if (!rec.ok()) Violate("Recover: " + rec.ToString());
  last_restart_us_ = sched_.now_us();
  FullChecks(false);  // no acknowledged event is lost across the crash
  return rec.ok();
}

void World::EndOfCycleChecks(std::uint32_t cycle) {
  (void)cycle;
  if (!journal_ || journal_->failed()) return;
  const State s = journal_->state();
  if (s.lifecycle != Lifecycle::kReady && s.lifecycle != Lifecycle::kTainted &&
      s.lifecycle != Lifecycle::kSleeping) {
    Violate(std::string("the cycle ended in ") + lifecycle_name(s.lifecycle));
    return;
  }
  if (s.lifecycle == Lifecycle::kTainted) {
    result_.stats.taints[cause_name(s.taint->cause)]++;
    return;
  }
  if (s.lifecycle == Lifecycle::kSleeping) {
    result_.stats.colocated.ended_asleep++;
    return CheckSleeper(s);
  }
  if (!s.engine_reachable || !engine_.truth().alive) return;
  if (s.engine_recheck) return CheckRecheckProgress(s);
  CheckReadyEngine(s);
}

std::string World::CommittedWeights(const State& s) const {
  return s.committed.generation == 0 ? std::string(kInitialWeights)
                                     : s.committed_identity.checkpoint;
}

// The engine is the one the fold verified, on the committed weights and label, awake, unpaused.
bool World::EngineIsCommitted(const State& s) const {
  const EngineTruth& t = engine_.truth();
  return t.alive && engine_.instance_name() == s.engine_instance && t.label == s.committed.label &&
         !t.paused && !engine_.asleep() && t.weights == CommittedWeights(s);
}

// READY and re-verified: the engine is the committed one. Weights changed after the last digest
// read that succeeded (kDigestUnread) are the monitor's still to find, at its next read.
void World::CheckReadyEngine(const State& s) {
  const EngineTruth& t = engine_.truth();
  const std::string want = CommittedWeights(s);
  const bool weights_read = ctl_.last_digest_read_op() >= t.last_mutation_op;
  if ((t.weights != want && weights_read) || t.label != s.committed.label ||
      engine_.instance_name() != s.engine_instance || t.paused || engine_.asleep()) {
    Violate("READY on '" + s.committed.label + "' (" + want + ") but the engine holds '" +
            t.weights + "' labelled '" + t.label + "'" + (t.paused ? ", paused" : "") +
            (engine_.asleep() ? ", asleep" : ""));
  }
}

// READY with a re-verification pending admits nothing (every admission is checked too), and the
// wait is bounded: once kRecheckTicksMax monitor looks read the committed engine's digest (none
// failed, no executor restart since), the re-verification is over.
void World::CheckRecheckProgress(const State& s) {
  if (admits(s)) return Violate("READY admits while the engine's re-verification is pending");
  const std::int64_t since_us = std::max(ctl_.last_digest_failure_us(), last_restart_us_);
  const std::int64_t quiet_us = sched_.now_us() - since_us;
  if (quiet_us <= kRecheckTicksMax * kTickUs || !EngineIsCommitted(s)) return;
  Violate("READY on '" + s.committed.label + "' still awaits its re-verification " +
          std::to_string(quiet_us / 1000) + " ms after the last failed digest read or " +
          "executor restart, though the engine is the verified one on the committed weights");
}

// A SLEEPING fold, its re-verification pending or not (sim/oracle.h, JudgeSleeper): the engine it
// verified sleeps at its level, paused, holding no request; anything else is the monitor's to
// taint within two ticks.
void World::CheckSleeper(const State& s) {
  // The monitor sees nothing while the executor is down: what changed before a restart is its to
  // see within the grace that follows the restart.
  const SleeperJudgement j = JudgeSleeper(s, engine_, sched_.now_us(),
                                          std::max(outside_us_, last_restart_us_), kMonitorGraceUs);
  if (j.judged && s.engine_recheck) result_.stats.colocated.sleepers_checked_pending++;
  if (!j.mismatch.empty()) Violate(j.mismatch);
}

// Scans the journal: acknowledged events, answers, the history checker, the rules of a pending
// re-verification, refold and snapshot against the live state (the fold rules with it), bindings.
// Bounded by the world's size (cycles_per_world). `with_replay`: the world's last check, at its
// close, which replays the journal and counts its figures.
void World::FullChecks(bool with_replay) {
  if (!journal_ || journal_->failed()) return;
  result_.stats.full_checks++;
  std::vector<journal::Record> records;
  Status scanned = journal_->Scan(1, 0, [&](const journal::Record& r) {
    records.push_back(r);
    return Status::OK();
  });
  if (!scanned.ok()) return Violate("scan: " + scanned.ToString());
  for (const auto& [seq, e] : acked_) {
    if (seq < 1 || seq > records.size()) {
      return Violate("acknowledged seq " + std::to_string(seq) + " (" + event_name(e) +
                     ") lost: head " + std::to_string(records.size()));
    }
    if (!(records[seq - 1].event == e)) {
      return Violate("acknowledged seq " + std::to_string(seq) + " was " + event_name(e) +
                     ", the journal holds " + event_name(records[seq - 1].event));
    }
  }
  std::vector<HistoryEntry> history;
  history.reserve(records.size());
  std::map<std::string, UpdateOutcome> ended;
  std::map<std::string, int> finishes;
  std::map<std::string, std::uint64_t> admitted_gen;
  std::uint64_t gen = 0;
  Lifecycle lifecycle = Lifecycle::kUninitialized;  // as the journal's own StateChanged say
  for (const journal::Record& r : records) {
    history.push_back(HistoryEntry{r.seq, r.cause_seq, r.event});
    if (const auto* c = std::get_if<StateChanged>(&r.event)) lifecycle = c->to;
    if (std::holds_alternative<RolloutAdmitted>(r.event) && lifecycle != Lifecycle::kReady) {
      Violate("admission journaled at seq " + std::to_string(r.seq) + " in " +
              lifecycle_name(lifecycle));
    }
    if (const auto* e = std::get_if<UpdateEnded>(&r.event)) ended[e->update_id] = e->outcome;
    if (const auto* v = std::get_if<VersionPublished>(&r.event)) gen = v->version.generation;
    if (const auto* a = std::get_if<RolloutAdmitted>(&r.event)) admitted_gen[a->rollout_id] = gen;
    if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
      finishes[f->rollout_id]++;
      if (admitted_gen.count(f->rollout_id) && admitted_gen[f->rollout_id] != gen) {
        Violate("rollout '" + f->rollout_id + "' admitted under generation " +
                std::to_string(admitted_gen[f->rollout_id]) + " finished under " +
                std::to_string(gen));
      }
    }
  }
  for (const auto& [id, outcome] : answers_) {
    auto it = ended.find(id);
    if (it == ended.end() || it->second != outcome) {
      Violate("update '" + id + "' answered " + update_outcome_name(outcome) +
              " but the journal says " +
              (it == ended.end() ? std::string("nothing") : update_outcome_name(it->second)));
    }
  }
  const State live = journal_->state();
  if (live.lifecycle != Lifecycle::kUninitialized && live.fold_rules != fold_rules_) {
    Violate("the journal folds by rules " + std::to_string(live.fold_rules) + ", not the " +
            std::to_string(fold_rules_) + " it reached READY under");
  }
  for (const auto& [id, c] : clients_) {
    if (!c.admitted) continue;
    const int n = finishes.count(id) ? finishes[id] : 0;
    if (n > 1 || (n == 0 && live.active.count(id) == 0)) {
      Violate("acknowledged rollout '" + id + "' has " + std::to_string(n) +
              " finish records and is " + (live.active.count(id) ? "active" : "not active"));
    }
  }
  HistoryReport h = check_history(history);
  if (!h.ok) Violate("history: seq " + std::to_string(h.first_bad_seq) + ": " + h.message);
  RecheckHistoryCounts counts;
  const std::string recheck = CheckRecheckHistory(history, &counts);
  if (!recheck.empty()) Violate("re-verification: " + recheck);
  if (with_replay) {  // the world's last check: its final journal's figures
    result_.stats.recheck.journaled_clears += counts.clears;
    result_.stats.recheck.journaled_unread_kept += counts.unread_kept;
    result_.stats.recheck.rules0_unread_clears += counts.rules0_unread_clears;
  }
  auto refold = journal_->Refold();
  if (!refold.ok() || !(*refold == live)) Violate("refold differs from the live state");
  auto loaded = journal_->LoadState();
  if (!loaded.ok() || !(*loaded == live)) Violate("snapshot + tail differs from the live state");
  if (with_replay) {
    auto rep = replay::Replay(*journal_, {});
    if (!rep.ok() || !rep->ok)
      Violate("replay: " + (rep.ok() ? rep->error : rep.status().ToString()));
  }
  head_ = std::to_string(records.size()) + ":" +
          (records.empty() ? std::string()
                           : std::to_string(records.back().hash[0]) + "." +
                                 std::to_string(records.back().hash[31]));
}

// The world ends with a clean close and a reopen: everything acknowledged is still there.
void World::Close() {
  result_.stats.recheck.digest_reads_failed += ctl_.digest_reads_failed();
  result_.stats.recheck.validations_unread += ctl_.validations_unread();
  if (!journal_) return;
  if (!journal_->failed()) FullChecks(true);
  result_.stats.events += journal_->head_seq();
  const State before = journal_->state();
  runner_.reset();
  journal_.reset();
  if (index_ % 8 != 1) return;  // the reopen costs more than a world's cycles: every 8th world
  if (!Open()) return;
  if (!journal_->recovery().clean_close) Violate("a clean close was not recorded");
  if (!(journal_->state() == before)) Violate("the reopened state differs from the closed one");
  journal_.reset();
}

}  // namespace

SimResult Run(const SimOptions& options, const FaultPlan& plan) {
  SimResult result;
  std::map<std::uint32_t, std::vector<Fault>> by_cycle;
  for (const Fault& f : plan) by_cycle[f.cycle].push_back(f);
  const Line line = options.seed % 3 == 2 ? Line::k025 : Line::kNewer;
  std::unique_ptr<World> world;
  std::uint64_t index = 0;
  for (std::uint32_t cycle = 0; cycle < options.cycles && result.violations.empty(); ++cycle) {
    if (world && ((world->tainted() && world->restores_exhausted()) ||
                  world->cycles() >= options.cycles_per_world)) {
      world->Close();
      result.head += world->head() + ";";
      world.reset();
    }
    if (!world) {
      world = std::make_unique<World>(options, ++index, line, result);
      if (!world->Boot()) break;
    }
    auto it = by_cycle.find(cycle);
    world->RunCycle(cycle, it == by_cycle.end() ? std::vector<Fault>{} : it->second);
  }
  if (world && result.violations.empty()) {
    world->Close();
    result.head += world->head();
  }
  return result;
}

}  // namespace rc::sim
