// The simulator's fleet (SimOptions::fleet_engines > 0): N simulated engines behind one real
// journal and the real fleet executor, its members driven side by side on threads that take turns
// in virtual time (SimThreads: members drain, transfer and validate at once, in an order the seed
// fixes), with clients admitting across the fleet, the engine monitor on every engine, and the
// seed's faults aimed at single engines. Each cycle is one fleet update, `all` or `rolling`, under
// a policy drawn for the world.
//
// Checked: each rollout saw one weight state of its engine from admission to its end (the
// engine's own truth); each publish was validated on the target's weights, every cache reset,
// paused; at the end of each world, the journal against check_fleet_history (the fold's rules:
// staleness bound, quarantine, one generation per rollout) and replay re-deriving every decision.
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <rocksdb/env.h>

#include "effects/fleet_runner.h"
#include "journal/journal.h"
#include "replay/replay.h"
#include "sim/engine.h"
#include "sim/sim.h"
#include "sim/sim_threads.h"
#include "statemachine/fleet.h"
#include "statemachine/fleet_history.h"

namespace rc::sim {
namespace {

constexpr std::int64_t kTickUs = 10'000;           // monitor period (virtual)
constexpr std::uint32_t kStallTimeoutMs = 200;     // the journal's commit stall bound (real time)
constexpr std::uint32_t kClientStartMsMax = 300;   // into a cycle
constexpr std::uint32_t kSlowRolloutMsMax = 2300;  // the longest client (a slow rollout)
// After an update: the clients end, the monitor looks. An update may end before the last client
// starts (its members run side by side), so this outlasts the latest start plus the longest run.
constexpr std::uint32_t kSettleMs = kClientStartMsMax + kSlowRolloutMsMax + 200;
constexpr std::uint32_t kClientsPerCycleMax = 8;
constexpr int kRestartsPerCycleMax = 5;
constexpr std::uint32_t kRestartDelayMs = 300;  // the executor's restart, in virtual time

WeightIdentity IdentityOf(const std::string& checkpoint, std::int64_t step) {
  return WeightIdentity{std::string(64, 'a'), "", checkpoint, "sim", step};
}

std::string Name(std::size_t i) { return "e" + std::to_string(i); }

struct FleetMember {
  FleetMember(Scheduler& s, Line line, std::vector<std::string>& violations)
      : engine(s, line, violations), ctl(engine, s) {}
  SimEngine engine;
  SimControl ctl;
};

struct FleetClient {
  std::string engine;
  std::uint64_t epoch = 0;    // the engine's transfer epoch at admission
  std::uint64_t request = 0;  // the engine's request id (0: none running)
  bool done = false;
};

class FleetWorld {
 public:
  FleetWorld(const SimOptions& o, std::uint64_t index, Line line, SimResult& result)
      : o_(o),
        index_(index),
        result_(result),
        clock_(sched_),
        threads_(sched_),
        mem_(rocksdb::NewMemEnv(rocksdb::Env::Default())),
        rng_(o.seed * 7919 + index) {
    for (std::uint32_t i = 0; i < o.fleet_engines; ++i) {
      members_.push_back(std::make_unique<FleetMember>(sched_, line, result.violations));
    }
  }
  ~FleetWorld() {
    runner_.reset();
    journal_.reset();
  }

  bool Boot();
  void RunCycle(std::uint32_t cycle, const std::vector<Fault>& faults);
  bool quarantined() const;  // every engine TAINTED: the world is over
  void Close();
  std::string head() const { return head_; }

 private:
  void Violate(const std::string& what) {
    result_.violations.push_back("world " + std::to_string(index_) + " cycle " +
                                 std::to_string(cycle_) + ": " + what);
  }
  FleetMember& Member(const std::string& engine) {
    return *members_.at(std::stoul(engine.substr(1)));
  }
  State EngineState(const std::string& engine) const;
  void OnDurable(const std::string& engine, const Event& e);
  void CheckPublish(const std::string& engine, const VersionPublished& v);
  void NewRunner();
  [[nodiscard]] Status JoinAll();
  bool Restart();
  void Tick();
  void Monitor(const std::string& engine);
  void Arm(const Fault& seed_fault, std::vector<std::uint32_t>& durations);
  void ClientAdmit(const std::string& id, std::uint32_t duration_ms);
  void ClientDone(const std::string& id, bool ok);
  bool Submit(const FleetEvent& e);
  FleetUpdateRequested RequestFor(std::uint32_t cycle);
  void CountEnd(const FleetUpdateEnded& end);
  void FullChecks();

  const SimOptions& o_;
  std::uint64_t index_;
  SimResult& result_;
  Scheduler sched_;
  SimClock clock_;
  SimThreads threads_;  // every member thread is joined before the runner goes
  std::unique_ptr<rocksdb::Env> mem_;
  std::mt19937_64 rng_;
  std::vector<std::unique_ptr<FleetMember>> members_;
  std::unique_ptr<journal::Journal> journal_;
  std::unique_ptr<effects::FleetRunner> runner_;
  bool recovering_ = false;  // serve listens only once its recovery is done: no client meanwhile
  std::map<std::string, FleetClient> clients_;
  std::uint32_t cycle_ = 0;
  std::string head_;
};

State FleetWorld::EngineState(const std::string& engine) const {
  State s;
  journal_->ReadFleetState([&](const FleetState& f) { s = engine_state(f, engine); });
  return s;
}

bool FleetWorld::Boot() {
  result_.stats.worlds++;
  journal::Options jo;
  jo.env = mem_.get();
  jo.rocksdb_log_to_stderr = false;
  jo.snapshot_every = 256;
  jo.commit_stall_timeout_ms = kStallTimeoutMs;
  jo.scan_pipelined = false;  // no reader thread: the simulator stays single-threaded
  auto j = journal::Journal::Open("/sim/fleet-" + std::to_string(index_), jo);
  if (!j.ok()) {
    Violate("journal open: " + j.status().ToString());
    return false;
  }
  journal_ = std::move(j.value());
  const auto n = static_cast<std::uint32_t>(members_.size());
  const FleetConfigured policy{static_cast<std::uint32_t>(rng_() % 2),
                               static_cast<std::uint32_t>(rng_() % n)};
  NewRunner();
  Status st = runner_->Configure(policy);
  if (st.ok()) st = JoinAll();
  for (std::size_t i = 0; st.ok() && i < members_.size(); ++i) {
    st = runner_->runner(Name(i))->Bootstrap("rc-0", IdentityOf(kInitialWeights, 0));
  }
  if (!st.ok()) Violate("boot: " + st.ToString());
  sched_.After(kTickUs, [this] { Tick(); });
  return st.ok();
}

void FleetWorld::NewRunner() {
  effects::FleetRunnerOptions fo;
  fo.runner.executor_id = "sim";
  fo.runner.drain_timeout_ms = 2000;
  fo.runner.await_rollouts_timeout_ms = 500;
  fo.runner.transfer_timeout_ms = 3000;
  fo.runner.call_timeout_ms = 500;
  fo.blocked_timeout_ms = 3000;
  fo.threads = &threads_;
  runner_ = std::make_unique<effects::FleetRunner>(*journal_, clock_, fo);
}

// Every engine joins this executor (journaled once; a restart finds them joined).
Status FleetWorld::JoinAll() {
  for (std::size_t i = 0; i < members_.size(); ++i) {
    RC_RETURN_IF_ERROR(runner_->Join(Name(i), members_[i]->ctl, members_[i]->ctl));
    runner_->runner(Name(i))->set_observer(
        [this, engine = Name(i)](std::uint64_t, const Event& e) { OnDurable(engine, e); });
  }
  return Status::OK();
}

// The executor restarts on the same journal: every member's runner recovers. The proxied
// requests die with it (their connections were the executor's): the engine drops them, and the
// recovery abandons their bindings.
bool FleetWorld::Restart() {
  result_.stats.restarts++;
  for (auto& [id, c] : clients_) {
    if (c.done) continue;
    c.done = true;
    if (c.request != 0) Member(c.engine).engine.Abort(c.request);
  }
  NewRunner();
  recovering_ = true;
  Status st = JoinAll();
  // The journal stays open across the restart (the executor died, not the journal): what the
  // recovery records of it is a crash at its head, with no torn tail.
  journal::Recovery crashed;
  crashed.head_seq = journal_->head_seq();
  if (st.ok()) st = runner_->Recover(crashed);
  recovering_ = false;
  if (!st.ok()) Violate("executor restart: " + st.ToString());
  return st.ok();
}

void FleetWorld::OnDurable(const std::string& engine, const Event& e) {
  result_.stats.events++;
  if (const auto* v = std::get_if<VersionPublished>(&e)) CheckPublish(engine, *v);
  const auto* c = std::get_if<StateChanged>(&e);
  if (c != nullptr && c->to == Lifecycle::kTainted) result_.stats.taints[cause_name(c->cause)]++;
}

// Nothing published without the target's weights validated, every cache reset, paused (the
// engine's own truth, as the one-engine world judges it).
void FleetWorld::CheckPublish(const std::string& engine, const VersionPublished& v) {
  FleetMember& m = Member(engine);
  const EngineTruth& t = m.engine.truth();
  const auto& val = m.ctl.validated();
  if (!t.alive || !val || val->instance != t.instance) return;  // the monitor's to taint
  if (val->weights != v.identity.checkpoint || val->label != v.version.label) {
    Violate(engine + " published '" + v.version.label + "' (" + v.identity.checkpoint +
            ") but at validation held '" + val->weights + "' labelled '" + val->label + "'");
  }
  if (!val->caches_reset) Violate(engine + " published without every cache reset");
  if (!val->paused) Violate(engine + " published on a validation answered unpaused");
}

void FleetWorld::Tick() {
  if (journal_ && !journal_->failed()) {
    for (std::size_t i = 0; i < members_.size(); ++i) Monitor(Name(i));
  }
  sched_.After(kTickUs, [this] { Tick(); });
}

// The engine monitor, as serve runs it per member: a look only when something changed.
void FleetWorld::Monitor(const std::string& engine) {
  const State s = EngineState(engine);
  if (s.lifecycle != Lifecycle::kReady || s.update.has_value()) return;
  EngineMonitored m = Member(engine).ctl.Monitor();
  const bool reachable = m.http.ok_2xx();
  const bool differs = m.reported_label != s.committed.label || m.is_paused ||
                       m.engine_instance != s.engine_instance || !weights_match(s, m.digest);
  const bool changed = reachable ? (!s.engine_reachable || look_clears_recheck(s, m) || differs)
                                 : s.engine_reachable;
  if (!changed) return;
  m.updates_seen = monitor_epoch(s);
  m.last_ok_wall_ms = clock_.wall_ms();
  (void)Submit(FleetEvent{engine, m});  // a refusal (stale, an effect in flight) is the fold's
}

bool FleetWorld::Submit(const FleetEvent& e) {
  auto s = journal_->SubmitFleet(e, clock_.wall_ms());
  if (!s.ok()) return false;
  if (!journal_->Wait(s->ticket).ok()) {
    Violate("journal wait: " + journal_->failure().ToString());
    return false;
  }
  return true;
}

// One fault, on engine a % N: the one-engine world's engine-side faults.
void FleetWorld::Arm(const Fault& seed_fault, std::vector<std::uint32_t>& durations) {
  // The engine is a % N; the fault keeps a / N for its own choices (the call it hits, the call
  // the engine dies at), so that an engine is not tied to some calls.
  const auto n = static_cast<std::uint32_t>(members_.size());
  FleetMember& m = *members_[seed_fault.a % n];
  Fault f = seed_fault;
  f.a = seed_fault.a / n;
  result_.stats.faults++;
  if (ArmCallFault(f, m.ctl.faults())) return;
  switch (f.kind) {
    case FaultKind::kEngineRestartReady:
      // A restart behind the fleet's back: back with its initial weights 50 ms later.
      sched_.After(std::int64_t{f.b % 500} * 1000, [&m] {
        if (m.engine.truth().alive) m.engine.Die(50);
      });
      break;
    case FaultKind::kRestartKeepsLabel:
      sched_.After(std::int64_t{f.b % 500} * 1000,
                   [&m, f] { m.engine.Die(50, LabelKeepingComeback(f)); });
      break;
    case FaultKind::kSlowRollout:  // may outlive the drain
      if (!durations.empty())
        durations[seed_fault.a % durations.size()] = 300 + f.b % (kSlowRolloutMsMax - 300);
      break;
    default:
      result_.stats.faults--;  // the journal and executor faults are the one-engine world's
      break;
  }
}

// A client: admitted to an engine the fold lets admit (picked at random), its request run on
// that engine, its finish journaled. An admission the journal refuses (an update began between
// the pick and the submit) is the fold's word, not a failure.
void FleetWorld::ClientAdmit(const std::string& id, std::uint32_t duration_ms) {
  if (journal_->failed() || recovering_) return;
  std::optional<FleetEvent> admission;
  journal_->ReadFleetState([&](const FleetState& f) {
    const std::vector<std::string> open = admitting_engines(f);
    if (open.empty()) return;
    admission = make_fleet_admission(f, open[rng_() % open.size()], id);
  });
  if (!admission || !Submit(*admission)) return;
  result_.stats.admissions_acked++;
  FleetMember& m = Member(admission->engine);
  clients_[id] = FleetClient{admission->engine, m.engine.truth().transfer_epoch, 0, false};
  const std::uint64_t request =
      m.engine.Start(id, id, duration_ms, [this, id](bool ok) { ClientDone(id, ok); });
  if (request == 0) return ClientDone(id, false);  // the engine is down: connection refused
  clients_[id].request = request;
}

void FleetWorld::ClientDone(const std::string& id, bool ok) {
  FleetClient& c = clients_.at(id);
  if (c.done) return;
  c.done = true;
  if (Member(c.engine).engine.truth().transfer_epoch != c.epoch) {
    Violate("rollout '" + id + "' on " + c.engine + " spans two weight states");
  }
  const RolloutOutcome outcome = ok ? RolloutOutcome::kCompleted : RolloutOutcome::kAborted;
  if (!Submit(FleetEvent{c.engine, RolloutFinished{id, outcome, 0, 0}})) {
    Violate("the finish of rollout '" + id + "' on " + c.engine + " was refused");
  }
}

FleetUpdateRequested FleetWorld::RequestFor(std::uint32_t cycle) {
  const std::string ckpt = "ckpt/c" + std::to_string(cycle);
  FleetUpdateRequested r;
  r.update_id = "u" + std::to_string(index_) + "-" + std::to_string(cycle);
  r.mode = rng_() % 2 == 0 ? FleetUpdateMode::kAll : FleetUpdateMode::kRolling;
  r.batch_max = 1 + static_cast<std::uint32_t>(rng_() % members_.size());
  r.min_healthy = 1;
  r.target_label = "rc-c" + std::to_string(cycle);
  r.identity = IdentityOf(ckpt, cycle);
  r.source_uri = "synthetic:" + ckpt;
  // The trainer's digest, as the one-engine world sends it: without it a silent partial transfer
  // (every call 2xx, chunks dropped) is indistinguishable from a complete one.
  r.expected_digest = SimDigest(ckpt).combined;
  return r;
}

void FleetWorld::CountEnd(const FleetUpdateEnded& end) {
  result_.stats.committed += end.committed;
  result_.stats.refused += end.refused;
  result_.stats.tainted += end.tainted;
  result_.stats.stalled += end.stalled;
}

// One fleet update under this cycle's faults and clients, then time for the clients to end and
// the monitor to look.
void FleetWorld::RunCycle(std::uint32_t cycle, const std::vector<Fault>& faults) {
  cycle_ = cycle;
  result_.stats.cycles++;
  for (auto& m : members_) m->ctl.faults() = CycleFaults{};
  std::vector<std::uint32_t> durations(rng_() % kClientsPerCycleMax);
  for (std::uint32_t& d : durations) d = static_cast<std::uint32_t>(1 + rng_() % 400);
  for (const Fault& f : faults) Arm(f, durations);
  for (std::size_t i = 0; i < durations.size(); ++i) {
    const std::string id = "r" + std::to_string(cycle) + "-" + std::to_string(i);
    sched_.After(static_cast<std::int64_t>(rng_() % (kClientStartMsMax * 1000)),
                 [this, id, d = durations[i]] { ClientAdmit(id, d); });
  }
  const FleetUpdateRequested request = RequestFor(cycle);
  Result<FleetUpdateEnded> end = runner_->Update(request);
  // An update that cannot end (a member's retries exhausted, e.g. its engine down) stops the
  // executor, as it stops serve; the next executor recovers every member and goes on with it.
  for (int k = 0; !end.ok() && k < kRestartsPerCycleMax; ++k) {
    result_.stats.update_errors++;
    if (o_.verbose) std::printf("cycle %u: %s\n", cycle, end.status().ToString().c_str());
    clock_.sleep_ms(kRestartDelayMs);
    if (!Restart()) return;
    end = runner_->Update(request);
  }
  if (!end.ok()) return Violate("fleet update never ended: " + end.status().ToString());
  CountEnd(*end);
  // The fleet update ended without a member that stalled (its engine never resumed); the
  // operator restarts the executor, whose recovery tries that plan again.
  if (end->stalled > 0 && !Restart()) return;
  clock_.sleep_ms(kSettleMs);
  for (const auto& [id, c] : clients_) {
    if (!c.done) Violate("rollout '" + id + "' on " + c.engine + " never ended");
  }
}

bool FleetWorld::quarantined() const {
  bool every = true;
  journal_->ReadFleetState([&](const FleetState& f) {
    for (const auto& [name, s] : f.engines) every = every && s.lifecycle == Lifecycle::kTainted;
  });
  return every;
}

// The journal as the fleet's rules and replay read it.
void FleetWorld::FullChecks() {
  result_.stats.full_checks++;
  std::vector<FleetHistoryEntry> history;
  const Status scanned = journal_->Scan(1, 0, [&](const journal::Record& r) {
    history.push_back({r.seq, r.cause_seq, r.engine, r.event});
    return Status::OK();
  });
  if (!scanned.ok()) return Violate("scan: " + scanned.ToString());
  const FleetHistoryReport h = check_fleet_history(history);
  if (!h.ok) Violate("fleet history, seq " + std::to_string(h.first_bad_seq) + ": " + h.message);
  auto report = replay::Replay(*journal_, {});
  if (!report.ok()) return Violate("replay: " + report.status().ToString());
  if (!report->ok) {
    Violate("replay, seq " + std::to_string(report->first_bad_seq) + ": " + report->error);
  }
}

void FleetWorld::Close() {
  clock_.sleep_ms(kSettleMs);  // the last clients end
  FullChecks();
  head_ = std::to_string(index_) + ":" + std::to_string(journal_->head_seq());
}

}  // namespace

SimResult RunFleet(const SimOptions& options, const FaultPlan& plan) {
  RC_CHECK(options.fleet_engines > 0);
  SimResult result;
  std::map<std::uint32_t, std::vector<Fault>> by_cycle;
  for (const Fault& f : plan) by_cycle[f.cycle].push_back(f);
  const Line line = options.seed % 3 == 2 ? Line::k025 : Line::kNewer;
  std::unique_ptr<FleetWorld> world;
  std::uint64_t index = 0, world_cycles = 0;
  for (std::uint32_t cycle = 0; cycle < options.cycles && result.violations.empty(); ++cycle) {
    if (world && (world->quarantined() || world_cycles >= options.cycles_per_world)) {
      world->Close();
      result.head += world->head() + ";";
      world.reset();
    }
    if (!world) {
      world = std::make_unique<FleetWorld>(options, ++index, line, result);
      world_cycles = 0;
      if (!world->Boot()) break;
    }
    auto it = by_cycle.find(cycle);
    world->RunCycle(cycle, it == by_cycle.end() ? std::vector<Fault>{} : it->second);
    ++world_cycles;
  }
  if (world && result.violations.empty()) {
    world->Close();
    result.head += world->head();
  }
  return result;
}

}  // namespace rc::sim
