// The article's experiments (docs/experiments.md), reproduced over real loopback HTTP against the
// vLLM test double with a real RocksDB journal. The double is not vLLM: these prove the
// controller's behaviour against vLLM's documented protocol; tests/gpu and bench/gpu cover the GPU
// path.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "replay/replay.h"
#include "tests/integration/harness.h"

namespace rc::itest {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

std::vector<int> TokenIds(const effects::HttpReply& r) {
  std::vector<int> ids;
  if (r.body.contains("choices")) {
    for (const auto& t : r.body["choices"][0]["token_ids"]) ids.push_back(t.get<int>());
  }
  return ids;
}

// E1 (control plane only) proves that pause(mode=wait) returns only after a running 256-token
// request finishes, and that drain/reset/validate/resume leave greedy output unchanged; it
// would catch a drain that aborts or returns early, or a lifecycle that perturbs generation.
TEST(Experiments, E1ControlPlaneOnly) {
  Executor x;
  x.Bootstrap();
  const std::string prompt = "Explain why the sky is blue, step by step.";
  const auto before = x.Complete(prompt, 32);
  ASSERT_TRUE(before.http.ok_2xx()) << before.http.error;

  std::thread long_request([&] {
    auto r = x.Complete("a 256-token rollout", 256);
    EXPECT_TRUE(r.http.ok_2xx());
    EXPECT_EQ(r.body["usage"]["completion_tokens"], 256);
  });
  ASSERT_TRUE(x.engine.engine().WaitUntil([](const auto& s) { return s.running == 1; }, 5000));
  DrainObserved drained = x.control->PauseWait(20000);
  // The engine's own count, read as the pause returns (not the client's clock, which a loaded
  // host delays after the engine's last token).
  const bool none_running =
      x.engine.engine().WaitUntil([](const auto& s) { return s.running == 0; }, 0);
  long_request.join();
  ASSERT_TRUE(drained.http.ok_2xx() && drained.paused);
  EXPECT_TRUE(none_running) << "pause(mode=wait) returned before the running request finished";
  EXPECT_GT(drained.http.latency_us, 256u * 2000 / 2) << "the drain did not wait";
  for (CacheKind c : {CacheKind::kPrefix, CacheKind::kEncoder, CacheKind::kMultimodal}) {
    CacheResetObserved reset = x.control->ResetCache(c);
    EXPECT_TRUE(reset.http.ok_2xx() && reset.reported_success) << cache_name(c);
  }
  ValidationObserved v = x.control->WeightInfo();
  EXPECT_EQ(v.reported_label, "rc-0");
  ResumeObserved resumed = x.control->Resume();
  EXPECT_TRUE(resumed.http.ok_2xx() && resumed.is_paused_known && !resumed.is_paused);
  const auto after = x.Complete(prompt, 32);
  EXPECT_EQ(TokenIds(before), TokenIds(after));
  EXPECT_FALSE(TokenIds(before).empty());
}

// E3 proves that an update requested while a rollout generates waits for it: the journal shows
// the rollout's finish before the transfer intent, the rollout is bound to rc-0 and the next one
// to rc-1; it would catch a mutation under a live rollout (one rollout, two policies).
TEST(Experiments, E3LiveRolloutDuringUpdate) {
  Executor x;
  x.Bootstrap();
  auto admitted = x.Admit("r-long");
  ASSERT_TRUE(admitted.ok()) << admitted.status().ToString();
  EXPECT_EQ(admitted->version.label, "rc-0");
  std::thread rollout([&] {
    auto r = x.Complete("a long rollout under rc-0", 256);
    EXPECT_TRUE(r.http.ok_2xx());
    EXPECT_TRUE(x.Finish("r-long", r.body).ok());
  });
  ASSERT_TRUE(x.engine.engine().WaitUntil([](const auto& s) { return s.running == 1; }, 5000));
  std::this_thread::sleep_for(milliseconds(50));  // genuinely mid-generation
  auto ended = x.runner->Update(Update("u-1", "rc-1", 100));
  rollout.join();
  ASSERT_TRUE(ended.ok()) << ended.status().ToString();
  EXPECT_EQ(ended->outcome, UpdateOutcome::kCommitted) << ended->reason;
  EXPECT_GT(x.runner->last_timings().drain_us, 100000u) << "the drain did not hold the update";

  auto records = x.Records();
  const auto finish_seq = FirstSeq(records, [](const journal::Record& r) {
    auto* f = std::get_if<RolloutFinished>(&r.event);
    return f != nullptr && f->rollout_id == "r-long";
  });
  const auto transfer_seq = FirstSeq(records, [](const journal::Record& r) {
    auto* e = std::get_if<EffectStarted>(&r.event);
    return e != nullptr && e->kind == EffectKind::kTransfer;
  });
  ASSERT_GT(finish_seq, 0u);
  ASSERT_GT(transfer_seq, 0u);
  EXPECT_LT(finish_seq, transfer_seq) << "weights mutated before the rollout finished";

  auto next = x.Admit("r-next");
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->version.label, "rc-1");
  EXPECT_EQ(next->version.generation, 1u);
  EXPECT_TRUE(x.Finish("r-next", x.Complete("next", 8).body).ok());
  HistoryReport h = x.CheckHistory();
  EXPECT_TRUE(h.ok) << h.first_bad_seq << ": " << h.message;
}

// E4 (negative control) proves that an update made outside RolloutCore with caches left in place
// reuses KV computed by the old weights (prefix hits > 0 and different output), while through
// RolloutCore the first request after the update sees zero hits and fresh output, and the second
// sees hits again (the cache was reset, not disabled); it would catch a missing post-mutation
// reset or a test that proves nothing because the cache was never used.
TEST(Experiments, E4StaleCacheNegativeControl) {
  const std::string prompt =
      "You are a helpful assistant. Solve: what is the capital of France? Think step by step.";
  auto hits = [](Executor& x) { return MetricOr0(*x.client, "vllm:prefix_cache_hits_total"); };

  // (a) Outside the controller: pause without clearing, transfer, no reset, resume.
  Executor bad;
  bad.Bootstrap();
  ASSERT_TRUE(bad.Complete(prompt, 16).http.ok_2xx());
  const double h0 = hits(bad);
  ASSERT_TRUE(bad.Complete(prompt, 16).http.ok_2xx());
  EXPECT_GT(hits(bad), h0) << "prefix caching is not in use: the control would prove nothing";
  ASSERT_TRUE(bad.client->Pause(effects::PauseMode::kWait, false).http.ok_2xx());
  TransferObserved t = bad.transfer->Transfer(
      effects::TransferTarget{"manual", {1, "rc-1"}, Identity(1), "synthetic:8x64:1"}, 5000);
  ASSERT_TRUE(t.acknowledged) << t.error;
  ASSERT_TRUE(bad.client->ResumeRaw().http.ok_2xx());
  const double h1 = hits(bad);
  const auto stale = bad.Complete(prompt, 16);
  EXPECT_GT(hits(bad) - h1, 0) << "the stale cache was not reused";
  ASSERT_TRUE(bad.client->ResetCacheRaw(CacheKind::kPrefix).http.ok_2xx());
  const auto fresh = bad.Complete(prompt, 16);
  EXPECT_NE(TokenIds(stale), TokenIds(fresh)) << "stale KV did not change the output";

  // (b) Through RolloutCore: the same steps, with the controller's INVALIDATING boundary.
  Executor good;
  good.Bootstrap();
  ASSERT_TRUE(good.Complete(prompt, 16).http.ok_2xx());
  ASSERT_TRUE(good.Complete(prompt, 16).http.ok_2xx());
  auto ended = good.runner->Update(Update("u-1", "rc-1", 1));
  ASSERT_TRUE(ended.ok() && ended->outcome == UpdateOutcome::kCommitted);
  const double g1 = hits(good);
  const auto first = good.Complete(prompt, 16);
  EXPECT_EQ(hits(good) - g1, 0) << "old-version KV reused after a RolloutCore update";
  EXPECT_EQ(TokenIds(first), TokenIds(fresh)) << "output differs from a fresh computation";
  const double g2 = hits(good);
  ASSERT_TRUE(good.Complete(prompt, 16).http.ok_2xx());
  EXPECT_GT(hits(good) - g2, 0) << "caching was disabled rather than reset";
}

// E5 proves that two checkpoints with identical manifests get distinct identities and that each
// trajectory's binding records its version and identity; it would catch provenance keyed on the
// manifest digest alone (step 100 and step 500 would be indistinguishable).
TEST(Experiments, E5ProvenanceDistinguishesSameManifest) {
  Executor x;
  x.Bootstrap();
  ASSERT_TRUE(x.Admit("r-a").ok());
  EXPECT_TRUE(x.Finish("r-a", x.Complete("a", 4).body).ok());
  auto u1 = x.runner->Update(Update("u-100", "rc-1", 100));
  ASSERT_TRUE(u1.ok() && u1->outcome == UpdateOutcome::kCommitted);
  ASSERT_TRUE(x.Admit("r-b").ok());
  EXPECT_TRUE(x.Finish("r-b", x.Complete("b", 4).body).ok());
  auto u2 = x.runner->Update(Update("u-500", "rc-2", 500));
  ASSERT_TRUE(u2.ok() && u2->outcome == UpdateOutcome::kCommitted);
  ASSERT_TRUE(x.Admit("r-c").ok());

  std::vector<VersionPublished> published;
  std::map<std::string, RolloutAdmitted> bindings;
  for (const auto& r : x.Records()) {
    if (auto* p = std::get_if<VersionPublished>(&r.event)) published.push_back(*p);
    if (auto* a = std::get_if<RolloutAdmitted>(&r.event)) bindings[a->rollout_id] = *a;
  }
  ASSERT_EQ(published.size(), 2u);
  EXPECT_EQ(published[0].identity.manifest_digest, published[1].identity.manifest_digest);
  EXPECT_NE(published[0].identity, published[1].identity);
  EXPECT_EQ(bindings["r-a"].version.label, "rc-0");
  EXPECT_EQ(bindings["r-b"].version.label, "rc-1");
  EXPECT_EQ(bindings["r-b"].identity.step, 100);
  EXPECT_EQ(bindings["r-c"].version.label, "rc-2");
  EXPECT_EQ(bindings["r-c"].identity.step, 500);
  auto seqs = x.journal->RolloutSeqs("r-b");
  ASSERT_TRUE(seqs.ok());
  EXPECT_EQ(seqs->size(), 2u);  // admitted, finished
}

// E6a proves a failure proven to precede mutation is refused without taint: a declared identity
// that does not match the source, and an engine that refuses the transfer's initialisation; it
// would catch a refusal that taints (or publishes).
TEST(Experiments, E6RefusedBeforeMutation) {
  Executor x;
  x.Bootstrap();
  UpdateRequested wrong = Update("u-wrong", "rc-1", 1);
  wrong.identity.manifest_digest = std::string(64, 'a');
  auto r1 = x.runner->Update(wrong);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->outcome, UpdateOutcome::kRefused);
  EXPECT_NE(r1->reason.find("source manifest"), std::string::npos) << r1->reason;
  EXPECT_EQ(x.engine.weights_generation(), 0u) << "weights mutated on an identity mismatch";

  fixtures::RouteFault fail;
  fail.status = 500;
  x.engine.SetRouteFault("/init_weight_transfer_engine", fail);
  auto r2 = x.runner->Update(Update("u-noinit", "rc-1", 1));
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->outcome, UpdateOutcome::kRefused) << r2->reason;
  const State s = x.journal->state();
  EXPECT_EQ(s.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(s.committed.label, "rc-0");
  EXPECT_FALSE(s.taint.has_value());
  EXPECT_TRUE(x.Admit("r-after").ok()) << "admissions must reopen after a refusal";
  EXPECT_TRUE(x.Finish("r-after", x.Complete("after", 4).body).ok());
  x.engine.ClearFaults();
  auto r3 = x.runner->Update(Update("u-ok", "rc-1", 1));
  ASSERT_TRUE(r3.ok());
  EXPECT_EQ(r3->outcome, UpdateOutcome::kCommitted) << r3->reason;
}

// E6b proves an ambiguous failure during the transfer (the connection drops while the engine
// receives) goes TAINTED, never publishes the target, refuses admissions, and that replay
// explains the incident from the journal; it would catch a transfer failure hidden as a refusal.
TEST(Experiments, E6AmbiguousTransferTaints) {
  Executor x;
  x.Bootstrap();
  fixtures::RouteFault drop;
  drop.drop_connection = true;
  drop.after = true;  // the engine ran the update; the caller cannot tell
  x.engine.SetRouteFault("/update_weights", drop);
  auto r = x.runner->Update(Update("u-1", "rc-1", 1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->outcome, UpdateOutcome::kTainted);
  const State s = x.journal->state();
  EXPECT_EQ(s.lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(s.committed.label, "rc-0") << "the target was published";
  auto admit = x.Admit("r-after-taint");
  ASSERT_FALSE(admit.ok());
  EXPECT_EQ(admit.status().code(), Code::kRejected);
  for (const auto& rec : x.Records()) {
    EXPECT_FALSE(std::holds_alternative<VersionPublished>(rec.event));
  }
  // Restarting the executor does not hide it.
  x.Restart();
  EXPECT_TRUE(x.runner->Recover(x.journal->recovery()).ok());
  EXPECT_EQ(x.journal->state().lifecycle, Lifecycle::kTainted);
  auto report = replay::Replay(*x.journal, {});
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok) << report->error;
  ASSERT_EQ(report->incidents.size(), 1u);
  EXPECT_NE(report->incidents[0].explanation.find("transfer_ambiguous"), std::string::npos);
  EXPECT_NE(report->incidents[0].explanation.find("u-1"), std::string::npos);
}

// E6c proves a prefix-cache reset answering HTTP 200 {"success": false} is a failure: retried a
// bounded number of times, then TAINTED and never published; a transient false is retried and
// the update commits; it would catch a 200 taken as success.
TEST(Experiments, E6ResetSuccessFalseNeverPublishes) {
  {
    Executor x;
    x.Bootstrap();
    x.engine.FailResetPrefixCache(1);
    auto r = x.runner->Update(Update("u-1", "rc-1", 1));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->outcome, UpdateOutcome::kCommitted) << "a transient success:false is retried";
  }
  Executor x;
  x.Bootstrap();
  x.engine.FailResetPrefixCache(1000);
  auto r = x.runner->Update(Update("u-1", "rc-1", 1));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->outcome, UpdateOutcome::kTainted);
  EXPECT_NE(r->reason.find("success=false"), std::string::npos) << r->reason;
  EXPECT_EQ(x.journal->state().committed.label, "rc-0");
  int resets = 0;
  for (const auto& rec : x.Records()) {
    auto* c = std::get_if<CacheResetObserved>(&rec.event);
    resets += c != nullptr && c->cache == CacheKind::kPrefix;
  }
  EXPECT_EQ(resets, static_cast<int>(kEffectAttemptsMax));
}

// Proves an executor restart in the middle of a drain records the rollout whose client died as
// abandoned (never silently dropped) and completes the update; would catch a restart that loses
// or invents a binding.
TEST(Experiments, RestartAbandonsDeadClientsAndFinishesTheUpdate) {
  Executor x;
  x.Bootstrap();
  ASSERT_TRUE(x.Admit("r-orphan").ok());
  x.Restart();  // the process that held r-orphan's client is gone
  ASSERT_TRUE(x.runner->Recover(x.journal->recovery()).ok());
  State s = x.journal->state();
  EXPECT_TRUE(s.active.empty());
  EXPECT_EQ(s.counters.rollouts_abandoned, 1u);
  auto r = x.runner->Update(Update("u-1", "rc-1", 1));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->outcome, UpdateOutcome::kCommitted);
  auto report = replay::Replay(*x.journal, {});
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok) << report->error;
  EXPECT_EQ(report->state, x.journal->state());
}

}  // namespace
}  // namespace rc::itest
