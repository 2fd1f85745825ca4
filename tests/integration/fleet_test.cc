// Fleets over real loopback HTTP: N vLLM doubles (N = 1, 2, 4, 16), one RocksDB journal, the
// fleet executor (effects/fleet_runner.h) driving one runner per engine. Both update modes, and
// faults on single engines (a transfer that dies ambiguously, an engine that dies mid-transfer, a
// cache reset that never succeeds): per engine and for the fleet, no rollout spans two weight
// states, nothing is admitted to a quarantined engine, the staleness bound holds, and every answer
// agrees with the journal (refold, history checker, replay).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "effects/fleet_runner.h"
#include "replay/replay.h"
#include "statemachine/fleet_history.h"
#include "tests/integration/harness.h"

namespace rc::itest {
namespace {

// One engine of the fleet: a vLLM double on loopback and the HTTP adapter its runner drives.
struct FleetEngine {
  FleetEngine() : engine(Options()) {
    port = engine.Start(0);
    RC_CHECK(port > 0);
    effects::EngineDeadlines d;
    d.connect_timeout_ms = 1000;
    d.call_timeout_ms = 5000;
    d.drain_timeout_ms = 20000;
    d.update_timeout_ms = 20000;
    client = std::make_unique<effects::EngineClient>(engine.base_url(), d);
    control = std::make_unique<effects::HttpEngineControl>(*client);
    transfer = std::make_unique<effects::HttpSequenceTransfer>(
        *client, effects::detect_protocol(Executor::Defaults().version));
  }
  // With RolloutCore's worker extension, so each engine reports its weight digest.
  static fixtures::VllmDoubleOptions Options() {
    fixtures::VllmDoubleOptions o = Executor::Defaults();
    o.worker_extension_cls = effects::kWorkerExtensionClass;
    return o;
  }
  ~FleetEngine() {
    transfer.reset();
    control.reset();
    client.reset();  // closes its keep-alive connections before the double stops
    engine.Stop();
  }

  fixtures::VllmDouble engine;
  int port = 0;
  std::unique_ptr<effects::EngineClient> client;
  std::unique_ptr<effects::HttpEngineControl> control;
  std::unique_ptr<effects::HttpSequenceTransfer> transfer;
};

std::string Name(int i) { return "e" + std::to_string(i); }

struct Fleet {
  explicit Fleet(int n, FleetConfigured policy = {}, std::uint64_t update_timeout_ms = 3600000)
      : dir(TempDir("fleet")) {
    auto j = journal::Journal::Open(dir, journal::Options{});
    RC_CHECK(j.ok());
    journal = std::move(j.value());
    effects::FleetRunnerOptions o;
    o.runner = Executor::FastRunner();
    o.blocked_timeout_ms = 300;
    o.update_timeout_ms = update_timeout_ms;
    runner = std::make_unique<effects::FleetRunner>(*journal, effects::system_clock(), o);
    EXPECT_TRUE(runner->Configure(policy).ok());
    for (int i = 0; i < n; ++i) engines.push_back(std::make_unique<FleetEngine>());
    for (int i = 0; i < n; ++i) {
      Status joined = runner->Join(Name(i), *engines[i]->control, *engines[i]->transfer);
      EXPECT_TRUE(joined.ok()) << joined.ToString();
    }
    for (int i = 0; i < n; ++i) {
      Status booted = runner->runner(Name(i))->Bootstrap("rc-0", Identity(0));
      EXPECT_TRUE(booted.ok()) << Name(i) << ": " << booted.ToString();
    }
  }
  ~Fleet() {
    runner.reset();
    journal.reset();
    engines.clear();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }

  FleetState state() const { return journal->fleet_state(); }

  // Durable admission to `engine` under its committed version (what the proxy does).
  Result<RolloutAdmitted> Admit(const std::string& engine, const std::string& id) {
    const FleetEvent a = make_fleet_admission(journal->fleet_state(), engine, id);
    auto s = journal->SubmitFleet(a, WallMs());
    if (!s.ok()) return s.status();
    RC_RETURN_IF_ERROR(journal->Wait(s->ticket));
    return std::get<RolloutAdmitted>(a.event);
  }
  Status Finish(const std::string& engine, const std::string& id) {
    auto s = journal->SubmitFleet(
        FleetEvent{engine, RolloutFinished{id, RolloutOutcome::kCompleted, 0, 0}}, WallMs());
    if (!s.ok()) return s.status();
    return journal->Wait(s->ticket);
  }

  static FleetUpdateRequested Request(const std::string& id, FleetUpdateMode mode, int step,
                                      std::uint32_t batch_max = 1, std::uint32_t min_healthy = 1) {
    return FleetUpdateRequested{id,
                                mode,
                                batch_max,
                                min_healthy,
                                "rc-" + std::to_string(step),
                                Identity(step),
                                "synthetic:8x64:" + std::to_string(step)};
  }

  // Every answer agrees with the journal: the live fold equals a refold and the snapshot load,
  // the fleet history checker accepts the records, replay re-derives every decision, and each
  // committed engine's double reports the label its fold committed.
  void Check() {
    const FleetState live = state();
    EXPECT_EQ(*journal->RefoldFleet(), live);
    EXPECT_EQ(*journal->LoadFleetState(), live);
    std::vector<FleetHistoryEntry> history;
    for (const journal::Record& r : ScanRecords(*journal)) {
      history.push_back({r.seq, r.cause_seq, r.engine, r.event});
    }
    const FleetHistoryReport h = check_fleet_history(history);
    EXPECT_TRUE(h.ok) << "seq " << h.first_bad_seq << ": " << h.message;
    auto report = replay::Replay(*journal, {});
    ASSERT_TRUE(report.ok());
    EXPECT_TRUE(report->ok) << "seq " << report->first_bad_seq << ": " << report->error;
    for (std::size_t i = 0; i < engines.size(); ++i) {
      const State& s = live.engines.at(Name(static_cast<int>(i)));
      if (s.lifecycle != Lifecycle::kReady) continue;
      EXPECT_EQ(engines[i]->engine.weight_label(), s.committed.label) << Name(static_cast<int>(i));
    }
  }

  std::string dir;
  std::unique_ptr<journal::Journal> journal;
  std::vector<std::unique_ptr<FleetEngine>> engines;
  std::unique_ptr<effects::FleetRunner> runner;
};

// Proves an `all` update over 1, 2, 4 and 16 engines commits every engine to the new label, each
// double then holds the new weights, and the fleet update ends committed with every member
// counted; and that the next one, its engines known to share a layout and no digest named, runs
// the first member alone and then all the others at once, each held to the first's digest.
// Catches an executor that skips members, ends the fleet update early, runs members one after
// another, or starts one unheld (which could publish on one engine what another does not hold).
TEST(FleetIntegration, AllModeCommitsEveryEngine) {
  for (int n : {1, 2, 4, 16}) {
    SCOPED_TRACE("engines " + std::to_string(n));
    Fleet f(n);
    Result<FleetUpdateEnded> end = f.runner->Update(Fleet::Request("u1", FleetUpdateMode::kAll, 1));
    ASSERT_TRUE(end.ok()) << end.status().ToString();
    EXPECT_EQ(end->outcome, FleetOutcome::kCommitted) << end->reason;
    EXPECT_EQ(end->committed, static_cast<std::uint32_t>(n));
    const FleetState s = f.state();
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(s.engines.at(Name(i)).committed.label, "rc-1") << Name(i);
      EXPECT_EQ(fleet_generation(s, Name(i)), 1u);
      EXPECT_EQ(f.engines[i]->engine.weights_generation(), 1u) << Name(i);
    }
    // The doubles start on four tensors and rc-1 has eight: until every engine holds rc-1's
    // layout they are not known to share one, so this update proves only that all commit.
    const auto waves = [&](std::uint64_t after_seq, std::string& first) {
      std::uint64_t last_start = 0, first_end = 0, starts = 0;
      for (const journal::Record& r : ScanRecords(*f.journal)) {
        if (r.seq <= after_seq) continue;
        if (std::holds_alternative<UpdateRequested>(r.event)) {
          if (starts++ == 0) first = r.engine;
          last_start = r.seq;
        }
        if (first_end == 0 && r.engine != first && std::holds_alternative<UpdateEnded>(r.event)) {
          first_end = r.seq;
        }
      }
      EXPECT_EQ(starts, static_cast<std::uint64_t>(n));
      return last_start < first_end || n == 1;
    };
    // Now that each engine's layout is known (one for all) and the request names no digest, the
    // first member goes alone until its validation reads the digest, then every other member
    // starts held to it, before any of them ends.
    const std::uint64_t before = f.journal->head_seq();
    Result<FleetUpdateEnded> next =
        f.runner->Update(Fleet::Request("u2", FleetUpdateMode::kAll, 2));
    ASSERT_TRUE(next.ok()) << next.status().ToString();
    EXPECT_EQ(next->committed, static_cast<std::uint32_t>(n)) << next->reason;
    std::string first;
    EXPECT_TRUE(waves(before, first)) << "the members after the first ran one after another";
    EXPECT_EQ(next->outcome, FleetOutcome::kCommitted) << next->reason;
    const FleetState after = f.state();
    const std::string held = after.engines.at(first).committed_digest.combined;
    ASSERT_FALSE(held.empty()) << "the doubles computed no digest: nothing could be held";
    for (const journal::Record& r : ScanRecords(*f.journal)) {
      const auto* u = std::get_if<UpdateRequested>(&r.event);
      if (r.seq <= before || u == nullptr) continue;
      EXPECT_EQ(u->expected_digest, r.engine == first ? "" : held) << r.engine;
    }
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(after.engines.at(Name(i)).committed.label, "rc-2") << Name(i);
      EXPECT_EQ(f.engines[i]->engine.weights_generation(), 2u) << Name(i);
    }
    f.Check();
  }
}

// Proves a rolling update takes one engine at a time while the others keep admitting, and that
// under a staleness bound of 1 every admission made meanwhile lands on an engine within it;
// catches a rolling update that drains the fleet at once or admits beyond the bound.
TEST(FleetIntegration, RollingKeepsServingWithinTheStalenessBound) {
  Fleet f(4, FleetConfigured{1, 3});
  std::atomic<bool> stop{false};
  std::atomic<int> admitted{0};
  std::atomic<std::size_t> fewest_admitting{4};
  std::thread load([&] {
    for (int i = 0; !stop.load(); ++i) {
      const std::vector<std::string> open = admitting_engines(f.state());
      if (open.size() < fewest_admitting.load()) fewest_admitting.store(open.size());
      if (open.empty()) continue;
      const std::string& engine = open[static_cast<std::size_t>(i) % open.size()];
      const std::string id = "r" + std::to_string(i);
      if (f.Admit(engine, id).ok()) {
        admitted++;
        EXPECT_TRUE(f.Finish(engine, id).ok());
      }
    }
  });
  Result<FleetUpdateEnded> end =
      f.runner->Update(Fleet::Request("u1", FleetUpdateMode::kRolling, 1));
  stop.store(true);
  load.join();
  ASSERT_TRUE(end.ok()) << end.status().ToString();
  EXPECT_EQ(end->outcome, FleetOutcome::kCommitted) << end->reason;
  EXPECT_EQ(end->committed, 4u);
  EXPECT_GT(admitted.load(), 0);
  EXPECT_GE(fewest_admitting.load(), 3u) << "fewer than min_serving engines admitted";
  // At most one member updated at a time (batch_max 1): count the members in flight.
  int in_flight = 0, most_in_flight = 0;
  for (const journal::Record& r : ScanRecords(*f.journal)) {
    in_flight += std::holds_alternative<UpdateRequested>(r.event) ? 1 : 0;
    in_flight -= std::holds_alternative<UpdateEnded>(r.event) ? 1 : 0;
    most_in_flight = std::max(most_in_flight, in_flight);
  }
  EXPECT_EQ(most_in_flight, 1) << "a rolling update with batch_max 1 ran members together";
  f.Check();
}

// Proves a rollout admitted before an `all` update finishes before its engine's weights change
// (the finish precedes that engine's transfer intent in the journal) and every rollout is bound to
// exactly one generation; catches an update that mutates an engine under a live rollout.
TEST(FleetIntegration, LiveRolloutsFinishBeforeTheirEngineMutates) {
  Fleet f(2);
  ASSERT_TRUE(f.Admit("e0", "live").ok());
  std::thread update([&] {
    Result<FleetUpdateEnded> end = f.runner->Update(Fleet::Request("u1", FleetUpdateMode::kAll, 1));
    ASSERT_TRUE(end.ok()) << end.status().ToString();
    EXPECT_EQ(end->outcome, FleetOutcome::kCommitted) << end->reason;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(f.Finish("e0", "live").ok());
  update.join();
  std::uint64_t finish = 0, transfer = 0;
  for (const journal::Record& r : ScanRecords(*f.journal)) {
    if (std::holds_alternative<RolloutFinished>(r.event)) finish = r.seq;
    const auto* e = std::get_if<EffectStarted>(&r.event);
    if (r.engine == "e0" && e != nullptr && e->kind == EffectKind::kTransfer) transfer = r.seq;
  }
  ASSERT_NE(finish, 0u);
  ASSERT_NE(transfer, 0u);
  EXPECT_LT(finish, transfer) << "e0's weights changed under a live rollout";
  f.Check();
}

enum class Fault { kAmbiguousTransfer, kDiesMidTransfer, kResetNeverSucceeds };

void Inject(fixtures::VllmDouble& engine, Fault fault) {
  fixtures::RouteFault f;
  switch (fault) {
    case Fault::kAmbiguousTransfer:
      f.drop_connection = true;
      f.after = true;  // the engine ran the update; the caller cannot tell
      engine.SetRouteFault("/update_weights", f);
      break;
    case Fault::kDiesMidTransfer:
      f.die = true;  // the engine process dies while it receives
      engine.SetRouteFault("/update_weights", f);
      break;
    case Fault::kResetNeverSucceeds:
      engine.FailResetPrefixCache(1000);
      break;
  }
}

// Proves a fault on one engine of four in an `all` update (its transfer lost ambiguously, its
// process dead mid-transfer, its cache never reset) makes that engine TAINTED on its own
// evidence while the other three commit, the fleet update ends partial with each count right,
// nothing is admitted to the quarantined engine afterwards, and the next update skips it; catches
// a failure on one engine that is hidden, spreads to the others, or leaves the engine admitting.
TEST(FleetIntegration, AFaultOnOneEngineQuarantinesOnlyThatEngine) {
  for (Fault fault :
       {Fault::kAmbiguousTransfer, Fault::kDiesMidTransfer, Fault::kResetNeverSucceeds}) {
    SCOPED_TRACE("fault " + std::to_string(static_cast<int>(fault)));
    Fleet f(4);
    Inject(f.engines[2]->engine, fault);
    Result<FleetUpdateEnded> end = f.runner->Update(Fleet::Request("u1", FleetUpdateMode::kAll, 1));
    ASSERT_TRUE(end.ok()) << end.status().ToString();
    EXPECT_EQ(end->outcome, FleetOutcome::kPartial) << end->reason;
    EXPECT_EQ(end->committed, 3u);
    EXPECT_EQ(end->tainted, 1u);
    const FleetState s = f.state();
    EXPECT_EQ(s.engines.at("e2").lifecycle, Lifecycle::kTainted);
    EXPECT_EQ(s.engines.at("e2").committed.label, "rc-0") << "the target was published on e2";
    EXPECT_EQ(admitting_engines(s), (std::vector<std::string>{"e0", "e1", "e3"}));
    Result<RolloutAdmitted> quarantined = f.Admit("e2", "to-e2");
    ASSERT_FALSE(quarantined.ok());
    EXPECT_EQ(quarantined.status().code(), Code::kRejected);
    EXPECT_TRUE(f.Admit("e3", "to-e3").ok());
    EXPECT_TRUE(f.Finish("e3", "to-e3").ok());
    Result<FleetUpdateEnded> next =
        f.runner->Update(Fleet::Request("u2", FleetUpdateMode::kAll, 2));
    ASSERT_TRUE(next.ok()) << next.status().ToString();
    EXPECT_EQ(next->committed, 3u);
    EXPECT_EQ(f.state().engines.at("e2").lifecycle, Lifecycle::kTainted);
    f.Check();
  }
}

// Proves a fleet update that carries the trainer's expected digest publishes on no engine whose
// weights, read while paused, differ from it: the engine whose transfer landed half the tensors
// is TAINTED, the others commit with exactly that digest; catches members validated on the label
// alone (a partial transfer published as the new version).
TEST(FleetIntegration, AnExpectedDigestCatchesAPartialTransfer) {
  std::string full;  // the digest a complete update to rc-1 gives, measured on one engine
  {
    Fleet probe(1);
    Result<FleetUpdateEnded> end =
        probe.runner->Update(Fleet::Request("u1", FleetUpdateMode::kAll, 1));
    ASSERT_TRUE(end.ok() && end->outcome == FleetOutcome::kCommitted);
    full = probe.state().engines.at("e0").committed_digest.combined;
    ASSERT_FALSE(full.empty()) << "the double computes no weight digest";
  }
  Fleet f(3);
  f.engines[1]->engine.SetWeightsFault(fixtures::WeightsFault::kPartial);
  FleetUpdateRequested request = Fleet::Request("u1", FleetUpdateMode::kAll, 1);
  request.expected_digest = full;
  Result<FleetUpdateEnded> end = f.runner->Update(request);
  ASSERT_TRUE(end.ok()) << end.status().ToString();
  EXPECT_EQ(end->outcome, FleetOutcome::kPartial) << end->reason;
  EXPECT_EQ(end->committed, 2u);
  EXPECT_EQ(end->tainted, 1u);
  const FleetState s = f.state();
  EXPECT_EQ(s.engines.at("e1").lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(s.engines.at("e1").committed.label, "rc-0");
  EXPECT_EQ(s.engines.at("e0").committed_digest.combined, full);
  EXPECT_EQ(s.engines.at("e2").committed_digest.combined, full);
  f.Check();
}

// Proves the fleet update is refused as a whole when fewer than min_healthy engines can take it,
// and that an update that cannot progress (min_serving keeps every engine serving) is cancelled
// after the executor's deadline instead of waiting forever; catches a partial update below the
// health floor and an executor that hangs on a blocked update.
TEST(FleetIntegration, RefusedBelowMinHealthyAndCancelledWhenBlocked) {
  Fleet f(3, FleetConfigured{0, 3});
  Inject(f.engines[0]->engine, Fault::kAmbiguousTransfer);
  // e0 alone: its rolling update cannot start (3 must keep serving), so the first is cancelled.
  Result<FleetUpdateEnded> blocked =
      f.runner->Update(Fleet::Request("u-blocked", FleetUpdateMode::kRolling, 1));
  ASSERT_TRUE(blocked.ok()) << blocked.status().ToString();
  EXPECT_EQ(blocked->outcome, FleetOutcome::kRefused);
  EXPECT_NE(blocked->reason.find("blocked for"), std::string::npos) << blocked->reason;
  EXPECT_EQ(blocked->skipped, 3u);
  // `all` ignores min_serving: e0 taints, e1 and e2 commit.
  Result<FleetUpdateEnded> all =
      f.runner->Update(Fleet::Request("u-all", FleetUpdateMode::kAll, 1));
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(all->tainted, 1u);
  // Two healthy engines cannot meet min_healthy 3: refused in the request's own group.
  Result<FleetUpdateEnded> refused =
      f.runner->Update(Fleet::Request("u-3", FleetUpdateMode::kAll, 2, 1, 3));
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  EXPECT_EQ(refused->outcome, FleetOutcome::kRefused);
  EXPECT_EQ(refused->committed, 0u);
  EXPECT_EQ(f.state().engines.at("e1").committed.label, "rc-1");
  f.Check();
}

// Proves a rolling update still open at its deadline is cancelled: the member updating then ends
// by its own deadlines and commits, no member starts after the deadline, and the update ends
// partial naming the deadline; catches a fleet update whose batches go on for as long as engines
// keep answering, holding the trainer's call (and the update slot) without a bound.
TEST(FleetIntegration, AnUpdatePastItsDeadlineStartsNoMoreMembers) {
  Fleet f(3, FleetConfigured{0, 0}, /*update_timeout_ms=*/100);
  fixtures::RouteFault slow;
  slow.delay_ms = 600;  // e0 is the first member of the batch (names in order)
  f.engines[0]->engine.SetRouteFault("/update_weights", slow);
  Result<FleetUpdateEnded> end =
      f.runner->Update(Fleet::Request("u1", FleetUpdateMode::kRolling, 1));
  ASSERT_TRUE(end.ok()) << end.status().ToString();
  EXPECT_EQ(end->outcome, FleetOutcome::kPartial) << end->reason;
  EXPECT_EQ(end->committed, 1u);
  EXPECT_EQ(end->skipped, 2u);
  EXPECT_NE(end->reason.find("deadline: open for"), std::string::npos) << end->reason;
  const FleetState s = f.state();
  EXPECT_EQ(s.engines.at("e0").committed.label, "rc-1");
  EXPECT_EQ(s.engines.at("e1").committed.label, "rc-0");
  EXPECT_EQ(s.engines.at("e2").committed.label, "rc-0");
  f.Check();
}

// Proves a fleet update's deadline counts from its request even when the request is asked again
// after a restart: the earlier process journaled it 10 s ago, the deadline is 1 s, so the
// re-POST starts no member and ends it cancelled. Catches the deadline restarting with every
// executor restart (a fresh full timeout per re-POST), so it never held across crashes.
TEST(FleetIntegration, AnUpdatesDeadlineCountsFromItsRequestAcrossRestarts) {
  Fleet f(3, FleetConfigured{0, 0}, /*update_timeout_ms=*/1000);
  const FleetUpdateRequested request = Fleet::Request("u1", FleetUpdateMode::kRolling, 1);
  auto earlier = f.journal->SubmitFleet(FleetEvent{"", request}, WallMs() - 10000,
                                        effects::FleetUpdateIdempotencyKey("u1"));
  ASSERT_TRUE(earlier.ok()) << earlier.status().ToString();
  ASSERT_TRUE(f.journal->Wait(earlier->ticket).ok());
  Result<FleetUpdateEnded> end = f.runner->Update(request);
  ASSERT_TRUE(end.ok()) << end.status().ToString();
  EXPECT_EQ(end->committed, 0u) << end->reason;
  EXPECT_EQ(end->skipped, 3u) << end->reason;
  EXPECT_NE(end->reason.find("deadline"), std::string::npos) << end->reason;
  f.Check();
}

// Proves a fleet update ended in another caller's group that nobody has made durable yet (here a
// cancel submitted straight to the journal; in serve, the monitor's taint of the last pending
// member) is reported once durable, with that end; catches an executor that sees the update
// closed in the fold, finds no durable end, and answers "closed without its end" (which serve
// treats as a journal failure and fail-stops on), or reports an end the journal may still lose.
TEST(FleetIntegration, AnEndDecidedInAnotherGroupIsReportedOnceDurable) {
  Fleet f(2, FleetConfigured{0, 2});
  std::thread canceller([&f] {
    // As soon as the update is open (its members cannot start: min_serving 2), well before the
    // executor's own cancel at blocked_timeout_ms.
    bool open = false;
    while (!open) {
      f.journal->ReadFleetState([&open](const FleetState& s) { open = s.update.has_value(); });
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    auto s =
        f.journal->SubmitFleet(FleetEvent{"", FleetUpdateCancelled{"u1", "by hand"}}, WallMs());
    EXPECT_TRUE(s.ok()) << s.status().ToString();  // not waited for: nothing commits it yet
  });
  Result<FleetUpdateEnded> end =
      f.runner->Update(Fleet::Request("u1", FleetUpdateMode::kRolling, 1));
  canceller.join();
  ASSERT_TRUE(end.ok()) << end.status().ToString();
  EXPECT_EQ(end->reason, "cancelled: by hand");
  EXPECT_EQ(end->skipped, 2u);
  f.Check();
}

// Proves an executor that died after journaling a fleet update and one member's own request
// comes back without losing or repeating anything: the new executor recovers each runner (the
// interrupted member's update is driven to its end), then the same request (same idempotency
// key) starts the members still pending, and every member commits exactly once; catches a
// restart that strands a member in its plan, journals the fleet update twice, or starts a member
// twice.
TEST(FleetIntegration, AnExecutorRestartMidUpdateFinishesIt) {
  Fleet f(3);
  const FleetUpdateRequested request = Fleet::Request("u1", FleetUpdateMode::kAll, 1);
  auto submitted = f.journal->SubmitFleet(FleetEvent{"", request}, WallMs(),
                                          effects::FleetUpdateIdempotencyKey("u1"));
  ASSERT_TRUE(submitted.ok()) << submitted.status().ToString();
  ASSERT_TRUE(f.journal->Wait(submitted->ticket).ok());
  ASSERT_TRUE(f.runner->runner("e1")->StartUpdate(member_update_request(f.state(), "e1")).ok());
  // The executor dies here: a new one joins the same engines over the same journal.
  effects::FleetRunnerOptions o;
  o.runner = Executor::FastRunner();
  f.runner = std::make_unique<effects::FleetRunner>(*f.journal, effects::system_clock(), o);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(f.runner->Join(Name(i), *f.engines[i]->control, *f.engines[i]->transfer).ok());
  }
  ASSERT_TRUE(f.runner->Recover(f.journal->recovery()).ok());
  EXPECT_EQ(f.state().update->members.at("e1"), MemberStatus::kCommitted);
  Result<FleetUpdateEnded> end = f.runner->Update(request);
  ASSERT_TRUE(end.ok()) << end.status().ToString();
  EXPECT_EQ(end->outcome, FleetOutcome::kCommitted) << end->reason;
  EXPECT_EQ(end->committed, 3u);
  int requests = 0, member_requests = 0;
  for (const journal::Record& r : ScanRecords(*f.journal)) {
    requests += std::holds_alternative<FleetUpdateRequested>(r.event);
    member_requests += std::holds_alternative<UpdateRequested>(r.event);
  }
  EXPECT_EQ(requests, 1);
  EXPECT_EQ(member_requests, 3);
  f.Check();
}

// Proves each member of a fleet update is looked at before its own plan: a member someone else
// paused between two monitor looks goes TAINTED from READY with the monitor's cause and is
// skipped, nothing sent to it, while the others commit; catches a fleet path whose members pause
// and update an engine that is no longer the one their committed version was verified on.
TEST(FleetIntegration, AMemberChangedBehindTheFleetIsTaintedAndSkipped) {
  Fleet f(3);
  effects::EngineClient outsider(f.engines[1]->engine.base_url());
  ASSERT_TRUE(outsider.Pause(effects::PauseMode::kAbort, /*clear_cache=*/false).http.ok_2xx());
  Result<FleetUpdateEnded> end = f.runner->Update(Fleet::Request("u1", FleetUpdateMode::kAll, 1));
  ASSERT_TRUE(end.ok()) << end.status().ToString();
  EXPECT_EQ(end->outcome, FleetOutcome::kPartial) << end->reason;
  EXPECT_EQ(end->committed, 2u);
  EXPECT_EQ(end->skipped, 1u);
  const FleetState s = f.state();
  const State& e1 = s.engines.at("e1");
  ASSERT_EQ(e1.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(e1.taint->from, Lifecycle::kReady);
  EXPECT_EQ(e1.taint->cause, Cause::kEnginePausedExternally) << e1.taint->detail;
  EXPECT_EQ(e1.counters.updates_requested, 0u);
  EXPECT_EQ(f.engines[1]->engine.RouteCount("/pause"), 1u) << "paused again by its runner";
  EXPECT_EQ(f.engines[1]->engine.weights_generation(), 0u);
  EXPECT_EQ(s.engines.at("e0").committed.label, "rc-1");
  EXPECT_EQ(s.engines.at("e2").committed.label, "rc-1");
  f.Check();
}

}  // namespace
}  // namespace rc::itest
