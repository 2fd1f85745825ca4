// Weight digests through the whole service: `serve` against the vLLM double (which holds tensor
// values and digests them like the worker extension) over loopback, with a real journal. Each
// test names the failure it would catch.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "effects/http/weight_digest.h"
#include "fixtures/vllm_double.h"
#include "service/service.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using nlohmann::json;
using SteadyClock = std::chrono::steady_clock;

constexpr const char* kToken = "digest-token";

httplib::Headers auth() { return stack::Bearer(kToken); }

struct Stack : stack::ServiceStack {
  explicit Stack(std::function<void(ServeConfig&)> t = nullptr,
                 std::function<void(fixtures::VllmDoubleOptions&)> engine_tweak = nullptr)
      : ServiceStack(Options(std::move(t), std::move(engine_tweak))) {}
  static stack::StackOptions Options(std::function<void(ServeConfig&)> t,
                                     std::function<void(fixtures::VllmDoubleOptions&)> e) {
    stack::StackOptions o;
    o.token = kToken;
    o.dir_prefix = "rc-digest";
    o.engine_tweak = std::move(e);
    o.tweak = [t = std::move(t)](ServeConfig& c) {
      c.engine_monitor_interval_ms = 20;
      c.weight_digest_check_interval_ms = 20;
      if (t) t(c);
    };
    return o;
  }
  json Update(const std::string& id, const std::string& label, int step,
              const std::string& expected = "") {
    json body = stack::UpdateBody(id, label, step, "run-a");
    if (!expected.empty()) body["expected_digest"] = expected;
    httplib::Client c = client();
    c.set_read_timeout(30, 0);
    auto r = c.Post("/v1/updates", auth(), body.dump(), "application/json");
    if (!r) return json{{"http", -1}};
    json out = json::parse(r->body, nullptr, false);
    if (!out.is_object()) out = json::object();
    out["http"] = r->status;
    return out;
  }
  std::string Metrics() {
    httplib::Client c = client();
    auto r = c.Get("/metrics");
    return r ? r->body : "";
  }
  // A counter's value on /metrics (0 when /metrics did not answer or lacks it).
  std::uint64_t Counter(const std::string& name) {
    const std::string text = Metrics();
    const std::string key = "\n" + name + " ";
    const std::size_t at = text.find(key);
    return at == std::string::npos ? 0 : std::strtoull(text.c_str() + at + key.size(), nullptr, 10);
  }
};

bool Eventually(const std::function<bool()>& pred, int timeout_ms) {
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(timeout_ms);
  while (SteadyClock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

// The bootstrap and each commit journal the engine's digest, which changes with every update;
// catches a service that validates on the label alone (no digest in the journal).
TEST(ServiceDigest, BootstrapAndCommitsJournalTheEnginesDigest) {
  Stack s;
  const std::string boot = s.svc->journal().state().committed_digest.combined;
  ASSERT_FALSE(boot.empty());
  ASSERT_EQ(s.Update("u1", "rc-1", 1)["http"], 200);
  const State after = s.svc->journal().state();
  EXPECT_FALSE(after.committed_digest.combined.empty());
  EXPECT_NE(after.committed_digest.combined, boot);
  EXPECT_EQ(after.label_digests.at("rc-0"), boot);
  EXPECT_EQ(after.label_digests.at("rc-1"), after.committed_digest.combined);
}

// Proves that, through serve, an update meeting a weight session someone left open taints, and an
// adopting restore ends that session before it relabels, so the next update commits; catches
// serve's gated engine control dropping the adopt's finish (the session then stayed for every
// later update to meet and blame on someone else: TAINTED again).
TEST(ServiceDigest, AnAdoptingRestoreEndsTheWeightSessionLeftOpen) {
  Stack s;
  ASSERT_EQ(s.Update("u1", "rc-1", 1)["http"], 200);
  httplib::Client outsider(s.engine->base_url());
  auto started = outsider.Post("/start_weight_update", "", "application/json");
  ASSERT_TRUE(started && started->status == 200) << (started ? started->body : "no answer");
  const json tainted = s.Update("u2", "rc-2", 2);
  EXPECT_EQ(tainted.value("outcome", ""), "tainted") << tainted.dump();
  ASSERT_EQ(s.svc->journal().state().lifecycle, Lifecycle::kTainted);

  httplib::Client c = s.client();
  c.set_read_timeout(30, 0);
  const json adopt = {{"restore_id", "a1"}, {"label", "rc-1"}, {"adopt", true}};
  auto restored = c.Post("/v1/restores", auth(), adopt.dump(), "application/json");
  ASSERT_TRUE(restored);
  EXPECT_EQ(restored->status, 200) << restored->body;
  EXPECT_FALSE(s.engine->StateJson()["update_active"].get<bool>());
  const json next = s.Update("u3", "rc-3", 3);
  EXPECT_EQ(next["http"], 200) << next.dump();
  EXPECT_EQ(s.svc->journal().state().committed.label, "rc-3");
}

// An engine that acknowledges an update but drops its data keeps the old weights: the update is
// TAINTED and never published; catches publishing an update nothing of which landed.
TEST(ServiceDigest, AnUpdateThatChangedNothingTaints) {
  Stack s;
  s.engine->SetWeightsFault(fixtures::WeightsFault::kIgnore);
  const json r = s.Update("u1", "rc-1", 1);
  EXPECT_EQ(r["http"], 500) << r.dump();
  EXPECT_EQ(r.value("outcome", ""), "tainted");
  EXPECT_NE(r.value("reason", "").find("did not change"), std::string::npos) << r.dump();
  EXPECT_EQ(s.svc->journal().state().committed.label, "rc-0");
}

// A trainer's expected digest that the engine does not reach (half the tensors landed) taints and
// names the tensors; catches a partial update that passes because its digest merely changed.
TEST(ServiceDigest, ExpectedDigestCatchesAPartialUpdate) {
  Stack s;
  // The digest the complete update gives: measured on a run that lands in full.
  ASSERT_EQ(s.Update("u1", "rc-1", 1)["http"], 200);
  const std::string full = s.svc->journal().state().committed_digest.combined;
  // rc-2 re-sends step 1's bytes (expected: `full`) to an engine that applies half of them.
  ASSERT_EQ(s.Update("u2", "rc-2", 2)["http"], 200);
  s.engine->SetWeightsFault(fixtures::WeightsFault::kPartial);
  const json r = s.Update("u3", "rc-3", 1, full);
  EXPECT_EQ(r.value("outcome", ""), "tainted") << r.dump();
  const std::string reason = r.value("reason", "");
  EXPECT_NE(reason.find("not the trainer's expected"), std::string::npos) << reason;
  EXPECT_NE(reason.find("tensors differ"), std::string::npos) << reason;
}

// A malformed expected digest is a 400 that journals nothing; catches outside text reaching the
// journal unchecked.
TEST(ServiceDigest, MalformedExpectedDigestIsRefusedBeforeTheJournal) {
  Stack s;
  const std::uint64_t head = s.svc->journal().head_seq();
  EXPECT_EQ(s.Update("u1", "rc-1", 1, "NOT-HEX")["http"], 400);
  EXPECT_EQ(s.svc->journal().head_seq(), head);
}

// Someone changes the READY engine's weights outside RolloutCore (same process, same label): the
// monitor's digest check taints with weights_changed and /metrics counts the drift; catches
// drift going unnoticed because label and instance still match.
TEST(ServiceDigest, MonitorCatchesWeightsChangedOutside) {
  // Label checks every 20 ms, digests every 400 ms: the two sights of the engine differ.
  Stack s([](ServeConfig& c) { c.weight_digest_check_interval_ms = 400; });
  EXPECT_TRUE(Eventually(
      [&] {
        return s.Metrics().find("rolloutcore_weight_digest_checks_match_total 0") ==
               std::string::npos;
      },
      5000))
      << "no digest check matched";
  // An outsider's own update through the engine's routes, label left as it was.
  effects::EngineClient outsider(s.engine->base_url());
  effects::HttpSequenceTransfer t(outsider, effects::detect_protocol("0.25.1"));
  effects::TransferTarget target;
  target.update_id = "outside";
  target.target = s.svc->journal().state().committed;
  target.source_uri = "synthetic:4x64:99";
  ASSERT_TRUE(t.Transfer(target, 10000).acknowledged);
  ASSERT_TRUE(
      Eventually([&] { return s.svc->journal().state().lifecycle == Lifecycle::kTainted; }, 5000));
  const State st = s.svc->journal().state();
  ASSERT_TRUE(st.taint.has_value());
  EXPECT_EQ(st.taint->cause, Cause::kWeightsChanged);
  EXPECT_NE(s.Metrics().find("rolloutcore_weight_digest_checks_drift_total 1"), std::string::npos);
  // The audit's window of suspect rollouts opens at the last digest that matched, not at the
  // last label check: the weights may have changed any time since.
  std::int64_t last_ok = -1, taint_wall = 0;
  // The fold shows the taint as soon as it is submitted; the records are readable once durable.
  const std::uint64_t head = s.svc->journal().head_seq();
  ASSERT_TRUE(Eventually([&] { return s.svc->journal().Read(head).ok(); }, 5000));
  for (std::uint64_t seq = 1; seq <= head; ++seq) {
    auto r = s.svc->journal().Read(seq);
    ASSERT_TRUE(r.ok());
    if (const auto* m = std::get_if<EngineMonitored>(&r->event); m && m->digest.present()) {
      last_ok = m->last_ok_wall_ms;
      taint_wall = r->wall_time_ms;
    }
  }
  EXPECT_GT(last_ok, 0);
  // At least one digest interval before the drift was seen, though labels matched until then.
  EXPECT_LE(last_ok, taint_wall - 300) << "window opens at the last label check, not the digest";
}

// Proves that with weight digests off (weight_digest_check_interval_ms 0) the look at the engine
// before a plan reads no digest, as the monitor reads none, and the update still commits (its
// validation digests what it loaded). Catches the look reading the weights' digest whenever the
// committed version has one, whatever the configuration, so it journaled (and refused plans on)
// a digest the monitor would never have read.
TEST(ServiceDigest, WithDigestChecksOffTheLookBeforeAPlanReadsNoDigest) {
  Stack s([](ServeConfig& c) { c.weight_digest_check_interval_ms = 0; });
  // The pause answers late: a digest read before it answers is the look's.
  s.engine->SetRouteFault("/pause", fixtures::RouteFault{.delay_ms = 1000, .times = 1});
  const std::uint64_t pauses = s.engine->RouteCount("/pause");
  const std::uint64_t digests = s.engine->RpcCount(effects::kWeightDigestMethod);
  json r;
  std::thread trainer([&] { r = s.Update("u1", "rc-1", 1); });
  const bool pausing = Eventually([&] { return s.engine->RouteCount("/pause") > pauses; }, 10000);
  const std::uint64_t looked = s.engine->RpcCount(effects::kWeightDigestMethod) - digests;
  trainer.join();
  ASSERT_TRUE(pausing);
  EXPECT_EQ(looked, 0u) << "the look before the plan read the weight digest";
  EXPECT_EQ(r["http"], 200) << r.dump();
  EXPECT_EQ(r.value("outcome", ""), "committed") << r.dump();
}

// Proves a digest check whose read failed is not taken as done: the look before a plan that could
// not read the digest (the engine's digest RPC answering 503) refuses the plan, and the next
// plan's look, once the backoff after that failure passed, reads the digest again although the
// interval (an hour) has not passed since. Catches the check counted when it was asked for, which
// let the next plan go on with no digest read for a whole weight_digest_check_interval_ms.
TEST(ServiceDigest, ADigestReadThatFailedIsReadAgainAtTheNextLook) {
  Stack s(
      [](ServeConfig& c) {
        c.engine_monitor_interval_ms = 60000;         // the monitor does not look meanwhile
        c.weight_digest_check_interval_ms = 3600000;  // one check an hour: only the first is due
      },
      // The label is read through /weight_info: only the digest goes through /collective_rpc.
      [](fixtures::VllmDoubleOptions& e) { e.version = "0.30.0"; });
  s.engine->SetRouteFault("/collective_rpc", fixtures::RouteFault{.status = 503});
  const json refused = s.Update("u1", "rc-1", 1);
  EXPECT_NE(refused["http"], 200) << refused.dump();
  EXPECT_NE(refused.dump().find("could not be verified before the plan"), std::string::npos)
      << refused.dump();
  s.engine->ClearFaults();
  // A failed read holds the next off for the first backoff, counted from the failed look's end
  // (before the refusal was answered). The hour has not passed: the next look reads only because
  // the failure was not taken as the check.
  std::this_thread::sleep_for(std::chrono::milliseconds(kDigestRetryBackoffMsMin + 100));
  // The pause answers late: a digest read before it answers is the look's.
  s.engine->SetRouteFault("/pause", fixtures::RouteFault{.delay_ms = 1000, .times = 1});
  const std::uint64_t pauses = s.engine->RouteCount("/pause");
  const std::uint64_t digests = s.engine->RpcCount(effects::kWeightDigestMethod);
  json r;
  std::thread trainer([&] { r = s.Update("u2", "rc-1", 1); });
  const bool pausing = Eventually([&] { return s.engine->RouteCount("/pause") > pauses; }, 10000);
  const std::uint64_t looked = s.engine->RpcCount(effects::kWeightDigestMethod) - digests;
  trainer.join();
  ASSERT_TRUE(pausing);
  EXPECT_EQ(looked, 1u) << "the look before the second plan did not read the weight digest";
  EXPECT_EQ(r["http"], 200) << r.dump();
  EXPECT_EQ(r.value("outcome", ""), "committed") << r.dump();
}

// Proves a re-verification pending after an executor restart ends once a digest is read, even
// with the monitor's scheduled digest checks off (weight_digest_check_interval_ms 0): while the
// engine's digest RPC answers 503 the restart's probes verify nothing and the re-verification
// stays pending; once the RPC answers again the monitor reads a digest within seconds and lifts
// it. Catches a re-verification lifted with no digest read (the engine served unverified), and
// one only a restart could lift with digest checks off (the engine admitted nothing forever).
TEST(ServiceDigest, ARecheckWhoseDigestReadsFailedEndsAtTheMonitorsNextDigest) {
  Stack s([](ServeConfig& c) { c.weight_digest_check_interval_ms = 0; },
          // The label is read through /weight_info: only the digest goes through /collective_rpc.
          [](fixtures::VllmDoubleOptions& e) { e.version = "0.30.0"; });
  ASSERT_TRUE(s.svc->journal().state().committed_digest.present());
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.svc.reset();
  s.engine->SetRouteFault("/collective_rpc", fixtures::RouteFault{.status = 503});
  s.Open();
  ASSERT_TRUE(s.svc->journal().state().engine_recheck);
  // The restart's probes are spent, each without a digest: nothing else of the runner is due.
  EXPECT_TRUE(Eventually(
      [&] {
        return admission_block_reason(s.svc->journal().state()).find("probes are spent") !=
               std::string::npos;
      },
      15000))
      << admission_block_reason(s.svc->journal().state());
  EXPECT_TRUE(s.svc->journal().state().engine_recheck) << "lifted with no digest read";
  s.engine->ClearFaults();
  EXPECT_TRUE(Eventually([&] { return !s.svc->journal().state().engine_recheck; }, 15000))
      << "the re-verification outlived the digest RPC's outage";
}

// Proves a digest read that keeps failing is tried again only after a backoff, not at every
// monitor tick: with the engine's digest RPC answering 503 and the monitor looking every 20 ms,
// the engine gets at most 3 digest calls (and /metrics counts at most 3 unavailable checks) in
// 1.5 s, where a retry at every tick makes about 75; and once the RPC answers again a digest is
// read within the backoff's cap (weight_digest_check_interval_ms). Catches a failed read retried
// at every tick (digests queued on the workers, the monitor blocked on them), and a backoff that
// grows past its cap or never ends.
TEST(ServiceDigest, ADigestReadThatKeepsFailingIsTriedAgainOnlyAfterABackoff) {
  constexpr int kIntervalMs = 2 * static_cast<int>(kDigestRetryBackoffMsMin);  // backoffs 1 s, 2 s
  constexpr const char* kUnavailable = "rolloutcore_weight_digest_checks_unavailable_total";
  Stack s([](ServeConfig& c) { c.weight_digest_check_interval_ms = kIntervalMs; },
          // The label is read through /weight_info: only the digest goes through /collective_rpc.
          [](fixtures::VllmDoubleOptions& e) { e.version = "0.30.0"; });
  s.engine->SetRouteFault("/collective_rpc", fixtures::RouteFault{.status = 503});
  const std::uint64_t calls = s.engine->RouteCount("/collective_rpc");
  const std::uint64_t unavailable = s.Counter(kUnavailable);
  // The first read that fails: at the monitor's first check, or one interval after it.
  ASSERT_TRUE(Eventually([&] { return s.engine->RouteCount("/collective_rpc") > calls; },
                         kIntervalMs + 3000));
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_LE(s.engine->RouteCount("/collective_rpc") - calls, 3u) << "retried at every tick";
  EXPECT_LE(s.Counter(kUnavailable) - unavailable, 3u);
  // The third failure (the backoff at its cap since the second) is answered before the fault
  // clears: the next read comes one cap after it, and succeeds.
  ASSERT_TRUE(Eventually([&] { return s.Counter(kUnavailable) >= unavailable + 3; },
                         2 * kIntervalMs + 1000));
  s.engine->ClearFaults();
  const std::uint64_t digests = s.engine->RpcCount(effects::kWeightDigestMethod);
  const std::uint64_t matches = s.Counter("rolloutcore_weight_digest_checks_match_total");
  EXPECT_TRUE(Eventually([&] { return s.engine->RpcCount(effects::kWeightDigestMethod) > digests; },
                         kIntervalMs + 1000))
      << "no digest read within the backoff's cap once the engine answered again";
  EXPECT_TRUE(Eventually(
      [&] { return s.Counter("rolloutcore_weight_digest_checks_match_total") > matches; }, 1000));
}

// Proves that of several askers of one engine's digest schedule at once (monitor ticks, looks
// before a plan), one only is given the read, and nobody else until it reported what it got.
// Catches a schedule that only answers whether a check is due, so that a look and a tick both
// read the digest at the same time.
TEST(ServiceDigest, OneAskerAtATimeTakesTheDigestRead) {
  constexpr std::uint64_t kIntervalMs = 60000;
  constexpr std::int64_t kNowMs = 1'000'000;
  EngineWatch w;
  std::atomic<int> taken{0};
  std::vector<std::thread> askers;
  for (int i = 0; i < 8; ++i) {
    askers.emplace_back([&] {
      if (w.TakeDigestCheck(kIntervalMs, kNowMs)) taken++;
    });
  }
  for (std::thread& t : askers) t.join();
  EXPECT_EQ(taken.load(), 1);
  EXPECT_FALSE(w.TakeDigestCheck(kIntervalMs, kNowMs + 2 * kIntervalMs)) << "a read in flight";
  w.DigestRead(/*answered=*/true, kIntervalMs, kNowMs + 5);
  EXPECT_FALSE(w.TakeDigestCheck(kIntervalMs, kNowMs + 5 + kIntervalMs - 1));
  EXPECT_TRUE(w.TakeDigestCheck(kIntervalMs, kNowMs + 5 + kIntervalMs));
  EXPECT_FALSE(EngineWatch{}.TakeDigestCheck(/*interval_ms=*/0, kNowMs)) << "checks are off";
}

// Proves the backoff after failed digest reads: the first backoff after one failure, doubled after
// each failure in a row, capped at the check interval, and ended by an answered check. Catches a
// failed read tried again at once (every monitor tick), a backoff that does not grow or grows past
// the interval, and one that outlives the answer.
TEST(ServiceDigest, FailedDigestReadsBackOffUpToTheCheckInterval) {
  constexpr auto kFirstMs = static_cast<std::int64_t>(kDigestRetryBackoffMsMin);
  constexpr std::uint64_t kIntervalMs = 3 * kDigestRetryBackoffMsMin;
  EngineWatch w;
  std::int64_t now_ms = 1'000'000;
  ASSERT_TRUE(w.TakeDigestCheck(kIntervalMs, now_ms));
  for (const std::int64_t backoff_ms : {kFirstMs, 2 * kFirstMs, 3 * kFirstMs, 3 * kFirstMs}) {
    w.DigestRead(/*answered=*/false, kIntervalMs, now_ms);
    EXPECT_FALSE(w.TakeDigestCheck(kIntervalMs, now_ms + backoff_ms - 1)) << backoff_ms;
    now_ms += backoff_ms;
    ASSERT_TRUE(w.TakeDigestCheck(kIntervalMs, now_ms)) << backoff_ms;
  }
  // The answer is the check: the next is due one interval later, and a failure then waits the
  // first backoff again.
  w.DigestRead(/*answered=*/true, kIntervalMs, now_ms);
  EXPECT_FALSE(w.TakeDigestCheck(kIntervalMs, now_ms + 3 * kFirstMs - 1));
  now_ms += 3 * kFirstMs;
  ASSERT_TRUE(w.TakeDigestCheck(kIntervalMs, now_ms));
  w.DigestRead(/*answered=*/false, kIntervalMs, now_ms);
  EXPECT_FALSE(w.TakeDigestCheck(kIntervalMs, now_ms + kFirstMs - 1));
  EXPECT_TRUE(w.TakeDigestCheck(kIntervalMs, now_ms + kFirstMs));
}

// Two journals in one directory write two trajectories files; catches the shared default that
// mixed two journals' rollouts into one file.
TEST(ServiceDigest, DefaultTrajectoriesFileIsNamedAfterItsJournal) {
  EXPECT_EQ(DefaultTrajectoriesPath("/data/rc/a"), "/data/rc/a.trajectories.jsonl");
  EXPECT_EQ(DefaultTrajectoriesPath("/data/rc/a/"), "/data/rc/a.trajectories.jsonl");
  EXPECT_NE(DefaultTrajectoriesPath("/data/rc/a"), DefaultTrajectoriesPath("/data/rc/b"));
}

}  // namespace
}  // namespace rc::service
