// `rolloutcore serve` stopped by SIGTERM while an update runs, as a child process in front of the
// vLLM double on loopback: no new mutation of the engine starts once the shutdown began (an update
// that had not begun its transfer ends refused, its trainer is answered, the engine serves on its
// committed weights), and a transfer already in flight is waited for rather than cut by the grace
// period. What the journal holds afterwards is read back read-only.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "fixtures/vllm_double.h"
#include "journal/journal.h"
#include "tests/service/serve_process.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

#ifdef RC_TEST_ROLLOUTCORE_BIN

namespace fs = std::filesystem;
using nlohmann::json;

// Generous bounds: only a hang comes near them.
constexpr auto kStartMax = std::chrono::seconds(60);
constexpr int kStateWaitMs = 30000;

fs::path FreshDir(const std::string& tag) {
  static int n = 0;
  fs::path d = fs::temp_directory_path() / ("rc-svc-shutdown-" + tag + "-" +
                                            std::to_string(::getpid()) + "-" + std::to_string(n++));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// The double as serve's tests run it (vLLM 0.25.1 with the worker extension), /update_weights
// answering after `update_delay_ms`.
std::unique_ptr<fixtures::VllmDouble> SlowUpdateEngine(int update_delay_ms) {
  fixtures::VllmDoubleOptions o;
  o.worker_extension_cls = effects::kWorkerExtensionClass;
  o.token_delay_ms = 1;
  auto engine = std::make_unique<fixtures::VllmDouble>(o);
  RC_CHECK(engine->Start(0) > 0);
  fixtures::RouteFault slow;
  slow.delay_ms = update_delay_ms;
  engine->SetRouteFault("/update_weights", slow);
  return engine;
}

std::vector<std::string> ServeArgs(const fixtures::VllmDouble& engine, const fs::path& dir,
                                   std::vector<std::string> extra) {
  std::vector<std::string> args = {"--engine-url",
                                   engine.base_url(),
                                   "--journal",
                                   (dir / "journal").string(),
                                   "--port",
                                   "0",
                                   "--initial-source",
                                   stack::kStackSource,
                                   "--initial-run",
                                   "run-a",
                                   "--engine-startup-timeout-ms",
                                   "10000"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

struct Answer {
  int status = 0;  // 0: no answer (the connection ended first)
  json body;
};

Answer PostUpdate(int port, const json& body) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(300, 0);
  auto r = c.Post("/v1/updates", body.dump(), "application/json");
  if (!r) return {};
  return {r->status, json::parse(r->body, nullptr, false)};
}

json Get(int port, const std::string& path) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30, 0);
  auto r = c.Get(path.c_str());
  return r ? json::parse(r->body, nullptr, false) : json();
}

// The string at `pointer` in `j`, or "" when `j` has none there (no answer, not JSON).
std::string Text(const json& j, const std::string& pointer) {
  const json::json_pointer at(pointer);
  if (!j.is_object() || !j.contains(at) || !j.at(at).is_string()) return "";
  return j.at(at).get<std::string>();
}

bool Eventually(const std::function<bool()>& done, int timeout_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

// What the journal the child left holds.
struct Journaled {
  bool clean_close = false;
  State state;
  std::vector<UpdateEnded> ends;
  std::vector<StateChanged> changes;
};

Journaled ReadJournal(const fs::path& path) {
  journal::Options o;
  o.read_only = true;
  auto opened = journal::Journal::Open(path.string(), o);
  EXPECT_TRUE(opened.ok()) << opened.status().ToString();
  Journaled out;
  if (!opened.ok()) return out;
  journal::Journal& j = **opened;
  out.clean_close = j.recovery().clean_close;
  out.state = j.state();
  EXPECT_TRUE(j.Scan(1, 0, [&](const journal::Record& r) {
                 if (const auto* e = std::get_if<UpdateEnded>(&r.event)) out.ends.push_back(*e);
                 if (const auto* c = std::get_if<StateChanged>(&r.event)) out.changes.push_back(*c);
                 return Status::OK();
               }).ok());
  return out;
}

bool Tainted(const Journaled& j) {
  for (const StateChanged& c : j.changes) {
    if (c.to == Lifecycle::kTainted) return true;
  }
  return false;
}

// Proves that an update still draining when SIGTERM comes never starts its transfer: it gives up
// at once on the explicit rollout it waits for and ends refused (journaled), its trainer is
// answered 503 shutting_down with that outcome, the engine is resumed on its committed weights
// and serve exits 0 with a clean journal, the rollout still active in it (no client ended it).
// Catches the reported failure: the transfer started ~300 ms after the signal, serve exited 3
// mid-transfer at the grace deadline, the trainer got no answer, and the restart recorded UPDATING
// -> TAINTED (recovered_ambiguous).
TEST(ServeShutdown, AnUpdateNotYetTransferringEndsRefusedAndItsTrainerIsAnswered) {
  const fs::path dir = FreshDir("refused");
  // The transfer, were it to start, would still run at the grace deadline.
  auto engine = SlowUpdateEngine(30000);
  stack::ServeChild serve(RC_TEST_ROLLOUTCORE_BIN,
                          ServeArgs(*engine, dir, {"--shutdown-grace-ms", "10000"}),
                          dir / "serve.log");
  const int port = serve.WaitListening(kStartMax);
  ASSERT_GT(port, 0) << serve.Output();
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60, 0);
  auto admitted = c.Post("/v1/rollouts", R"({"lease_ms": 60000})", "application/json");
  ASSERT_TRUE(admitted && admitted->status == 201) << (admitted ? admitted->body : "no answer");
  const std::string rollout = json::parse(admitted->body)["rollout_id"].get<std::string>();

  Answer update;
  std::thread trainer(
      [&] { update = PostUpdate(port, stack::UpdateBody("u1", "rc-1", 1, "run-a")); });
  ASSERT_TRUE(Eventually([&] { return Text(Get(port, "/v1/state"), "/lifecycle") == "DRAINING"; },
                         kStateWaitMs));
  serve.Signal(SIGTERM);
  ASSERT_TRUE(Eventually([&] { return Text(Get(port, "/readyz"), "/reason") == "shutting down"; },
                         kStateWaitMs));
  trainer.join();  // answered without the rollout ending: the drain gave up on it
  const int exit_code = serve.Wait(std::chrono::seconds(120));

  EXPECT_EQ(update.status, 503) << update.body.dump();
  EXPECT_EQ(Text(update.body, "/error/type"), "shutting_down") << update.body.dump();
  EXPECT_EQ(Text(update.body, "/outcome"), "refused") << update.body.dump();
  EXPECT_NE(Text(update.body, "/reason").find("shutting down"), std::string::npos)
      << update.body.dump();
  EXPECT_EQ(exit_code, 0) << serve.Output();
  EXPECT_EQ(engine->RouteCount("/start_weight_update"), 0u);
  EXPECT_EQ(engine->RouteCount("/update_weights"), 0u);
  EXPECT_FALSE(engine->StateJson().value("is_paused", true)) << "the engine was not resumed";

  const Journaled j = ReadJournal(dir / "journal");
  EXPECT_TRUE(j.clean_close);
  EXPECT_FALSE(Tainted(j));
  EXPECT_EQ(j.state.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(j.state.committed.label, "rc-0");
  EXPECT_EQ(j.state.active.count(rollout), 1u);
  ASSERT_EQ(j.ends.size(), 1u);
  EXPECT_EQ(j.ends[0].update_id, "u1");
  EXPECT_EQ(j.ends[0].outcome, UpdateOutcome::kRefused);
  engine->Stop();
  fs::remove_all(dir);
}

// Proves that a transfer already in flight when SIGTERM comes is waited for up to its own deadline,
// past the grace period and past the process's own exit bound for the rest of the shutdown: the
// update commits, its trainer is answered 200, serve exits 0 with a clean journal. Catches serve
// exiting 3 at the grace deadline (or at its exit bound) with the transfer half done, which the
// restart records TAINTED, and the trainer left without an answer.
TEST(ServeShutdown, ATransferInFlightIsWaitedForPastTheGrace) {
  const fs::path dir = FreshDir("in-flight");
  // Longer than the grace period plus the exit bound of the rest (10 s settle, twice the commit
  // stall bound, the trajectory drain's 5 s): 19.5 s with these flags.
  auto engine = SlowUpdateEngine(22000);
  stack::ServeChild serve(
      RC_TEST_ROLLOUTCORE_BIN,
      ServeArgs(*engine, dir,
                {"--shutdown-grace-ms", "500", "--journal-commit-stall-timeout-ms", "2000"}),
      dir / "serve.log");
  const int port = serve.WaitListening(kStartMax);
  ASSERT_GT(port, 0) << serve.Output();

  Answer update;
  std::thread trainer(
      [&] { update = PostUpdate(port, stack::UpdateBody("u1", "rc-1", 1, "run-a")); });
  ASSERT_TRUE(Eventually([&] { return engine->RouteCount("/update_weights") > 0; }, kStateWaitMs));
  serve.Signal(SIGTERM);
  trainer.join();
  const int exit_code = serve.Wait(std::chrono::seconds(180));

  EXPECT_EQ(update.status, 200) << update.body.dump();
  EXPECT_EQ(Text(update.body, "/outcome"), "committed") << update.body.dump();
  EXPECT_EQ(exit_code, 0) << serve.Output();
  EXPECT_EQ(engine->weight_label(), "rc-1");
  const Journaled j = ReadJournal(dir / "journal");
  EXPECT_TRUE(j.clean_close);
  EXPECT_FALSE(Tainted(j));
  EXPECT_EQ(j.state.lifecycle, Lifecycle::kReady);
  EXPECT_EQ(j.state.committed.label, "rc-1");
  engine->Stop();
  fs::remove_all(dir);
}

#endif  // RC_TEST_ROLLOUTCORE_BIN

}  // namespace
}  // namespace rc::service
