// `serve` in front of a fleet, over real loopback HTTP: N vLLM doubles, one RocksDB journal, the
// Service with `engines` configured. The proxy spreads rollouts over the engines that admit and
// names each rollout's engine; the trainer API updates the fleet in both modes; an engine that
// fails is quarantined and gets no traffic; a removed engine gets none; a restart recovers the
// fleet; and every answer agrees with the journal (history checker, replay).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "replay/replay.h"
#include "service/http_util.h"
#include "statemachine/fleet_history.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using nlohmann::json;
using stack::kStackSource;

std::string Name(int i) { return "e" + std::to_string(i); }

// N doubles on loopback and a fleet `serve` in front of them; `engine_tweak` sets engine i's
// options last (its workers, say).
class FleetStack {
 public:
  explicit FleetStack(
      int n, std::function<void(ServeConfig&)> tweak = nullptr, int token_delay_ms = 1,
      const std::function<void(int, fixtures::VllmDoubleOptions&)>& engine_tweak = nullptr)
      : tweak_(std::move(tweak)) {
    static int k = 0;
    dir = std::filesystem::temp_directory_path() /
          ("rc-fleet-serve-" + std::to_string(::getpid()) + "-" + std::to_string(k++));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    for (int i = 0; i < n; ++i) {
      fixtures::VllmDoubleOptions o;
      o.worker_extension_cls = effects::kWorkerExtensionClass;
      o.token_delay_ms = token_delay_ms;
      if (engine_tweak) engine_tweak(i, o);
      engines.push_back(std::make_unique<fixtures::VllmDouble>(o));
      RC_CHECK(engines.back()->Start(0) > 0);
    }
    Open();
  }
  ~FleetStack() {
    if (svc && !svc->failed()) (void)svc->Shutdown(5000);
    svc.reset();
    for (auto& e : engines) e->Stop();
    std::filesystem::remove_all(dir);
  }

  ServeConfig Config() const {
    ServeConfig c;
    for (std::size_t i = 0; i < engines.size(); ++i) {
      c.engines.push_back({Name(static_cast<int>(i)), engines[i]->base_url()});
    }
    c.journal_path = (dir / "journal").string();
    c.listen_port = 0;
    c.initial_source = kStackSource;
    c.initial_checkpoint = "ckpt-0";
    c.initial_run = "run-a";
    c.initial_step = 0;
    c.engine_startup_timeout_ms = 10000;
    c.fleet_blocked_timeout_ms = 2000;
    if (tweak_) tweak_(c);
    return c;
  }

  void Open() {
    auto opened = Service::Open(Config());
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    svc = std::move(opened.value());
    ASSERT_TRUE(svc->Start().ok());
  }

  // Stops serve if it runs, and starts it again on `c`: the same journal and engines.
  void Reopen(const ServeConfig& c) {
    if (svc) {
      ASSERT_TRUE(svc->Shutdown(5000));
      svc.reset();
    }
    auto opened = Service::Open(c);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    svc = std::move(opened.value());
    ASSERT_TRUE(svc->Start().ok());
  }
  // The configuration with engine i marked retiring.
  ServeConfig Retiring(std::size_t i) const {
    ServeConfig c = Config();
    c.engines[i].retire = true;
    return c;
  }

  // Engine i's process restarts on its port: initial label, a new instance.
  bool RestartEngine(std::size_t i) {
    const int port = engines[i]->port();
    fixtures::VllmDoubleOptions o;
    o.worker_extension_cls = effects::kWorkerExtensionClass;
    engines[i]->Stop();
    engines[i] = std::make_unique<fixtures::VllmDouble>(o);
    return engines[i]->Start(port) == port;
  }

  httplib::Client client() const {
    httplib::Client c("127.0.0.1", svc->port());
    c.set_read_timeout(60, 0);
    return c;
  }

  // A proxied completion; the engine and generation it was bound to, from the headers.
  struct Answer {
    int status = 0;
    std::string engine;
    std::string label;
    std::string rollout_id;
    std::string fleet_generation;
  };
  Answer Complete(int max_tokens = 2, const std::string& prompt = "hello") const {
    httplib::Client c = client();
    auto r = c.Post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", max_tokens}}.dump(),
                    "application/json");
    if (!r) return {};
    return {r->status, r->get_header_value("X-RolloutCore-Engine"),
            r->get_header_value("X-RolloutCore-Version"),
            r->get_header_value("X-RolloutCore-Rollout-Id"),
            r->get_header_value("X-RolloutCore-Fleet-Generation")};
  }

  httplib::Result FleetUpdate(const std::string& id, const std::string& mode, int step,
                              int batch_max = 1) const {
    json body = stack::UpdateBody(id, "rc-" + std::to_string(step), step, "run-a");
    body["mode"] = mode;
    body["batch_max"] = batch_max;
    return client().Post("/v1/fleet/updates", body.dump(), "application/json");
  }

  json State() const {
    auto r = client().Get("/v1/state");
    RC_CHECK(r && r->status == 200);
    return json::parse(r->body);
  }

  // Every record of the journal, as the fleet history checker and replay read it: each rule of
  // the fleet held (staleness, quarantine, one weight state per rollout), and replay re-derives
  // every decision.
  void CheckJournal() const {
    std::vector<FleetHistoryEntry> history;
    ASSERT_TRUE(svc->journal()
                    .Scan(1, 0,
                          [&](const journal::Record& r) {
                            history.push_back({r.seq, r.cause_seq, r.engine, r.event});
                            return Status::OK();
                          })
                    .ok());
    const FleetHistoryReport h = check_fleet_history(history);
    EXPECT_TRUE(h.ok) << "seq " << h.first_bad_seq << ": " << h.message;
    auto report = replay::Replay(svc->journal(), {});
    ASSERT_TRUE(report.ok());
    EXPECT_TRUE(report->ok) << "seq " << report->first_bad_seq << ": " << report->error;
  }

  // rollout id -> the engine its RolloutAdmitted names in the journal.
  std::map<std::string, std::string> AdmittedEngines() const {
    std::map<std::string, std::string> out;
    EXPECT_TRUE(svc->journal()
                    .Scan(1, 0,
                          [&](const journal::Record& r) {
                            if (const auto* a = std::get_if<RolloutAdmitted>(&r.event)) {
                              out[a->rollout_id] = r.engine;
                            }
                            return Status::OK();
                          })
                    .ok());
    return out;
  }

  std::filesystem::path dir;
  std::vector<std::unique_ptr<fixtures::VllmDouble>> engines;
  std::unique_ptr<Service> svc;

 private:
  std::function<void(ServeConfig&)> tweak_;
};

bool Eventually(const std::function<bool()>& done, int timeout_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

// rollout id -> the engine its trajectory line names (lines without one, or at a fleet
// generation other than 0, map to "?").
std::map<std::string, std::string> TrajectoryEngines(const FleetStack& f) {
  std::map<std::string, std::string> out;
  EXPECT_TRUE(f.svc->DrainTrajectories(10000)) << "the trajectory writer did not drain";
  std::ifstream in(f.dir / "journal.trajectories.jsonl");
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line, nullptr, false);
    if (j.is_discarded()) continue;
    const bool named = j.contains("engine") && j.value("fleet_generation", 1) == 0;
    out[j.value("rollout_id", "")] = named ? j["engine"].get<std::string>() : "?";
  }
  return out;
}

// Runs `n` completions on `threads` client threads; the answers, in no order.
std::vector<FleetStack::Answer> CompleteMany(const FleetStack& f, int n, int threads) {
  std::vector<FleetStack::Answer> out(static_cast<std::size_t>(n));
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int i = next++; i < n; i = next++) out[static_cast<std::size_t>(i)] = f.Complete();
    });
  }
  for (auto& t : pool) t.join();
  return out;
}

// Proves concurrent proxied rollouts are spread over every engine (least outstanding), each
// answer names the engine the journal admitted it to, and /metrics and /v1/state speak per
// engine; catches a balancer that sends everything to one engine, or a header that names another
// engine than the binding.
TEST(FleetServe, ProxiedRolloutsSpreadAndNameTheirEngine) {
  FleetStack f(3, nullptr, /*token_delay_ms=*/20);
  const std::vector<FleetStack::Answer> answers = CompleteMany(f, 36, 9);
  const std::map<std::string, std::string> journaled = f.AdmittedEngines();
  std::map<std::string, int> per_engine;
  for (const auto& a : answers) {
    ASSERT_EQ(a.status, 200);
    ASSERT_EQ(journaled.count(a.rollout_id), 1u) << a.rollout_id;
    EXPECT_EQ(journaled.at(a.rollout_id), a.engine) << a.rollout_id;
    EXPECT_EQ(a.label, "rc-0");
    EXPECT_EQ(a.fleet_generation, "0");
    per_engine[a.engine]++;
  }
  EXPECT_EQ(per_engine.size(), 3u) << "every engine took some of the 9 concurrent clients";
  const json s = f.State();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s["engines"][Name(i)]["lifecycle"], "READY");
    EXPECT_EQ(s["engines"][Name(i)]["generation"], 0);
    EXPECT_EQ(s["engines"][Name(i)]["active_rollouts"], 0);
    EXPECT_EQ(s["engines"][Name(i)]["outstanding"], 0) << "every pick's count was released";
  }
  auto m = f.client().Get("/metrics");
  ASSERT_TRUE(m && m->status == 200);
  EXPECT_NE(m->body.find("rolloutcore_fleet_engine_state{engine=\"e1\",state=\"READY\"} 1"),
            std::string::npos);
  EXPECT_NE(m->body.find("rolloutcore_fleet_engine_rollouts_admitted_total{engine=\"e0\"} " +
                         std::to_string(per_engine["e0"])),
            std::string::npos);
  // Each trajectory line names the engine (and fleet generation) its rollout was bound to.
  const std::map<std::string, std::string> admitted = f.AdmittedEngines();
  std::map<std::string, std::string> lines;
  EXPECT_TRUE(Eventually(
      [&] {
        lines = TrajectoryEngines(f);
        return lines.size() >= admitted.size();
      },
      5000));
  EXPECT_EQ(lines, admitted);
  f.CheckJournal();
}

// Proves prefix affinity: with fleet_affinity_prefix_bytes, one prompt prefix always meets the same
// engine while distinct prefixes spread over the fleet, and without it sequential requests all go
// to the least busy (the first) engine; catches an affinity setting that is ignored, or a key
// taken from bytes beyond the prefix.
TEST(FleetServe, PrefixAffinityKeepsAPrefixOnOneEngine) {
  FleetStack affine(3, [](ServeConfig& c) { c.fleet_affinity_prefix_bytes = 16; });
  std::set<std::string> same, spread;
  for (int i = 0; i < 8; ++i) {
    // The same first 16 bytes, different tails: one engine.
    same.insert(affine.Complete(2, "a shared prefix!" + std::to_string(i)).engine);
    spread.insert(affine.Complete(2, "prompt number " + std::to_string(i) + " xxxxxxxx").engine);
  }
  EXPECT_EQ(same.size(), 1u);
  EXPECT_GT(spread.size(), 1u) << "8 distinct prefixes all hashed to one engine";
  // A chat whose first message fills the prefix meets one engine, whatever follows it.
  std::set<std::string> chats;
  for (int i = 0; i < 6; ++i) {
    const json body = {
        {"max_tokens", 2},
        {"messages",
         {{{"role", "system"}, {"content", "one long system prompt"}},
          {{"role", "user"}, {"content", std::string(200, 'q') + std::to_string(i)}}}}};
    auto r = affine.client().Post("/v1/chat/completions", body.dump(), "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    chats.insert(r->get_header_value("X-RolloutCore-Engine"));
  }
  EXPECT_EQ(chats.size(), 1u);
  FleetStack by_load(3);
  std::set<std::string> engines;
  for (int i = 0; i < 8; ++i) {
    engines.insert(by_load.Complete(2, "prompt number " + std::to_string(i)).engine);
  }
  EXPECT_EQ(engines, std::set<std::string>{"e0"}) << "one at a time: the least busy, e0";
}

// Proves an `all` update through the trainer API moves every engine to the new label (each
// double reports it), answers committed with every engine's state, and new rollouts are bound to
// the new generation on every engine; catches an update that leaves an engine behind, or a
// binding that still names the old label.
TEST(FleetServe, AnAllUpdateCommitsEveryEngineAndBindsNewRollouts) {
  FleetStack f(3);
  auto r = f.FleetUpdate("u1", "all", 1);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json end = json::parse(r->body);
  EXPECT_EQ(end["outcome"], "committed");
  EXPECT_EQ(end["committed"], 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(f.engines[static_cast<std::size_t>(i)]->weight_label(), "rc-1") << Name(i);
    EXPECT_EQ(end["engines"][Name(i)]["generation"], 1);
  }
  for (const auto& a : CompleteMany(f, 9, 3)) {
    EXPECT_EQ(a.status, 200);
    EXPECT_EQ(a.label, "rc-1");
    EXPECT_EQ(a.fleet_generation, "1");
  }
  auto again = f.FleetUpdate("u1", "all", 1);  // idempotent: the recorded end
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200) << again->body;
  auto other = f.FleetUpdate("u1", "all", 2);  // the same id for another request
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 409) << other->body;
  f.CheckJournal();
}

// Proves a rolling update under live traffic keeps serving: every request is answered 200 while
// engines update one at a time, with staleness 0 no rollout starts on the old generation once the
// first engine committed the new one (the history checker's rule), and each rollout has one
// weight state; catches a rolling update that stops the proxy, or admissions past the bound.
TEST(FleetServe, RollingUpdateUnderLiveTrafficKeepsServing) {
  // A short admission wait: a drain of every engine at once would answer 503 here.
  FleetStack f(
      3,
      [](ServeConfig& c) {
        c.fleet_min_serving = 2;
        c.admit_wait_ms = 300;
      },
      /*token_delay_ms=*/5);
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, bad{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&] {
      while (!stop.load()) (f.Complete().status == 200 ? ok : bad)++;
    });
  }
  auto r = f.FleetUpdate("roll-1", "rolling", 1);
  stop = true;
  for (auto& t : clients) t.join();
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["committed"], 3);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(bad.load(), 0);
  for (const auto& e : f.engines) EXPECT_EQ(e->weight_label(), "rc-1");
  f.CheckJournal();
}

// Proves an engine whose transfer is lost ambiguously is TAINTED alone: the update answers 207
// partial, /v1/state names the taint, /readyz stays ready, and no later rollout is routed to the
// quarantined engine; catches a failure that is hidden, spreads, or keeps receiving traffic.
TEST(FleetServe, ATaintedEngineIsQuarantinedFromTheProxy) {
  FleetStack f(3);
  fixtures::RouteFault fault;
  fault.drop_connection = true;
  fault.after = true;
  f.engines[1]->SetRouteFault("/update_weights", fault);
  auto r = f.FleetUpdate("u1", "all", 1);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 207) << r->body;
  const json end = json::parse(r->body);
  EXPECT_EQ(end["outcome"], "partial");
  EXPECT_EQ(end["tainted"], 1);
  const json s = f.State();
  EXPECT_EQ(s["engines"]["e1"]["lifecycle"], "TAINTED");
  EXPECT_TRUE(s["engines"]["e1"].contains("taint"));
  EXPECT_EQ(s["engines"]["e1"]["admitting"], false);
  auto ready = f.client().Get("/readyz");
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 200) << ready->body;
  for (const auto& a : CompleteMany(f, 12, 4)) {
    EXPECT_EQ(a.status, 200);
    EXPECT_NE(a.engine, "e1");
    EXPECT_EQ(a.label, "rc-1");
  }
  f.CheckJournal();
}

// The expected_digest of each BootstrapRequested the journal holds for `engine`, in order.
std::vector<std::string> BootstrapDigests(const FleetStack& f, const std::string& engine) {
  std::vector<std::string> out;
  EXPECT_TRUE(f.svc->journal()
                  .Scan(1, 0,
                        [&](const journal::Record& r) {
                          const auto* b = std::get_if<BootstrapRequested>(&r.event);
                          if (b != nullptr && r.engine == engine) out.push_back(b->expected_digest);
                          return Status::OK();
                        })
                  .ok());
  if (out.empty()) out.emplace_back("(no bootstrap)");
  return out;
}

// Stops engine i's process and waits (2 s at most) until the fleet admits nothing to it.
bool KillAndAwaitUnrouted(FleetStack& f, std::size_t i) {
  f.engines[i]->Stop();
  const std::string name = Name(static_cast<int>(i));
  return Eventually([&] { return f.State()["engines"][name]["admitting"] == false; }, 2000);
}

// Proves the engine monitor watches every member: a member whose process is replaced behind the
// fleet's back (an update committed, then a restart back to its initial weights) is TAINTED alone
// within seconds and gets no rollout, while the others keep serving the committed generation;
// catches a fleet whose restarted engine serves old weights under the new generation's binding.
TEST(FleetServe, AMemberRestartedBehindTheFleetsBackIsTaintedAlone) {
  FleetStack f(3, [](ServeConfig& c) { c.engine_monitor_interval_ms = 20; });
  ASSERT_EQ(f.FleetUpdate("u1", "all", 1)->status, 200);
  ASSERT_TRUE(f.RestartEngine(2));
  ASSERT_TRUE(
      Eventually([&] { return f.State()["engines"]["e2"]["lifecycle"] == "TAINTED"; }, 5000))
      << "the replaced engine went unnoticed: " << f.State().dump();
  for (const auto& a : CompleteMany(f, 12, 4)) {
    EXPECT_EQ(a.status, 200);
    EXPECT_NE(a.engine, "e2");
    EXPECT_EQ(a.label, "rc-1");
  }
  EXPECT_EQ(f.State()["engines"]["e0"]["lifecycle"], "READY");
  f.CheckJournal();
}

// Proves a member that stops answering is seen unreachable within 2 s and the proxy stops routing
// to it, while the others serve; catches a proxy that keeps sending rollouts to a dead engine.
TEST(FleetServe, ADeadMemberGetsNoTraffic) {
  FleetStack f(3, [](ServeConfig& c) { c.engine_monitor_interval_ms = 20; });
  ASSERT_TRUE(KillAndAwaitUnrouted(f, 0)) << f.State().dump();
  for (const auto& a : CompleteMany(f, 12, 4)) {
    EXPECT_EQ(a.status, 200);
    EXPECT_NE(a.engine, "e0");
  }
  f.CheckJournal();
}

// The value of the series `name` (with its labels) in /metrics, or -1 when it is missing.
long long MetricValue(FleetStack& f, const std::string& name) {
  auto m = f.client().Get("/metrics");
  if (!m || m->status != 200) return -1;
  const std::string head = "\n" + name + " ";
  const std::size_t at = m->body.find(head);
  if (at == std::string::npos) return -1;
  return std::stoll(m->body.substr(at + head.size()));
}

// Proves a removed engine receives no rollout afterwards and leaves the fleet, while the others
// keep serving, and its rollouts stay in the fleet's totals; catches a removal the balancer does
// not see, or exported counters that fall when an engine leaves.
TEST(FleetServe, ARemovedEngineGetsNoTrafficAndLeaves) {
  FleetStack f(3, nullptr, /*token_delay_ms=*/20);
  std::size_t on_e2 = 0;
  for (const auto& a : CompleteMany(f, 36, 9)) {
    ASSERT_EQ(a.status, 200);
    on_e2 += a.engine == "e2" ? 1 : 0;
  }
  ASSERT_GT(on_e2, 0u) << "e2 took some of the 9 concurrent clients";
  const std::string kCompleted = "rolloutcore_rollouts_finished_total{outcome=\"completed\"}";
  EXPECT_EQ(MetricValue(f, "rolloutcore_rollouts_admitted_total"), 36);
  EXPECT_EQ(MetricValue(f, kCompleted), 36);
  auto r = f.client().Delete("/v1/fleet/engines/e2");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 202) << r->body;
  EXPECT_FALSE(f.State()["engines"].contains("e2")) << "idle: removed at once";
  EXPECT_EQ(MetricValue(f, "rolloutcore_rollouts_admitted_total"), 36) << "never falls";
  EXPECT_EQ(MetricValue(f, kCompleted), 36);
  for (const auto& a : CompleteMany(f, 12, 4)) {
    EXPECT_EQ(a.status, 200);
    EXPECT_NE(a.engine, "e2");
  }
  EXPECT_EQ(MetricValue(f, "rolloutcore_rollouts_admitted_total"), 48);
  auto unknown = f.client().Delete("/v1/fleet/engines/nope");
  ASSERT_TRUE(unknown);
  EXPECT_GE(unknown->status, 400);
  EXPECT_LT(unknown->status, 500);
  f.CheckJournal();
}

// Proves a third retry of a fleet update, sent while a second retry has just taken the slot the
// first call gave back but not yet named it, waits for that slot too and answers the recorded end
// (a fleet update's end is read back by its runner, only once it holds the slot). Catches the
// slot held with no name between a waiter's lock and its naming: the third retry answered 409
// "another plan is running" by its own plan.
TEST(FleetServe, ARetryFindsTheSlotNamedWhileAnEarlierRetryTakesIt) {
  FleetStack f(1);
  ASSERT_TRUE(f.svc->Shutdown(5000));
  f.svc.reset();
  auto opened = Service::Open(f.Config());
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  f.svc = std::move(opened.value());
  std::atomic<int> taken{0};
  std::atomic<bool> second_waits{false};
  std::atomic<bool> in_gap{false};
  std::atomic<bool> third_came{false};  // the third call waits for the slot, or was answered
  f.svc->set_step_probe([&](const char* step) {
    const std::string name(step);
    if (name == "plan slot taken" && ++taken == 1) {  // the first call holds the slot until
      for (int i = 0; i < 1000 && !second_waits.load(); ++i) {  // its retry waits (10 s at most)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } else if (name == "plan slot wait") {
      if (in_gap.load()) third_came = true;
      second_waits = true;
    } else if (name == "plan slot waited for" && !in_gap.exchange(true)) {
      for (int i = 0; i < 1000 && !third_came.load(); ++i) {  // 10 s at most: never a hang
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  });
  ASSERT_TRUE(f.svc->Start().ok());
  auto post = [&] {
    auto r = f.FleetUpdate("u1", "all", 1);
    return r ? std::make_pair(r->status, r->body) : std::make_pair(0, std::string("no answer"));
  };
  std::pair<int, std::string> first, second;
  std::thread first_call([&] { first = post(); });
  ASSERT_TRUE(Eventually([&] { return taken.load() == 1; }, 10000));
  std::thread second_call([&] { second = post(); });
  ASSERT_TRUE(Eventually([&] { return in_gap.load(); }, 20000));
  const std::pair<int, std::string> third = post();
  third_came = true;
  first_call.join();
  second_call.join();
  for (const auto& answer : {first, second, third}) {
    EXPECT_EQ(answer.first, 200) << answer.second;
  }
  f.CheckJournal();
}

// Proves a removal retried while the engine still leaves (a rollout in flight on it) is answered
// 202 again, with "already": true, and the engine leaves once idle. Catches the retry of a DELETE
// whose 202 was lost answered 409 "is leaving", which a trainer reads as a refused removal.
TEST(FleetServe, ARetriedRemovalOfALeavingEngineIsAcknowledgedAgain) {
  FleetStack f(2);
  fixtures::RouteFault hang;
  hang.hang = true;  // the rollout stays on its engine until the faults are cleared
  for (auto& e : f.engines) e->SetRouteFault("/v1/completions", hang);
  FleetStack::Answer answer;
  std::thread client([&] { answer = f.Complete(); });
  std::string busy;
  ASSERT_TRUE(Eventually(
      [&] {
        const json state = f.State();  // kept: items() holds a reference into it
        for (const auto& [name, e] : state["engines"].items()) {
          if (e.value("active_rollouts", 0) == 1) busy = name;
        }
        return !busy.empty();
      },
      10000));
  auto first = f.client().Delete(("/v1/fleet/engines/" + busy).c_str());
  auto retry = f.client().Delete(("/v1/fleet/engines/" + busy).c_str());
  const json leaving = f.State()["engines"][busy];
  for (auto& e : f.engines) e->ClearFaults();
  client.join();
  ASSERT_TRUE(first);
  ASSERT_EQ(first->status, 202) << first->body;
  ASSERT_TRUE(retry);
  EXPECT_EQ(retry->status, 202) << retry->body;
  const json again = json::parse(retry->body, nullptr, false);
  EXPECT_EQ(again.value("already", false), true) << retry->body;
  EXPECT_EQ(again.value("leaving", false), true) << retry->body;
  EXPECT_EQ(leaving.value("leaving", false), true) << DumpSafe(leaving);
  EXPECT_EQ(answer.status, 200);
  EXPECT_EQ(answer.engine, busy);
  EXPECT_TRUE(Eventually([&] { return !f.State()["engines"].contains(busy); }, 10000))
      << "the engine did not leave once idle";
  f.CheckJournal();
}

// A fleet update POSTed on a thread of its own and held at a member's drain until Release; its
// answer is read after Release.
struct HeldFleetUpdate {
  explicit HeldFleetUpdate(FleetStack& stack) : f(stack) {}
  HeldFleetUpdate(const HeldFleetUpdate&) = delete;
  HeldFleetUpdate& operator=(const HeldFleetUpdate&) = delete;
  ~HeldFleetUpdate() { Release(); }
  // Every engine's faults cleared, the held drain goes on; returns once the update answered.
  void Release() {
    for (auto& e : f.engines) e->ClearFaults();
    if (thread.joinable()) thread.join();
  }
  FleetStack& f;
  std::thread thread;
  int status = 0;
  std::string body;
};

// Starts a rolling fleet update "u1" to rc-1 whose first member's drain hangs at its /pause (every
// engine's /pause hangs until Release), and returns once that /pause came; nullptr when none came
// within 10 s (the update released and answered).
std::unique_ptr<HeldFleetUpdate> StartHeldFleetUpdate(FleetStack& f) {
  fixtures::RouteFault hang;
  hang.hang = true;
  for (auto& e : f.engines) e->SetRouteFault("/pause", hang);
  auto held = std::make_unique<HeldFleetUpdate>(f);
  held->thread = std::thread([h = held.get()] {
    auto r = h->f.FleetUpdate("u1", "rolling", 1);
    if (r) std::tie(h->status, h->body) = std::make_pair(r->status, r->body);
  });
  const bool paused = Eventually(
      [&f] {
        std::uint64_t pauses = 0;
        for (const auto& e : f.engines) pauses += e->RouteCount("/pause");
        return pauses > 0;
      },
      10000);
  return paused ? std::move(held) : nullptr;
}

// Proves a cancel retried while its fleet update is still open (a member mid-plan) is answered
// 202 again, with "already": true and the reason the first cancel recorded, and the update ends
// with the pending member skipped. Catches the retry of a cancel whose 202 was lost answered 409
// "is cancelled", which a trainer reads as a refused cancel.
TEST(FleetServe, ARetriedCancelIsAcknowledgedAgainWithTheRecordedReason) {
  FleetStack f(2);
  const std::unique_ptr<HeldFleetUpdate> update = StartHeldFleetUpdate(f);
  ASSERT_TRUE(update != nullptr) << "no member's drain sent its /pause";
  auto first = f.client().Post("/v1/fleet/updates/u1/cancel", R"({"reason": "operator stop"})",
                               "application/json");
  auto retry = f.client().Post("/v1/fleet/updates/u1/cancel", R"({"reason": "a second reason"})",
                               "application/json");
  update->Release();
  ASSERT_TRUE(first);
  ASSERT_EQ(first->status, 202) << first->body;
  ASSERT_TRUE(retry);
  EXPECT_EQ(retry->status, 202) << retry->body;
  const json again = json::parse(retry->body, nullptr, false);
  EXPECT_EQ(again.value("already", false), true) << retry->body;
  EXPECT_EQ(again.value("cancelled", false), true) << retry->body;
  EXPECT_EQ(again.value("reason", ""), "operator stop") << retry->body;
  ASSERT_EQ(update->status, 207) << update->body;
  EXPECT_EQ(json::parse(update->body)["skipped"], 1) << update->body;
  EXPECT_FALSE(f.svc->failed());
  f.CheckJournal();
}

// Proves a cancel of a fleet update that already ended (the update finished after a first cancel
// whose answer was lost), whether this serve remembers it or reads it back from the journal after a
// restart, is answered the recorded end, as a re-POST is (207 partial, "replayed": true), while a
// cancel of an id never requested stays 404. Catches such a retry answered 404, which tells a
// trainer no such update exists.
TEST(FleetServe, ACancelRetriedAfterItsUpdateEndedAnswersTheRecordedEnd) {
  FleetStack f(2);
  const std::unique_ptr<HeldFleetUpdate> update = StartHeldFleetUpdate(f);
  ASSERT_TRUE(update != nullptr) << "no member's drain sent its /pause";
  auto first = f.client().Post("/v1/fleet/updates/u1/cancel", R"({"reason": "operator stop"})",
                               "application/json");
  update->Release();
  ASSERT_TRUE(first);
  ASSERT_EQ(first->status, 202) << first->body;
  ASSERT_EQ(update->status, 207) << update->body;
  auto cancel = [&f](const std::string& id) {
    auto r = f.client().Post(("/v1/fleet/updates/" + id + "/cancel").c_str(),
                             R"({"reason": "a retry"})", "application/json");
    return r ? std::make_pair(r->status, r->body) : std::make_pair(0, std::string("no answer"));
  };
  const auto remembered = cancel("u1");
  f.Reopen(f.Config());  // the new process remembers no end: the journal's is read back
  const auto read_back = cancel("u1");
  for (const auto& [status, body] : {remembered, read_back}) {
    EXPECT_EQ(status, 207) << body;
    const json end = json::parse(body, nullptr, false);
    ASSERT_TRUE(end.is_object()) << body;
    EXPECT_EQ(end.value("update_id", ""), "u1") << body;
    EXPECT_EQ(end.value("outcome", ""), "partial") << body;
    EXPECT_EQ(end.value("committed", -1), 1) << body;
    EXPECT_EQ(end.value("skipped", -1), 1) << body;
    EXPECT_EQ(end.value("reason", ""), "cancelled: operator stop") << body;
    EXPECT_EQ(end.value("replayed", false), true) << body;
  }
  EXPECT_EQ(cancel("never-requested").first, 404);
  f.CheckJournal();
}

// Proves a re-POST of a fleet update that ended is answered its recorded end (200, "replayed":
// true) while another fleet update holds the plan slot, and that the same id with another body is
// still 409. Catches the 409 "is running" such a retry got (the slot was asked for before the
// recorded end was looked up), which a trainer whose first answer was lost reads as a refusal.
TEST(FleetServe, AnEndedUpdateIsReplayedWhileAnotherHoldsTheSlot) {
  FleetStack f(2);
  auto first = f.FleetUpdate("u1", "all", 1);
  ASSERT_TRUE(first);
  ASSERT_EQ(first->status, 200) << first->body;
  const std::uint64_t pauses =
      f.engines[0]->RouteCount("/pause") + f.engines[1]->RouteCount("/pause");
  fixtures::RouteFault hang;
  hang.hang = true;  // u2's drains hold it open, and the slot with it, until the faults are cleared
  for (auto& e : f.engines) e->SetRouteFault("/pause", hang);
  int status = 0;
  std::string body;
  std::thread second([&] {
    auto r = f.FleetUpdate("u2", "all", 2);
    if (r) std::tie(status, body) = std::make_pair(r->status, r->body);
  });
  ASSERT_TRUE(Eventually(
      [&] {
        return f.engines[0]->RouteCount("/pause") + f.engines[1]->RouteCount("/pause") > pauses;
      },
      10000));
  auto again = f.FleetUpdate("u1", "all", 1);
  auto other = f.FleetUpdate("u1", "all", 3);  // the same id, another target
  for (auto& e : f.engines) e->ClearFaults();
  second.join();
  ASSERT_TRUE(again);
  EXPECT_EQ(again->status, 200) << again->body;
  const json replayed = json::parse(again->body, nullptr, false);
  EXPECT_EQ(replayed.value("replayed", false), true) << again->body;
  EXPECT_EQ(replayed.value("update_id", ""), "u1") << again->body;
  EXPECT_EQ(replayed.value("outcome", ""), "committed") << again->body;
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 409) << other->body;
  EXPECT_EQ(status, 200) << body;
  f.CheckJournal();
}

// Proves a shutdown during a rolling fleet update starts no transfer: the member draining when it
// began ends refused at the gate (resumed on rc-0), the member not started is skipped by the
// fleet's own cancel, the update is answered 503 shutting_down with its recorded end, and the
// shutdown is clean. Catches the members' transfers started after the shutdown began (the update
// went on to commit, or was cut mid-transfer at the grace deadline and left an engine TAINTED).
TEST(FleetServe, AShutdownStartsNoTransferAndAnswersTheUpdate) {
  FleetStack f(2);
  const std::unique_ptr<HeldFleetUpdate> update = StartHeldFleetUpdate(f);
  ASSERT_TRUE(update != nullptr) << "no member's drain sent its /pause";
  bool clean = false;
  std::thread shutdown([&] { clean = f.svc->Shutdown(30000); });
  ASSERT_TRUE(Eventually(
      [&] {
        auto r = f.client().Get("/readyz");
        return r && json::parse(r->body, nullptr, false).value("reason", "") == "shutting down";
      },
      10000));
  update->Release();
  shutdown.join();
  const std::string& body = update->body;
  EXPECT_EQ(update->status, 503) << body;
  const json end = json::parse(body, nullptr, false);
  ASSERT_TRUE(end.is_object()) << body;
  EXPECT_EQ(end.value("/error/type"_json_pointer, ""), "shutting_down") << body;
  EXPECT_EQ(end.value("outcome", ""), "refused") << body;
  EXPECT_EQ(end.value("committed", -1), 0) << body;
  EXPECT_EQ(end.value("tainted", -1), 0) << body;
  EXPECT_TRUE(clean);
  for (auto& e : f.engines) {
    EXPECT_EQ(e->RouteCount("/start_weight_update"), 0u);
    EXPECT_EQ(e->RouteCount("/update_weights"), 0u);
    EXPECT_FALSE(e->StateJson().value("is_paused", true)) << "an engine was left paused";
  }
  f.Reopen(f.Config());
  const json state = f.State();
  for (const auto& [name, e] : state["engines"].items()) {
    EXPECT_EQ(e.value("lifecycle", ""), "READY") << name;
    EXPECT_EQ(e["committed"].value("label", ""), "rc-0") << name;
  }
  f.CheckJournal();
}

// Proves a fleet update refused for a reason of its own while serve shuts down (min_healthy above
// the fleet's two engines, requested just before the MutationGate closed and journaled after) keeps
// its own answer, 422 refused naming that reason, rather than 503 shutting_down. Catches every
// refusal answered 503 shutting_down once the gate closed, which tells the trainer to send the same
// request again once serve is back, to be refused again.
TEST(FleetServe, AnUpdateRefusedForItsOwnReasonAtShutdownKeepsItsAnswer) {
  FleetStack f(2);
  ASSERT_TRUE(f.svc->Shutdown(5000));
  f.svc.reset();
  auto opened = Service::Open(f.Config());
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  f.svc = std::move(opened.value());
  std::atomic<bool> taken{false};
  std::atomic<bool> release{false};
  f.svc->set_step_probe([&](const char* step) {
    if (std::string(step) != "plan slot taken" || taken.exchange(true)) return;
    for (int i = 0; i < 1000 && !release.load(); ++i) {  // 10 s at most: never a hang
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  ASSERT_TRUE(f.svc->Start().ok());
  json request = stack::UpdateBody("u1", "rc-1", 1, "run-a");
  request["mode"] = "all";
  request["min_healthy"] = 3;
  int status = 0;
  std::string body;
  std::thread update([&] {
    auto r = f.client().Post("/v1/fleet/updates", request.dump(), "application/json");
    if (r) std::tie(status, body) = std::make_pair(r->status, r->body);
  });
  const bool held = Eventually([&] { return taken.load(); }, 10000);
  bool clean = false;
  std::thread shutdown([&] { clean = f.svc->Shutdown(30000); });
  const bool gate_closed =
      held &&
      Eventually(
          [&] {
            auto r = f.client().Get("/readyz");
            return r && json::parse(r->body, nullptr, false).value("reason", "") == "shutting down";
          },
          10000);
  release = true;
  update.join();
  shutdown.join();
  ASSERT_TRUE(held) << "the update never took the plan slot";
  ASSERT_TRUE(gate_closed) << "serve never said it was shutting down";
  EXPECT_EQ(status, 422) << body;
  const json end = json::parse(body, nullptr, false);
  ASSERT_TRUE(end.is_object()) << body;
  EXPECT_FALSE(end.contains("error")) << body;
  EXPECT_EQ(end.value("outcome", ""), "refused") << body;
  EXPECT_NE(end.value("reason", "").find("min_healthy is 3"), std::string::npos) << body;
  EXPECT_EQ(end.value("replayed", true), false) << body;
  EXPECT_TRUE(clean);
  f.Reopen(f.Config());
  f.CheckJournal();
}

// Proves a restart of serve on its fleet journal recovers every engine at its committed label
// without a second bootstrap, and serves again; catches a restart that re-joins or re-bootstraps
// engines, or forgets the fleet's generation.
TEST(FleetServe, ARestartRecoversTheFleet) {
  auto f = std::make_unique<FleetStack>(2);
  ASSERT_EQ(f->FleetUpdate("u1", "all", 1)->status, 200);
  const std::uint64_t head = f->svc->journal().head_seq();
  ASSERT_TRUE(f->svc->Shutdown(5000));
  f->svc.reset();
  f->Open();
  ASSERT_NE(f->svc, nullptr);
  const json s = f->State();
  EXPECT_EQ(s["engines"]["e0"]["committed"]["label"], "rc-1");
  EXPECT_EQ(s["engines"]["e1"]["generation"], 1);
  EXPECT_GT(f->svc->journal().head_seq(), head);  // the runners' recovery records
  EXPECT_EQ(f->Complete().label, "rc-1");
  f->CheckJournal();
}

// Proves a fleet journal whose engine the configuration leaves out is refused at start (its
// rollouts would never be recovered and the fleet's rules would still count it), a removed engine
// that is still configured joins again at the next start, held to a member's weight digest, and
// an engine that reports the fleet's newest label over other weights does not join (it retires
// instead); catches a restart that silently orphans an engine, or a join verified by label only.
TEST(FleetServe, TheConfigurationDecidesMembershipAtStart) {
  auto f = std::make_unique<FleetStack>(3);
  ASSERT_TRUE(f->svc->Shutdown(5000));
  f->svc.reset();
  ServeConfig two = f->Config();
  two.engines.pop_back();
  auto refused = Service::Open(two);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("e2"), std::string::npos)
      << refused.status().ToString();

  f->Open();
  ASSERT_EQ(f->client().Delete("/v1/fleet/engines/e2")->status, 202);
  EXPECT_FALSE(f->State()["engines"].contains("e2"));
  ASSERT_TRUE(f->svc->Shutdown(5000));
  f->svc.reset();
  f->Open();  // e2 is configured: it joins again, and must hold e0's weights at rc-0
  EXPECT_EQ(f->State()["engines"]["e2"]["lifecycle"], "READY");
  EXPECT_FALSE(BootstrapDigests(*f, "e2").back().empty()) << "the rejoin was not held to a digest";

  ASSERT_EQ(f->client().Delete("/v1/fleet/engines/e2")->status, 202);
  ASSERT_EQ(f->FleetUpdate("u1", "all", 1)->status, 200);  // e0 and e1 only
  ASSERT_EQ(f->engines[2]->weight_label(), "rc-0") << "e2 left before u1";
  ASSERT_TRUE(f->svc->Shutdown(5000));
  f->svc.reset();
  ServeConfig adopt = f->Config();
  adopt.adopt_engine = true;  // e2's double still holds rc-0's weights; the fleet serves rc-1
  auto relabelled = Service::Open(adopt);
  ASSERT_FALSE(relabelled.ok()) << "an engine holding rc-0's weights joined as rc-1";
  EXPECT_NE(relabelled.status().message().find("digest"), std::string::npos)
      << relabelled.status().ToString();

  adopt.engines[2].retire = true;  // the operator drops it instead
  auto reopened = Service::Open(adopt);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  f->svc = std::move(reopened.value());
  ASSERT_TRUE(f->svc->Start().ok());
  EXPECT_FALSE(f->State()["engines"].contains("e2"));
  EXPECT_EQ(f->Complete().label, "rc-1");
  f->CheckJournal();
}

// Proves an engine joining a fleet is held to the digest of a member of its layout: one with other
// weights under the same tensor names is refused (serve does not start, and says why), one with
// the members' weights joins, and one of another layout (two workers) joins on its label alone;
// catches a replica serving other weights under the fleet's binding.
TEST(FleetServe, AJoiningEngineMustHoldAMembersWeights) {
  auto f = std::make_unique<FleetStack>(1);
  ASSERT_TRUE(f->svc->Shutdown(5000));
  f->svc.reset();
  fixtures::VllmDoubleOptions other;
  other.worker_extension_cls = effects::kWorkerExtensionClass;
  other.model_name = "another-model";  // same tensor names, other values
  f->engines.push_back(std::make_unique<fixtures::VllmDouble>(other));
  ASSERT_GT(f->engines.back()->Start(0), 0);
  auto refused = Service::Open(f->Config());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("is not the expected"), std::string::npos)
      << refused.status().ToString();

  fixtures::VllmDoubleOptions same;
  same.worker_extension_cls = effects::kWorkerExtensionClass;
  f->engines.back()->Stop();
  f->engines.back() = std::make_unique<fixtures::VllmDouble>(same);
  ASSERT_GT(f->engines.back()->Start(0), 0);
  fixtures::VllmDoubleOptions two_workers = same;
  two_workers.world_size = 2;
  f->engines.push_back(std::make_unique<fixtures::VllmDouble>(two_workers));
  ASSERT_GT(f->engines.back()->Start(0), 0);
  f->Open();
  const json s = f->State();
  EXPECT_EQ(s["engines"]["e1"]["lifecycle"], "READY");
  EXPECT_EQ(s["engines"]["e2"]["lifecycle"], "READY");
  std::string e0_digest;  // what e0's bootstrap probe read
  ASSERT_TRUE(f->svc->journal()
                  .Scan(1, 0,
                        [&](const journal::Record& r) {
                          const auto* p = std::get_if<EngineProbed>(&r.event);
                          if (p != nullptr && r.engine == "e0" && e0_digest.empty()) {
                            e0_digest = p->digest.combined;
                          }
                          return Status::OK();
                        })
                  .ok());
  ASSERT_FALSE(e0_digest.empty());
  EXPECT_EQ(BootstrapDigests(*f, "e1").back(), e0_digest);
  EXPECT_EQ(BootstrapDigests(*f, "e2").back(), "") << "another layout has no member to match";
  f->CheckJournal();
}

// What a fleet update's members were held to and what they published, by engine, as the journal
// holds it: each member's UpdateRequested expected digest and each VersionPublished engine digest.
struct MemberDigests {
  std::map<std::string, std::string> held;
  std::map<std::string, std::string> published;
};
MemberDigests MemberDigestsOf(const FleetStack& f, const std::string& update_id) {
  MemberDigests out;
  EXPECT_TRUE(f.svc->journal()
                  .Scan(1, 0,
                        [&](const journal::Record& r) {
                          if (const auto* u = std::get_if<UpdateRequested>(&r.event);
                              u != nullptr && u->update_id == update_id) {
                            out.held[r.engine] = u->expected_digest;
                          }
                          if (const auto* p = std::get_if<VersionPublished>(&r.event);
                              p != nullptr && p->update_id == update_id) {
                            out.published[r.engine] = p->engine_digest;
                          }
                          return Status::OK();
                        })
                  .ok());
  return out;
}

// Proves that in a fleet update naming no expected digest, in either mode, a member whose engine
// ends up with other bytes than a member of its layout published for the label (its transfer
// landed half the tensors) is held to that member's digest, goes TAINTED and does not publish the
// label, while the other commits; catches members of one layout each validated on their own
// digest, so that rollouts admitted under one label run other weights on each engine.
TEST(FleetServe, AMemberIsHeldToTheDigestItsLayoutPublished) {
  for (const char* mode : {"all", "rolling"}) {
    SCOPED_TRACE(mode);
    FleetStack f(2);
    f.engines[1]->SetWeightsFault(fixtures::WeightsFault::kPartial);
    auto r = f.FleetUpdate("u1", mode, 1);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 207) << r->body;
    const json end = json::parse(r->body);
    EXPECT_EQ(end["committed"], 1);
    EXPECT_EQ(end["tainted"], 1);
    const MemberDigests d = MemberDigestsOf(f, "u1");
    ASSERT_EQ(d.published.count("e0"), 1u);
    EXPECT_EQ(d.published.count("e1"), 0u) << "e1 published rc-1 on other weights";
    EXPECT_EQ(d.held.at("e0"), "") << "the first of the layout has no digest to be held to";
    EXPECT_EQ(d.held.at("e1"), d.published.at("e0"));
    const json e1 = f.State()["engines"]["e1"];
    EXPECT_EQ(e1["lifecycle"], "TAINTED") << DumpSafe(e1);
    EXPECT_EQ(e1["committed"]["label"], "rc-0") << DumpSafe(e1);
    EXPECT_NE(e1["taint"].value("detail", "").find(d.published.at("e0").substr(0, 16)),
              std::string::npos)
        << DumpSafe(e1);
    for (const auto& a : CompleteMany(f, 6, 3)) {
      EXPECT_EQ(a.status, 200);
      EXPECT_EQ(a.engine, "e0");
      EXPECT_EQ(a.label, "rc-1");
    }
    f.CheckJournal();
  }
}

// Proves a fleet of two weight layouts (one worker; two workers, whose digests name each shard)
// still commits an `all` update naming no expected digest: the first member of each layout
// starts without a digest, a second member of the two-worker layout is held to the digest the
// first of its layout published, never to the one-worker engine's; catches a member held to the
// digest of another layout (refused for holding its own shard) or a fleet serialised across
// layouts that never differ.
TEST(FleetServe, AFleetOfTwoLayoutsCommitsEachOnItsOwnDigest) {
  FleetStack f(3, nullptr, 1, [](int i, fixtures::VllmDoubleOptions& o) {
    if (i > 0) o.world_size = 2;
  });
  auto r = f.FleetUpdate("u1", "all", 1);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["committed"], 3);
  const MemberDigests d = MemberDigestsOf(f, "u1");
  ASSERT_EQ(d.published.size(), 3u);
  EXPECT_EQ(d.held.at("e0"), "");
  EXPECT_EQ(d.held.at("e1"), "") << "held to a digest of the other layout";
  EXPECT_EQ(d.held.at("e2"), d.published.at("e1"));
  EXPECT_EQ(d.published.at("e2"), d.published.at("e1"));
  EXPECT_NE(d.published.at("e0"), d.published.at("e1")) << "the layouts' digests do not differ";
  for (const auto& e : f.engines) EXPECT_EQ(e->weight_label(), "rc-1");
  f.CheckJournal();
}

// Adds a fresh one-worker engine (e0's layout, holding the initial weights) as e2 and expects
// serve's start to refuse it as not holding the digest its layout holds for the label; `why`
// names what a start that succeeded would mean.
void JoinFreshEngineRefused(FleetStack& f, const char* why) {
  fixtures::VllmDoubleOptions fresh;
  fresh.worker_extension_cls = effects::kWorkerExtensionClass;
  f.engines.push_back(std::make_unique<fixtures::VllmDouble>(fresh));
  ASSERT_GT(f.engines.back()->Start(0), 0);
  auto opened = Service::Open(f.Config());
  ASSERT_FALSE(opened.ok()) << why;
  EXPECT_NE(opened.status().message().find("is not the expected"), std::string::npos)
      << opened.status().ToString();
}

// Proves a joining engine is held to the digest its weight layout published for the fleet's label
// even when the only engine of that layout that published it has been TAINTED since: a fresh
// one-worker engine (rc-0's weights) does not join at rc-1 beside a two-worker member, and says
// why; catches a join that counted only untainted holders, so the fresh engine bootstrapped rc-1
// by its label alone and served rc-0's weights under it.
TEST(FleetServe, AJoinerIsHeldToItsLayoutsDigestOfATaintedEngine) {
  auto f = std::make_unique<FleetStack>(
      2, [](ServeConfig& c) { c.engine_monitor_interval_ms = 20; }, 1,
      [](int i, fixtures::VllmDoubleOptions& o) {
        if (i == 1) o.world_size = 2;
      });
  ASSERT_EQ(f->FleetUpdate("u1", "all", 1)->status, 200);
  const MemberDigests published = MemberDigestsOf(*f, "u1");
  ASSERT_EQ(published.published.count("e0"), 1u);
  const std::string rc1 = published.published.at("e0");
  ASSERT_TRUE(f->RestartEngine(0));  // e0's process is replaced: the monitor taints it
  ASSERT_TRUE(
      Eventually([&] { return f->State()["engines"]["e0"]["lifecycle"] == "TAINTED"; }, 5000))
      << f->State().dump();
  ASSERT_TRUE(f->svc->Shutdown(5000));
  f->svc.reset();

  ASSERT_NO_FATAL_FAILURE(
      JoinFreshEngineRefused(*f, "e2 joined rc-1 on other weights than its layout published"));

  f->Reopen(f->Retiring(2));
  EXPECT_EQ(BootstrapDigests(*f, "e2").back(), rc1) << "the join was not held to e0's record";
  f->CheckJournal();
}

// Proves a joining engine is held to the digest an open plan of its layout validated: with the
// only one-worker member stalled at its resume after validating rc-1 (unpublished) and a
// two-worker member on rc-1, a fresh one-worker engine does not join at rc-1 on rc-0's weights,
// and once that plan publishes, the join had been held to what it published; catches a join
// blind to plans still open (the fresh engine joins by its label, then the stalled member
// publishes rc-1 on other weights), or a fold that refuses a join held to a validated digest.
TEST(FleetServe, AJoinerIsHeldToTheDigestAnOpenPlanOfItsLayoutValidated) {
  auto f = std::make_unique<FleetStack>(2, nullptr, 1, [](int i, fixtures::VllmDoubleOptions& o) {
    if (i == 1) o.world_size = 2;
  });
  fixtures::RouteFault refused;
  refused.status = 503;  // every resume of e0 until cleared: its plan stalls in RESUMING
  f->engines[0]->SetRouteFault("/resume", refused);
  auto r = f->FleetUpdate("u1", "all", 1);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 207) << r->body;
  ASSERT_EQ(f->State()["engines"]["e0"]["lifecycle"], "RESUMING");
  ASSERT_TRUE(f->svc->Shutdown(5000));
  f->svc.reset();

  ASSERT_NO_FATAL_FAILURE(
      JoinFreshEngineRefused(*f, "e2 joined rc-1 beside e0's validated plan, on other weights"));

  f->engines[0]->ClearFaults();
  f->Reopen(f->Retiring(2));  // e0's plan is driven once serve listens: it publishes rc-1
  ASSERT_TRUE(
      Eventually([&] { return f->State()["engines"]["e0"]["lifecycle"] == "READY"; }, 10000))
      << f->State().dump();
  const MemberDigests d = MemberDigestsOf(*f, "u1");
  ASSERT_EQ(d.published.count("e0"), 1u);
  EXPECT_EQ(BootstrapDigests(*f, "e2").back(), d.published.at("e0"));
  f->CheckJournal();
}

// Proves an engine that died while serve was down is dropped by marking it retiring: serve starts
// without waiting for it, the engine leaves the fleet, and the others serve and update; and that
// without the mark serve refuses to start, naming the way out; catches a fleet that can never
// start again once one of its engines is gone.
TEST(FleetServe, AnEngineThatDiedWhileServeWasDownRetires) {
  auto f =
      std::make_unique<FleetStack>(3, [](ServeConfig& c) { c.engine_startup_timeout_ms = 300; });
  ASSERT_EQ(f->FleetUpdate("u1", "all", 1)->status, 200);
  ASSERT_TRUE(f->svc->Shutdown(5000));
  f->svc.reset();
  f->engines[1]->Stop();
  auto refused = Service::Open(f->Config());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("retire"), std::string::npos)
      << refused.status().ToString();

  f->Reopen(f->Retiring(1));
  EXPECT_FALSE(f->State()["engines"].contains("e1"));
  for (const auto& a : CompleteMany(*f, 8, 4)) {
    EXPECT_EQ(a.status, 200);
    EXPECT_NE(a.engine, "e1");
    EXPECT_EQ(a.label, "rc-1");
  }
  auto r = f->FleetUpdate("u2", "all", 2);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["committed"], 2);
  f->CheckJournal();

  f->Reopen(f->Retiring(1));  // e1 is gone: nothing to do, nothing refused
  EXPECT_FALSE(f->State()["engines"].contains("e1"));
}

// A fleet update POSTed again while another plan holds the slot (409: after a restart, the drive
// of an interrupted plan), for 10 s at most; a 409 changes nothing.
httplib::Result FleetUpdateWhenFree(const FleetStack& f, const std::string& id,
                                    const std::string& mode, int step) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    auto r = f.FleetUpdate(id, mode, step);
    if (!r || r->status != 409 || std::chrono::steady_clock::now() >= until) return r;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Proves a member whose engine dies paused (at its resume) stalls without holding the fleet: the
// update answers 207 with that member stalled and the others committed, serve keeps serving them
// and /v1/state says the engine's plan is stalled; a restart that retires the dead engine lets it
// leave with its plan open, and the next update commits the rest. Catches one dead engine that
// keeps the fleet update from ending, so serve fail-stops at this and every later start.
TEST(FleetServe, AMemberThatDiesPausedStallsAndRetires) {
  auto f =
      std::make_unique<FleetStack>(3, [](ServeConfig& c) { c.engine_startup_timeout_ms = 300; });
  fixtures::RouteFault dies;
  dies.die = true;
  f->engines[1]->SetRouteFault("/resume", dies);
  auto r = f->FleetUpdate("u1", "all", 1);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 207) << r->body;
  const json end = json::parse(r->body);
  EXPECT_EQ(end["committed"], 2);
  EXPECT_EQ(end["stalled"], 1);
  EXPECT_FALSE(f->svc->failed());
  const json e1 = f->State()["engines"]["e1"];
  EXPECT_EQ(e1["lifecycle"], "RESUMING") << DumpSafe(e1);
  EXPECT_EQ(e1["stalled"], true) << DumpSafe(e1);
  EXPECT_EQ(e1["admitting"], false);
  for (const auto& a : CompleteMany(*f, 6, 3)) {
    EXPECT_EQ(a.status, 200);
    EXPECT_NE(a.engine, "e1");
    EXPECT_EQ(a.label, "rc-1");
  }
  f->CheckJournal();

  f->Reopen(f->Retiring(1));
  // Its plan is driven once serve listens (it stalls again, its engine dead), then it leaves.
  EXPECT_TRUE(Eventually([&] { return !f->State()["engines"].contains("e1"); }, 10000));
  auto next = FleetUpdateWhenFree(*f, "u2", "all", 2);
  ASSERT_TRUE(next);
  ASSERT_EQ(next->status, 200) << next->body;
  EXPECT_EQ(json::parse(next->body)["committed"], 2);
  f->CheckJournal();
}

// Proves a restart that finds a member's own plan interrupted (stalled at its resume) drives it
// only once serve listens, on a thread of its own: with that engine hanging on /resume under a
// 60 s call deadline, Open and Start return and the other member admits within seconds, and a
// shutdown during that drive returns promptly once the engine answers. Catches the recovery that
// drove every member's plan inside Open, before listening, so one hung engine kept the whole fleet
// from admitting for minutes.
TEST(FleetServe, AMemberHungInItsRecoveryKeepsNoOtherFromServing) {
  FleetStack f(2, [](ServeConfig& c) { c.call_timeout_ms = 60000; });
  fixtures::RouteFault refused;
  refused.status = 503;  // every resume of e1 until cleared: its plan stalls in RESUMING
  f.engines[1]->SetRouteFault("/resume", refused);
  auto r = f.FleetUpdate("u1", "all", 1);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 207) << r->body;
  ASSERT_TRUE(f.svc->Shutdown(5000));
  f.svc.reset();

  fixtures::RouteFault hang;
  hang.hang = true;  // e1's recovery resends its resume, which now waits out the 60 s deadline
  f.engines[1]->SetRouteFault("/resume", hang);
  const std::uint64_t resumes = f.engines[1]->RouteCount("/resume");
  const auto began = std::chrono::steady_clock::now();
  std::unique_ptr<Service> svc;
  Status started = Status::OK();
  std::atomic<bool> returned{false};
  std::thread opener([&] {
    auto opened = Service::Open(f.Config());
    if (opened.ok()) {
      svc = std::move(opened.value());
      started = svc->Start();
    } else {
      started = opened.status();
    }
    returned = true;
  });
  const bool in_time = Eventually([&] { return returned.load(); }, 10000);
  if (!in_time) f.engines[1]->ClearFaults();  // the recovery held inside Open goes on
  opener.join();
  f.svc = std::move(svc);
  ASSERT_TRUE(in_time) << "Open and Start did not return within 10 s while e1 hung at /resume";
  ASSERT_TRUE(started.ok()) << started.ToString();
  EXPECT_TRUE(Eventually([&] { return f.engines[1]->RouteCount("/resume") > resumes; }, 5000))
      << "e1's interrupted plan was never driven";
  const FleetStack::Answer a = f.Complete();
  EXPECT_EQ(a.status, 200);
  EXPECT_EQ(a.engine, "e0");
  EXPECT_EQ(a.label, "rc-1");
  EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(15));
  EXPECT_EQ(f.State()["engines"]["e1"]["lifecycle"], "RESUMING") << "e1's resume did not hang";

  bool clean = false;
  std::thread stop([&] { clean = f.svc->Shutdown(30000); });
  const bool closing = Eventually(
      [&] {
        auto ready = f.client().Get("/readyz");
        return ready &&
               json::parse(ready->body, nullptr, false).value("reason", "") == "shutting down";
      },
      10000);
  const auto released = std::chrono::steady_clock::now();
  f.engines[1]->ClearFaults();  // e1 answers its resume: its drive ends, and the shutdown with it
  stop.join();
  EXPECT_TRUE(closing) << "serve never said it was shutting down";
  EXPECT_TRUE(clean);
  EXPECT_LT(std::chrono::steady_clock::now() - released, std::chrono::seconds(10));
  EXPECT_FALSE(f.engines[1]->StateJson().value("is_paused", true)) << "e1 was left paused";
  f.Reopen(f.Config());
  EXPECT_EQ(f.State()["engines"]["e1"]["lifecycle"], "READY");
  f.CheckJournal();
}

// Proves serve tries a stalled member again by itself once its engine answers: a member whose
// engine died paused and came back as another process goes TAINTED (engine_replaced), one whose
// resume was refused until it stalled resumes on the target and serves; neither needs a restart
// of serve. Catches a stalled member left out of service, or a replaced engine left unverified,
// until an operator restarts serve.
TEST(FleetServe, AStalledMemberIsTriedAgainOnceItsEngineAnswers) {
  FleetStack f(3, [](ServeConfig& c) {
    c.engine_monitor_interval_ms = 50;
    c.stalled_plan_retry_ms = 100;
  });
  fixtures::RouteFault dies;
  dies.die = true;
  f.engines[1]->SetRouteFault("/resume", dies);
  fixtures::RouteFault refused;
  refused.status = 503;
  refused.times = static_cast<int>(kEffectAttemptsMax);
  f.engines[2]->SetRouteFault("/resume", refused);
  auto r = f.FleetUpdate("u1", "all", 1);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 207) << r->body;
  EXPECT_EQ(json::parse(r->body)["stalled"], 2) << r->body;
  auto lifecycle = [&f](const char* e) { return f.State()["engines"][e]["lifecycle"]; };
  (void)Eventually([&] { return lifecycle("e2") == "READY"; }, 10000);
  json e2 = f.State()["engines"]["e2"];
  ASSERT_EQ(e2["lifecycle"], "READY") << DumpSafe(e2);
  EXPECT_EQ(e2["committed"]["label"], "rc-1");
  EXPECT_EQ(lifecycle("e1"), "RESUMING") << "nothing answers for e1: it stays stalled";
  EXPECT_EQ(f.State()["engines"]["e1"]["stalled"], true);

  ASSERT_TRUE(f.RestartEngine(1));
  (void)Eventually([&] { return lifecycle("e1") == "TAINTED"; }, 10000);
  const json e1 = f.State()["engines"]["e1"];
  ASSERT_EQ(e1["lifecycle"], "TAINTED") << DumpSafe(e1);
  EXPECT_EQ(e1["taint"]["cause"], "engine_replaced") << DumpSafe(e1);
  EXPECT_EQ(f.engines[1]->weight_label(), "default") << "the new process was never touched";
  EXPECT_FALSE(f.svc->failed());
  std::set<std::string> served;
  for (const auto& a : CompleteMany(f, 8, 4)) {
    EXPECT_EQ(a.status, 200);
    EXPECT_EQ(a.label, "rc-1");
    served.insert(a.engine);
  }
  EXPECT_EQ(served.count("e1"), 0u);
  EXPECT_EQ(served.count("e2"), 1u) << "the member that resumed serves";
  f.CheckJournal();
}

// Proves a fleet update while one member is dead leaves that member out (it is not reachable,
// so not a member), commits on the others and keeps serve serving; catches a dead member taken
// into the update, whose plan can then never end and stops the whole fleet.
TEST(FleetServe, AnUpdateWithADeadMemberCommitsTheOthers) {
  FleetStack f(3, [](ServeConfig& c) { c.engine_monitor_interval_ms = 20; });
  ASSERT_TRUE(KillAndAwaitUnrouted(f, 0)) << f.State().dump();
  auto r = f.FleetUpdate("u1", "all", 1);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["committed"], 2);
  EXPECT_FALSE(f.svc->failed());
  EXPECT_EQ(f.State()["engines"]["e0"]["committed"]["label"], "rc-0");
  for (const auto& a : CompleteMany(f, 6, 3)) {
    EXPECT_EQ(a.status, 200);
    EXPECT_EQ(a.label, "rc-1");
  }
  f.CheckJournal();
}

// Proves a fail-stop of serve for a reason of its own (not the journal's) stops a fleet update
// whose members are mid-plan: nothing more is journaled, the member still draining goes no
// further, and the update is answered 503 outcome_unknown. Catches member threads that checked
// only the journal's health and went on draining, transferring and publishing after serve had
// fail-stopped.
TEST(FleetServe, AFailStopStopsAFleetUpdateInFlight) {
  FleetStack f(2);
  fixtures::RouteFault slow;
  slow.delay_ms = 1500;  // e1's drain is in flight when serve fail-stops
  slow.times = 1;
  f.engines[1]->SetRouteFault("/pause", slow);
  int status = 0;
  std::string body;
  std::thread update([&] {
    auto r = f.FleetUpdate("u1", "all", 1);
    if (r) std::tie(status, body) = std::make_pair(r->status, r->body);
  });
  for (int i = 0; i < 500 && f.engines[1]->RouteCount("/pause") == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(f.engines[1]->RouteCount("/pause"), 1u);
  f.svc->FailStop("a test stops serve while e1 drains");
  const std::uint64_t head = f.svc->journal().head_seq();
  update.join();
  ASSERT_EQ(status, 503) << body;
  EXPECT_EQ(json::parse(body)["error"]["type"], "outcome_unknown") << body;
  EXPECT_EQ(f.svc->journal().head_seq(), head) << "journaled after the fail-stop";
  EXPECT_EQ(f.engines[1]->RouteCount("/resume"), 0u) << "e1's plan went on after the fail-stop";
  EXPECT_NE(f.engines[1]->weight_label(), "rc-1");
}

// Proves an engine the staleness bound left behind is still a member of the next fleet update
// and catches up; catches members taken from the admitting engines only (a stale engine stranded
// for good, since nothing else can update it through serve).
TEST(FleetServe, AStaleEngineCatchesUpInTheNextUpdate) {
  FleetStack f(3);
  fixtures::RouteFault refused;
  refused.status = 500;  // e1 cannot be paused: its update is refused untouched, left on rc-0
  f.engines[1]->SetRouteFault("/pause", refused);
  auto first = f.FleetUpdate("u1", "all", 1);
  f.engines[1]->ClearFaults();
  ASSERT_TRUE(first);
  ASSERT_EQ(first->status, 207) << first->body;
  json s = f.State();
  ASSERT_EQ(s["engines"]["e1"]["lifecycle"], "READY") << s.dump();
  EXPECT_EQ(s["engines"]["e1"]["admitting"], false) << "staleness 0: rc-0 is behind";
  auto second = f.FleetUpdate("u2", "all", 2);
  ASSERT_TRUE(second);
  ASSERT_EQ(second->status, 200) << second->body;
  EXPECT_EQ(json::parse(second->body)["committed"], 3);
  EXPECT_EQ(f.engines[1]->weight_label(), "rc-2");
  f.CheckJournal();
}

// Proves the one-engine trainer routes answer 409 on a fleet instead of acting on one engine, and
// bad fleet requests change nothing; catches a route that bypasses the fleet's rules.
TEST(FleetServe, OneEngineRoutesAndBadRequestsChangeNothing) {
  FleetStack f(2);
  const std::uint64_t head = f.svc->journal().head_seq();
  httplib::Client c = f.client();
  auto update =
      c.Post("/v1/updates", stack::UpdateBody("u", "rc-1", 1, "run-a").dump(), "application/json");
  ASSERT_TRUE(update);
  EXPECT_EQ(update->status, 409);
  auto admit = c.Post("/v1/rollouts", "{}", "application/json");
  ASSERT_TRUE(admit);
  EXPECT_EQ(admit->status, 409);
  for (const char* body : {"", "[]", R"({"update_id": "x"})"}) {
    auto bad = c.Post("/v1/fleet/updates", body, "application/json");
    ASSERT_TRUE(bad);
    EXPECT_EQ(bad->status, 400) << body;
  }
  json sideways = stack::UpdateBody("u3", "rc-1", 1, "run-a");
  sideways["mode"] = "sideways";  // a whole valid body but its mode
  auto mode = c.Post("/v1/fleet/updates", sideways.dump(), "application/json");
  ASSERT_TRUE(mode);
  EXPECT_EQ(mode->status, 400) << mode->body;
  EXPECT_NE(mode->body.find("mode"), std::string::npos);
  json body = stack::UpdateBody("u2", "rc-1", 1, "run-a");
  body["batch_max"] = 0;
  auto zero = c.Post("/v1/fleet/updates", body.dump(), "application/json");
  ASSERT_TRUE(zero);
  EXPECT_EQ(zero->status, 400);
  auto cancel = c.Post("/v1/fleet/updates/none/cancel", R"({"reason": 5})", "application/json");
  ASSERT_TRUE(cancel);
  EXPECT_EQ(cancel->status, 400);
  EXPECT_EQ(f.svc->journal().head_seq(), head);
}

// Proves two members that reach one engine process under two host names are refused at start,
// before anything is journaled; catches two runners pausing, loading and resuming one engine
// under each other's rollouts (a rolling update then changes the weights of a serving member).
TEST(FleetServe, TwoNamesOfOneEngineAreRefusedAtStart) {
  FleetStack f(1);
  ServeConfig c = f.Config();
  c.journal_path = (f.dir / "other-journal").string();
  c.engines.push_back({"alias", "http://localhost:" + std::to_string(f.engines[0]->port())});
  ASSERT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c).ToString();
  auto opened = Service::Open(c);
  ASSERT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find("one engine process"), std::string::npos)
      << opened.status().ToString();
}

// Proves the configuration of a fleet is checked before anything opens: one engine and a fleet
// together, duplicate or malformed names, NCCL for a fleet, a one-engine journal served as a fleet
// and a fleet journal served as one engine; catches a configuration that would drive engines the
// journal does not describe.
TEST(FleetServe, ConfigurationIsCheckedBeforeAnythingOpens) {
  ServeConfig c;
  c.journal_path = "/tmp/unused";
  c.engines = {{"a", "http://127.0.0.1:1"}, {"a", "http://127.0.0.1:2"}};
  EXPECT_NE(ValidateConfig(c).message().find("twice"), std::string::npos);
  c.engines = {{"a/b", "http://127.0.0.1:1"}};
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.engines = {{"a", "https://127.0.0.1:1"}};
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.engines = {{"a", "http://127.0.0.1:1"}, {"b", "http://127.0.0.1:1"}};
  EXPECT_NE(ValidateConfig(c).message().find("engine_url of another"), std::string::npos);
  c.engines = {{"a", "http://Engine-1:80/"},
               {"b", "http://engine-1"}};  // one engine, spelled twice
  EXPECT_NE(ValidateConfig(c).message().find("engine_url of another"), std::string::npos);
  c.engines = {{"a", "http://127.0.0.1:1/v1"}, {"b", "http://127.0.0.1:1/v2"}};
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c).ToString();
  c.engines = {{"a", "http://127.0.0.1:1"}, {"b", "http://127.0.0.1:2"}};
  c.fleet_min_serving = 2;
  EXPECT_NE(ValidateConfig(c).message().find("fleet_min_serving"), std::string::npos);
  c.fleet_min_serving = 1;
  EXPECT_TRUE(ValidateConfig(c).ok());
  c.engines = {{"a", "http://127.0.0.1:1"}};
  c.fleet_min_serving = 0;
  EXPECT_TRUE(ValidateConfig(c).ok());
  c.engine_url = "http://127.0.0.1:3";
  EXPECT_NE(ValidateConfig(c).message().find("not both"), std::string::npos);
  c.engine_url.clear();
  c.transfer = "nccl";  // a communicator per engine, at the rendezvous port + its index
  c.engines = {{"a", "http://127.0.0.1:1"}, {"b", "http://127.0.0.1:2"}};
  c.rendezvous = "127.0.0.1:0";
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c).ToString();
  EXPECT_EQ(FleetMemberRendezvous(c, 1).port, 0) << "port 0: each its own ephemeral port";
  c.rendezvous = "10.0.0.7:29500";
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c).ToString();
  EXPECT_EQ(FleetMemberRendezvous(c, 1).port, 29501);
  EXPECT_EQ(FleetMemberRendezvous(c, 1).host, "10.0.0.7");
  c.rendezvous = "127.0.0.1:65535";
  EXPECT_NE(ValidateConfig(c).message().find("past 65535"), std::string::npos);
  c.engines.clear();
  c.transfer = "http";
  EXPECT_NE(ValidateConfig(c).message().find("required"), std::string::npos);

  ServeConfig parsed;
  ASSERT_TRUE(MergeConfigJson(json::parse(R"({"engines": [{"name": "x", "engine_url":
      "http://127.0.0.1:5"}]})"),
                              parsed)
                  .ok());
  ASSERT_EQ(parsed.engines.size(), 1u);
  EXPECT_EQ(parsed.engines[0].name, "x");
  EXPECT_FALSE(MergeConfigJson(json::parse(R"({"engines": [{"name": "x"}]})"), parsed).ok());
  EXPECT_FALSE(MergeConfigJson(json::parse(R"({"engines": {"x": 1}})"), parsed).ok());
  EXPECT_FALSE(ParseFleetEngineFlag("=http://x").ok());
  EXPECT_EQ(ParseFleetEngineFlag("a=http://h:1")->engine_url, "http://h:1");
  ASSERT_TRUE(MergeConfigJson(json::parse(R"({"engines": [{"name": "x", "engine_url":
      "http://127.0.0.1:5"}, {"name": "y", "engine_url": "http://127.0.0.1:6", "retire": true}]})"),
                              parsed)
                  .ok());
  EXPECT_TRUE(parsed.engines[1].retire && !parsed.engines[0].retire);
  EXPECT_FALSE(MergeConfigJson(json::parse(R"({"engines": [{"name": "x", "engine_url":
      "http://127.0.0.1:5", "retire": "yes"}]})"),
                               parsed)
                   .ok());
  EXPECT_FALSE(MergeConfigJson(json::parse(R"({"engines": [{"name": "x", "engine_url":
      "http://127.0.0.1:5", "other": true}]})"),
                               parsed)
                   .ok());
  c.engines = {{"a", "http://127.0.0.1:1"}, {"b", "http://127.0.0.1:2"}};
  c.transfer = "http";
  ASSERT_TRUE(MarkRetiring({"b"}, c).ok());
  EXPECT_TRUE(c.engines[1].retire);
  EXPECT_FALSE(MarkRetiring({"nope"}, c).ok());
  c.fleet_min_serving = 1;  // one engine stays: a rolling update could not keep one serving
  EXPECT_NE(ValidateConfig(c).message().find("stay"), std::string::npos);
  c.fleet_min_serving = 0;
  EXPECT_TRUE(ValidateConfig(c).ok());
  c.engines[0].retire = true;
  EXPECT_NE(ValidateConfig(c).message().find("every engine retires"), std::string::npos);
  c.engines.clear();

  // A fleet journal is not served as one engine, nor a one-engine journal as a fleet.
  FleetStack f(1);
  const std::string fleet_journal = f.Config().journal_path;
  ASSERT_TRUE(f.svc->Shutdown(5000));
  f.svc.reset();
  ServeConfig one = f.Config();
  one.engines.clear();
  one.engine_url = f.engines[0]->base_url();
  auto refused = Service::Open(one);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("fleet"), std::string::npos);

  stack::ServiceStack single(stack::StackOptions{});
  ServeConfig as_fleet = single.Config();
  as_fleet.engine_url.clear();
  as_fleet.engines = {{"a", single.engine->base_url()}};
  ASSERT_TRUE(single.svc->Shutdown(5000));
  single.svc.reset();
  auto refused_one = Service::Open(as_fleet);
  ASSERT_FALSE(refused_one.ok());
  EXPECT_NE(refused_one.status().message().find("one unnamed engine"), std::string::npos);
}

}  // namespace
}  // namespace rc::service
