// Trust under faults: seeded runs of many update cycles with proxy-less rollouts (admissions and
// finishes submitted through the journal, as the service does), over the real RocksDB journal on
// a fault-injecting Env and the real HTTP stack against the vLLM test double. Each seed draws its
// own fault mix (a swarm): WAL append/sync errors (EIO, ENOSPC) at a random point, sync stalls
// below and above the journal's commit_stall_timeout_ms, engine restarts (same port, new
// process), route faults, labels changed and pauses behind the executor's back, and executor
// crashes at a random step (in process: FaultEnv::Crash(), the objects dropped, unsynced bytes
// dropped or torn, reopen, Runner::Recover()).
//
// After every cycle (and after every restart): refold == live state, snapshot + tail == live,
// replay re-derives every decision, the history checker passes, every acknowledged (seq, event)
// is in the journal with the same content, every update answer given to a client agrees with the
// journal, every rollout finished under the generation it was admitted under, and each step ended
// within a deadline.
//
// RC_TRUST_SEEDS=N runs N seeds (default 4); RC_TRUST_SEED=n reruns one seed.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "journal/testing/fault_env.h"
#include "replay/replay.h"
#include "statemachine/text.h"
#include "tests/integration/harness.h"

namespace rc::itest {
namespace {

using journal::testing::Fault;
using journal::testing::FaultEnv;
using journal::testing::FileKind;
using journal::testing::FileOp;
using journal::testing::Torn;

constexpr std::uint32_t kStallTimeoutMs = 400;  // the journal's commit_stall_timeout_ms here
constexpr int kCyclesPerSeed = 10;
// Frequent folded-state snapshots, so reopening after a crash restores from one.
constexpr std::uint64_t kSnapshotEvery = 64;
constexpr auto kStepDeadline = std::chrono::seconds(90);  // liveness bound of one step

std::vector<std::uint32_t> Seeds() {
  if (const char* s = std::getenv("RC_TRUST_SEED")) {
    return {static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10))};
  }
  std::uint32_t n = 4;
  if (const char* s = std::getenv("RC_TRUST_SEEDS")) n = static_cast<std::uint32_t>(std::atoi(s));
  std::vector<std::uint32_t> out;
  for (std::uint32_t i = 1; i <= n; ++i) out.push_back(i * 104729u + 17u);
  return out;
}

enum class Kind : int {
  kNone,
  kWalFault,            // EIO/ENOSPC on a WAL append or sync after a random number of successes
  kStallBelow,          // every WAL sync stalls well below commit_stall_timeout_ms
  kStallAbove,          // every WAL sync stalls past commit_stall_timeout_ms: fail-stop
  kRouteFaults,         // 5xx, garbage bodies, dropped connections on engine routes
  kEngineRestartMid,    // the engine restarts (same port, new process) during the update
  kEngineRestartReady,  // the engine restarts while READY
  kRelabel,             // someone else sets the engine's label while READY
  kPauseExternal,       // someone else pauses the engine while READY
  kExecutorCrash,       // the executor process dies at a random step of the update
  kStaleMonitor,        // a monitor observation taken before an update is submitted after it
  kCount
};
const char* KindName(Kind k) {
  static const char* names[] = {
      "none",           "wal_fault",          "stall_below",          "stall_above",
      "route_faults",   "engine_restart_mid", "engine_restart_ready", "relabel",
      "pause_external", "executor_crash",     "stale_monitor"};
  return names[static_cast<int>(k)];
}

struct Totals {
  int seeds = 0, cycles = 0, worlds = 0;
  std::map<std::string, int> faults;  // by kind
  int fail_stops = 0, executor_crashes = 0, executor_restarts = 0, engine_restarts = 0;
  int committed = 0, refused = 0, tainted_updates = 0, update_errors = 0;
  std::map<std::string, int> taints;  // by cause
  int stale_refused = 0, acked_checked = 0, admissions_acked = 0;
};

// Runs fn on another thread and waits at most kStepDeadline: a step that hangs is a liveness bug.
template <class F>
auto Bounded(const std::string& what, F fn) -> decltype(fn()) {
  std::packaged_task<decltype(fn())()> task(std::move(fn));
  auto fut = task.get_future();
  std::thread t(std::move(task));
  if (fut.wait_for(kStepDeadline) != std::future_status::ready) {
    std::fprintf(stderr, "LIVENESS: '%s' did not end within %lld s\n", what.c_str(),
                 static_cast<long long>(kStepDeadline.count()));
    std::fflush(stderr);
    std::abort();  // nothing can be unwound from a hung step; the seed is in the trace above
  }
  t.join();
  return fut.get();
}

// One executor "process" lineage over one journal and one engine port. A taint ends it.
struct World {
  FaultEnv faults;  // first: outlives the journal
  fixtures::VllmDoubleOptions dopts;
  std::unique_ptr<fixtures::VllmDouble> engine;
  int port = 0;
  std::string dir;
  std::unique_ptr<effects::EngineClient> client;    // the executor's
  std::unique_ptr<effects::EngineClient> intruder;  // someone else acting on the engine
  std::unique_ptr<effects::HttpEngineControl> control;
  std::unique_ptr<effects::HttpSequenceTransfer> transfer;
  std::unique_ptr<journal::Journal> journal;
  std::unique_ptr<effects::Runner> runner;

  std::mutex mu;
  std::vector<std::pair<std::uint64_t, Event>> acked;  // every (seq, event) acknowledged
  std::map<std::string, UpdateOutcome> answers;        // update id -> outcome answered OK
  std::atomic<int> crash_at{0};  // observer event count at which the "process" dies (0: never)
  std::atomic<int> observed{0};

  std::uint64_t snapshot_every = kSnapshotEvery;

  explicit World(fixtures::VllmDoubleOptions o) : dopts(std::move(o)) {
    engine = std::make_unique<fixtures::VllmDouble>(dopts);
    port = engine->Start(0);
    RC_CHECK(port > 0);
    dir = TempDir("trust");
    effects::EngineDeadlines d;
    d.connect_timeout_ms = 1000;
    d.call_timeout_ms = 3000;
    d.drain_timeout_ms = 10000;
    d.update_timeout_ms = 10000;
    client = std::make_unique<effects::EngineClient>(url(), d);
    intruder = std::make_unique<effects::EngineClient>(url(), d);
    control = std::make_unique<effects::HttpEngineControl>(*client);
    transfer = std::make_unique<effects::HttpSequenceTransfer>(
        *client, effects::detect_protocol(dopts.version));
  }
  ~World() {
    runner.reset();
    journal.reset();
    engine->Stop();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port); }

  [[nodiscard]] bool OpenJournal() {
    journal::Options o;
    o.env = faults.env();
    o.commit_stall_timeout_ms = kStallTimeoutMs;
    o.snapshot_every = snapshot_every;
    auto j = journal::Journal::Open(dir, o);
    EXPECT_TRUE(j.ok()) << "reopen after a crash: " << j.status().ToString();
    if (!j.ok()) return false;
    journal = std::move(j.value());
    return true;
  }
  void NewRunner() {
    effects::RunnerOptions ro = Executor::FastRunner();
    ro.executor_id = "trust";
    ro.drain_timeout_ms = 10000;
    ro.transfer_timeout_ms = 10000;
    ro.call_timeout_ms = 3000;
    runner = std::make_unique<effects::Runner>(*journal, *control, *transfer,
                                               effects::system_clock(), ro);
    runner->set_observer([this](std::uint64_t seq, const Event& e) {
      {
        std::lock_guard lk(mu);
        acked.emplace_back(seq, e);
      }
      const int at = crash_at.load();
      if (at > 0 && ++observed == at) faults.Crash();  // the process dies right here
    });
  }
  void Ack(const journal::Journal::Submitted& s, const Event& input) {
    std::lock_guard lk(mu);
    acked.emplace_back(s.ticket.result.first_seq, input);
    for (std::size_t i = 0; i < s.decisions.size(); ++i) {
      acked.emplace_back(s.ticket.result.first_seq + 1 + i, s.decisions[i]);
    }
  }
  // Submit + Wait; records what was acknowledged.
  Status SubmitAcked(const Event& e) {
    auto s = journal->Submit(e, WallMs());
    if (!s.ok()) return s.status();
    RC_RETURN_IF_ERROR(journal->Wait(s->ticket));
    Ack(*s, e);
    return Status::OK();
  }

  // The engine process restarts: same port, same version and extension, a new instance.
  void RestartEngine() {
    engine->Stop();
    engine = std::make_unique<fixtures::VllmDouble>(dopts);
    int p = -1;
    for (int i = 0; i < 200 && p < 0; ++i) {
      p = engine->Start(port);
      if (p < 0) {
        engine = std::make_unique<fixtures::VllmDouble>(dopts);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    RC_CHECK(p == port);
  }
};

// Proxy-less rollouts admitted and finished through the journal while an update runs.
struct RolloutLoad {
  World& w;
  std::atomic<bool> stop{false};
  std::atomic<int> admitted{0};
  std::vector<std::thread> threads;
  RolloutLoad(World& world, int workers, int per_worker, const std::string& tag) : w(world) {
    for (int k = 0; k < workers; ++k) {
      threads.emplace_back([this, k, per_worker, tag] {
        for (int i = 0; !stop.load() && i < per_worker; ++i) {
          const std::string id = tag + "-w" + std::to_string(k) + "-" + std::to_string(i);
          RolloutAdmitted a = make_admission(w.journal->state(), id);
          if (!w.SubmitAcked(a).ok()) {  // refused during an update, tainted or failed
            std::this_thread::sleep_for(std::chrono::milliseconds(3));
            continue;
          }
          admitted++;
          nlohmann::json req = {{"model", "rc-double-model"},
                                {"prompt", "trust " + id},
                                {"max_tokens", 4},
                                {"temperature", 0}};
          auto reply = w.client->Completions(req);
          RolloutFinished f{
              id, reply.http.ok_2xx() ? RolloutOutcome::kCompleted : RolloutOutcome::kAborted, 0,
              0};
          w.SubmitAcked(f).IgnoreError();  // a failed journal leaves it to recovery
        }
      });
    }
  }
  void Stop() {
    stop = true;
    for (auto& t : threads) t.join();
    threads.clear();
  }
  ~RolloutLoad() { Stop(); }
};

void InjectRouteFaults(fixtures::VllmDouble& engine, std::mt19937& rng) {
  const char* routes[] = {"/pause",
                          "/resume",
                          "/is_paused",
                          "/weight_info",
                          "/reset_prefix_cache",
                          "/reset_encoder_cache",
                          "/start_weight_update",
                          "/update_weights",
                          "/finish_weight_update",
                          "/init_weight_transfer_engine",
                          "/collective_rpc"};
  for (const char* route : routes) {
    if (rng() % 4 != 0) continue;
    fixtures::RouteFault f;
    f.times = 1 + static_cast<int>(rng() % 2);
    switch (rng() % 4) {
      case 0:
        f.status = (rng() % 2) ? 500 : 503;
        break;
      case 1:
        f.garbage_body = true;
        break;
      case 2:
        f.drop_connection = true;
        f.after = (rng() % 2) == 0;
        break;
      default:
        f.delay_ms = 1 + static_cast<int>(rng() % 20);
        f.status = 500;
        break;
    }
    engine.SetRouteFault(route, f);
  }
}

// Names the fields in which two states differ (for failure messages).
std::string StateDiff(const State& a, const State& b) {
  std::string out;
  auto field = [&](const char* name, bool same) {
    if (!same) out += std::string(" ") + name;
  };
  field("lifecycle", a.lifecycle == b.lifecycle);
  field("committed", a.committed == b.committed);
  field("committed_identity", a.committed_identity == b.committed_identity);
  field("bootstrap", a.bootstrap == b.bootstrap);
  field("attempts", a.attempts == b.attempts);
  field("in_flight", a.in_flight == b.in_flight);
  field("active", a.active == b.active);
  field("update", a.update == b.update);
  field("taint", a.taint == b.taint);
  field("engine_instance", a.engine_instance == b.engine_instance);
  field("engine_reachable", a.engine_reachable == b.engine_reachable);
  field("engine_recheck", a.engine_recheck == b.engine_recheck);
  field("labels", a.labels == b.labels);
  field("counters", a.counters == b.counters);
  if (!(a.counters == b.counters)) {
    const Counters& x = a.counters;
    const Counters& y = b.counters;
    out += " [events " + std::to_string(x.events) + "/" + std::to_string(y.events) + " admitted " +
           std::to_string(x.rollouts_admitted) + "/" + std::to_string(y.rollouts_admitted) +
           " completed " + std::to_string(x.rollouts_completed) + "/" +
           std::to_string(y.rollouts_completed) + " aborted " + std::to_string(x.rollouts_aborted) +
           "/" + std::to_string(y.rollouts_aborted) + " abandoned " +
           std::to_string(x.rollouts_abandoned) + "/" + std::to_string(y.rollouts_abandoned) +
           " expired " + std::to_string(x.rollouts_expired) + "/" +
           std::to_string(y.rollouts_expired) + " requested " +
           std::to_string(x.updates_requested) + "/" + std::to_string(y.updates_requested) +
           " committed " + std::to_string(x.updates_committed) + "/" +
           std::to_string(y.updates_committed) + " refused " + std::to_string(x.updates_refused) +
           "/" + std::to_string(y.updates_refused) + " recoveries " + std::to_string(x.recoveries) +
           "/" + std::to_string(y.recoveries) + "]";
  }
  return out.empty() ? " (none)" : out;
}

// Every check that must hold of a journal that is not failed.
void CheckWorld(World& w, Totals& totals) {
  journal::Journal& j = *w.journal;
  const State live = j.state();
  auto refold = j.Refold();
  ASSERT_TRUE(refold.ok()) << refold.status().ToString();
  EXPECT_EQ(*refold, live) << "refold differs from the live state in" << StateDiff(*refold, live);
  auto loaded = j.LoadState();
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(*loaded, live) << "snapshot + tail differs from the live state in"
                           << StateDiff(*loaded, live);

  const std::vector<journal::Record> records = ScanRecords(j);
  HistoryReport h = CheckRecords(records);
  EXPECT_TRUE(h.ok) << "history: seq " << h.first_bad_seq << ": " << h.message;
  auto report = replay::Replay(j, {});
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->ok) << "replay: seq " << report->first_bad_seq << ": " << report->error;

  // No acknowledged event is missing, and each is there with the content acknowledged.
  std::lock_guard lk(w.mu);
  for (const auto& [seq, event] : w.acked) {
    ASSERT_TRUE(seq >= 1 && seq <= records.size())
        << "acknowledged seq " << seq << " (" << event_name(event) << ") is missing: head "
        << records.size();
    const journal::Record& r = records[seq - 1];
    ASSERT_EQ(r.seq, seq);
    EXPECT_TRUE(r.event == event) << "acknowledged seq " << seq << " was " << event_name(event)
                                  << ", the journal holds " << event_name(r.event);
  }
  totals.acked_checked += static_cast<int>(w.acked.size());

  // Every update answer given to a client agrees with the journal.
  for (const auto& [id, outcome] : w.answers) {
    bool found = false;
    for (const journal::Record& r : records) {
      if (const auto* e = std::get_if<UpdateEnded>(&r.event); e && e->update_id == id) {
        EXPECT_EQ(e->outcome, outcome)
            << "update " << id << " answered " << update_outcome_name(outcome) << ", journal says "
            << update_outcome_name(e->outcome);
        found = true;
      }
    }
    EXPECT_TRUE(found) << "update " << id << " answered " << update_outcome_name(outcome)
                       << " but the journal has no UpdateEnded for it";
  }

  // No rollout spans two weight states: each finishes under the generation it was admitted under.
  State s;
  std::map<std::string, WeightVersion> admitted;
  for (const journal::Record& r : records) {
    if (const auto* a = std::get_if<RolloutAdmitted>(&r.event)) {
      EXPECT_EQ(a->version, s.committed) << "seq " << r.seq << ": admitted off the committed";
      admitted[a->rollout_id] = a->version;
    } else if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
      auto it = admitted.find(f->rollout_id);
      EXPECT_TRUE(it != admitted.end()) << "seq " << r.seq << ": finish without admission";
      if (it != admitted.end()) {
        EXPECT_EQ(it->second.generation, s.committed.generation)
            << "seq " << r.seq << ": rollout " << f->rollout_id << " admitted under generation "
            << it->second.generation << " finished under " << s.committed.generation;
      }
    }
    Status st = apply(s, r.event);
    ASSERT_TRUE(st.ok()) << "seq " << r.seq << ": " << st.ToString();
  }
}

// The journal failed (or the process was killed): every later call fails, then the process
// restarts from what is durable and recovers.
void RestartProcess(World& w, std::mt19937& rng, Totals& totals, bool journal_failed) {
  if (journal_failed) {
    EXPECT_TRUE(w.journal->failed());
    EXPECT_FALSE(w.journal->failure().ok());
    EXPECT_NE(w.journal->failure().ToString().find(w.dir), std::string::npos)
        << "the failure does not name the journal: " << w.journal->failure().ToString();
    // Fail-stop: a later call fails, nothing is acknowledged.
    RolloutFinished probe{"after-fail-stop", RolloutOutcome::kAborted, 0, 0};
    auto s = w.journal->Submit(probe, WallMs());
    EXPECT_TRUE(!s.ok() || !w.journal->Wait(s->ticket).ok()) << "a call after fail-stop succeeded";
  }
  w.faults.Crash();
  w.runner.reset();
  w.journal.reset();
  std::uint64_t kept = 0;
  const Torn torn = (rng() % 2) ? Torn::kRandomPrefix : Torn::kNone;
  rocksdb::Status ds = w.faults.DropUnsyncedData(torn, rng(), &kept);
  ASSERT_TRUE(ds.ok()) << ds.ToString();
  w.faults.Restart();
  w.crash_at = 0;
  totals.executor_restarts++;
  ASSERT_TRUE(w.OpenJournal());
  w.engine->ClearFaults();
  w.NewRunner();
  Status rec = Bounded("Recover", [&] { return w.runner->Recover(w.journal->recovery()); });
  EXPECT_TRUE(rec.ok()) << "Recover: " << rec.ToString();
  const State s = w.journal->state();
  EXPECT_TRUE(s.active.empty() ||
              std::all_of(s.active.begin(), s.active.end(),
                          [](const auto& kv) { return kv.second.lease_ms > 0; }))
      << "bindings of the dead process were not abandoned";
}

// Simulates the executor's engine monitor: one observation of the engine now, submitted with the
// current epoch. Returns the lifecycle after it.
void SubmitMonitor(World& w, Cause expected) {
  SCOPED_TRACE(std::string("monitor expecting ") + cause_name(expected));
  EngineMonitored m;
  for (int i = 0; i < 50; ++i) {  // a restarted engine may take a moment to answer
    m = w.client->Monitor();
    if (m.http.ok_2xx()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(m.http.ok_2xx()) << "the engine never answered the monitor";
  const State before = w.journal->state();
  ASSERT_EQ(before.lifecycle, Lifecycle::kReady);
  m.updates_seen = monitor_epoch(before);
  m.last_ok_wall_ms = WallMs();
  Status st = w.SubmitAcked(m);
  ASSERT_TRUE(st.ok()) << st.ToString();
  const State after = w.journal->state();
  ASSERT_EQ(after.lifecycle, Lifecycle::kTainted)
      << "the monitor saw the engine changed behind our back, but the state is "
      << lifecycle_name(after.lifecycle);
  ASSERT_TRUE(after.taint.has_value());
  EXPECT_EQ(after.taint->cause, expected)
      << "taint cause " << cause_name(after.taint->cause) << ": " << after.taint->detail;
}

fixtures::VllmDoubleOptions EngineOptionsFor(std::uint32_t seed) {
  fixtures::VllmDoubleOptions o;
  o.token_delay_ms = 1;
  if (seed % 3 == 2) {  // vLLM 0.25.x: the label lives in the worker extension
    o.version = "0.25.1";
    o.worker_extension_cls = effects::kWorkerExtensionClass;
  } else {
    o.version = "0.30.0";
  }
  return o;
}

std::unique_ptr<World> NewWorld(std::uint32_t seed, Totals& totals) {
  auto w = std::make_unique<World>(EngineOptionsFor(seed));
  totals.worlds++;
  if (!w->OpenJournal()) return nullptr;
  w->NewRunner();
  Status st = Bounded("Bootstrap", [&] { return w->runner->Bootstrap("rc-0", Identity(0)); });
  EXPECT_TRUE(st.ok()) << "bootstrap: " << st.ToString();
  if (!st.ok()) return nullptr;
  return w;
}

void RunSeed(std::uint32_t seed, Totals& totals) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun: RC_TRUST_SEED=" + std::to_string(seed) +
               ")");
  std::mt19937 rng(seed);
  // The swarm: this seed's fault kinds.
  std::vector<Kind> enabled;
  for (int k = 1; k < static_cast<int>(Kind::kCount); ++k) {
    if (rng() % 3 != 0) enabled.push_back(static_cast<Kind>(k));
  }
  if (enabled.empty()) enabled.push_back(Kind::kWalFault);
  totals.seeds++;
  std::unique_ptr<World> w = NewWorld(seed, totals);
  ASSERT_TRUE(w);
  for (int cycle = 0; cycle < kCyclesPerSeed; ++cycle) {
    SCOPED_TRACE("cycle " + std::to_string(cycle));
    if (!w) {  // TAINTED is terminal: a fresh journal and a fresh engine
      w = NewWorld(seed, totals);
      ASSERT_TRUE(w);
    }
    totals.cycles++;
    const Kind kind = (rng() % 5 == 0) ? Kind::kNone : enabled[rng() % enabled.size()];
    totals.faults[KindName(kind)]++;

    // ---- faults armed before the update ----
    std::optional<EngineMonitored> stale;
    std::thread engine_restarter;
    switch (kind) {
      case Kind::kWalFault:
        w->faults.Inject(FileKind::kWal, (rng() % 2) ? FileOp::kSync : FileOp::kAppend,
                         (rng() % 2) ? Fault::kEio : Fault::kEnospc,
                         static_cast<std::uint32_t>(rng() % 12));
        break;
      case Kind::kStallBelow:
        w->faults.StallSync(FileKind::kWal, kStallTimeoutMs / 8);
        break;
      case Kind::kStallAbove:
        w->faults.StallSync(FileKind::kWal, kStallTimeoutMs * 2 + 100);
        break;
      case Kind::kRouteFaults:
        InjectRouteFaults(*w->engine, rng);
        break;
      case Kind::kExecutorCrash:
        w->crash_at = w->observed.load() + 1 + rng() % 24;
        break;
      case Kind::kStaleMonitor: {
        EngineMonitored m = w->client->Monitor();
        m.updates_seen = monitor_epoch(w->journal->state());
        stale = m;
        break;
      }
      case Kind::kEngineRestartMid: {
        const int delay = static_cast<int>(rng() % 120);
        World* wp = w.get();
        engine_restarter = std::thread([wp, delay] {
          std::this_thread::sleep_for(std::chrono::milliseconds(delay));
          wp->RestartEngine();
        });
        totals.engine_restarts++;
        break;
      }
      default:
        break;
    }

    // ---- one update cycle with rollouts interleaved ----
    const State before = w->journal->state();
    const std::uint64_t gen = before.committed.generation + 1;
    const std::string update_id = "s" + std::to_string(seed) + "-w" +
                                  std::to_string(totals.worlds) + "-c" + std::to_string(cycle);
    Result<UpdateEnded> ended = Status::Unavailable("not run");
    {
      RolloutLoad load(*w, 2, 12, update_id);
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 15));
      ended = Bounded("Update " + update_id, [&] {
        return w->runner->Update(
            Update(update_id, "rc-" + std::to_string(gen), static_cast<int>(gen)));
      });
      load.Stop();
    }
    if (engine_restarter.joinable()) engine_restarter.join();
    w->engine->ClearFaults();
    if (!w->journal->failed()) w->faults.Clear();  // an armed fault that never hit is disarmed
    const bool crashed = w->crash_at.load() > 0 && w->observed.load() >= w->crash_at.load();
    w->crash_at = 0;

    if (ended.ok()) {
      EXPECT_EQ(ended->update_id, update_id);
      std::lock_guard lk(w->mu);
      w->answers[update_id] = ended->outcome;
      totals.committed += ended->outcome == UpdateOutcome::kCommitted;
      totals.refused += ended->outcome == UpdateOutcome::kRefused;
      totals.tainted_updates += ended->outcome == UpdateOutcome::kTainted;
    } else {
      totals.update_errors++;
    }

    // ---- a dead or failed process restarts from what is durable ----
    if (crashed) {
      totals.executor_crashes++;
      RestartProcess(*w, rng, totals, /*journal_failed=*/false);
    } else if (w->journal->failed()) {
      totals.fail_stops++;
      // An update may have answered OK before a concurrent rollout's append hit the fault: its
      // answer must then survive the restart (checked against the reopened journal below).
      RestartProcess(*w, rng, totals, /*journal_failed=*/true);
    } else if (!ended.ok()) {
      // Retries exhausted (e.g. RESUMING against a faulty engine): a restart resumes.
      RestartProcess(*w, rng, totals, /*journal_failed=*/false);
    }
    if (::testing::Test::HasFatalFailure()) return;

    // ---- the engine changed behind the executor's back while READY ----
    std::optional<Cause> expect_taint;
    if (kind == Kind::kEngineRestartMid) expect_taint = Cause::kEngineReplaced;
    if (w->journal->state().lifecycle == Lifecycle::kReady) {
      switch (kind) {
        case Kind::kEngineRestartReady:
          w->RestartEngine();
          totals.engine_restarts++;
          expect_taint = Cause::kEngineReplaced;
          break;
        case Kind::kRelabel: {
          const std::string label = "intruder-" + std::to_string(rng() % 1000);
          auto r = w->dopts.version == "0.25.1"
                       ? w->intruder->CollectiveRpc("rc_set_weight_version", {label})
                       : w->intruder->UpdateWeightVersion(label);
          ASSERT_TRUE(r.http.ok_2xx()) << r.raw;
          expect_taint = Cause::kEngineRelabelled;
          break;
        }
        case Kind::kPauseExternal: {
          auto r = w->intruder->Pause(effects::PauseMode::kKeep, false);
          ASSERT_TRUE(r.http.ok_2xx()) << r.raw;
          expect_taint = Cause::kEnginePausedExternally;
          break;
        }
        case Kind::kStaleMonitor:
          if (stale &&
              w->journal->state().counters.updates_requested > before.counters.updates_requested) {
            auto s = w->journal->Submit(*stale, WallMs());
            EXPECT_FALSE(s.ok()) << "a monitor observation taken before an update was accepted";
            if (!s.ok()) {
              EXPECT_EQ(s.status().code(), Code::kRejected) << s.status().ToString();
              totals.stale_refused++;
            }
          }
          break;
        default:
          break;
      }
      if (expect_taint) SubmitMonitor(*w, *expect_taint);
    }
    if (::testing::Test::HasFatalFailure()) return;

    CheckWorld(*w, totals);
    if (::testing::Test::HasFailure()) return;

    const State after = w->journal->state();
    if (after.lifecycle == Lifecycle::kTainted) {
      totals.taints[cause_name(after.taint->cause)]++;
      w.reset();  // a tainted engine is replaced, never reused
    } else {
      EXPECT_EQ(after.lifecycle, Lifecycle::kReady)
          << "the cycle left " << lifecycle_name(after.lifecycle) << ": the update never ended";
    }
  }
  // The run ends with a clean close and a reopen: everything acknowledged is still there.
  if (w) {
    w->runner.reset();
    w->journal.reset();
    ASSERT_TRUE(w->OpenJournal());
    EXPECT_TRUE(w->journal->recovery().clean_close);
    CheckWorld(*w, totals);
  }
}

// Proves that under seeded disk, engine and executor faults the journal never loses an
// acknowledged event, every answer given to a client agrees with it, no rollout spans two weight
// states, engine changes behind a READY executor taint with the right cause, and every step
// ends; would catch an acknowledgement before durability, a journal that keeps writing after a
// write error, a lost or altered acknowledged record, a stale monitor observation accepted, or a
// hang under faults.
TEST(TrustFaults, SeededFaultsNeverBreakTrust) {
  Totals t;
  for (std::uint32_t seed : Seeds()) {
    RunSeed(seed, t);
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "seed " << seed << " failed; rerun with RC_TRUST_SEED=" << seed;
      break;
    }
  }
  std::string faults, taints;
  for (const auto& [k, n] : t.faults) faults += " " + k + "=" + std::to_string(n);
  for (const auto& [k, n] : t.taints) taints += " " + k + "=" + std::to_string(n);
  std::printf(
      "trust faults: %d seeds, %d cycles, %d worlds; faults:%s; fail-stops %d, executor crashes "
      "%d, executor restarts %d, engine restarts %d; updates committed %d refused %d tainted %d "
      "errors %d; taints:%s; stale monitor refused %d; acknowledged events checked %d\n",
      t.seeds, t.cycles, t.worlds, faults.c_str(), t.fail_stops, t.executor_crashes,
      t.executor_restarts, t.engine_restarts, t.committed, t.refused, t.tainted_updates,
      t.update_errors, taints.c_str(), t.stale_refused, t.acked_checked);
  EXPECT_GT(t.committed, 0) << "nothing committed: the run proves nothing";
}

// A state restored from a snapshot (LoadState, and the live state of a journal reopened past a
// snapshot) equals the full refold, counters included; catches a snapshot decoder that shifted
// every counter after one was added, so that after a restart monitor_epoch() was wrong and the
// monitor's current observations were refused as stale.
TEST(TrustFaults, ReopenedStateEqualsRefoldAfterSnapshot) {
  fixtures::VllmDoubleOptions o;
  o.version = "0.30.0";
  o.token_delay_ms = 1;
  World w(o);
  w.snapshot_every = 4;
  ASSERT_TRUE(w.OpenJournal());
  w.NewRunner();
  ASSERT_TRUE(w.runner->Bootstrap("rc-0", Identity(0)).ok());
  for (int g = 1; g <= 2; ++g) {
    auto ended =
        w.runner->Update(Update("snap-" + std::to_string(g), "rc-" + std::to_string(g), g));
    ASSERT_TRUE(ended.ok()) << ended.status().ToString();
    ASSERT_EQ(ended->outcome, UpdateOutcome::kCommitted);
  }
  auto loaded = w.journal->LoadState();
  ASSERT_TRUE(loaded.ok());
  auto refold = w.journal->Refold();
  ASSERT_TRUE(refold.ok());
  EXPECT_EQ(*loaded, *refold) << "snapshot + tail differs from the refold in"
                              << StateDiff(*loaded, *refold);
  w.runner.reset();
  w.journal.reset();  // a clean close
  ASSERT_TRUE(w.OpenJournal());
  const State reopened = w.journal->state();
  EXPECT_EQ(reopened, *refold) << "the reopened live state differs from the refold in"
                               << StateDiff(reopened, *refold);
  EXPECT_EQ(monitor_epoch(reopened), monitor_epoch(*refold));
}

// Proves an update requested again with its id after it ended, by a runner that never saw its
// end (a restarted executor; in serve, a re-POST older than the lookup window), is a Conflict
// naming where it was requested, and changes nothing; catches the "did not end" (Unavailable) it
// gave, on which serve fail-stopped.
TEST(TrustFaults, AnEndedUpdateRequestedAgainIsAConflictNotAStuckPlan) {
  Executor x;
  x.Bootstrap();
  auto first = x.runner->Update(Update("u-1", "rc-1", 1));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->outcome, UpdateOutcome::kCommitted) << first->reason;
  x.Restart();
  ASSERT_TRUE(x.runner->Recover(x.journal->recovery()).ok());
  const std::uint64_t head = x.journal->head_seq();
  auto again = x.runner->Update(Update("u-1", "rc-1", 1));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kConflict) << again.status().ToString();
  EXPECT_NE(again.status().message().find("was requested at seq"), std::string::npos)
      << again.status().message();
  EXPECT_EQ(x.journal->head_seq(), head);
  EXPECT_EQ(x.journal->state().lifecycle, Lifecycle::kReady);
}

// Proves a drain whose rollouts outlive it still pauses the engine (50 ms to answer) at its first
// attempt, with time left for the pause; would catch the local wait taking the whole deadline and
// leaving the pause 1 ms, so it timed out (or, unsent on a slower link, ran the whole drain again,
// admitting nothing, up to three times its deadline).
TEST(TrustFaults, ADrainThatRolloutsOutliveStillPausesAtOnce) {
  effects::RunnerOptions ro = Executor::FastRunner();
  ro.drain_timeout_ms = 600;
  Executor x(Executor::Defaults(), ro);
  x.Bootstrap();
  fixtures::RouteFault slow;
  slow.delay_ms = 50;  // an engine that takes a moment to pause
  x.engine.SetRouteFault("/pause", slow);
  ASSERT_TRUE(x.Admit("held").ok());
  auto r = x.runner->Update(Update("u-1", "rc-1", 1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::vector<DrainObserved> drains;
  for (const journal::Record& rec : x.Records()) {
    if (const auto* d = std::get_if<DrainObserved>(&rec.event)) drains.push_back(*d);
  }
  ASSERT_EQ(drains.size(), 1u) << "the drain was tried again";
  EXPECT_TRUE(drains[0].http.ok_2xx()) << drains[0].http.error;
  EXPECT_TRUE(drains[0].paused);
}

// Proves each intent journals the bound of its whole effect: a probe, a validation and a resume
// make several engine calls, each bounded by call_timeout_ms, and their intents say so. Catches a
// journal claiming one call's deadline for effects that can take four or six times as long, which
// misleads a replay's account of what overran.
TEST(TrustFaults, AnIntentJournalsItsWholeEffectsBound) {
  Executor x;
  x.Bootstrap();
  auto r = x.runner->Update(Update("u-1", "rc-1", 1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const std::uint64_t call_ms = x.runner_options.call_timeout_ms;
  std::map<EffectKind, std::uint64_t> journaled;
  for (const journal::Record& rec : x.Records()) {
    if (const auto* e = std::get_if<EffectStarted>(&rec.event)) journaled[e->kind] = e->deadline_ms;
  }
  EXPECT_EQ(journaled.at(EffectKind::kProbeEngine), 6 * call_ms);
  EXPECT_EQ(journaled.at(EffectKind::kValidate), 4 * call_ms);
  EXPECT_EQ(journaled.at(EffectKind::kResume), 4 * call_ms);
  EXPECT_EQ(journaled.at(EffectKind::kTransfer), x.runner_options.transfer_timeout_ms);
}

// A transfer whose preflight and transfer report texts far longer than the fold's bound, in
// two-byte characters, and then refuse (nothing sent), as a source path or an engine's error
// may.
class VerboseRefusingTransfer final : public effects::WeightTransfer {
 public:
  PreflightObserved Preflight(const effects::TransferTarget& target) override {
    PreflightObserved p = inner_ ? inner_->Preflight(target) : PreflightObserved{};
    p.detail = Long();
    return p;
  }
  TransferObserved Transfer(const effects::TransferTarget&, std::uint64_t) override {
    TransferObserved t;
    t.mutation = MutationClass::kNone;
    t.error = Long();
    return t;
  }
  effects::WeightTransfer* inner_ = nullptr;

 private:
  static std::string Long() {
    std::string s = "x";  // odd length: a byte cut would split a character
    for (int i = 0; i < 5000; ++i) s += "\xc3\xa9";
    return s;
  }
};

// Proves an effect's texts longer than the fold accepts are cut to it (whole characters) before
// they are journaled: the update ends refused and the executor goes on. Catches an observation
// the fold refuses for its length (a source path in an error, an engine's long message), which
// fail-stopped the executor and, since recovery re-runs the effect, every restart after it.
TEST(TrustFaults, AnEffectsLongTextsAreBoundedNotRefused) {
  Executor x;
  x.Bootstrap();
  VerboseRefusingTransfer transfer;
  transfer.inner_ = x.transfer.get();
  effects::Runner runner(*x.journal, *x.control, transfer, effects::system_clock(),
                         x.runner_options);
  auto r = runner.Update(Update("u-long", "rc-1", 1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_NE(r->outcome, UpdateOutcome::kCommitted) << r->reason;
  EXPECT_FALSE(x.journal->failed());
  bool saw_long = false;
  for (const journal::Record& rec : x.Records()) {
    if (const auto* p = std::get_if<PreflightObserved>(&rec.event)) {
      EXPECT_LE(p->detail.size(), kTextBytesMax);
      EXPECT_TRUE(rc::text::valid_utf8(p->detail));
      saw_long = saw_long || p->detail.size() > kTextBytesMax - 2;
    }
  }
  EXPECT_TRUE(saw_long) << "the preflight's text was not journaled at its bound";
  EXPECT_EQ(x.journal->state().lifecycle, Lifecycle::kReady);
}

}  // namespace
}  // namespace rc::itest
