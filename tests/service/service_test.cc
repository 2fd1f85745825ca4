// Integration tests of the executor service: a real Service (RocksDB journal in a temp dir) in
// front of the in-process vLLM double, driven over loopback HTTP on ephemeral ports.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "effects/http/sequence_transfer.h"
#include "effects/http/engine_client.h"
#include "fixtures/vllm_double.h"
#include "service/api_parse.h"
#include "service/service.h"
#include "statemachine/state.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr const char* kToken = "test-token";

// The stack these tests use: a token, a double and a service sized for hundreds of streams.
struct Stack : stack::ServiceStack {
  explicit Stack(std::function<void(ServeConfig&)> tweak = nullptr, int token_delay_ms = 1)
      : ServiceStack(Options(std::move(tweak), token_delay_ms)) {}
  static stack::StackOptions Options(std::function<void(ServeConfig&)> tweak, int delay_ms) {
    stack::StackOptions o;
    o.token = kToken;
    o.token_delay_ms = delay_ms;
    o.engine_http_threads = 320;
    o.tweak = [tweak = std::move(tweak)](ServeConfig& c) {
      c.drain_timeout_ms = 20000;
      c.admit_wait_ms = 20000;
      c.http_threads = 600;
      if (tweak) tweak(c);
    };
    return o;
  }
};

httplib::Headers auth() { return stack::Bearer(kToken); }

json update_body(const std::string& id, const std::string& label, int step) {
  return stack::UpdateBody(id, label, step, "run-a");
}

std::vector<journal::Record> all_records(journal::Journal& j) {
  std::vector<journal::Record> out;
  Status st = j.Scan(1, 0, [&](const journal::Record& r) {
    out.push_back(r);
    return Status::OK();
  });
  RC_CHECK(st.ok());
  return out;
}

// What a client saw of one proxied rollout.
struct Seen {
  int status = 0;
  std::string rollout_id;
  std::uint64_t generation = 0;
  std::string label;
  bool done = false;  // streamed [DONE] / non-stream body parsed
  std::string error;
};

Seen proxied(const Stack& s, bool stream, int max_tokens, const std::string& prompt) {
  httplib::Client c = s.client();
  json body = {{"model", "rc-double-model"},
               {"prompt", prompt},
               {"max_tokens", max_tokens},
               {"stream", stream}};
  Seen seen;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  std::string data;
  req.response_handler = [&](const httplib::Response& r) {
    seen.status = r.status;
    seen.rollout_id = r.get_header_value("X-RolloutCore-Rollout-Id");
    seen.label = r.get_header_value("X-RolloutCore-Version");
    const std::string g = r.get_header_value("X-RolloutCore-Generation");
    if (!g.empty()) seen.generation = std::stoull(g);
    return true;
  };
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    data.append(d, n);
    return true;
  };
  auto res = c.send(req);
  if (!res) {
    seen.error = httplib::to_string(res.error());
    return seen;
  }
  if (stream) {
    seen.done = data.find("data: [DONE]") != std::string::npos &&
                data.find("\"error\"") == std::string::npos;
  } else {
    json j = json::parse(data, nullptr, false);
    seen.done = !j.is_discarded() && j.contains("choices") && !j.contains("prompt_token_ids");
  }
  return seen;
}

// Proves the core contract under load: 256 concurrent proxied rollouts (streaming and not) while
// three updates run are each bound to exactly one version, none is finished after the next
// version is published, all finish, and the journal agrees with the headers the clients saw.
// Catches: admission slipping past a drain, a rollout spanning a mutation, lost finishes,
// headers that disagree with the journal.
TEST(ServiceE2E, ConcurrentRolloutsDuringUpdatesAreBoundToOneVersion) {
  Stack s(nullptr, 1);
  constexpr int kClients = 256;
  std::vector<Seen> seen(kClients);
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  auto launch = [&](int from, int to) {
    for (int i = from; i < to; ++i) {
      threads.emplace_back([&, i] {
        started++;
        seen[i] = proxied(s, i % 4 != 0, 6 + i % 5, "rollout prompt " + std::to_string(i % 7));
      });
    }
  };
  // Half the clients before the first update, half after it committed (racing the next two), so
  // the rollouts span at least two versions however the threads are scheduled.
  launch(0, kClients / 2);
  std::vector<std::pair<int, std::string>> updates;
  {
    httplib::Client trainer = s.client();
    for (int u = 1; u <= 3; ++u) {
      if (u == 2) launch(kClients / 2, kClients);
      auto r =
          trainer.Post("/v1/updates", auth(),
                       update_body("u" + std::to_string(u), "rc-" + std::to_string(u), u).dump(),
                       "application/json");
      updates.emplace_back(r ? r->status : 0,
                           r ? r->body : "no response: " + httplib::to_string(r.error()));
    }
  }
  for (auto& t : threads) t.join();
  for (const auto& [status, body] : updates) {
    ASSERT_EQ(status, 200) << body;
    EXPECT_EQ(json::parse(body)["outcome"], "committed");
  }

  // Clients: every rollout got 200 and a binding, and ran to its end.
  int failures = 0;
  for (int i = 0; i < kClients; ++i) {
    if (seen[i].status != 200 && failures++ < 5) {
      ADD_FAILURE() << "client " << i << " stream=" << (i % 4 != 0) << " status " << seen[i].status
                    << " " << seen[i].error;
    }
  }
  EXPECT_EQ(failures, 0) << s.svc->RenderMetrics();
  std::map<std::string, Seen> by_id;
  for (const Seen& x : seen) {
    ASSERT_EQ(x.status, 200) << x.error;
    ASSERT_FALSE(x.rollout_id.empty());
    EXPECT_TRUE(x.done) << x.rollout_id;
    EXPECT_EQ(x.label, "rc-" + std::to_string(x.generation));
    by_id[x.rollout_id] = x;
  }
  ASSERT_EQ(by_id.size(), static_cast<size_t>(kClients));
  std::set<std::uint64_t> generations;
  for (const auto& [id, x] : by_id) generations.insert(x.generation);
  EXPECT_GE(generations.size(), 2u) << "the updates did not overlap the rollouts";

  // Journal: admitted under exactly one version; finished before the next publish.
  std::map<std::string, std::uint64_t> admitted_gen;
  std::map<std::string, RolloutOutcome> finished;
  std::map<std::string, std::size_t> output_tokens;  // journaled trajectory, before the finish
  std::uint64_t published_gen = 0;
  for (const journal::Record& r : all_records(s.svc->journal())) {
    if (const auto* t = std::get_if<TrajectoryRecorded>(&r.event)) {
      EXPECT_EQ(finished.count(t->rollout_id), 0u) << "trajectory after the finish";
      output_tokens[t->rollout_id] += t->output_token_ids.size();
    } else if (const auto* a = std::get_if<RolloutAdmitted>(&r.event)) {
      ASSERT_EQ(admitted_gen.count(a->rollout_id), 0u) << "admitted twice: " << a->rollout_id;
      EXPECT_EQ(a->version.generation, published_gen) << a->rollout_id;
      admitted_gen[a->rollout_id] = a->version.generation;
    } else if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
      ASSERT_EQ(admitted_gen.count(f->rollout_id), 1u);
      EXPECT_EQ(admitted_gen[f->rollout_id], published_gen)
          << f->rollout_id << " finished after generation " << published_gen << " was published";
      finished[f->rollout_id] = f->outcome;
    } else if (const auto* p = std::get_if<VersionPublished>(&r.event)) {
      published_gen = p->version.generation;
    }
  }
  EXPECT_EQ(published_gen, 3u);
  for (const auto& [id, x] : by_id) {
    ASSERT_EQ(admitted_gen.count(id), 1u) << id;
    EXPECT_EQ(admitted_gen[id], x.generation) << "headers disagree with the journal for " << id;
    ASSERT_EQ(finished.count(id), 1u) << id << " never finished";
    EXPECT_EQ(finished[id], RolloutOutcome::kCompleted) << id;
    EXPECT_GT(output_tokens[id], 0u) << id << " has no journaled trajectory";
  }
  EXPECT_TRUE(s.svc->journal().state().active.empty());
}

// Proves bad input is refused with a 4xx and a message and journals nothing, and that /metrics
// counts an update the fold finds invalid as "invalid". Catches: parsers that accept unknown
// fields or wrong types, auth that lets a missing/wrong token through, oversized bodies reaching
// the journal, an invalid update counted as a conflict.
TEST(ServiceApi, BadInputIs4xxAndJournalsNothing) {
  Stack s([](ServeConfig& c) { c.body_bytes_max = 4096; });
  httplib::Client c = s.client();
  const std::uint64_t head = s.svc->journal().head_seq();
  json good = update_body("ok", "rc-1", 1);
  json unknown = good;
  unknown["surprise"] = 1;
  json wrong_type = good;
  wrong_type["identity"]["step"] = "ten";
  json bad_source = good;
  bad_source["source"] = "ftp://x";
  // Well-formed, but the fold finds it invalid: the label it would publish is the committed one.
  const json same_label = update_body("same", s.svc->journal().state().committed.label, 1);
  struct Case {
    std::string path, body;
    httplib::Headers headers;
    int status;
  };
  std::vector<Case> cases = {
      {"/v1/updates", "{not json", auth(), 400},
      {"/v1/updates", unknown.dump(), auth(), 400},
      {"/v1/updates", wrong_type.dump(), auth(), 400},
      {"/v1/updates", bad_source.dump(), auth(), 400},
      {"/v1/updates", same_label.dump(), auth(), 400},
      {"/v1/updates", good.dump(), {}, 401},
      {"/v1/updates", good.dump(), {{"Authorization", "Bearer nope"}}, 403},
      {"/v1/updates", std::string(8192, ' '), auth(), 413},
      {"/v1/rollouts", R"({"rollout_id": 5})", auth(), 400},
      {"/v1/rollouts", R"({"rollout_id": "x", "extra": true})", auth(), 400},
      {"/v1/rollouts", R"({"rollout_id": "x"})", {}, 401},
      {"/v1/completions", "[1,2]", {}, 400},
      {"/v1/completions", R"({"prompt": "a", "stream": "yes"})", {}, 400},
      {"/v1/completions", R"({"prompt": "a", "cache_salt": ""})", {}, 400},
      {"/inference/v1/generate", R"({"sampling_params": {}})", {}, 400},
  };
  for (const Case& k : cases) {
    auto r = c.Post(k.path, k.headers, k.body, "application/json");
    ASSERT_TRUE(r) << k.path;
    EXPECT_EQ(r->status, k.status) << k.path << " " << k.body.substr(0, 60) << " -> " << r->body;
    json e = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(e.is_discarded()) << r->body;
    EXPECT_FALSE(e["error"]["message"].get<std::string>().empty());
  }
  auto del =
      c.Delete("/v1/rollouts/ghost", auth(), R"({"outcome": "sideways"})", "application/json");
  ASSERT_TRUE(del);
  EXPECT_EQ(del->status, 400);
  auto events = c.Get("/v1/events?since=abc", auth());
  ASSERT_TRUE(events);
  EXPECT_EQ(events->status, 400);
  EXPECT_EQ(s.svc->journal().head_seq(), head) << "bad input reached the journal";
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  for (const char* sample : {"rolloutcore_updates_total{outcome=\"invalid\"} 1\n",
                             "rolloutcore_updates_total{outcome=\"conflict\"} 0\n"}) {
    EXPECT_NE(m->body.find(sample), std::string::npos) << sample << m->body;
  }
}

// Proves the update parsers (one engine and fleet) refuse exactly the identities the fold's
// check_weight_identity refuses, naming the field, and accept what it accepts (no content digest,
// checkpoint or run; step -1); it would catch a parser that lets a bad identity on to the source
// read, or one stricter than the fold.
TEST(ApiParse, UpdateIdentityIsCheckedWithTheFoldsRule) {
  struct Case {
    const char* field;
    json value;
    bool ok;
  };
  const std::vector<Case> cases = {
      {"manifest_digest", "", false},
      {"manifest_digest", "ABCD", false},
      {"manifest_digest", std::string(kDigestBytesMax + 1, 'a'), false},
      {"content_digest", "not-hex", false},
      {"checkpoint", "ckpt\x01", false},
      {"run", "run\n", false},
      {"content_digest", "", true},
      {"checkpoint", "", true},
      {"run", "", true},
      {"step", -1, true},
  };
  for (const Case& k : cases) {
    json body = update_body("u-1", "rc-1", 1);
    body["identity"][k.field] = k.value;
    json fleet_body = body;
    fleet_body["mode"] = "rolling";
    const Result<UpdateRequested> one = ParseUpdateBody(body.dump(), SourceReader::kEngine);
    const Result<FleetUpdateRequested> fleet =
        ParseFleetUpdateBody(fleet_body.dump(), SourceReader::kEngine);
    const std::string what = std::string("identity.") + k.field + " = " + k.value.dump();
    ASSERT_EQ(one.ok(), k.ok) << what << ": " << one.status().ToString();
    ASSERT_EQ(fleet.ok(), k.ok) << what << ": " << fleet.status().ToString();
    if (k.ok) {
      EXPECT_TRUE(check_weight_identity(one->identity).ok()) << what;
      continue;
    }
    for (const Status& st : {one.status(), fleet.status()}) {
      EXPECT_EQ(st.code(), Code::kInvalidArgument) << what;
      EXPECT_NE(st.message().find(std::string("identity.") + k.field), std::string::npos)
          << what << ": " << st.ToString();
    }
  }
}

// Proves an update declaring an identity the fold would refuse is a 400 naming the field before
// its source is read for the manifest, journals nothing and is not counted as an update the fold
// found invalid; it would catch the source read first, which answered an empty manifest_digest
// 422 manifest_mismatch and let a control byte in the checkpoint on to the fold.
TEST(ServiceApi, ABadIdentityIs400BeforeTheSourceIsRead) {
  Stack s;
  httplib::Client c = s.client();
  const std::uint64_t head = s.svc->journal().head_seq();
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"manifest_digest", ""}, {"manifest_digest", "XYZ"}, {"checkpoint", "ckpt\x01"}};
  for (const auto& [field, value] : bad) {
    json body = update_body("bad-identity", "rc-bad", 1);
    body["identity"][field] = value;
    auto r = c.Post("/v1/updates", auth(), body.dump(), "application/json");
    ASSERT_TRUE(r) << field;
    EXPECT_EQ(r->status, 400) << field << " -> " << r->body;
    json e = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(e.is_discarded()) << r->body;
    EXPECT_EQ(e["error"]["type"].get<std::string>(), "InvalidArgument") << r->body;
    EXPECT_NE(e["error"]["message"].get<std::string>().find("identity." + field), std::string::npos)
        << r->body;
  }
  EXPECT_EQ(s.svc->journal().head_seq(), head) << "a bad identity reached the journal";
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  const char* sample = "rolloutcore_updates_total{outcome=\"invalid\"} 0\n";
  EXPECT_NE(m->body.find(sample), std::string::npos) << m->body;
}

// Proves explicit admission binds to the committed version, blocks the update's mutation until
// finished, and that the finish records token counts. Catches: an update that mutates under an
// explicitly admitted rollout, or a finish that loses its counts.
TEST(ServiceApi, ExplicitRolloutHoldsTheUpdateUntilFinished) {
  Stack s;
  httplib::Client c = s.client();
  auto a = c.Post("/v1/rollouts", auth(), R"({"rollout_id": "r-explicit"})", "application/json");
  ASSERT_TRUE(a);
  ASSERT_EQ(a->status, 201) << a->body;
  json binding = json::parse(a->body);
  EXPECT_EQ(binding["version"]["label"], "rc-0");
  std::atomic<bool> update_done{false};
  std::thread updater([&] {
    httplib::Client t = s.client();
    auto r = t.Post("/v1/updates", auth(), update_body("u1", "rc-1", 1).dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no response");
    update_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(update_done.load()) << "update finished while a rollout was active";
  EXPECT_EQ(s.engine->weights_generation(), 0u) << "weights mutated under an active rollout";
  auto f = c.Delete("/v1/rollouts/r-explicit", auth(),
                    R"({"outcome": "completed", "prompt_tokens": 3, "completion_tokens": 4})",
                    "application/json");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->status, 200) << f->body;
  updater.join();
  EXPECT_TRUE(update_done.load());
  bool found = false;
  for (const auto& r : all_records(s.svc->journal())) {
    if (const auto* fin = std::get_if<RolloutFinished>(&r.event)) {
      found =
          fin->rollout_id == "r-explicit" && fin->prompt_tokens == 3 && fin->completion_tokens == 4;
    }
  }
  EXPECT_TRUE(found);
  auto v = c.Get("/v1/version");
  ASSERT_TRUE(v);
  EXPECT_EQ(json::parse(v->body)["version"]["label"], "rc-1");
}

// Proves a second update while one runs gets 409, and that requests arriving mid-update wait and
// are then served under the new version (or get 503 + Retry-After when they may not wait).
// Catches: concurrent runner calls, proxied requests reaching a paused/half-updated engine.
TEST(ServiceApi, UpdateConflictAndRequestsDuringUpdate) {
  Stack s([](ServeConfig& c) { c.admit_wait_ms = 10000; });
  s.engine->SetRouteFault("/update_weights", fixtures::RouteFault{.delay_ms = 600, .times = 1});
  std::thread updater([&] {
    httplib::Client t = s.client();
    auto r = t.Post("/v1/updates", auth(), update_body("u1", "rc-1", 1).dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "none");
  });
  // Wait until the update is in flight.
  for (int i = 0; i < 200 && s.svc->journal().state().lifecycle == Lifecycle::kReady; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_NE(s.svc->journal().state().lifecycle, Lifecycle::kReady);
  httplib::Client c = s.client();
  auto second =
      c.Post("/v1/updates", auth(), update_body("u2", "rc-2", 2).dump(), "application/json");
  ASSERT_TRUE(second);
  EXPECT_EQ(second->status, 409) << second->body;
  Seen during = proxied(s, false, 4, "during the update");
  updater.join();
  EXPECT_EQ(during.status, 200);
  EXPECT_EQ(during.label, "rc-1") << "a request during the update ran on the old version";
  // With no wait allowed: 503 + Retry-After while updating.
  s.svc.reset();
  s.Open([](ServeConfig& c) { c.admit_wait_ms = 0; });
  s.engine->SetRouteFault("/update_weights", fixtures::RouteFault{.delay_ms = 600, .times = 1});
  std::thread updater2([&] {
    httplib::Client t = s.client();
    auto r = t.Post("/v1/updates", auth(), update_body("u2", "rc-2", 2).dump(), "application/json");
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "none");
  });
  for (int i = 0; i < 200 && s.svc->journal().state().lifecycle == Lifecycle::kReady; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  httplib::Client c2 = s.client();
  auto r = c2.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})", "application/json");
  updater2.join();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_FALSE(r->get_header_value("Retry-After").empty());
}

// Proves a TAINTED engine refuses proxied requests with 503 naming the taint. Catches: serving
// rollouts on weights of unknown content after an ambiguous transfer failure.
TEST(ServiceApi, TaintedRefusesWithTheReason) {
  Stack s;
  s.engine->SetRouteFault("/update_weights",
                          fixtures::RouteFault{.drop_connection = true, .after = true, .times = 1});
  httplib::Client c = s.client();
  auto u = c.Post("/v1/updates", auth(), update_body("u1", "rc-1", 1).dump(), "application/json");
  ASSERT_TRUE(u);
  EXPECT_EQ(u->status, 500) << u->body;
  EXPECT_EQ(json::parse(u->body)["outcome"], "tainted");
  const std::uint64_t head = s.svc->journal().head_seq();
  auto r = c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 2})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_NE(r->body.find("TAINTED"), std::string::npos) << r->body;
  EXPECT_EQ(s.svc->journal().head_seq(), head);
}

// Proves a client that hangs up mid-stream cancels the engine request and its rollout is recorded
// as aborted. Catches: orphaned engine requests, rollouts left active forever (blocking drains).
TEST(ServiceProxy, ClientDisconnectAbortsTheRollout) {
  Stack s(nullptr, /*token_delay_ms=*/50);
  {
    httplib::Client c = s.client();
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = R"({"prompt": "hang up on me", "max_tokens": 200, "stream": true})";
    req.set_header("Content-Type", "application/json");
    int chunks = 0;
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
    auto r = c.send(req);  // the receiver returning false closes the connection
    (void)r;
  }
  bool aborted = false;
  for (int i = 0; i < 400 && !aborted; ++i) {
    for (const auto& r : all_records(s.svc->journal())) {
      if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
        aborted = f->outcome == RolloutOutcome::kAborted;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(aborted) << "the disconnected rollout was not recorded as aborted";
  EXPECT_TRUE(s.engine->engine().WaitUntil(
      [](const fixtures::EngineSnapshot& e) { return e.running == 0 && e.waiting == 0; }, 3000))
      << "the engine request kept running after the client left";
}

// Proves a client that hangs up on a NON-streamed request (nothing is written to it until the
// engine answers) is noticed by the DisconnectWatcher, cancels the engine call and is recorded
// aborted. Catches: a watcher that misses hang-ups (epoll registration, socket lookup by
// endpoints), which would record such rollouts as completed and keep the engine busy.
TEST(ServiceProxy, NonStreamedClientDisconnectAbortsTheRollout) {
  Stack s(nullptr, /*token_delay_ms=*/50);
  {
    httplib::Client c = s.client();
    c.set_read_timeout(0, 300 * 1000);  // gives up (closes) long before 200 tokens x 50 ms
    auto r = c.Post("/v1/completions", R"({"prompt": "hang up on me", "max_tokens": 200})",
                    "application/json");
    EXPECT_FALSE(r) << "the request should have timed out on the client side";
  }
  bool aborted = false;
  for (int i = 0; i < 400 && !aborted; ++i) {
    for (const auto& r : all_records(s.svc->journal())) {
      if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
        aborted = f->outcome == RolloutOutcome::kAborted;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Within 4 s, while the engine would still be generating for 10 s: only the watcher's cancel
  // can have ended it. (The double itself does not notice a non-streamed client leaving.)
  EXPECT_TRUE(aborted) << "the disconnected rollout was not recorded as aborted";
  EXPECT_GE(s.svc->metrics().client_disconnects.load(), 1u);
}

// Proves the proxy's engine client reuses keep-alive connections for generation POSTs that opt
// in (reuse_connection) and keeps as many idle handles as it was configured for, while POSTs
// without the option still get a fresh connection each. Catches: a pool capped at the old 16
// (most proxied calls reconnecting under load) and reuse leaking into weight/lifecycle POSTs.
TEST(ServiceProxy, EngineClientReusesConnectionsOnlyWhenAsked) {
  std::mutex mu;
  std::set<int> ports;
  httplib::Server srv;
  std::atomic<int> arrived{0};
  constexpr int kThreads = 24, kCalls = 20;
  // A thread per connection: room for the fresh-connection round's idle cached connections.
  srv.set_keep_alive_timeout(1);
  srv.set_keep_alive_max_count(1000);
  srv.new_task_queue = [] { return new httplib::ThreadPool(256); };
  int listen_fd = -1;
  srv.set_socket_options([&listen_fd](int fd) {
    httplib::default_socket_options(fd);
    listen_fd = fd;
  });
  srv.Post("/v1/completions", [&](const httplib::Request& req, httplib::Response& res) {
    {
      std::lock_guard<std::mutex> g(mu);
      ports.insert(req.remote_port);
    }
    // The first kThreads calls meet here, so that many handles are in use at once.
    if (++arrived <= kThreads) {
      for (int i = 0; i < 500 && arrived.load() < kThreads; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    res.set_content(R"({"choices": []})", "application/json");
  });
  const int port = srv.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  ASSERT_EQ(::listen(listen_fd, 4096), 0);  // httplib's backlog of 5 resets connect bursts
  std::thread t([&] { srv.listen_after_bind(); });
  const std::string url = "http://127.0.0.1:" + std::to_string(port);
  auto run = [&](effects::EngineClient& c, bool reuse) {
    std::vector<std::thread> threads;
    std::atomic<int> good{0};
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&] {
        effects::CallOptions o;
        o.reuse_connection = reuse;
        for (int k = 0; k < kCalls; ++k) {
          effects::HttpReply r = c.Completions({{"prompt", "x"}}, o);
          if (r.http.ok_2xx()) {
            ++good;
          } else {
            ADD_FAILURE() << "call failed: " << r.http.error;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    return good.load();
  };
  {
    effects::EngineClient pooled(url, {}, /*idle_handles_max=*/64);
    EXPECT_EQ(run(pooled, true), kThreads * kCalls);
    EXPECT_GT(pooled.idle_handles(), effects::kIdleHandlesMax) << "pool capped below its option";
    std::lock_guard<std::mutex> g(mu);
    EXPECT_LE(ports.size(), static_cast<std::size_t>(kThreads))
        << "reuse_connection POSTs opened more connections than concurrent calls";
    ports.clear();
  }
  {
    effects::EngineClient fresh(url);
    EXPECT_EQ(fresh.idle_handles_max(), effects::kIdleHandlesMax);
    EXPECT_EQ(run(fresh, false), kThreads * kCalls);
    std::lock_guard<std::mutex> g(mu);
    EXPECT_GT(ports.size(), static_cast<std::size_t>(2 * kThreads))
        << "POSTs without reuse_connection went over reused connections";
  }
  srv.stop();
  t.join();
}

// Proves acknowledged admissions survive an unclean stop: a request-bound (proxied, lease 0)
// rollout is recorded abandoned on restart while a leased explicit rollout stays active; events
// and watch routes page through the journal. Catches: acknowledging before the record is durable,
// recovery that silently drops bindings, and recovery that abandons an explicit rollout whose
// client is alive (its lease still holds).
TEST(ServiceApi, RestartAbandonsAcknowledgedRollouts) {
  Stack s;
  httplib::Client c = s.client();
  auto a = c.Post("/v1/rollouts", auth(), R"({"rollout_id": "r-leased"})", "application/json");
  ASSERT_TRUE(a);
  ASSERT_EQ(a->status, 201);
  Service::AdmitResult proxied = s.svc->Admit("r-lost", 1000, 0);
  ASSERT_TRUE(proxied.admitted.has_value());
  s.svc.reset();  // no Shutdown: like a crash after the acknowledgement
  s.Open();
  const State st = s.svc->journal().state();
  EXPECT_EQ(st.active.count("r-lost"), 0u);
  EXPECT_EQ(st.active.count("r-leased"), 1u) << "a leased rollout was abandoned by a restart";
  EXPECT_EQ(st.counters.rollouts_abandoned, 1u);
  httplib::Client c2 = s.client();
  auto ev = c2.Get("/v1/events?since=0&limit=5", auth());
  ASSERT_TRUE(ev);
  json page = json::parse(ev->body);
  EXPECT_EQ(page["records"].size(), 5u);
  EXPECT_EQ(page["next_since"], 5);
  auto w = c2.Get("/v1/watch?after=0&timeout_ms=10");
  ASSERT_TRUE(w);
  EXPECT_EQ(json::parse(w->body)["lifecycle"], "READY");
  auto m = c2.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("rolloutcore_lifecycle_state{state=\"READY\"} 1"), std::string::npos);
}

// Proves the proxy's security face: with proxy_token set, generations and read-only
// pass-throughs need that token (the trainer's token is not it) and nothing is admitted without
// it; the engine's development routes are never reachable through the proxy; /v1/models is
// passed through. Catches an anonymous client holding off updates with admissions, and a proxy
// that forwards /pause or /collective_rpc to the engine.
TEST(ProxySecurity, ProxyTokenGuardsTheProxyAndDevRoutesAreUnreachable) {
  Stack s([](ServeConfig& c) { c.proxy_token = "proxy-secret"; });
  auto c = s.client();
  const std::string body =
      json{{"model", "rc-double-model"}, {"prompt", "hi"}, {"max_tokens", 2}}.dump();
  auto anonymous = c.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(anonymous);
  EXPECT_EQ(anonymous->status, 401);
  auto trainer = c.Post("/v1/completions", auth(), body, "application/json");
  ASSERT_TRUE(trainer);
  EXPECT_EQ(trainer->status, 401) << "the trainer's token must not open the proxy";
  EXPECT_EQ(s.svc->metrics().admissions.load(), 0u);
  const httplib::Headers client = stack::Bearer("proxy-secret");
  auto ok = c.Post("/v1/completions", client, body, "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  auto models = c.Get("/v1/models", client);
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 200) << models->body;
  EXPECT_NE(models->body.find("rc-double-model"), std::string::npos);
  EXPECT_EQ(c.Get("/v1/models")->status, 401);
  for (const char* dev : {"/pause", "/resume", "/collective_rpc", "/reset_prefix_cache",
                          "/update_weights", "/init_weight_transfer_engine"}) {
    auto r = c.Post(dev, client, "{}", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 404) << dev;
  }
  EXPECT_EQ(s.svc->metrics().admissions.load(), 1u);
}

}  // namespace
}  // namespace rc::service
