// The parsers the engine client runs on an engine's bytes: bounded JSON and the SSE splitter.
#include "effects/http/response_parsers.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace rc::effects {
namespace {

using nlohmann::json;

// Feeds `raw` to a fresh splitter in pieces of `step` bytes; returns the events' JSON as dumped.
std::vector<std::string> Events(const std::string& raw, std::size_t step, bool* fed_ok) {
  std::vector<std::string> seen;
  EngineClient::ChunkFn fn = [&](const json& j) {
    seen.push_back(j.dump(-1, ' ', false, json::error_handler_t::replace));
    return true;
  };
  SseState sse;
  sse.on_chunk = &fn;
  *fed_ok = true;
  for (std::size_t at = 0; at < raw.size() && *fed_ok; at += step) {
    *fed_ok = sse.Feed(raw.data() + at, std::min(step, raw.size() - at));
  }
  return seen;
}

// Proves an engine body nested past the bound is discarded, not parsed, while ordinary bodies
// parse as before; catches a 200 KB body 100,000 levels deep reaching code that copies or dumps
// it recursively (a stack overflow that kills serve).
TEST(ResponseParsers, DeeplyNestedEngineJsonIsDiscarded) {
  EXPECT_TRUE(
      parse_outside_json(std::string(100000, '[') + std::string(100000, ']')).is_discarded());
  EXPECT_TRUE(parse_outside_json("{\"a\":" + std::string(200, '[') + std::string(200, ']') + "}")
                  .is_discarded());
  EXPECT_EQ(parse_outside_json(R"({"text":"[[[[","n":[1,[2]]})")["n"][1][0], 2);
  EXPECT_TRUE(parse_outside_json("not json").is_discarded());
}

// Proves the SSE splitter finds every event however the bytes are cut (LF and CRLF blank lines,
// a blank line split across reads), including 30,000 keep-alive blank lines in one read, in time
// linear in the bytes; catches a splitter that rescans and shifts its whole buffer per event
// (quadratic: one 64 KiB read of blank lines held an event loop for seconds) or that loses a
// separator split between two reads.
TEST(ResponseParsers, SseSplitterIsLinearAndCutIndependent) {
  std::string raw;
  for (int i = 0; i < 50; ++i) {
    raw += "data: {\"i\":" + std::to_string(i) + "}" + (i % 2 == 0 ? "\n\n" : "\r\n\r\n");
    if (i == 25) raw += std::string(60000, '\n');
  }
  raw += "data: [DONE]\n\n";
  for (std::size_t step : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{7},
                           std::size_t{4096}, raw.size()}) {
    bool fed_ok = false;
    const std::vector<std::string> seen = Events(raw, step, &fed_ok);
    EXPECT_TRUE(fed_ok) << step;
    ASSERT_EQ(seen.size(), 50u) << step;
    EXPECT_EQ(seen[49], "{\"i\":49}") << step;
  }
}

// Proves a stream delimited only by CRLF blank lines splits in one pass (60,000 events in one
// feed; a search that rescans the buffer per event takes minutes here and hits the test's
// timeout), and that events left in the buffer when the caller stopped the feed are still found
// by the next feed; catches the LF search that rescanned the whole buffer for every CRLF event,
// and a stopped feed that marked unsearched bytes as searched (events merged and lost).
TEST(ResponseParsers, CrlfStreamsAreLinearAndAStoppedFeedLosesNothing) {
  std::string raw;
  for (int i = 0; i < 60000; ++i) raw += "data: {\"i\":" + std::to_string(i) + "}\r\n\r\n";
  bool fed_ok = false;
  EXPECT_EQ(Events(raw, raw.size(), &fed_ok).size(), 60000u);
  EXPECT_TRUE(fed_ok);

  int seen = 0;
  EngineClient::ChunkFn stop_at_first = [&](const json&) { return ++seen > 1; };
  SseState sse;
  sse.on_chunk = &stop_at_first;
  const std::string three = "data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: {\"c\":3}\n\n";
  EXPECT_FALSE(sse.Feed(three.data(), three.size()));  // the caller stopped at the first event
  EXPECT_TRUE(sse.Feed("", 0));                        // fed again: the rest is still found
  EXPECT_EQ(seen, 3);
  EXPECT_FALSE(sse.bad_event);
}

// Proves a stream ends at `data: [DONE]`: what follows it (an event, an event that is not JSON)
// is never passed on nor judged, however the bytes are cut, and only [DONE] makes the stream
// parsed: one the caller stopped at its unterminated last event is not. Catches events after
// [DONE] relayed and recorded by the proxy, and a stream the proxy stopped itself (its trace over
// the body budget) counted as complete.
TEST(ResponseParsers, OnlyDoneEndsAStreamAndNothingAfterItIsPassed) {
  const std::string raw =
      "data: {\"i\":0}\n\ndata: [DONE]\n\ndata: {\"i\":1}\n\ndata: not json\n\ndata: {\"i\":2}";
  for (std::size_t step : {std::size_t{1}, std::size_t{5}, raw.size()}) {
    std::vector<std::string> seen;
    EngineClient::ChunkFn fn = [&](const json& j) {
      seen.push_back(j.dump());
      return true;
    };
    SseState sse;
    sse.on_chunk = &fn;
    for (std::size_t at = 0; at < raw.size(); at += step) {
      EXPECT_TRUE(sse.Feed(raw.data() + at, std::min(step, raw.size() - at))) << step;
    }
    HttpEvidence ev;
    sse.Finish(ev);
    EXPECT_EQ(seen, std::vector<std::string>{"{\"i\":0}"}) << step;
    EXPECT_TRUE(ev.body_parsed) << step << ": " << ev.error;
    EXPECT_FALSE(sse.bad_event) << step;
  }

  EngineClient::ChunkFn refuse_last = [](const json& j) { return !j.contains("last"); };
  SseState stopped;
  stopped.on_chunk = &refuse_last;
  const std::string cut = "data: {\"i\":0}\n\ndata: {\"last\":true}";
  EXPECT_TRUE(stopped.Feed(cut.data(), cut.size()));
  HttpEvidence ev;
  stopped.Finish(ev);  // the last event, without its blank line, is refused here
  EXPECT_TRUE(stopped.stopped);
  EXPECT_FALSE(ev.body_parsed);
  EXPECT_NE(ev.error.find("stopped"), std::string::npos) << ev.error;
}

// An instance an engine names is taken only as text a record can hold and print on one line
// (1..bound printable bytes); anything else is no instance, so the /metrics start time or an
// unknown instance stands in. Catches a 5,000-byte or control-character instance that the fold
// refused, failing every update and every monitor record on that engine.
TEST(ResponseParsers, AnInstanceIsBoundedPrintableText) {
  EXPECT_EQ(instance_in_label_body(json{{"instance", "n-1,n-2"}}), "n-1,n-2");
  for (const json& bad : {json(""), json(std::string(5000, 'x')), json("a\nb"), json(7)}) {
    EXPECT_EQ(instance_in_label_body(json{{"instance", bad}}), std::nullopt) << bad.dump();
  }
  EXPECT_EQ(rpc_instances(json::array({json{{"instance", "a"}}, json{{"instance", "b"}}})), "a,b");
  EXPECT_EQ(rpc_instances(json::array({json{{"instance", "a\u2028"}}})), "");
  EXPECT_EQ(rpc_instances(json::array({json{{"instance", ""}}})), "");
}

// Proves a 2xx body {"success": false} fails the success check (body not what the route
// promises, with an error), as do a missing or non-boolean "success", and only {"success": true}
// passes; catches a route that reported failure counted as done because "success" was a boolean.
TEST(ResponseParsers, OnlySuccessTrueIsSuccess) {
  EXPECT_TRUE(check_success(json{{"success", true}, {"new_version", "rc-1"}}));
  EXPECT_FALSE(check_success(json{{"success", false}}));
  EXPECT_FALSE(check_success(json{{"success", "true"}}));
  EXPECT_FALSE(check_success(json::object()));
  for (const char* raw : {R"({"success": false})", R"({"success": true})"}) {
    HttpReply reply;
    reply.http = HttpEvidence{Transport::kOk, 200, false, 0, ""};
    reply.raw = raw;
    interpret_body(EngineClient::Shape::kJsonObject, &check_success, "/update_weight_version",
                   reply);
    const bool success = std::string(raw).find("true") != std::string::npos;
    EXPECT_EQ(reply.http.ok_2xx(), success) << raw;
    EXPECT_EQ(reply.http.error.empty(), success) << raw;
  }
}

}  // namespace
}  // namespace rc::effects
