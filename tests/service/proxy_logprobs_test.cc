// The sampled tokens' logprobs through the proxy, over loopback against the vLLM double: what a
// client gets back (exactly what it asked for) and what the trajectory keeps (one logprob per
// output token, whatever the client asked).
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "audit/audit.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using nlohmann::json;

struct Stack : stack::ServiceStack {
  Stack() : ServiceStack(Options()) {}
  static stack::StackOptions Options() {
    stack::StackOptions o;
    o.dir_prefix = "rc-logprobs";
    return o;
  }
  std::string trajectories() const { return DefaultTrajectoriesPath(Config().journal_path); }
};

// One answer as the client saw it: the JSON body, or each SSE event's JSON.
struct Answer {
  int status = 0;
  json body;                 // non-streamed
  std::vector<json> events;  // streamed, [DONE] excluded
  bool done = false;
};

Answer Call(const Stack& s, const std::string& path, const std::string& rollout_id,
            const json& body) {
  httplib::Client c = s.client();
  const httplib::Headers h = {{"X-RolloutCore-Rollout-Id", rollout_id}};
  auto res = c.Post(path, h, body.dump(), "application/json");
  Answer a;
  if (!res) return a;
  a.status = res->status;
  if (!body.value("stream", false)) {
    a.body = json::parse(res->body, nullptr, false);
    return a;
  }
  std::size_t pos = 0;
  const std::string& raw = res->body;
  while (pos < raw.size() && raw.compare(pos, 6, "data: ") == 0) {
    const std::size_t end = raw.find("\n\n", pos);
    if (end == std::string::npos) break;
    const std::string data = raw.substr(pos + 6, end - pos - 6);
    pos = end + 2;
    if (data == "[DONE]") {
      a.done = pos == raw.size();
      break;
    }
    a.events.push_back(json::parse(data, nullptr, false));
  }
  return a;
}

// Every choice of an answer, streamed or not.
std::vector<json> Choices(const Answer& a) {
  std::vector<json> out;
  const std::vector<json> docs = a.events.empty() ? std::vector<json>{a.body} : a.events;
  for (const json& d : docs) {
    for (const json& c : d.value("choices", json::array())) out.push_back(c);
  }
  return out;
}

// The trajectories file's line for one rollout (null if none).
json TrajectoryLine(const Stack& s, const std::string& rollout_id) {
  EXPECT_TRUE(s.svc->DrainTrajectories(10000)) << "the trajectory writer did not drain";
  std::ifstream in(s.trajectories());
  std::string line;
  json found;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("rollout_id", "") == rollout_id) found = std::move(j);
  }
  return found;
}

// The journal's TrajectoryRecorded output logprobs of one rollout, in part order.
std::vector<float> JournaledLogprobs(Stack& s, const std::string& rollout_id) {
  std::vector<float> out;
  Status st = s.svc->journal().Scan(1, 0, [&](const journal::Record& r) {
    const auto* t = std::get_if<TrajectoryRecorded>(&r.event);
    if (t != nullptr && t->rollout_id == rollout_id) {
      out.insert(out.end(), t->output_logprobs.begin(), t->output_logprobs.end());
    }
    return Status::OK();
  });
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

// The recorded trajectory holds one finite logprob per output token, in the file and the journal.
void ExpectOneLogprobPerToken(Stack& s, const std::string& rollout_id) {
  const json line = TrajectoryLine(s, rollout_id);
  ASSERT_TRUE(line.is_object()) << rollout_id << " has no trajectory line";
  const json& out = line["outputs"][0];
  ASSERT_FALSE(out["token_ids"].empty()) << rollout_id;
  ASSERT_EQ(out["logprobs"].size(), out["token_ids"].size()) << rollout_id;
  for (const json& lp : out["logprobs"]) {
    ASSERT_TRUE(lp.is_number()) << rollout_id << ": " << line.dump();
    EXPECT_TRUE(std::isfinite(lp.get<double>()));
    EXPECT_LE(lp.get<double>(), 0.0);
  }
  const std::vector<float> journaled = JournaledLogprobs(s, rollout_id);
  ASSERT_EQ(journaled.size(), out["token_ids"].size()) << rollout_id;
  for (std::size_t i = 0; i < journaled.size(); ++i) {
    EXPECT_FLOAT_EQ(journaled[i], out["logprobs"][i].get<float>()) << rollout_id << " token " << i;
  }
}

json CompletionBody(bool stream) {
  return {{"prompt", "logprobs for all"}, {"max_tokens", 7}, {"stream", stream}};
}

json ChatBody(bool stream) {
  return {{"messages", {{{"role", "user"}, {"content", "logprobs for all"}}}},
          {"max_tokens", 7},
          {"stream", stream}};
}

// Proves a client that asked for no logprobs gets each choice's logprobs as null, exactly as
// the engine answers it (completions and chat, buffered and streamed), while the trajectory
// line and the journal hold one finite logprob per output token; would catch the added
// logprobs leaking to the client, or a trajectory recorded without them.
TEST(ProxyLogprobs, AddedForTheTraceAndNullForTheClient) {
  Stack s;
  int n = 0;
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    for (bool stream : {false, true}) {
      const std::string id = "lp-none-" + std::to_string(n++);
      const bool chat = std::string(path) == "/v1/chat/completions";
      const Answer a = Call(s, path, id, chat ? ChatBody(stream) : CompletionBody(stream));
      ASSERT_EQ(a.status, 200) << path;
      EXPECT_EQ(stream, a.done) << path;
      const std::vector<json> choices = Choices(a);
      ASSERT_FALSE(choices.empty()) << path;
      for (const json& c : choices) {
        ASSERT_TRUE(c.contains("logprobs")) << path << " stream " << stream;
        EXPECT_TRUE(c["logprobs"].is_null()) << path << " stream " << stream << ": " << c.dump();
        EXPECT_FALSE(c.contains("token_ids")) << path;
      }
      ExpectOneLogprobPerToken(s, id);
    }
  }
}

// Proves /inference/v1/generate gets `sampling_params.logprobs: 0` added the same way: null for
// the client, one logprob per output token recorded; would catch the generate route recording
// trajectories without logprobs.
TEST(ProxyLogprobs, GenerateRouteRecordsLogprobs) {
  Stack s;
  const Answer a = Call(s, "/inference/v1/generate", "lp-gen",
                        {{"token_ids", {104, 105}}, {"sampling_params", {{"max_tokens", 5}}}});
  ASSERT_EQ(a.status, 200) << a.body.dump();
  EXPECT_TRUE(a.body["choices"][0]["logprobs"].is_null()) << a.body.dump();
  EXPECT_EQ(a.body["choices"][0]["token_ids"].size(), 5u);
  ExpectOneLogprobPerToken(s, "lp-gen");
}

// Proves a client that asked for logprobs (top-k alternatives included) gets exactly what the
// engine answers that request directly, buffered and streamed, and the trajectory records the
// same sampled-token logprobs; would catch the proxy rewriting a client's own logprobs request.
TEST(ProxyLogprobs, ClientsOwnLogprobsPassUnchanged) {
  Stack s;
  httplib::Client engine("127.0.0.1", s.engine->port());
  int n = 0;
  const std::pair<const char*, json> asked[] = {
      {"/v1/completions", {{"logprobs", 2}}},
      {"/v1/chat/completions", {{"logprobs", true}, {"top_logprobs", 2}}}};
  for (const auto& [path, extra] : asked) {
    const bool chat = std::string(path) == "/v1/chat/completions";
    json direct_body = chat ? ChatBody(false) : CompletionBody(false);
    direct_body.update(extra);
    auto direct = engine.Post(path, direct_body.dump(), "application/json");
    ASSERT_TRUE(direct && direct->status == 200);
    const json want = json::parse(direct->body)["choices"][0]["logprobs"];
    ASSERT_TRUE(want.is_object());
    for (bool stream : {false, true}) {
      const std::string id = "lp-own-" + std::to_string(n++);
      json body = chat ? ChatBody(stream) : CompletionBody(stream);
      body.update(extra);
      const Answer a = Call(s, path, id, body);
      ASSERT_EQ(a.status, 200) << path;
      json got;  // the streamed pieces joined into the buffered shape
      for (const json& c : Choices(a)) {
        if (c["logprobs"].is_null()) continue;  // chat's role chunk
        for (const auto& [k, v] : c["logprobs"].items()) {
          for (const json& item : v) got[k].push_back(item);
        }
      }
      if (!stream) got = Choices(a).at(0)["logprobs"];
      EXPECT_EQ(got, want) << path << " stream " << stream;
      ExpectOneLogprobPerToken(s, id);
      json sampled = json::array();
      if (chat) {
        for (const json& item : want["content"]) sampled.push_back(item["logprob"]);
      } else {
        sampled = want["token_logprobs"];
      }
      // The line holds each figure as the journal does: rounded to float32.
      for (json& v : sampled) v = static_cast<double>(static_cast<float>(v.get<double>()));
      EXPECT_EQ(TrajectoryLine(s, id)["outputs"][0]["logprobs"], sampled) << path;
    }
  }
}

// Proves the loop the logprobs are recorded for: rollouts whose clients asked for no logprobs
// (completions, chat, generate), re-scored by the audit from the journal and from the
// trajectories file against the engine that served them, all check with 0 mismatches (the
// journal's float32 logprobs within the default tolerance) and every token compared; would catch
// trajectories the audit cannot verify (no logprobs, misaligned ones, a generate rollout
// journaled without its prompt, or a rounding beyond the tolerance).
TEST(ProxyLogprobs, AuditReverifiesWhatTheProxyRecorded) {
  Stack s;
  int n = 0;
  for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
    for (bool stream : {false, true}) {
      const bool chat = std::string(path) == "/v1/chat/completions";
      const Answer a = Call(s, path, "lp-audit-" + std::to_string(n++),
                            chat ? ChatBody(stream) : CompletionBody(stream));
      ASSERT_EQ(a.status, 200) << path;
    }
  }
  ASSERT_EQ(Call(s, "/inference/v1/generate", "lp-audit-gen",
                 {{"token_ids", {104, 105}}, {"sampling_params", {{"max_tokens", 5}}}})
                .status,
            200);
  effects::EngineClient engine(s.engine->base_url());
  auto journaled = audit::TrajectoriesFromJournal(s.svc->journal());
  ASSERT_TRUE(journaled.ok()) << journaled.status().ToString();
  ASSERT_TRUE(s.svc->DrainTrajectories(10000)) << "the trajectory writer did not drain";
  auto filed = audit::LoadTrajectories(s.trajectories());
  ASSERT_TRUE(filed.ok()) << filed.status().ToString();
  for (const auto* ts : {&*journaled, &*filed}) {
    ASSERT_EQ(ts->size(), 5u);
    const audit::ReverifySummary r = audit::ReverifyAll(engine, *ts, 1e-3, /*greedy=*/true);
    EXPECT_EQ(r.checked, 5u) << audit::FormatReverifySummary(r, "double");
    EXPECT_EQ(r.failed, 0u) << audit::FormatReverifySummary(r, "double");
    EXPECT_EQ(r.tokens, 33u);
    EXPECT_EQ(r.compared, 33u);
    EXPECT_EQ(r.top1, 33u);
    EXPECT_LT(r.max_abs_diff, 1e-6);  // float32 rounding at most
    std::printf("%s\n",
                audit::FormatReverifySummary(r, ts == &*filed ? "file" : "journal").c_str());
  }
}

}  // namespace
}  // namespace rc::service
