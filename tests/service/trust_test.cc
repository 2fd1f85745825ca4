// Trust under faults: the executor service against the vLLM double over loopback HTTP, with a
// real RocksDB journal (over a fault-injecting Env where a test needs write/fsync faults).
// Each test reproduces one reported failure and proves the class is fixed.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "effects/http/sequence_transfer.h"
#include "fixtures/vllm_double.h"
#include "journal/testing/fault_env.h"
#include "service/http_util.h"
#include "service/service.h"
#include "statemachine/describe.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;
using journal::testing::Fault;
using journal::testing::FaultEnv;
using journal::testing::FileKind;
using journal::testing::FileOp;
using SteadyClock = std::chrono::steady_clock;

constexpr const char* kToken = "trust-token";
constexpr const char* kSource = "synthetic:4x64";

httplib::Headers auth() { return stack::Bearer(kToken); }

json update_body(const std::string& id, const std::string& label, int step) {
  return stack::UpdateBody(id, label, step, "run-t");
}

// A service over a journal in a temp dir (optionally over a FaultEnv) and a vLLM double.
struct Stack : stack::ServiceStack {
  explicit Stack(std::function<void(ServeConfig&)> t = nullptr, bool fault_env = false,
                 int token_delay_ms = 1)
      : ServiceStack(Options(std::move(t), fault_env, token_delay_ms)) {}
  static stack::StackOptions Options(std::function<void(ServeConfig&)> t, bool fault_env,
                                     int delay_ms) {
    stack::StackOptions o;
    o.token = kToken;
    o.run = "run-t";
    o.dir_prefix = "rc-trust";
    o.token_delay_ms = delay_ms;
    o.fault_env = fault_env;
    o.tweak = [t = std::move(t)](ServeConfig& c) {
      c.drain_timeout_ms = 20000;
      c.admit_wait_ms = 20000;
      c.http_threads = 64;
      if (t) t(c);
    };
    return o;
  }
};

bool eventually(const std::function<bool()>& pred, int timeout_ms) {
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(timeout_ms);
  while (SteadyClock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

// Proves that with fsyncs stalled and long proxied requests in flight every finish is durable
// (no binding stays active) and the next update commits. Catches: the proxy dropping a finish it
// could not journal at once (9 bindings active forever, every later update refused "N rollouts
// still active").
TEST(TrustFaults, StalledFsyncNeverDropsAFinish) {
  Stack s([](ServeConfig& c) { c.journal_commit_stall_timeout_ms = 20000; }, /*fault_env=*/true,
          /*token_delay_ms=*/20);
  constexpr int kClients = 24;
  std::vector<int> status(kClients, 0);
  std::vector<std::thread> threads;
  s.faults->StallSync(FileKind::kWal, 1500);
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      httplib::Client c = s.client();
      auto r = c.Post(
          "/v1/completions",
          json({{"prompt", "p" + std::to_string(i)}, {"max_tokens", 16}, {"stream", i % 2 == 0}})
              .dump(),
          "application/json");
      status[i] = r ? r->status : -1;
    });
  }
  for (auto& t : threads) t.join();
  s.faults->StallSync(FileKind::kWal, 0);
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(status[i], 200) << "client " << i;
  EXPECT_FALSE(s.svc->failed()) << s.svc->failure();
  EXPECT_TRUE(s.svc->journal().state().active.empty())
      << s.svc->journal().state().active.size() << " binding(s) left active";
  httplib::Client c = s.client();
  auto u = c.Post("/v1/updates", auth(), DumpSafe(update_body("u-after-stall", "rc-1", 1)),
                  "application/json");
  ASSERT_TRUE(u);
  EXPECT_EQ(u->status, 200) << u->body;
}

// Proves an fsync error while an update drains fail-stops the executor (readyz/healthz 503, the
// update answered 503 outcome_unknown, never "failed") and that after the restart a re-POST of
// the same update_id answers what recovery recorded. Catches: a 500 "failed" that recovery later
// contradicts by completing the update, /healthz ok on a failed journal, proxied requests left
// waiting on a dead executor.
TEST(TrustFaults, FsyncErrorWhileDrainingFailStopsAndNeverContradicts) {
  Stack s(nullptr, /*fault_env=*/true);
  httplib::Client c = s.client();
  auto a = c.Post("/v1/rollouts", auth(), R"({"rollout_id": "held"})", "application/json");
  ASSERT_TRUE(a);
  ASSERT_EQ(a->status, 201) << a->body;
  std::string update_answer;
  int update_status = 0;
  std::thread trainer([&] {
    httplib::Client t = s.client();
    auto r = t.Post("/v1/updates", auth(), DumpSafe(update_body("u-eio", "rc-1", 1)),
                    "application/json");
    update_status = r ? r->status : -1;
    update_answer = r ? r->body : "";
  });
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kDraining; }, 5000));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the drain intent is durable
  s.faults->Inject(FileKind::kWal, FileOp::kSync, Fault::kEio);
  auto f = c.Delete("/v1/rollouts/held", auth());
  ASSERT_TRUE(f);
  EXPECT_EQ(f->status, 503) << "a finish that is not durable was acknowledged: " << f->body;
  trainer.join();
  EXPECT_TRUE(s.svc->failed());
  EXPECT_NE(s.svc->failure().find(s.Config().journal_path), std::string::npos) << s.svc->failure();
  EXPECT_EQ(update_status, 503) << update_answer;
  EXPECT_NE(update_answer.find("outcome_unknown"), std::string::npos) << update_answer;
  auto h = c.Get("/healthz");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503) << h->body;
  auto rz = c.Get("/readyz");
  ASSERT_TRUE(rz);
  EXPECT_EQ(rz->status, 503) << rz->body;
  auto p = c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})", "application/json");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->status, 503) << "admitted on a failed journal";

  // The process exits; the next start recovers from what is durable.
  s.Kill();
  s.faults->Restart();
  s.Open();
  httplib::Client c2 = s.client();
  auto again =
      c2.Post("/v1/updates", auth(), DumpSafe(update_body("u-eio", "rc-1", 1)), "application/json");
  ASSERT_TRUE(again);
  json j = json::parse(again->body, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << again->body;
  // Whatever recovery decided is what the re-POST reads: recorded, never a second attempt.
  EXPECT_TRUE(again->status == 200 || again->status == 422 || again->status == 500) << again->body;
  EXPECT_EQ(j.value("replayed", false), true) << again->body;
  EXPECT_EQ(s.svc->journal().state().counters.updates_requested, 1u);
}

// Proves a proxied rollout whose finish cannot be made durable is never answered as done: the
// non-streamed client gets 503, the streamed one an error event and no [DONE], and no trajectory
// line claims either. Catches the answer (200, or [DONE]) going out whatever the finish's
// status, and the trajectory line written before the finish was durable, both of which a
// restart then contradicts by recording the rollout abandoned.
TEST(TrustFaults, AProxiedFinishThatIsNotDurableIsNeverAcknowledged) {
  Stack s(nullptr, /*fault_env=*/true, /*token_delay_ms=*/300);
  int plain_status = 0;
  std::string streamed;
  std::thread plain([&] {
    auto r = s.client().Post("/v1/completions", R"({"prompt": "a", "max_tokens": 4})",
                             "application/json");
    plain_status = r ? r->status : -1;
  });
  std::thread stream([&] {
    auto r =
        s.client().Post("/v1/completions", R"({"prompt": "b", "max_tokens": 4, "stream": true})",
                        "application/json");
    streamed = r ? r->body : "";
  });
  ASSERT_TRUE(eventually([&] { return s.svc->journal().state().active.size() == 2; }, 5000));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // both admissions durable
  s.faults->Inject(FileKind::kWal, FileOp::kSync, Fault::kEio);
  plain.join();
  stream.join();
  EXPECT_TRUE(s.svc->failed());
  EXPECT_EQ(plain_status, 503) << "a finish that is not durable was answered as done";
  EXPECT_EQ(streamed.find("[DONE]"), std::string::npos) << streamed;
  EXPECT_NE(streamed.find("could not be made durable"), std::string::npos) << streamed;
  EXPECT_TRUE(s.svc->DrainTrajectories(10000));
  std::ifstream lines(s.Config().journal_path + ".trajectories.jsonl");
  std::string line;
  EXPECT_FALSE(std::getline(lines, line)) << "a trajectory line for an undurable finish: " << line;
}

// Proves the trainer API cannot end a proxied rollout: DELETE answers 409 and the rollout stays
// bound until its request ends, which then answers normally. Catches a DELETE that frees the
// binding while the generation runs, so an update could pause and reload the engine under it.
TEST(TrustApi, AProxiedRolloutEndsOnlyWithItsRequest) {
  Stack s(nullptr, /*fault_env=*/false, /*token_delay_ms=*/200);
  int status = 0;
  std::thread client([&] {
    auto r = s.client().Post("/v1/completions", R"({"prompt": "a", "max_tokens": 4})",
                             "application/json");
    status = r ? r->status : -1;
  });
  ASSERT_TRUE(eventually([&] { return s.svc->journal().state().active.size() == 1; }, 5000));
  const std::string id = s.svc->journal().state().active.begin()->first;
  auto d = s.client().Delete("/v1/rollouts/" + id, auth());
  ASSERT_TRUE(d);
  EXPECT_EQ(d->status, 409) << d->body;
  EXPECT_EQ(s.svc->journal().state().active.count(id), 1u) << "the binding was freed";
  client.join();
  EXPECT_EQ(status, 200);
  EXPECT_TRUE(s.svc->journal().state().active.empty());
}

// Proves the trainer's finish refuses a proxied rollout by the journal's own state at the moment
// it would write, whatever the caller saw before: the proxied rollout is admitted after the
// HTTP layer could have looked. Catches a check-then-finish race where a DELETE for an id not
// yet used ended a proxied rollout admitted in between, freeing its binding mid-generation.
TEST(TrustApi, TheTrainersFinishNeverEndsAProxiedRollout) {
  Stack s;
  Service::AdmitResult a = s.svc->Admit("raced", 1000);  // proxied: no lease
  ASSERT_TRUE(a.admitted.has_value());
  const std::uint64_t events = s.svc->journal().state().counters.events;
  Status st = s.svc->FinishLeased("raced", RolloutOutcome::kCompleted, 1, 1);
  EXPECT_EQ(st.code(), Code::kConflict) << st.ToString();
  Status lapsed = s.svc->FinishLeased("raced", RolloutOutcome::kExpired, 0, 0);
  EXPECT_EQ(lapsed.code(), Code::kConflict) << lapsed.ToString();
  EXPECT_EQ(s.svc->journal().state().counters.events, events) << "a refused finish was journaled";
  EXPECT_EQ(s.svc->journal().state().active.count("raced"), 1u);
  EXPECT_TRUE(s.svc->FinishDurably("raced", RolloutOutcome::kCompleted, 1, 1).ok());
  EXPECT_EQ(s.svc->FinishLeased("raced", RolloutOutcome::kCompleted, 1, 1).code(), Code::kNotFound);
}

// Proves admissions that wait for a drain hold at most a quarter of the blocking pool: beyond it
// they are refused at once (503 overloaded), and a lease renewal is served meanwhile. Catches
// waiting admissions filling the pool, so that renewals queued until the lease lapsed under a
// live client (recorded expired while it still generated) and health probes stalled.
TEST(TrustApi, WaitingAdmissionsLeaveThreadsForLeaseRenewals) {
  Stack s([](ServeConfig& c) { c.http_threads = 8; });
  httplib::Client c = s.client();
  auto held = c.Post("/v1/rollouts", auth(), R"({"rollout_id": "held"})", "application/json");
  ASSERT_TRUE(held && held->status == 201);
  int update_status = 0;
  std::thread trainer([&] {
    auto r = s.client().Post("/v1/updates", auth(), update_body("u1", "rc-1", 1).dump(),
                             "application/json");
    update_status = r ? r->status : -1;
  });
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kDraining; }, 5000));
  constexpr int kWaiting = 8;
  std::vector<std::string> answers(kWaiting);
  std::vector<std::thread> waiting;
  for (int i = 0; i < kWaiting; ++i) {
    waiting.emplace_back([&, i] {
      auto r = s.client().Post("/v1/rollouts", auth(), R"({"wait_ms": 3000})", "application/json");
      answers[i] = r ? std::to_string(r->status) + " " + r->body : "none";
    });
  }
  auto renewed = c.Post("/v1/rollouts/held/lease", auth(), "{}", "application/json");
  for (std::thread& t : waiting) t.join();
  ASSERT_TRUE(renewed);
  EXPECT_EQ(renewed->status, 200) << renewed->body;
  int overloaded = 0;
  for (const std::string& a : answers) overloaded += a.find("overloaded") != std::string::npos;
  EXPECT_GE(overloaded, kWaiting - 2) << "more than http_threads / 4 admissions waited";
  auto done = c.Delete("/v1/rollouts/held", auth());
  ASSERT_TRUE(done);
  EXPECT_EQ(done->status, 200) << done->body;
  trainer.join();
  EXPECT_EQ(update_status, 200);
}

// Proves a restore after the engine restarted initializes the new process's transfer engine, and
// commits. Catches a transfer initialized once per serve process: every restore after an engine
// restart sent its weights to a process with no transfer engine, tainting it again until serve
// itself restarted.
TEST(TrustEngine, ARestoreAfterAnEngineRestartInitializesItsTransferAgain) {
  Stack s;
  httplib::Client c = s.client();
  auto u = c.Post("/v1/updates", auth(), update_body("u1", "rc-1", 1).dump(), "application/json");
  ASSERT_TRUE(u && u->status == 200) << (u ? u->body : "no answer");
  ASSERT_TRUE(s.RestartEngine());
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kTainted; }, 15000));
  const json body = {{"restore_id", "r1"}, {"label", "rc-1"}, {"source", "synthetic:4x64:1"}};
  auto r = c.Post("/v1/restores", auth(), body.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(s.svc->journal().state().lifecycle, Lifecycle::kReady);
}

// Proves a malformed plan id is a bad request at once, even while another plan holds the slot:
// 400, counted as a bad request, nothing journaled. Catches ids checked only by the fold, after
// the slot: a 409 ("another plan runs") for a request that could never run.
TEST(TrustApi, AMalformedPlanIdIsRefusedBeforeThePlanSlot) {
  Stack s;
  httplib::Client c = s.client();
  auto held = c.Post("/v1/rollouts", auth(), R"({"rollout_id": "held"})", "application/json");
  ASSERT_TRUE(held && held->status == 201);
  std::thread trainer([&] {
    (void)s.client().Post("/v1/updates", auth(), update_body("u1", "rc-1", 1).dump(),
                          "application/json");
  });
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kDraining; }, 5000));
  const std::uint64_t events = s.svc->journal().state().counters.events;
  const std::uint64_t bad = s.svc->metrics().bad_requests.load();
  auto r =
      c.Post("/v1/updates", auth(),
             update_body(std::string(kIdBytesMax + 1, 'x'), "rc-2", 2).dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_EQ(s.svc->metrics().bad_requests.load(), bad + 1);
  EXPECT_EQ(s.svc->journal().state().counters.events, events);
  ASSERT_TRUE(c.Delete("/v1/rollouts/held", auth()));
  trainer.join();
}

// Proves a client cannot take an id of the kind serve generates ("px-..."), through the trainer
// API or the proxy's rollout-id header, and that the refusal journals nothing. Catches clients
// claiming the ids serve is about to give others (every answer shows one), which turned every
// later generated admission into a 409.
TEST(TrustApi, GeneratedRolloutIdsCannotBeClaimed) {
  Stack s;
  const std::uint64_t events = s.svc->journal().state().counters.events;
  httplib::Client c = s.client();
  auto a =
      c.Post("/v1/rollouts", auth(), R"({"rollout_id": "px-0000000000-1"})", "application/json");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->status, 400) << a->body;
  httplib::Headers h = {{"X-RolloutCore-Rollout-Id", "px-0000000000-2"}};
  auto p = c.Post("/v1/completions", h, R"({"prompt": "a", "max_tokens": 1})", "application/json");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->status, 400) << p->body;
  EXPECT_EQ(s.svc->journal().state().counters.events, events) << "a refusal was journaled";
  auto ok = c.Post("/v1/rollouts", auth(), R"({"rollout_id": "mine-px-1"})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 201) << ok->body;
}

// Proves a proxied client that leaves while its admission waits for the engine (an update is
// draining) is never admitted: its wait ends when it leaves, and once the update commits nothing
// names its rollout id. Catches the admission that went on for a client long gone (up to
// admit_wait_ms), then journaled it on the new policy only to abort it at once.
TEST(TrustProxy, AClientThatLeavesWhileItsAdmissionWaitsIsNeverAdmitted) {
  Stack s;
  httplib::Client c = s.client();
  auto held =
      c.Post("/v1/rollouts", auth(), json{{"rollout_id", "held"}}.dump(), "application/json");
  ASSERT_TRUE(held && held->status == 201);
  std::thread trainer([&] {
    httplib::Client t = s.client();
    auto u =
        t.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)), "application/json");
    ASSERT_TRUE(u);
    EXPECT_EQ(u->status, 200) << u->body;
  });
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kDraining; }, 5000));
  std::thread leaver([&] {
    httplib::Client l = s.client();
    l.set_read_timeout(3, 0);  // then it gives up and closes its connection
    auto r = l.Post("/v1/completions", {{"X-RolloutCore-Rollout-Id", "gone-1"}},
                    R"({"prompt": "x", "max_tokens": 2})", "application/json");
    EXPECT_FALSE(r) << "answered while the engine drained: " << r->status;
  });
  EXPECT_TRUE(eventually([&] { return s.svc->admissions_in_progress() == 1; }, 5000));
  leaver.join();
  EXPECT_TRUE(eventually([&] { return s.svc->admissions_in_progress() == 0; }, 5000))
      << "the admission still waits for a client that left";
  auto done = c.Delete("/v1/rollouts/held", auth());
  ASSERT_TRUE(done);
  trainer.join();
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kReady; }, 5000));
  auto seqs = s.svc->journal().RolloutSeqs("gone-1");
  ASSERT_TRUE(seqs.ok()) << seqs.status().ToString();
  EXPECT_TRUE(seqs->empty()) << "the rollout of a client that left was journaled";
  EXPECT_EQ(s.svc->journal().state().counters.rollouts_admitted, 1u);
  EXPECT_EQ(s.svc->metrics().admissions_abandoned.load(), 1u);
}

// Puts the stack's journal in DRAINING with the leased rollout "held" active, as a process that
// died mid-drain leaves it (fail-stopped by an fsync error on the finish of a second rollout).
void CrashWhileDraining(Stack& s) {
  httplib::Client c = s.client();
  for (const char* id : {"held", "other"}) {
    auto a = c.Post("/v1/rollouts", auth(), json{{"rollout_id", id}}.dump(), "application/json");
    ASSERT_TRUE(a && a->status == 201);
  }
  std::thread trainer([&] {
    httplib::Client t = s.client();
    (void)t.Post("/v1/updates", auth(), DumpSafe(update_body("u-mid", "rc-1", 1)),
                 "application/json");
  });
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kDraining; }, 5000));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the drain intent is durable
  s.faults->Inject(FileKind::kWal, FileOp::kSync, Fault::kEio);
  (void)c.Delete("/v1/rollouts/other", auth());
  trainer.join();
  ASSERT_TRUE(s.svc->failed());
  s.Kill();
  s.faults->Restart();
}

// Starts the reopened service on a thread (Start drives the interrupted update) and waits until
// it listens.
std::thread StartInBackground(Stack& s, std::atomic<bool>& started_ok) {
  std::thread t([&] { started_ok = s.svc->Start().ok(); });
  EXPECT_TRUE(eventually([&] { return s.svc->port() > 0; }, 10000)) << "never listened";
  return t;
}

// A restart that finds an update interrupted mid-drain listens before it goes on with it, so the
// holders of leased rollouts can finish them and the update commits; catches the recovery that
// ran before listening, waited out the drain for clients that could not reach it, and refused.
TEST(TrustRecovery, InterruptedDrainGoesOnOnceClientsCanFinish) {
  Stack s(nullptr, /*fault_env=*/true);
  CrashWhileDraining(s);
  s.OpenWithoutStarting();
  std::atomic<bool> started_ok{false};
  std::thread starter = StartInBackground(s, started_ok);
  httplib::Client c = s.client();
  auto held = c.Delete("/v1/rollouts/held", auth());
  ASSERT_TRUE(held);
  EXPECT_EQ(held->status, 200) << held->body;
  // The finish of "other" was written but never acknowledged: it may or may not have survived.
  auto other = c.Delete("/v1/rollouts/other", auth());
  ASSERT_TRUE(other);
  EXPECT_TRUE(other->status == 200 || other->status == 404) << other->body;
  starter.join();
  EXPECT_TRUE(started_ok);
  const State st = s.svc->journal().state();
  EXPECT_EQ(st.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(st.committed.label, "rc-1") << "the interrupted update did not go on";
}

// An engine replaced while the executor was down is re-verified before anything is admitted,
// even when the interrupted update is refused on the way back to READY; catches a restart that
// resumed an aborted update and served rollouts on an engine it never looked at.
TEST(TrustRecovery, EngineReplacedWhileDownIsCaughtAfterARefusedUpdate) {
  // The drain waits for the leased rollout nobody finishes here: keep that wait short.
  Stack s([](ServeConfig& c) { c.drain_timeout_ms = 2000; }, /*fault_env=*/true);
  CrashWhileDraining(s);
  ASSERT_TRUE(s.RestartEngine());
  s.engine->SetRouteFault("/pause", fixtures::RouteFault{.status = 500, .times = 3});
  s.OpenWithoutStarting();
  std::atomic<bool> started_ok{false};
  std::thread starter = StartInBackground(s, started_ok);
  starter.join();
  const State st = s.svc->journal().state();
  ASSERT_EQ(st.lifecycle, Lifecycle::kTainted) << describe(st);
  EXPECT_EQ(st.taint->cause, Cause::kEngineReplaced);
  std::uint64_t admitted = 0;
  ASSERT_TRUE(s.svc->journal()
                  .Scan(1, 0,
                        [&](const journal::Record& r) {
                          admitted += std::holds_alternative<RolloutAdmitted>(r.event);
                          return Status::OK();
                        })
                  .ok());
  EXPECT_EQ(admitted, 2u) << "an admission reached the replaced engine";
}

// Proves a re-POST of an ended update answers its recorded outcome (in memory and, after a
// restart, from the journal), a reused id with another body is 409, and a 128-byte update_id is
// accepted. Catches: 503 "did not end ... retries exhausted" on an idempotent retry, and an
// internal idempotency prefix pushing ids of 122..128 bytes over the id limit.
TEST(TrustIdempotency, RePostOfAnEndedUpdateAnswersTheRecordedOutcome) {
  Stack s;
  httplib::Client c = s.client();
  auto u =
      c.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)), "application/json");
  ASSERT_TRUE(u);
  ASSERT_EQ(u->status, 200) << u->body;
  EXPECT_FALSE(u->get_header_value("X-RolloutCore-Head").empty());
  auto again =
      c.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)), "application/json");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200) << again->body;
  EXPECT_EQ(json::parse(again->body)["outcome"], "committed");
  EXPECT_EQ(json::parse(again->body)["replayed"], true);
  auto other =
      c.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-9", 9)), "application/json");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 409) << other->body;

  s.Kill();
  s.Open();
  httplib::Client c2 = s.client();
  auto after =
      c2.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)), "application/json");
  ASSERT_TRUE(after);
  EXPECT_EQ(after->status, 200) << after->body;
  EXPECT_EQ(json::parse(after->body)["replayed"], true) << after->body;
  EXPECT_EQ(s.svc->journal().state().counters.updates_requested, 1u);
}

// Proves a re-POST of an update that ended, after a restart and while the engine does not answer,
// is answered from the journal (200, its recorded outcome, "replayed") with no call to the engine
// and no record written. Catches the look at the engine before a plan made ahead of the journal's
// idempotency lookup: the retry was refused 409 ("could not be verified") and the engine journaled
// unreachable, though the update had committed.
TEST(TrustIdempotency, AnEndedUpdateReplaysAfterARestartWithoutLookingAtTheEngine) {
  // The monitor stays quiet: every call the engine gets below is the re-POST's.
  Stack s([](ServeConfig& c) { c.engine_monitor_interval_ms = 60000; });
  for (int step : {1, 2}) {
    const std::string n = std::to_string(step);
    auto u = s.client().Post("/v1/updates", auth(),
                             DumpSafe(update_body("u-" + n, "rc-" + n, step)), "application/json");
    ASSERT_TRUE(u && u->status == 200) << (u ? u->body : "no answer");
  }
  s.Kill();
  s.Open();  // nothing is remembered: u-1's end is the journal's alone
  s.engine->SetEngineDead(true);
  const std::uint64_t head = s.svc->journal().head_seq();
  const std::uint64_t health = s.engine->RouteCount("/health");
  // u-1 is not the committed version (rc-2 is): the fold would take it, so a look is due for it.
  auto again = s.client().Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)),
                               "application/json");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200) << again->body;
  const json answer = json::parse(again->body, nullptr, false);
  EXPECT_EQ(answer.value("outcome", ""), "committed") << again->body;
  EXPECT_EQ(answer.value("replayed", false), true) << again->body;
  EXPECT_EQ(s.engine->RouteCount("/health"), health) << "the engine was looked at";
  EXPECT_EQ(s.svc->journal().head_seq(), head);
  EXPECT_EQ(s.svc->journal().state().counters.updates_requested, 2u);
}

// Proves a retry of an update sent while its first call holds the plan slot outside the runner
// call (the slot just taken, or the answer formed and the slot not yet given back) waits for it
// and answers the recorded outcome. Catches the retry being answered 409 "another plan is
// running" by its own first call, as when the slot's name was set only around the runner call.
TEST(TrustIdempotency, ARetryWhileItsFirstCallHoldsTheSlotWaitsForIt) {
  for (const char* window : {"plan slot taken", "plan slot given back"}) {
    SCOPED_TRACE(window);
    Stack s;
    ASSERT_TRUE(s.svc->Shutdown(5000));
    s.OpenWithoutStarting();
    std::atomic<bool> in_window{false};
    std::atomic<bool> widened{false};
    s.svc->set_step_probe([&, window](const char* step) {
      if (std::string(step) != window || widened.exchange(true)) return;
      in_window = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
    });
    ASSERT_TRUE(s.svc->Start().ok());
    std::thread first([&] {
      httplib::Client c = s.client();
      auto u = c.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)),
                      "application/json");
      ASSERT_TRUE(u);
      EXPECT_EQ(u->status, 200) << u->body;
    });
    ASSERT_TRUE(eventually([&] { return in_window.load(); }, 10000));
    httplib::Client c = s.client();
    auto retry =
        c.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)), "application/json");
    first.join();
    ASSERT_TRUE(retry);
    EXPECT_EQ(retry->status, 200) << retry->body;
    EXPECT_EQ(json::parse(retry->body)["outcome"], "committed") << retry->body;
    EXPECT_EQ(s.svc->journal().state().counters.updates_requested, 1u);
  }
}

// Proves a retry of a restore that ended, sent while another plan holds the plan slot, answers at
// once as it would with the slot free: 200 with the recorded outcome and "replayed": true, and
// the same id with another body 409 "already used", counted as a replay and a conflict. Catches
// restores replayed only once they held the slot: a trainer whose restore committed but whose
// answer was lost read 409 "'u-2' is running" on its retry, the type it also reads for an id
// used by another request, and could take its restore for refused.
TEST(TrustIdempotency, AnEndedRestoreAnswersItsRetryWhileAnotherPlanHoldsTheSlot) {
  Stack s;
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();
  std::atomic<bool> armed{false};
  std::atomic<bool> holding{false};
  std::atomic<bool> answered{false};
  // The next plan keeps the slot until the retries are answered.
  stack::HoldNextPlanSlot(*s.svc, armed, holding, answered);
  ASSERT_TRUE(s.svc->Start().ok());
  httplib::Client c = s.client();
  auto u = c.Post("/v1/updates", auth(), update_body("u-1", "rc-1", 1).dump(), "application/json");
  ASSERT_TRUE(u && u->status == 200) << (u ? u->body : "no answer");
  ASSERT_TRUE(s.RestartEngine());  // a restore runs only on a TAINTED engine
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kTainted; }, 15000));
  const json body = {{"restore_id", "r-1"}, {"label", "rc-1"}, {"source", "synthetic:4x64:1"}};
  auto restored = c.Post("/v1/restores", auth(), body.dump(), "application/json");
  ASSERT_TRUE(restored && restored->status == 200) << (restored ? restored->body : "no answer");
  armed = true;
  int next_status = 0;
  std::thread next_plan([&] {
    auto r = s.client().Post("/v1/updates", auth(), update_body("u-2", "rc-2", 2).dump(),
                             "application/json");
    next_status = r ? r->status : -1;
  });
  ASSERT_TRUE(eventually([&] { return holding.load(); }, 10000));
  auto retry = c.Post("/v1/restores", auth(), body.dump(), "application/json");
  json other = body;
  other["source"] = "synthetic:4x64:2";
  auto reused = c.Post("/v1/restores", auth(), other.dump(), "application/json");
  answered = true;
  next_plan.join();
  ASSERT_TRUE(retry);
  EXPECT_EQ(retry->status, 200) << retry->body;
  const json replayed = json::parse(retry->body, nullptr, false);
  EXPECT_EQ(replayed.value("outcome", ""), "committed") << retry->body;
  EXPECT_EQ(replayed.value("replayed", false), true) << retry->body;
  EXPECT_EQ(replayed.value("restore_id", ""), "r-1") << retry->body;
  ASSERT_TRUE(reused);
  EXPECT_EQ(reused->status, 409) << reused->body;
  EXPECT_NE(reused->body.find("already used for another request"), std::string::npos)
      << reused->body;
  EXPECT_EQ(next_status, 200);
  EXPECT_EQ(s.svc->metrics().restores_replayed.load(), 1u);
  EXPECT_EQ(s.svc->metrics().restores_conflict.load(), 1u);
  EXPECT_EQ(s.svc->journal().state().counters.restores_requested, 1u);
}

// Proves the journal lookups that a refused source starts (has this id already ended?) run one
// at a time: an update refused while another's lookup runs is told to retry (503 overloaded,
// Retry-After), and the first still gets its refusal. Catches each refused update scanning up to
// ten million records at once on its own thread, until bad sources retried in a loop take the
// whole blocking pool and lease renewals wait behind them.
TEST(TrustApi, RefusedSourcesLookTheJournalUpOneAtATime) {
  Stack s;
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();
  std::atomic<bool> looking{false};
  std::atomic<bool> second_answered{false};
  s.svc->set_step_probe([&](const char* step) {
    if (std::string(step) == "journal lookup" && !looking.exchange(true)) {
      for (int i = 0; i < 1000 && !second_answered.load(); ++i) {  // 10 s at most: never a hang
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  });
  ASSERT_TRUE(s.svc->Start().ok());
  auto post = [&](const std::string& id) {
    json body = update_body(id, "rc-1", 1);
    body["source"] = "safetensors:/nonexistent/step-1.safetensors";
    auto r = s.client().Post("/v1/updates", auth(), body.dump(), "application/json");
    return r ? std::make_pair(r->status, r->body) : std::make_pair(0, std::string("no answer"));
  };
  std::pair<int, std::string> first;
  std::thread first_call([&] { first = post("u-a"); });
  ASSERT_TRUE(eventually([&] { return looking.load(); }, 10000));
  const std::pair<int, std::string> second = post("u-b");
  second_answered = true;
  first_call.join();
  EXPECT_EQ(first.first, 400) << first.second;
  EXPECT_EQ(second.first, 503) << second.second;
  EXPECT_NE(second.second.find("overloaded"), std::string::npos) << second.second;
  EXPECT_EQ(post("u-b").first, 400) << "the turn was not given back";
  EXPECT_EQ(s.svc->journal().state().counters.updates_requested, 0u);
}

// Proves a retry that waited for its own plan's slot, and lost it to another plan once its own
// had ended, answers its plan's recorded outcome (200, replayed), not a conflict. Catches the
// retry told 409 "'u-2' is running" after its 5 s wait, though the update it retried had
// committed and was remembered.
TEST(TrustIdempotency, ARetryThatLostTheSlotToAnotherPlanAnswersItsEndedPlan) {
  Stack s;
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();
  std::atomic<int> taken{0};
  std::atomic<bool> retry_waits{false};
  std::atomic<bool> other_holds{false};
  std::atomic<bool> retry_answered{false};
  auto wait_for = [](const std::atomic<bool>& flag) {
    for (int i = 0; i < 2000 && !flag.load(); ++i) {  // 20 s at most: never a hang
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  };
  s.svc->set_step_probe([&](const char* step) {
    const std::string name(step);
    if (name == "plan slot taken") {
      const int n = ++taken;
      if (n == 1) wait_for(retry_waits);  // u-1's call holds the slot until its retry waits
      if (n == 2) {                       // u-2 holds the slot until the retry of u-1 is answered
        other_holds = true;
        wait_for(retry_answered);
      }
    } else if (name == "plan slot wait") {
      retry_waits = true;
      wait_for(other_holds);  // the retry starts its wait only once u-2 holds the slot
    }
  });
  ASSERT_TRUE(s.svc->Start().ok());
  auto post = [&](const std::string& id, const std::string& label, int step) {
    auto r = s.client().Post("/v1/updates", auth(), update_body(id, label, step).dump(),
                             "application/json");
    return r ? std::make_pair(r->status, r->body) : std::make_pair(0, std::string("no answer"));
  };
  std::pair<int, std::string> first, retry, other;
  std::thread first_call([&] { first = post("u-1", "rc-1", 1); });
  ASSERT_TRUE(eventually([&] { return taken.load() == 1; }, 10000));
  std::thread retry_call([&] {
    retry = post("u-1", "rc-1", 1);
    retry_answered = true;
  });
  first_call.join();
  std::thread other_call([&] { other = post("u-2", "rc-2", 2); });
  retry_call.join();
  other_call.join();
  EXPECT_EQ(first.first, 200) << first.second;
  EXPECT_EQ(retry.first, 200) << retry.second;
  EXPECT_EQ(json::parse(retry.second, nullptr, false).value("replayed", false), true)
      << retry.second;
  EXPECT_EQ(other.first, 200) << other.second;
}

// Proves a plan refused for a reason of its own once the MutationGate closed (every /pause fails,
// nothing was kept from the engine by the gate) keeps its own answer: 422 with its refused
// outcome and no shutting_down error, and the shutdown ends cleanly. Catches every refusal after
// the gate closed answered 503 shutting_down, which tells the trainer its plan was cut short by
// the shutdown when the engine refused it.
TEST(TrustShutdown, APlanRefusedOnItsOwnGroundsAtShutdownKeepsItsAnswer) {
  Stack s;
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();
  std::atomic<bool> armed{true};
  std::atomic<bool> holding{false};
  std::atomic<bool> released{false};
  // The update holds the slot, before its runner call, until the shutdown has begun.
  stack::HoldNextPlanSlot(*s.svc, armed, holding, released);
  ASSERT_TRUE(s.svc->Start().ok());
  s.engine->SetRouteFault("/pause", fixtures::RouteFault{.status = 500});
  std::pair<int, std::string> answer{0, "no answer"};
  std::thread trainer([&] {
    auto r = s.client().Post("/v1/updates", auth(), update_body("u-1", "rc-1", 1).dump(),
                             "application/json");
    if (r) answer = {r->status, r->body};
  });
  const bool held = eventually([&] { return holding.load(); }, 10000);
  bool clean = false;
  std::thread stopper([&] { clean = s.svc->Shutdown(20000); });
  const bool stopping =
      eventually([&] { return s.svc->NotReadyReason() == "shutting down"; }, 10000);
  released = true;
  trainer.join();
  stopper.join();
  ASSERT_TRUE(held && stopping);
  EXPECT_EQ(answer.first, 422) << answer.second;
  const json body = json::parse(answer.second, nullptr, false);
  EXPECT_EQ(body.value("outcome", ""), "refused") << answer.second;
  EXPECT_FALSE(body.contains("error")) << answer.second;
  EXPECT_TRUE(clean);
  s.svc.reset();  // shut down already
}

// Proves a retry waiting for its own plan's slot is answered as soon as the shutdown begins (503
// shutting_down, well within the HTTP server's 2 s stop settle), while the plan it retried still
// ends and the shutdown is clean. Catches the retry left waiting out its 5 s bound: at shutdown
// it outlasted the HTTP server's stop, whose exit was then unclean and the trainer unanswered.
TEST(TrustShutdown, ARetryWaitingForTheSlotIsAnsweredOnceTheShutdownBegins) {
  Stack s;
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();
  std::atomic<bool> holding{false};
  std::atomic<bool> retry_waits{false};
  std::atomic<bool> released{false};
  s.svc->set_step_probe([&](const char* step) {
    const std::string name(step);
    if (name == "plan slot taken" && !holding.exchange(true)) {
      for (int i = 0; i < 1000 && !released.load(); ++i) {  // 10 s at most: never a hang
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } else if (name == "plan slot wait") {
      retry_waits = true;
    }
  });
  ASSERT_TRUE(s.svc->Start().ok());
  auto post = [&] {
    auto r = s.client().Post("/v1/updates", auth(), update_body("u-1", "rc-1", 1).dump(),
                             "application/json");
    return r ? std::make_pair(r->status, r->body) : std::make_pair(0, std::string("no answer"));
  };
  std::pair<int, std::string> first, retry;
  SteadyClock::time_point retry_answered{};
  std::thread first_call([&] { first = post(); });
  const bool held = eventually([&] { return holding.load(); }, 10000);
  std::thread retry_call([&] {
    retry = post();
    retry_answered = SteadyClock::now();
  });
  const bool waits = eventually([&] { return retry_waits.load(); }, 10000);
  const SteadyClock::time_point shutdown_began = SteadyClock::now();
  bool clean = false;
  std::thread stopper([&] { clean = s.svc->Shutdown(20000); });
  // The plan retried keeps the slot until its retry is answered (or 10 s pass).
  retry_call.join();
  released = true;
  first_call.join();
  stopper.join();
  ASSERT_TRUE(held && waits);
  EXPECT_EQ(retry.first, 503) << retry.second;
  EXPECT_NE(retry.second.find("shutting_down"), std::string::npos) << retry.second;
  EXPECT_LT(retry_answered - shutdown_began, std::chrono::milliseconds(1000))
      << "the retry waited on after the shutdown began";
  // The plan retried ran once the gate had closed: its transfer was kept from the engine.
  EXPECT_EQ(first.first, 503) << first.second;
  EXPECT_EQ(json::parse(first.second, nullptr, false).value("outcome", ""), "refused")
      << first.second;
  EXPECT_TRUE(clean);
  s.svc.reset();  // shut down already
}

// Proves an update_id reused with another body after a restart (the journal refuses it, and
// nothing remembers its end) is answered 409 "already used" while a refused source's journal
// lookup runs: only refused sources take the one lookup turn. Catches the reused id answered 503
// "the source cannot be used ... retry" for a source that was fine.
TEST(TrustApi, AReusedUpdateIdIsAConflictWhileARefusedSourceIsLookedUp) {
  Stack s;
  auto u = s.client().Post("/v1/updates", auth(), update_body("u-1", "rc-1", 1).dump(),
                           "application/json");
  ASSERT_TRUE(u && u->status == 200) << (u ? u->body : "no answer");
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();  // a restart: no end is remembered
  std::atomic<bool> looking{false};
  std::atomic<bool> reused_answered{false};
  s.svc->set_step_probe([&](const char* step) {
    if (std::string(step) == "journal lookup" && !looking.exchange(true)) {
      for (int i = 0; i < 1000 && !reused_answered.load(); ++i) {  // 10 s at most: never a hang
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  });
  ASSERT_TRUE(s.svc->Start().ok());
  int refused_status = 0;
  std::thread refused([&] {
    json body = update_body("u-a", "rc-2", 2);
    body["source"] = "safetensors:/nonexistent/step-2.safetensors";
    auto r = s.client().Post("/v1/updates", auth(), body.dump(), "application/json");
    refused_status = r ? r->status : -1;
  });
  ASSERT_TRUE(eventually([&] { return looking.load(); }, 10000));
  auto reused = s.client().Post("/v1/updates", auth(), update_body("u-1", "rc-2", 2).dump(),
                                "application/json");
  reused_answered = true;
  refused.join();
  ASSERT_TRUE(reused);
  EXPECT_EQ(reused->status, 409) << reused->body;
  EXPECT_NE(reused->body.find("already used"), std::string::npos) << reused->body;
  EXPECT_EQ(refused_status, 400);
}

// Proves an update_id of the full id limit (128 bytes) is accepted: one limit, stated once.
// Catches: an internal idempotency key ("update:" + id) that pushes ids of 122..128 bytes over
// the journal's id limit (400 "client_event_id exceeds 128 bytes"). The key is derived in the
// runner (effects/runner.cc): this test fails until it is a fixed-size digest of the id.
TEST(TrustIdempotency, UpdateIdOfTheFullIdLimitIsAccepted) {
  Stack s;
  httplib::Client c = s.client();
  const std::string long_id(kIdBytesMax, 'x');
  auto l =
      c.Post("/v1/updates", auth(), DumpSafe(update_body(long_id, "rc-2", 2)), "application/json");
  ASSERT_TRUE(l);
  EXPECT_EQ(l->status, 200) << "a " << kIdBytesMax << "-byte update_id: " << l->body;
  auto over = c.Post("/v1/updates", auth(), DumpSafe(update_body(long_id + "y", "rc-3", 3)),
                     "application/json");
  ASSERT_TRUE(over);
  EXPECT_EQ(over->status, 400) << over->body;
}

// Proves a long poll on /v1/watch looks at most once per notice or per 20 ms while the journal
// grows by records that decide nothing (here the monitor's observation that the engine stopped
// answering). Catches a watch that treats any notice past `after` as news and spins, looking
// every 2 ms for its whole timeout, taking the journal's lock a thousand times a second.
TEST(TrustWatch, ARecordThatDecidesNothingDoesNotSpinALongPoll) {
  Stack s([](ServeConfig& c) { c.engine_monitor_interval_ms = 50; });
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();
  std::atomic<bool> counting{false};
  std::atomic<int> looks{0};
  s.svc->set_step_probe([&](const char* step) {
    if (counting.load() && std::string(step) == "watch looked") looks++;
  });
  ASSERT_TRUE(s.svc->Start().ok());
  httplib::Client c = s.client();
  auto now = c.Get("/v1/watch?after=0&timeout_ms=0");
  ASSERT_TRUE(now && now->status == 200);
  const std::uint64_t decided = json::parse(now->body)["seq"].get<std::uint64_t>();
  const std::uint64_t head = s.svc->journal().head_seq();
  s.engine->Stop();
  ASSERT_TRUE(eventually([&] { return s.svc->journal().head_seq() > head; }, 10000))
      << "the monitor journaled nothing about an engine that stopped answering";
  counting = true;
  auto w = c.Get(("/v1/watch?after=" + std::to_string(decided) + "&timeout_ms=2000").c_str());
  counting = false;
  ASSERT_TRUE(w && w->status == 200);
  ASSERT_EQ(json::parse(w->body)["changed"], false) << "the observation decided something";
  EXPECT_LE(looks.load(), 250) << "looks in a 2 s long poll (at most ~100 + one per notice)";
}

// Proves a shutdown whose clean close of the journal fails (the clean-close record cannot be
// written) is not reported clean: Shutdown returns false, no CLOSED is left, and the journal
// reopens with every record it had. Catches the close that swallowed the failure, so serve
// logged "stopped cleanly" and exited 0 over a journal the next start reads as crashed.
TEST(TrustDurability, AFailedCleanCloseIsNotACleanShutdown) {
  Stack s(nullptr, /*fault_env=*/true);
  const std::uint64_t head = s.svc->journal().head_seq();
  ASSERT_GT(head, 0u);
  const fs::path path = s.dir / "journal";
  // The durable mark covers every commit first: no mark written later meets the armed fault.
  const auto marked = [&] {
    std::ifstream in(path / "DURABLE");
    std::string line;
    while (std::getline(in, line)) {
      if (line == "seq " + std::to_string(s.svc->journal().durable_seq())) return true;
    }
    return false;
  };
  ASSERT_TRUE(eventually(marked, 5000)) << "the durable mark never covered the durable head";
  s.faults->Inject(FileKind::kOther, FileOp::kAppend, Fault::kEio);
  EXPECT_FALSE(s.svc->Shutdown(5000));
  EXPECT_FALSE(fs::exists(path / "CLOSED"));
  EXPECT_FALSE(fs::exists(path / "CLOSED.tmp"));
  s.faults->Clear();
  journal::Options o;
  o.env = s.faults->env();
  auto reopened = journal::Journal::Open(path.string(), o);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_EQ((*reopened)->head_seq(), head);
}

// Proves /v1/state, /v1/events and /v1/watch report only durable records while a commit is
// stalled, and that acknowledgements carry the head they made durable. Catches: a watcher told
// "committed" before it is durable, /v1/events answering 400 "past the durable head" mid-update.
TEST(TrustDurability, ReadRoutesReportOnlyDurableRecords) {
  Stack s([](ServeConfig& c) { c.journal_commit_stall_timeout_ms = 20000; }, /*fault_env=*/true);
  httplib::Client c = s.client();
  const DurableHead before = s.svc->CatchUpDurableHead();
  s.faults->StallSync(FileKind::kWal, 800);
  std::thread admit([&] {
    httplib::Client a = s.client();
    auto r = a.Post("/v1/rollouts", auth(), R"({"rollout_id": "slow"})", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 201);
    const std::string head = r->get_header_value("X-RolloutCore-Head");
    EXPECT_EQ(head.rfind(std::to_string(before.seq + 1) + ":", 0), 0u) << head;
  });
  ASSERT_TRUE(eventually([&] { return s.svc->journal().head_seq() > before.seq; }, 2000));
  auto st = c.Get("/v1/state");
  ASSERT_TRUE(st);
  EXPECT_EQ(json::parse(st->body)["head_seq"], before.seq) << "reported a record not yet durable";
  EXPECT_EQ(json::parse(st->body)["active_rollouts"], 0);
  auto ev = c.Get("/v1/events?since=0&limit=1000", auth());
  ASSERT_TRUE(ev);
  EXPECT_EQ(ev->status, 200) << ev->body;
  EXPECT_EQ(json::parse(ev->body)["head_seq"], before.seq);
  admit.join();
  s.faults->StallSync(FileKind::kWal, 0);
  auto st2 = c.Get("/v1/state");
  ASSERT_TRUE(st2);
  EXPECT_EQ(json::parse(st2->body)["head_seq"], before.seq + 1);
  EXPECT_EQ(json::parse(st2->body)["active_rollouts"], 1);
}

// Proves an explicit rollout's lease is renewed by its client, survives a restart, and lapses
// into RolloutFinished{expired} once renewals stop. Catches: explicit rollouts recorded abandoned
// on a restart while their client is alive, and leases that never end.
TEST(TrustLeases, RenewedLeaseSurvivesARestartAndLapsesWhenRenewalsStop) {
  Stack s;
  httplib::Client c = s.client();
  auto a = c.Post("/v1/rollouts", auth(), R"({"rollout_id": "leased", "lease_ms": 1000})",
                  "application/json");
  ASSERT_TRUE(a);
  ASSERT_EQ(a->status, 201) << a->body;
  for (int i = 0; i < 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    auto r = c.Post("/v1/rollouts/leased/lease", auth(), "", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
  }
  EXPECT_EQ(s.svc->journal().state().active.count("leased"), 1u);
  s.Kill();
  s.Open();
  EXPECT_EQ(s.svc->journal().state().active.count("leased"), 1u) << "abandoned by the restart";
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().counters.rollouts_expired == 1; }, 3000));
  EXPECT_EQ(s.svc->journal().state().active.count("leased"), 0u);
  httplib::Client c2 = s.client();
  auto late = c2.Post("/v1/rollouts/leased/lease", auth(), "", "application/json");
  ASSERT_TRUE(late);
  EXPECT_EQ(late->status, 404) << late->body;
}

// Proves the engine monitor notices an engine replaced behind the executor's back (a new process
// on the same port, reporting label "default" and a new instance): the journal goes TAINTED,
// /readyz answers 503 while /healthz stays 200 (liveness), and proxied requests are refused.
// Reports the detection window. Catches: serving rollouts on weights nobody loaded, /healthz
// used as readiness.
TEST(TrustEngine, MonitorDetectsAReplacedEngine) {
  Stack s([](ServeConfig& c) { c.engine_monitor_interval_ms = 50; });
  httplib::Client c = s.client();
  auto ready = c.Get("/readyz");
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 200) << ready->body;
  ASSERT_TRUE(s.RestartEngine());
  const auto started = SteadyClock::now();
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kTainted; }, 10000))
      << "the replaced engine went unnoticed";
  const auto window_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - started).count();
  std::printf("[ detection ] replaced engine detected %lld ms after it started answering\n",
              static_cast<long long>(window_ms));
  const State st = s.svc->journal().state();
  ASSERT_TRUE(st.taint.has_value());
  EXPECT_TRUE(st.taint->cause == Cause::kEngineReplaced ||
              st.taint->cause == Cause::kEngineRelabelled)
      << cause_name(st.taint->cause);
  auto h = c.Get("/healthz");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  auto r = c.Get("/readyz");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_NE(r->body.find("TAINTED"), std::string::npos) << r->body;
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("rolloutcore_engine_info{instance=\""), std::string::npos);
  EXPECT_NE(m->body.find("rolloutcore_journal_failed 0"), std::string::npos);
}

json StateOf(httplib::Client& c) {
  auto r = c.Get("/v1/state", auth());
  RC_CHECK(r && r->status == 200);
  return json::parse(r->body);
}

std::uint64_t StalledPlanRetries(httplib::Client& c) {
  auto m = c.Get("/metrics");
  RC_CHECK(m && m->status == 200);
  const std::string name = "\nrolloutcore_stalled_plan_retries_total ";
  const std::size_t at = m->body.find(name);
  RC_CHECK(at != std::string::npos);
  return std::stoull(m->body.substr(at + name.size()));
}

// The monitor looks every 50 ms and a stalled plan is tried again 100 ms after the last try.
void FastStalledPlanRetry(ServeConfig& c) {
  c.engine_monitor_interval_ms = 50;
  c.stalled_plan_retry_ms = 100;
}

// Starts update `id` whose resume the engine never takes: the plan stalls in RESUMING, answered
// 503 outcome_unknown without a fail-stop, shown stalled.
// `stays_stalled`: the engine keeps failing, so the stall is still visible after the answer (an
// engine that answers again may be retried, and the plan go on, before the state is read).
void StallAtResume(Stack& s, httplib::Client& c, const std::string& id,
                   const fixtures::RouteFault& fault, bool stays_stalled = true) {
  s.engine->SetRouteFault("/resume", fault);
  auto u = c.Post("/v1/updates", auth(), DumpSafe(update_body(id, "rc-1", 1)), "application/json");
  ASSERT_TRUE(u);
  ASSERT_EQ(u->status, 503) << u->body;
  EXPECT_NE(u->body.find("outcome_unknown"), std::string::npos) << u->body;
  EXPECT_NE(u->body.find("stalled"), std::string::npos) << u->body;
  EXPECT_FALSE(s.svc->failed()) << s.svc->failure();
  if (!stays_stalled) return;
  const json st = StateOf(c);
  EXPECT_EQ(st["lifecycle"], "RESUMING") << DumpSafe(st);
  EXPECT_EQ(st["update"]["stalled"], true) << DumpSafe(st);
}

// Proves an engine that dies paused at its resume leaves its update stalled and visible, with no
// fail-stop, and that once another process answers on its address serve notices by itself: the
// plan is tried again and ends TAINTED (engine_replaced), and a re-POST reads that outcome.
// Catches a stalled plan that waits for an operator's restart of serve while an engine nobody
// verified sits behind it (the restart went unnoticed).
TEST(TrustEngine, AnEngineThatDiesPausedAndComesBackAsAnotherProcessIsTainted) {
  Stack s(FastStalledPlanRetry);
  httplib::Client c = s.client();
  fixtures::RouteFault dies;
  dies.die = true;
  StallAtResume(s, c, "u-1", dies);
  auto asked =
      c.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)), "application/json");
  ASSERT_TRUE(asked);
  EXPECT_EQ(asked->status, 503) << "asked again while stalled: " << asked->body;
  EXPECT_FALSE(s.svc->failed()) << s.svc->failure();
  EXPECT_EQ(StalledPlanRetries(c), 0u) << "tried while nothing answers";
  ASSERT_TRUE(s.RestartEngine());
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kTainted; }, 10000))
      << DumpSafe(StateOf(c));
  const State st = s.svc->journal().state();
  EXPECT_EQ(st.taint->cause, Cause::kEngineReplaced) << describe(st);
  EXPECT_FALSE(st.update.has_value());
  EXPECT_FALSE(s.svc->failed());
  const std::uint64_t retries = StalledPlanRetries(c);
  EXPECT_GE(retries, 1u);
  std::uint64_t retried_in_place = 0;  // replay tells these from an executor restart
  ASSERT_TRUE(s.svc->journal()
                  .Scan(1, 0,
                        [&](const journal::Record& r) {
                          const auto* rs = std::get_if<RecoveryStarted>(&r.event);
                          retried_in_place += rs != nullptr && is_stalled_plan_retry(*rs);
                          return Status::OK();
                        })
                  .ok());
  EXPECT_EQ(retried_in_place, retries);
  auto again =
      c.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)), "application/json");
  ASSERT_TRUE(again);
  EXPECT_EQ(json::parse(again->body)["outcome"], "tainted") << again->body;
  EXPECT_EQ(s.engine->weight_label(), "default") << "the new process was never touched";
}

// Proves a resume refused until the plan stalled goes on when the same engine process answers
// again: the validated target is published and serves, without a restart or a fail-stop, and a
// re-POST reads "committed". Catches an engine that recovered but stays out of service (admitting
// nothing) until an operator restarts serve.
TEST(TrustEngine, AStalledResumeGoesOnWhenTheSameEngineAnswers) {
  Stack s(FastStalledPlanRetry);
  httplib::Client c = s.client();
  fixtures::RouteFault refused;
  refused.status = 503;
  refused.times = static_cast<int>(kEffectAttemptsMax);
  StallAtResume(s, c, "u-1", refused, /*stays_stalled=*/false);
  ASSERT_TRUE(
      eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kReady; }, 10000))
      << DumpSafe(StateOf(c));
  const State st = s.svc->journal().state();
  EXPECT_EQ(st.committed.label, "rc-1") << describe(st);
  EXPECT_FALSE(s.svc->failed());
  EXPECT_EQ(StalledPlanRetries(c), 1u);
  auto again =
      c.Post("/v1/updates", auth(), DumpSafe(update_body("u-1", "rc-1", 1)), "application/json");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200) << again->body;
  EXPECT_EQ(json::parse(again->body)["outcome"], "committed") << again->body;
  auto gen =
      c.Post("/v1/completions", R"({"model": "rc-double-model", "prompt": "hi", "max_tokens": 2})",
             "application/json");
  ASSERT_TRUE(gen);
  EXPECT_EQ(gen->status, 200) << gen->body;
  EXPECT_EQ(gen->get_header_value("X-RolloutCore-Version"), "rc-1");
}

// Proves /v1/manifest needs the token and never quotes the file it opened, and that an update
// with a bad source is a 4xx with zero journal events. Catches: anyone reading the first bytes of
// any file through the manifest error, a bad source draining and pausing the engine first.
TEST(TrustApi, ManifestNeedsTheTokenAndBadSourcesJournalNothing) {
  Stack s;
  httplib::Client c = s.client();
  const fs::path secret = s.dir / "secret.bin";
  {
    std::ofstream out(secret, std::ios::binary);
    out << "SECRETXYsome more private bytes";
  }
  const std::string q = "/v1/manifest?source=safetensors:" + secret.string();
  auto noauth = c.Get(q);
  ASSERT_TRUE(noauth);
  EXPECT_EQ(noauth->status, 401);
  auto bad = c.Get(q, auth());
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400) << bad->body;
  EXPECT_EQ(bad->body.find("SECRETXY"), std::string::npos) << bad->body;
  const std::uint64_t head = s.svc->journal().head_seq();
  json body = update_body("u-bad-source", "rc-1", 1);
  for (const std::string src : {"safetensors:/nonexistent/model.safetensors", "ipc:relative.json",
                                "synthetic:nonsense", "file:/etc/passwd"}) {
    body["source"] = src;
    auto u = c.Post("/v1/updates", auth(), body.dump(), "application/json");
    ASSERT_TRUE(u);
    EXPECT_EQ(u->status, 400) << src << ": " << u->body;
  }
  EXPECT_EQ(s.svc->journal().head_seq(), head) << "a bad source reached the journal";
  // A readable source whose manifest is not the declared one: refused before the drain too.
  json mismatch = update_body("u-mismatch", "rc-1", 1);
  mismatch["source"] = "synthetic:8x64";
  auto m = c.Post("/v1/updates", auth(), mismatch.dump(), "application/json");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 422) << m->body;
  EXPECT_EQ(s.svc->journal().head_seq(), head) << "a mismatched manifest reached the journal";
  EXPECT_EQ(s.engine->RouteCount("/pause"), 0u) << "the engine was drained for a bad source";
}

// Proves /v1/events, which returns the journal (prompts and outputs included), wants the trainer's
// token and still pages with it; catches anyone who reaches the port reading every trajectory,
// or pulling 1,000 of the largest records per request into the executor's memory.
TEST(TrustApi, EventsNeedTheToken) {
  Stack s;
  httplib::Client c = s.client();
  auto noauth = c.Get("/v1/events?since=0&limit=5");
  ASSERT_TRUE(noauth);
  EXPECT_EQ(noauth->status, 401) << noauth->body;
  auto page = c.Get("/v1/events?since=0&limit=2", auth());
  ASSERT_TRUE(page);
  ASSERT_EQ(page->status, 200) << page->body;
  const json j = json::parse(page->body);
  ASSERT_EQ(j["records"].size(), 2u) << page->body;
  EXPECT_EQ(j["records"][1]["seq"], 2);
  EXPECT_EQ(j["next_since"], 2);
  EXPECT_GE(j["head_seq"].get<std::uint64_t>(), 2u);
}

// Hostile bodies, ids and queries on every trainer route: each gets a 4xx whose body is valid
// JSON, the journal gains no record, and the server keeps serving; catches a route that throws on
// invalid UTF-8 (std::terminate), answers 500 on an integer past 64 bits, or journals bad input.
TEST(TrustApi, HostileInputOnEveryTrainerRouteIsA4xxThatChangesNothing) {
  Stack s;
  httplib::Client c = s.client();
  const std::uint64_t head = s.svc->journal().head_seq();
  // Invalid UTF-8 makes the body invalid JSON; control characters arrive JSON-escaped and must be
  // refused after parsing; an over-long string must be refused by its bound.
  const std::string raw_bad[] = {std::string("\xff\xfe", 2), std::string("\xc3", 1),
                                 std::string("a\x01"
                                             "b",
                                             3)};
  const std::string parsed_bad[] = {std::string("a\0b", 3), "ck\nverification: OK", "\x1b[31mred",
                                    std::string(20000, 'x')};
  std::vector<std::pair<std::string, std::string>> posts;  // path, raw body
  int n = 0;
  for (const char* field : {"update_id", "target_label", "source"}) {
    for (const std::string& bad : raw_bad) {
      posts.emplace_back("/v1/updates", std::string("{\"") + field + "\":\"" + bad + "\"}");
    }
    for (const std::string& bad : parsed_bad) {
      json b = update_body("u-hostile-" + std::to_string(n++), "rc-1", 1);
      b[field] = bad;
      posts.emplace_back("/v1/updates", b.dump());
    }
  }
  for (const std::string& bad : parsed_bad) {
    json b = update_body("u-hostile-" + std::to_string(n++), "rc-1", 1);
    b["identity"]["checkpoint"] = bad;
    posts.emplace_back("/v1/updates", b.dump());
    posts.emplace_back("/v1/rollouts", json{{"rollout_id", bad}}.dump());
  }
  for (const std::string& bad : raw_bad) {
    posts.emplace_back("/v1/rollouts", std::string("{\"rollout_id\":\"") + bad + "\"}");
  }
  posts.emplace_back("/v1/updates", std::string(100000, '['));
  posts.emplace_back("/v1/updates",
                     R"({"update_id":"u","target_label":"rc-1","identity":{"step":1e400}})");
  posts.emplace_back("/v1/rollouts", R"({"lease_ms":18446744073709551616})");
  posts.emplace_back("/v1/rollouts/%ff%fe/lease", "{}");
  for (const auto& [path, body] : posts) {
    auto r = c.Post(path, auth(), body, "application/json");
    ASSERT_TRUE(r) << path;
    EXPECT_GE(r->status, 400) << path << " " << body.substr(0, 80);
    EXPECT_LT(r->status, 500) << path << " " << body.substr(0, 80) << ": " << r->body;
    EXPECT_FALSE(json::parse(r->body, nullptr, false).is_discarded()) << r->body;
  }
  for (const std::string q :
       {"/v1/events?since=18446744073709551616", "/v1/events?limit=99999999999999999999999",
        "/v1/watch?after=-1", "/v1/watch?timeout_ms=18446744073709551616",
        "/v1/manifest?source=%00", "/v1/manifest?source=safetensors:../../etc/passwd"}) {
    auto r = c.Get(q, auth());
    ASSERT_TRUE(r) << q;
    EXPECT_EQ(r->status, 400) << q << ": " << r->body;
    EXPECT_FALSE(json::parse(r->body, nullptr, false).is_discarded()) << r->body;
  }
  auto del = c.Delete("/v1/rollouts/%ff%fe%00", auth());
  ASSERT_TRUE(del);
  EXPECT_GE(del->status, 400);
  EXPECT_LT(del->status, 500) << del->body;
  EXPECT_EQ(s.svc->journal().head_seq(), head) << "hostile input reached the journal";
  auto health = c.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

}  // namespace
}  // namespace rc::service
