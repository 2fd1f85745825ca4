// Colocated mode end to end: `serve --transfer ipc` against the vLLM double with vLLM 0.25.1's
// ipc backend and sleep routes, a real journal and loopback HTTP. A sleep drains and releases
// the engine; nothing is admitted while it sleeps; an update from sleep (a vllm-ipc: file of the
// trainer's handles) or a level-1 wake-up brings it back only through validation; every failure
// leaves the engine asleep (nothing changed), serving (the sleep was never done) or TAINTED.
#include <atomic>
#include <filesystem>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "effects/http/weight_digest.h"
#include "encoding/base64.h"
#include "fixtures/vllm_double.h"
#include "service/service.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using nlohmann::json;

constexpr const char* kToken = "colocated-token";
constexpr int kTensors = 4;  // the bootstrap's synthetic:4x64 layout

json Answer(const httplib::Result& r) {
  if (!r) return json{{"http", -1}};
  json out = json::parse(r->body, nullptr, false);
  if (!out.is_object()) out = json::object();
  out["http"] = r->status;
  return out;
}

// A real (protocol 2) pickle of [{uuid: "<step's handles>"}] per tensor: the shape of vLLM's
// unpacked ipc_handles, with a string standing in for torch's rebuild arguments.
std::string PickleString(const std::string& s) {
  std::string out = "X";
  for (int i = 0; i < 4; ++i) out += static_cast<char>((s.size() >> (8 * i)) & 0xff);
  return out + s;
}

std::string HandlesPickle(const std::string& uuid, int step) {
  std::string p = "\x80\x02]";
  for (int i = 0; i < kTensors; ++i) {
    p += "}" + PickleString(uuid) +
         PickleString("step " + std::to_string(step) + " tensor " + std::to_string(i)) + "sa";
  }
  return p + ".";
}

struct Stack : stack::ServiceStack {
  Stack() : ServiceStack(Options()) {}
  static stack::StackOptions Options() {
    stack::StackOptions o;
    o.token = kToken;
    o.dir_prefix = "rc-colocated";
    o.tweak = [](ServeConfig& c) {
      c.transfer = "ipc";
      c.initial_source.clear();
      c.initial_manifest_digest = stack::SyntheticDigest(stack::kStackSource);
      c.engine_monitor_interval_ms = 50;
      c.admit_wait_ms = 100;
    };
    o.engine_tweak = [](fixtures::VllmDoubleOptions& e) {
      e.weight_transfer_backend = "ipc";
      e.allow_insecure_serialization = true;
      e.enable_sleep_mode = true;
    };
    return o;
  }
  json Post(const std::string& path, const json& body) {
    httplib::Client c = client();
    return Answer(c.Post(path, stack::Bearer(kToken), body.dump(), "application/json"));
  }
  json Sleep(const std::string& id, int level) {
    return Post("/v1/sleep", {{"sleep_id", id}, {"level", level}});
  }
  json Wake(const std::string& id) { return Post("/v1/wake", {{"wake_id", id}}); }
  // A trainer step's export: the engine's layout, handles under `uuid` (the engine's by
  // default), values named by `step` (the double derives content from the pickled bytes).
  std::string Export(int step, std::string uuid = "") {
    if (uuid.empty()) uuid = engine->GpuUuids().at(0);
    json f = {{"format", "rolloutcore-vllm-ipc"}, {"version", 1}, {"gpu_uuids", {uuid}}};
    for (int i = 0; i < kTensors; ++i) {
      f["names"].push_back("model.layers." + std::to_string(i) + ".weight");
      f["dtype_names"].push_back("bfloat16");
      f["shapes"].push_back({64, 64});
    }
    f["ipc_handles_pickled"] = encoding::Base64Encode(HandlesPickle(uuid, step));
    const std::string path = (dir / ("step-" + std::to_string(step) + ".json")).string();
    std::ofstream(path) << f.dump();
    return "vllm-ipc:" + path;
  }
  json Update(const std::string& id, const std::string& label, int step, std::string source = "") {
    if (source.empty()) source = Export(step);
    return Post("/v1/updates", {{"update_id", id},
                                {"target_label", label},
                                {"identity",
                                 {{"manifest_digest", stack::SyntheticDigest(stack::kStackSource)},
                                  {"checkpoint", "step-" + std::to_string(step)},
                                  {"step", step}}},
                                {"source", source}});
  }
  State Fold() { return svc->journal().state(); }
  json EngineState() { return engine->StateJson(); }
  int Proxied() {
    httplib::Client c = client(10);
    auto r = c.Post("/v1/completions", json{{"prompt", "hello"}, {"max_tokens", 2}}.dump(),
                    "application/json");
    return r ? r->status : -1;
  }
  std::string EngineDigest() {
    effects::EngineClient c(engine->base_url());
    return effects::ReadWeightDigest(c).combined;
  }
};

// The colocated step: the sleep answers with the memory freed, nothing is admitted asleep, the
// update from sleep wakes the weights, transfers, validates and wakes the KV cache last, and a
// re-POST answers the recorded sleep, counted as replayed; catches admissions while asleep, a
// resume before validation, an engine left with a pool asleep under READY, and a replayed sleep
// /metrics does not count.
TEST(Colocated, SleepThenUpdateFromSleep) {
  Stack s;
  const std::string d0 = s.EngineDigest();
  json slept = s.Sleep("s-1", 1);
  ASSERT_EQ(slept["http"], 200) << slept.dump();
  EXPECT_EQ(slept["outcome"], "committed");
  EXPECT_GT(slept["freed_bytes"].get<std::int64_t>(), 0) << slept.dump();
  EXPECT_EQ(slept["state"]["lifecycle"], "SLEEPING");
  EXPECT_EQ(slept["state"]["sleep_level"], 1);
  EXPECT_GT(slept["timings"]["sleep_us"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(s.Proxied(), 503);
  EXPECT_EQ(s.Post("/v1/rollouts", {{"wait_ms", 0}})["http"], 503);
  EXPECT_TRUE(s.EngineState()["executor_sleeping"].get<bool>());

  json u = s.Update("u-1", "rc-1", 1);
  ASSERT_EQ(u["http"], 200) << u.dump();
  EXPECT_EQ(u["state"]["lifecycle"], "READY");
  EXPECT_EQ(u["state"]["committed"]["generation"], 1);
  EXPECT_GT(u["timings"]["wake_weights_us"].get<std::uint64_t>(), 0u);
  EXPECT_GT(u["timings"]["wake_kv_us"].get<std::uint64_t>(), 0u);
  EXPECT_NE(s.EngineDigest(), d0);
  EXPECT_EQ(s.EngineDigest(), s.Fold().committed_digest.combined);
  const json e = s.EngineState();
  EXPECT_FALSE(e["executor_sleeping"].get<bool>()) << e.dump();
  EXPECT_EQ(s.Proxied(), 200);

  json again = s.Sleep("s-1", 1);
  EXPECT_EQ(again["http"], 200);
  EXPECT_TRUE(again["replayed"].get<bool>());
  EXPECT_EQ(s.Sleep("s-1", 2)["http"], 409);  // the id names another request
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kReady);
  httplib::Client c = s.client();
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  for (const char* sample : {"rolloutcore_sleeps_total{outcome=\"committed\"} 1\n",
                             "rolloutcore_sleeps_total{outcome=\"replayed\"} 1\n",
                             "rolloutcore_sleeps_total{outcome=\"conflict\"} 1\n",
                             "rolloutcore_updates_total{outcome=\"replayed\"} 0\n"}) {
    EXPECT_NE(m->body.find(sample), std::string::npos) << sample << m->body;
  }
}

// A level-1 wake-up restores the host copy and is validated against the committed digest;
// level 2 refuses a wake-up and takes an update; catches serving after level 2 without weights.
TEST(Colocated, WakeUpAfterLevelOneUpdateAfterLevelTwo) {
  Stack s;
  const std::string d0 = s.EngineDigest();
  ASSERT_EQ(s.Sleep("s-1", 1)["http"], 200);
  json w = s.Wake("w-1");
  ASSERT_EQ(w["http"], 200) << w.dump();
  EXPECT_EQ(w["state"]["committed"]["generation"], 0);
  EXPECT_EQ(s.EngineDigest(), d0);
  ASSERT_EQ(s.Sleep("s-2", 2)["http"], 200);
  json refused = s.Wake("w-2");
  EXPECT_EQ(refused["http"], 409) << refused.dump();
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kSleeping);
  ASSERT_EQ(s.Update("u-1", "rc-1", 1)["http"], 200);
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kReady);
  EXPECT_FALSE(s.EngineState()["weights_garbage"].get<bool>());
}

// Handles that name another GPU are refused in preflight: the engine stays asleep and nothing
// was transferred; catches a transfer of handles the engine's workers cannot open.
TEST(Colocated, HandlesForAnotherGpuAreRefusedAsleep) {
  Stack s;
  ASSERT_EQ(s.Sleep("s-1", 1)["http"], 200);
  json u = s.Update("u-1", "rc-1", 1, s.Export(1, "GPU-00000000-0000-0000-0000-000000000000"));
  EXPECT_EQ(u["http"], 422) << u.dump();
  EXPECT_NE(u["reason"].get<std::string>().find("has no handles"), std::string::npos);
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kSleeping);
  EXPECT_EQ(s.engine->RouteCount("/start_weight_update"), 0u);
  EXPECT_EQ(s.Update("u-2", "rc-1", 2)["http"], 200);
}

// A sleep the engine refused at its route (404: no dev routes) resumes serving; one that may have
// released memory (the freed-memory assertion: 500 after unmapping) taints, and a restore from
// the trainer's export wakes the engine before its transfer; catches an engine believed asleep
// or awake against the evidence.
TEST(Colocated, SleepFailuresRefuseOrTaint) {
  Stack s;
  s.engine->SetRouteFault("/sleep", {.status = 404, .times = 1});
  json refused = s.Sleep("s-1", 1);
  EXPECT_EQ(refused["http"], 422) << refused.dump();
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kReady);
  EXPECT_EQ(s.Proxied(), 200);

  s.engine->SetSleepAssertionFault(true);
  json tainted = s.Sleep("s-2", 1);
  EXPECT_EQ(tainted["http"], 500) << tainted.dump();
  ASSERT_EQ(s.Fold().lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(s.Fold().taint->cause, Cause::kSleepFailed);
  EXPECT_EQ(s.Fold().sleep_level, 1);
  EXPECT_EQ(s.Proxied(), 503);
}

// The wake-up of the weights failing after it may have run taints; failing at its route (never
// done) leaves the engine asleep; catches a transfer into weights whose mapping is unknown.
TEST(Colocated, WakeFailuresRefuseOrTaint) {
  Stack s;
  ASSERT_EQ(s.Sleep("s-1", 1)["http"], 200);
  s.engine->SetRouteFault("/wake_up", {.status = 404, .times = 1});
  json refused = s.Update("u-1", "rc-1", 1);
  EXPECT_EQ(refused["http"], 422) << refused.dump();
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kSleeping);
  s.engine->SetRouteFault("/wake_up", {.status = 500, .after = true, .times = 1});
  json tainted = s.Update("u-2", "rc-1", 1);
  EXPECT_EQ(tainted["http"], 500) << tainted.dump();
  ASSERT_EQ(s.Fold().lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(s.Fold().taint->cause, Cause::kWakeFailed);
  EXPECT_EQ(s.engine->RouteCount("/start_weight_update"), 0u);
}

// A transfer that fails after /start_weight_update taints (vLLM has the layers on meta); a
// restore of the committed version from the trainer's export then proves it by its digest and
// leaves nothing asleep; catches a restore that resumes a half-asleep engine.
TEST(Colocated, AmbiguousTransferTaintsAndARestoreBringsItBack) {
  Stack s;
  ASSERT_EQ(s.Update("u-1", "rc-1", 1)["http"], 200);  // an update from READY works too
  const std::string d1 = s.EngineDigest();
  ASSERT_EQ(s.Sleep("s-1", 1)["http"], 200);
  s.engine->SetRouteFault("/update_weights", {.status = 500, .times = 1});
  EXPECT_EQ(s.Update("u-2", "rc-2", 2)["http"], 500);
  ASSERT_EQ(s.Fold().lifecycle, Lifecycle::kTainted);
  json r =
      s.Post("/v1/restores", {{"restore_id", "x-1"}, {"label", "rc-1"}, {"source", s.Export(1)}});
  ASSERT_EQ(r["http"], 200) << r.dump();
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kReady);
  EXPECT_EQ(s.EngineDigest(), d1);
  EXPECT_FALSE(s.EngineState()["executor_sleeping"].get<bool>());
  EXPECT_EQ(s.Proxied(), 200);
}

// A sleeper someone woke outside RolloutCore is TAINTED by the monitor; a restore then wakes
// whatever may still sleep before its drain, so its reload, resets and validation run on a paused
// engine (the journal's validation says so) and it commits; catches a restore that wakes an
// awake engine after pausing it (vLLM resumes its scheduler then, and the evidence would be read
// from a running engine).
TEST(Colocated, RestoreOfASleeperWokenOutsideValidatesPaused) {
  Stack s;
  ASSERT_EQ(s.Update("u-1", "rc-1", 1)["http"], 200);
  ASSERT_EQ(s.Sleep("s-1", 1)["http"], 200);
  httplib::Client engine(s.engine->base_url());
  auto woken = engine.Post("/wake_up", "", "application/json");
  ASSERT_TRUE(woken && woken->status == 200);
  for (int i = 0; i < 200 && s.Fold().lifecycle == Lifecycle::kSleeping; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(s.Fold().lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(s.Fold().taint->cause, Cause::kEngineWokenExternally);
  EXPECT_EQ(s.Fold().sleep_level, 1) << "the fold cannot know what still sleeps";
  json r =
      s.Post("/v1/restores", {{"restore_id", "x-1"}, {"label", "rc-1"}, {"source", s.Export(1)}});
  ASSERT_EQ(r["http"], 200) << r.dump();
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kReady);
  EXPECT_EQ(s.Fold().sleep_level, 0);
  int validations = 0;
  Status st = s.svc->journal().Scan(1, 0, [&](const journal::Record& rec) {
    if (const auto* v = std::get_if<ValidationObserved>(&rec.event)) {
      validations++;
      EXPECT_TRUE(v->is_paused_known && v->is_paused) << "validation #" << validations;
    }
    return Status::OK();
  });
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(validations, 2) << "the update's and the restore's";
  EXPECT_EQ(s.Proxied(), 200);
}

// An executor that crashes while the engine sleeps comes back SLEEPING and the colocated update
// still works (its validation re-verifies the engine); an engine that restarted meanwhile is
// seen by the monitor and taints; catches a restart while asleep going unnoticed.
TEST(Colocated, RestartsWhileAsleep) {
  Stack s;
  ASSERT_EQ(s.Sleep("s-1", 1)["http"], 200);
  s.Kill();
  s.Open();
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kSleeping);
  EXPECT_EQ(s.Proxied(), 503);
  ASSERT_EQ(s.Update("u-1", "rc-1", 1)["http"], 200);
  EXPECT_EQ(s.Fold().lifecycle, Lifecycle::kReady);

  ASSERT_EQ(s.Sleep("s-2", 1)["http"], 200);
  ASSERT_TRUE(s.RestartEngine());  // a fresh process: awake, label "default"
  for (int i = 0; i < 200 && s.Fold().lifecycle == Lifecycle::kSleeping; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(s.Fold().lifecycle, Lifecycle::kTainted);
  EXPECT_EQ(s.Fold().taint->cause, Cause::kEngineReplaced);
  EXPECT_EQ(s.Proxied(), 503);
}

// A retry of an ended update answers its recorded outcome once its export is gone (the trainer's
// `with` block closed it), before and after a restart (then from the journal); a new id with that
// source is still refused. Catches the source read before the recorded answer was looked up,
// which turned a retry after a lost answer into 400 invalid_source.
TEST(Colocated, ARetryAnswersItsOutcomeOnceItsExportIsGone) {
  Stack s;
  const std::string source = s.Export(1);
  ASSERT_EQ(s.Update("u-1", "rc-1", 1, source)["http"], 200);
  std::filesystem::remove(source.substr(std::string("vllm-ipc:").size()));
  json again = s.Update("u-1", "rc-1", 1, source);
  EXPECT_EQ(again["http"], 200) << again.dump();
  EXPECT_TRUE(again.value("replayed", false)) << again.dump();
  s.Kill();
  s.Open();
  json after_restart = s.Update("u-1", "rc-1", 1, source);
  EXPECT_EQ(after_restart["http"], 200) << after_restart.dump();
  EXPECT_TRUE(after_restart.value("replayed", false)) << after_restart.dump();
  const std::uint64_t head = s.svc->journal().head_seq();
  EXPECT_EQ(s.Update("u-2", "rc-2", 1, source)["http"], 400);
  EXPECT_EQ(s.svc->journal().head_seq(), head);
}

// Proves a re-POST of a sleep that ended, after a restart and while the engine does not answer,
// is answered from the journal (200, its recorded outcome, "replayed") with no call to the engine
// and no record written. Catches the look at the engine before a plan made ahead of the journal's
// idempotency lookup: the retry was refused 409 ("could not be verified") and the engine journaled
// unreachable, though the sleep had committed.
TEST(Colocated, AnEndedSleepReplaysAfterARestartWithoutLookingAtTheEngine) {
  Stack s;
  ASSERT_EQ(s.Sleep("s-1", 1)["http"], 200);
  ASSERT_EQ(s.Wake("w-1")["http"], 200);  // awake: the fold would take s-1, a look is due for it
  s.Kill();
  // The monitor stays quiet: every call the engine gets below is the re-POST's.
  s.Open([](ServeConfig& c) { c.engine_monitor_interval_ms = 60000; });
  ASSERT_EQ(s.Fold().lifecycle, Lifecycle::kReady);
  s.engine->SetEngineDead(true);
  const std::uint64_t head = s.svc->journal().head_seq();
  const std::uint64_t health = s.engine->RouteCount("/health");
  const json again = s.Sleep("s-1", 1);
  EXPECT_EQ(again["http"], 200) << again.dump();
  EXPECT_EQ(again.value("outcome", ""), "committed") << again.dump();
  EXPECT_TRUE(again.value("replayed", false)) << again.dump();
  EXPECT_EQ(s.engine->RouteCount("/health"), health) << "the engine was looked at";
  EXPECT_EQ(s.svc->journal().head_seq(), head);
  EXPECT_EQ(s.Fold().counters.sleeps_requested, 1u);
}

// Each kind of plan has its own ids: a sleep and an update both named "step-7" each replay their
// own outcome. Catches the lookup taking the last end recorded under the id, so a re-POSTed
// sleep that committed answered the refusal of the update that shared its id.
TEST(Colocated, PlansSharingAnIdReplayTheirOwnOutcome) {
  Stack s;
  ASSERT_EQ(s.Sleep("step-7", 1)["http"], 200);
  s.engine->SetRouteFault("/wake_up", {.status = 404, .times = 1});
  json refused = s.Update("step-7", "rc-1", 1);
  ASSERT_EQ(refused["http"], 422) << refused.dump();
  json slept = s.Sleep("step-7", 1);
  EXPECT_EQ(slept["http"], 200) << slept.dump();
  EXPECT_EQ(slept.value("outcome", ""), "committed") << slept.dump();
  EXPECT_TRUE(slept.value("replayed", false)) << slept.dump();
  EXPECT_TRUE(slept.contains("freed_bytes") && slept["freed_bytes"].is_null()) << slept.dump();
  json update = s.Update("step-7", "rc-1", 1);
  EXPECT_EQ(update["http"], 422) << update.dump();
  EXPECT_TRUE(update.value("replayed", false)) << update.dump();
}

// Proves a retry of a sleep and of a wake-up that ended, sent while another plan holds the plan
// slot, answers at once with its recorded outcome (200, "replayed": true), counted as a replay,
// and the same sleep_id with another body is 409 "already used". Catches sleeps and wake-ups
// replayed only once they held the slot: a retry after a lost answer read 409 "'u-1' is running",
// the type it also reads for an id used by another request, and could take its plan for refused.
TEST(Colocated, EndedSleepsAndWakeUpsAnswerRetriesWhileAnotherPlanHoldsTheSlot) {
  Stack s;
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();
  std::atomic<bool> armed{false};
  std::atomic<bool> holding{false};
  std::atomic<bool> answered{false};
  // The next plan keeps the slot until the retries are answered.
  stack::HoldNextPlanSlot(*s.svc, armed, holding, answered);
  ASSERT_TRUE(s.svc->Start().ok());
  ASSERT_EQ(s.Sleep("s-1", 1)["http"], 200);
  ASSERT_EQ(s.Wake("w-1")["http"], 200);
  const std::string source = s.Export(1);
  armed = true;
  json next;
  std::thread next_plan([&] { next = s.Update("u-1", "rc-1", 1, source); });
  for (int i = 0; i < 1000 && !holding.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(holding.load()) << "the update never took the slot";
  const json slept = s.Sleep("s-1", 1);
  const json woken = s.Wake("w-1");
  const json reused = s.Sleep("s-1", 2);
  answered = true;
  next_plan.join();
  EXPECT_EQ(slept["http"], 200) << slept.dump();
  EXPECT_EQ(slept.value("outcome", ""), "committed") << slept.dump();
  EXPECT_TRUE(slept.value("replayed", false)) << slept.dump();
  EXPECT_EQ(woken["http"], 200) << woken.dump();
  EXPECT_EQ(woken.value("outcome", ""), "committed") << woken.dump();
  EXPECT_TRUE(woken.value("replayed", false)) << woken.dump();
  EXPECT_EQ(reused["http"], 409) << reused.dump();
  EXPECT_NE(reused.dump().find("already used for another request"), std::string::npos)
      << reused.dump();
  EXPECT_EQ(next["http"], 200) << next.dump();
  EXPECT_EQ(s.svc->metrics().sleeps_replayed.load(), 1u);
  EXPECT_EQ(s.svc->metrics().wakes_replayed.load(), 1u);
  EXPECT_EQ(s.svc->metrics().sleeps_conflict.load(), 1u);
  EXPECT_EQ(s.Fold().counters.sleeps_requested, 1u);
  EXPECT_EQ(s.Fold().counters.wakes_requested, 1u);
}

// Bad requests change nothing: a level other than 1 or 2, a sleep while asleep, a wake-up while
// awake, a source this transfer does not take; catches a malformed request reaching the engine.
TEST(Colocated, BadRequestsChangeNothing) {
  Stack s;
  const std::uint64_t head = s.svc->journal().head_seq();
  EXPECT_EQ(s.Sleep("s-1", 3)["http"], 400);
  EXPECT_EQ(s.Post("/v1/sleep", {{"sleep_id", "s-1"}})["http"], 400);
  EXPECT_EQ(s.Wake("w-1")["http"], 409);
  EXPECT_EQ(s.Update("u-1", "rc-1", 1, "synthetic:4x64:1")["http"], 400);
  EXPECT_EQ(s.svc->journal().head_seq(), head);
  EXPECT_EQ(s.engine->RouteCount("/sleep"), 0u);
  ASSERT_EQ(s.Sleep("s-2", 1)["http"], 200);
  EXPECT_EQ(s.Sleep("s-3", 1)["http"], 409);
  httplib::Client c = s.client();
  EXPECT_EQ(Answer(c.Post("/v1/wake", json{{"wake_id", "w-2"}}.dump(), "application/json"))["http"],
            401);
}

}  // namespace
}  // namespace rc::service
