// The figures serve records of an engine's answer, over loopback: a real Service (RocksDB journal)
// in front of a scripted engine that answers chosen bodies on the three proxy routes, streamed and
// not, with numbers out of range (a usage count of 2^64-1, choice indexes that are no choice).
// The journal's RolloutFinished and TrajectoryRecorded parts and the trajectory line must hold the
// same figures, and a trace serve cannot trust must be marked so, never silently mapped.
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "service/answer_relay.h"
#include "service/service.h"
#include "tests/service/scripted_engine.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using nlohmann::json;

struct Stack : stack::ServiceStack {
  explicit Stack(stack::ScriptedEngine& engine) : ServiceStack(Options(engine)) {}
  static stack::StackOptions Options(stack::ScriptedEngine& engine) {
    stack::StackOptions o;
    o.dir_prefix = "rc-figures";
    o.tweak = [&engine](ServeConfig& c) {  // serve calls `engine`, which forwards the rest
      engine.ForwardTo(c.engine_url);
      c.engine_url = engine.url();
    };
    return o;
  }
};

struct Route {
  const char* path;
  const char* name;
};
constexpr Route kRoutes[] = {{"/v1/completions", "completions"},
                             {"/v1/chat/completions", "chat"},
                             {"/inference/v1/generate", "generate"}};

bool IsChat(const Route& r) { return std::string(r.name) == "chat"; }
bool IsGenerate(const Route& r) { return std::string(r.name) == "generate"; }

// The engine's one choice (output token ids 7, 8, 9) as `route` shapes it, with `index` written
// as is; a generate answer carries no prompt (serve takes the request's token_ids 1, 2).
std::string ChoiceText(const Route& route, bool stream, const std::string& index) {
  if (IsGenerate(route)) {
    return R"({"index":)" + index +
           R"(,"token_ids":[7,8,9],"logprobs":null,"finish_reason":"stop"})";
  }
  if (IsChat(route)) {
    const std::string content = stream ? R"("delta":{"content":"abc","token_ids":[7,8,9]})"
                                       : R"("message":{"role":"assistant","content":"abc"},)"
                                         R"("token_ids":[7,8,9])";
    return R"({"index":)" + index + "," + content + R"(,"logprobs":null,"finish_reason":"stop"})";
  }
  return R"({"index":)" + index +
         R"(,"text":"abc","token_ids":[7,8,9],"prompt_token_ids":[1,2],"logprobs":null,)"
         R"("finish_reason":"stop"})";
}

// The engine's answer: one document (`pad` bytes of padding take it past the simdjson relay's
// bound, to the nlohmann path), or an SSE stream of the choice's chunk, the usage chunk and
// [DONE].
std::string AnswerText(const Route& route, bool stream, const std::string& index,
                       const std::string& usage, std::size_t pad = 0) {
  const std::string prompt = IsChat(route) ? R"("prompt_token_ids":[1,2],)" : "";
  const std::string choices = R"("choices":[)" + ChoiceText(route, stream, index) + "]";
  if (!stream) {
    return "{" + prompt + choices + R"(,"usage":)" + usage + R"(,"pad":")" + std::string(pad, 'p') +
           "\"}";
  }
  return "data: {" + prompt + choices + "}\n\n" + R"(data: {"choices":[],"usage":)" + usage +
         "}\n\ndata: [DONE]\n\n";
}

stack::ScriptedEngine::Script Answering(bool stream, std::string text) {
  return [stream, text = std::move(text)](const httplib::Request&, httplib::Response& res) {
    if (!stream) return res.set_content(text, "application/json");
    res.set_chunked_content_provider("text/event-stream", [text](size_t, httplib::DataSink& sink) {
      sink.write(text.data(), text.size());
      sink.done();
      return true;
    });
  };
}

json ClientBody(const Route& route, bool stream) {
  if (IsGenerate(route)) {
    return {{"token_ids", {1, 2}}, {"sampling_params", {{"max_tokens", 3}}}, {"stream", stream}};
  }
  json body = {{"model", "rc-double-model"}, {"max_tokens", 3}, {"stream", stream}};
  if (IsChat(route)) {
    body["messages"] = json::array({{{"role", "user"}, {"content", "hi"}}});
  } else {
    body["prompt"] = "hi";
  }
  return body;
}

// What serve recorded of one rollout: its finish and trajectory parts in the journal, its line.
struct Recorded {
  std::optional<RolloutFinished> finish;
  std::size_t parts = 0;
  std::vector<std::int32_t> prompt_ids, output_ids;
  json line;
};

json LineOf(Stack& s, const std::string& rollout_id) {
  EXPECT_TRUE(s.svc->DrainTrajectories(10000)) << "the trajectory writer did not drain";
  std::ifstream in(DefaultTrajectoriesPath(s.Config().journal_path));
  json found;
  for (std::string text; std::getline(in, text);) {
    json j = json::parse(text, nullptr, false);
    if (!j.is_discarded() && j.value("rollout_id", "") == rollout_id) found = std::move(j);
  }
  return found;
}

Recorded RecordedOf(Stack& s, const std::string& rollout_id) {
  Recorded r;
  const Status st = s.svc->journal().Scan(1, 0, [&](const journal::Record& rec) {
    if (const auto* f = std::get_if<RolloutFinished>(&rec.event);
        f && f->rollout_id == rollout_id) {
      r.finish = *f;
    }
    const auto* t = std::get_if<TrajectoryRecorded>(&rec.event);
    if (t != nullptr && t->rollout_id == rollout_id) {
      ++r.parts;
      r.prompt_ids.insert(r.prompt_ids.end(), t->prompt_token_ids.begin(),
                          t->prompt_token_ids.end());
      r.output_ids.insert(r.output_ids.end(), t->output_token_ids.begin(),
                          t->output_token_ids.end());
    }
    return Status::OK();
  });
  EXPECT_TRUE(st.ok()) << st.ToString();
  r.line = LineOf(s, rollout_id);
  return r;
}

// Every figure the journal holds of the rollout is the line's: the counts, and when parts are
// journaled the prompt's and choice 0's token ids; no parts only with a line that says truncated.
// The engine answers one choice: the line holds no index but 0 (none filed under another).
void ExpectTheJournalHoldsTheLinesFigures(const Recorded& r, const std::string& what) {
  ASSERT_TRUE(r.finish.has_value()) << what;
  ASSERT_TRUE(r.line.is_object()) << what << ": no trajectory line";
  EXPECT_EQ(r.finish->prompt_tokens, r.line["prompt_tokens"].get<std::uint64_t>()) << what;
  EXPECT_EQ(r.finish->completion_tokens, r.line["completion_tokens"].get<std::uint64_t>()) << what;
  json choice0;
  for (const json& out : r.line["outputs"]) {
    EXPECT_EQ(out["index"], 0) << what << ": " << r.line.dump();
    if (out["index"] == 0) choice0 = out;
  }
  if (r.parts == 0) {
    EXPECT_EQ(r.line["truncated"], true) << what << ": nothing journaled, line not marked";
    return;
  }
  EXPECT_EQ(json(r.prompt_ids), r.line["prompt_token_ids"]) << what;
  ASSERT_TRUE(choice0.is_object()) << what << ": choice 0 journaled, not in the line";
  EXPECT_EQ(json(r.output_ids), choice0["token_ids"]) << what;
}

struct Case {
  std::string index;
  std::string usage;
  bool trusted;  // the trace is the engine's (else: truncated, no parts)
};

// Proves, on every proxy route streamed and not, that a usage count of 2^64-1 and choice indexes
// 2^64-1, 2^32 and 99999999 are recorded alike in the journal and the trajectory line: the counts
// are the 2 prompt and 3 output ids, the trace is untrusted (no parts, line truncated) and no
// index is filed under another; a sane answer journals its ids. Catches the line's
// completion_tokens 18446744073709551615 beside the journal's clamped 4294967295, choice -1 in
// the line, and choice 0 journaled with an empty output for a choice the engine never sent.
TEST(EngineFigures, OutOfRangeNumbersAreRecordedAlikeOrMarkedUntrusted) {
  stack::ScriptedEngine engine;
  Stack s(engine);
  const std::string sane_usage = R"({"prompt_tokens":2,"completion_tokens":3,"total_tokens":5})";
  const std::vector<Case> cases = {
      {"0", sane_usage, true},
      {"0", R"({"prompt_tokens":2,"completion_tokens":18446744073709551615})", false},
      {"18446744073709551615", sane_usage, false},
      {"4294967296", sane_usage, false},
      {"99999999", sane_usage, false},
  };
  int n = 0;
  for (const Route& route : kRoutes) {
    for (bool stream : {false, true}) {
      for (std::size_t pad : stream ? std::vector<std::size_t>{0}
                                    : std::vector<std::size_t>{0, kRelayAnswerBytesMax}) {
        for (const Case& c : cases) {
          const std::string id = "fig-" + std::to_string(n++);
          const std::string what = std::string(route.name) + (stream ? " streamed" : "") +
                                   (pad > 0 ? " large" : "") + ", index " + c.index + ", usage " +
                                   c.usage + " (" + id + ")";
          engine.Set(route.path,
                     Answering(stream, AnswerText(route, stream, c.index, c.usage, pad)));
          auto client = s.client(30);
          auto res = client.Post(route.path, {{"X-RolloutCore-Rollout-Id", id}},
                                 ClientBody(route, stream).dump(), "application/json");
          ASSERT_TRUE(res) << what << ": " << httplib::to_string(res.error());
          ASSERT_EQ(res->status, 200) << what << ": " << res->body;
          const Recorded r = RecordedOf(s, id);
          ExpectTheJournalHoldsTheLinesFigures(r, what);
          ASSERT_TRUE(r.finish.has_value()) << what;
          EXPECT_EQ(r.finish->outcome, RolloutOutcome::kCompleted) << what;
          EXPECT_EQ(r.finish->prompt_tokens, 2u) << what;
          EXPECT_EQ(r.finish->completion_tokens, 3u) << what;
          EXPECT_EQ(r.line["truncated"], !c.trusted) << what;
          if (c.trusted) {
            EXPECT_EQ(r.parts, 1u) << what;
            EXPECT_EQ(r.output_ids, (std::vector<std::int32_t>{7, 8, 9})) << what;
          } else {
            EXPECT_EQ(r.parts, 0u) << what << ": an untrusted trace was journaled";
          }
        }
      }
    }
  }
}

// Proves a streamed answer whose choice index is valid but whose usage counts fewer tokens than
// the ids it sent is recorded with the counted ids in both the journal and the line, untrusted.
// Catches a usage below the token ids taken as the count (the journal and line then disagree
// with the trajectory they describe).
TEST(EngineFigures, AUsageBelowTheIdsSentIsNotTheCount) {
  stack::ScriptedEngine engine;
  Stack s(engine);
  for (bool stream : {false, true}) {
    const std::string id = std::string("fig-below-") + (stream ? "s" : "b");
    engine.Set("/v1/completions",
               Answering(stream, AnswerText(kRoutes[0], stream, "0",
                                            R"({"prompt_tokens":2,"completion_tokens":1})")));
    auto client = s.client(30);
    auto res = client.Post("/v1/completions", {{"X-RolloutCore-Rollout-Id", id}},
                           ClientBody(kRoutes[0], stream).dump(), "application/json");
    ASSERT_TRUE(res && res->status == 200) << id;
    const Recorded r = RecordedOf(s, id);
    ExpectTheJournalHoldsTheLinesFigures(r, id);
    ASSERT_TRUE(r.finish.has_value()) << id;
    EXPECT_EQ(r.finish->completion_tokens, 3u) << id;
    EXPECT_EQ(r.line["truncated"], true) << id;
    EXPECT_EQ(r.parts, 0u) << id;
  }
}

}  // namespace
}  // namespace rc::service
