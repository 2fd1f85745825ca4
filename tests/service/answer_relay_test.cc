// The engine's non-streamed answer read with simdjson (service/answer_relay.h) against the
// nlohmann path it stands in for: the same trace, the same client document, and the same
// documents left to that path.
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "effects/http/response_parsers.h"
#include "service/answer_relay.h"
#include "service/proxy_stream.h"

namespace rc::service {
namespace {

const std::vector<std::string>& Answers() {
  static const std::vector<std::string> answers = {
      // vLLM's completion with the fields the proxy adds.
      R"({"id":"cmpl-1","object":"text_completion","created":1796588167,"model":"m",
          "choices":[{"index":0,"text":"wb o","logprobs":{"text_offset":[0,1,2,3],
          "token_logprobs":[-0.755,-0.817,-0.417,-0.67],"tokens":["w","b"," ","o"],
          "top_logprobs":[{"w":-0.755},{"b":-0.817},{" ":-0.417},{"o":-0.67}]},
          "finish_reason":"length","stop_reason":null,"prompt_logprobs":null,
          "prompt_token_ids":[104,101,108],"token_ids":[119,98,32,111]}],
          "usage":{"prompt_tokens":3,"total_tokens":7,"completion_tokens":4,
          "prompt_tokens_details":null},"system_fingerprint":null,"kv_transfer_params":null})",
      // Chat, two choices, logprobs.content, the prompt ids at the top.
      R"({"id":"chatcmpl-1","object":"chat.completion","prompt_token_ids":[1,2],
          "choices":[{"index":0,"message":{"role":"assistant","content":"h\u00e9\u2028"},
          "logprobs":{"content":[{"token":"h","logprob":-0.125,"bytes":[104],"top_logprobs":[]}]},
          "finish_reason":"stop","token_ids":[5]},
          {"index":1,"message":{"content":"x"},"finish_reason":"length","token_ids":[6,7]}],
          "usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}})",
      // Keys given twice: the last one counts, as in nlohmann's and Python's parse.
      R"({"choices":[{"index":0,"token_ids":[1]}],"choices":[{"index":0,"token_ids":[2,3],
          "token_ids":[4]}],"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":9}})",
      // Shapes Absorb ignores, and values of every kind.
      R"({"choices":"none","prompt_token_ids":[1,"x"],"n":[true,false,null,1.5e300,-7,
          18446744073709551615,{"a":{"b":[[]]}}],"usage":[]})",
      R"({"choices":[1,null,{"index":"two","delta":{"token_ids":[3],"content":"c"},
          "logprobs":{"content":["not an object",{"logprob":"x"}]}},
          {"index":-4,"token_ids":[9223372036854775807,1]}]})",
      R"({"choices":[{"index":0,"token_ids":[18446744073709551615],"logprobs":null}]})",
      R"({})",
      R"({"a\"b\\c\u0001":"\ud83d\ude00","choices":[]})",
      // Choices filed under no index of their own, and logprobs no float holds exactly.
      R"({"prompt_token_ids":[1,2],"choices":[{"token_ids":[7,8]},{"token_ids":[9]}],
          "usage":{"prompt_tokens":2,"completion_tokens":3}})",
      R"({"choices":[{"index":0,"token_ids":[7,8]},{"index":0,"token_ids":[9]},null,
          {"index":1,"index":0,"token_ids":[10]}]})",
      R"({"choices":[{"token_ids":[7],"logprobs":{"token_logprobs":[-0.1,1e-50,-3]}}]})",
  };
  return answers;
}

const std::vector<AddedFields>& Additions() {
  static const std::vector<AddedFields> additions = {
      AddedFields{},
      AddedFields{.token_ids = true, .usage = true, .logprobs = true},
      AddedFields{.token_ids = true},
      AddedFields{.logprobs = true},
      AddedFields{.usage = true},
  };
  return additions;
}

void ExpectSameTrace(const Trajectory& a, const Trajectory& b) {
  EXPECT_EQ(a.prompt_token_ids, b.prompt_token_ids);
  EXPECT_EQ(a.usage_prompt, b.usage_prompt);
  EXPECT_EQ(a.usage_completion, b.usage_completion);
  EXPECT_EQ(a.entries, b.entries);
  EXPECT_EQ(a.truncated, b.truncated);
  EXPECT_EQ(a.prompt_cut, b.prompt_cut);
  EXPECT_EQ(a.bad_index, b.bad_index);
  EXPECT_EQ(a.Trusted(), b.Trusted());
  ASSERT_EQ(a.choices.size(), b.choices.size());
  for (const auto& [index, choice] : a.choices) {
    const ChoiceTrace& other = b.choices.at(index);
    EXPECT_EQ(choice.token_ids, other.token_ids) << index;
    EXPECT_EQ(choice.logprobs, other.logprobs) << index;
    EXPECT_EQ(choice.finish_reason, other.finish_reason) << index;
    EXPECT_EQ(choice.cut, other.cut) << index;
  }
}

// Proves that for completions, chat answers, repeated keys, odd shapes and every value kind, the
// simdjson path leaves the trace as Absorb leaves it and gives the client the document
// StripAdded gives; would catch a field Absorb reads that the simdjson path does not copy, a
// signed/unsigned mismatch (usage counts are taken only when unsigned), or a removal done wrong.
TEST(AnswerRelay, SameTraceAndSameClientDocumentAsTheNlohmannPath) {
  for (const std::string& text : Answers()) {
    for (const AddedFields& added : Additions()) {
      SCOPED_TRACE(text);
      Trajectory fast;
      const std::optional<std::string> out = RelayAnswer(text, fast, added);
      ASSERT_TRUE(out.has_value());
      json doc = effects::parse_outside_json(text);
      ASSERT_FALSE(doc.is_discarded());
      Trajectory slow;
      slow.Absorb(doc);
      StripAdded(doc, added);
      ExpectSameTrace(fast, slow);
      EXPECT_EQ(json::parse(*out), doc);
    }
  }
}

// Proves the simdjson path files choices as Absorb does, not merely alike: a choice without an
// index beside another, or an index repeated within the answer (a key given twice counting as its
// last), makes the trace untrusted and keeps nothing of the repeat, and a one-choice answer
// without an index is choice 0. Catches the fast path merging [7, 8] and [9] into one trusted
// choice 0 (both paths wrong alike would pass the comparison above).
TEST(AnswerRelay, AChoiceWithoutAnIndexOfItsOwnIsUntrustedOnTheFastPath) {
  for (const char* text :
       {R"({"prompt_token_ids":[1,2],"choices":[{"token_ids":[7,8]},{"token_ids":[9]}],)"
        R"("usage":{"prompt_tokens":2,"completion_tokens":3}})",
        R"({"choices":[{"index":0,"token_ids":[7,8]},{"index":1,"index":0,"token_ids":[9]}]})"}) {
    SCOPED_TRACE(text);
    Trajectory t;
    ASSERT_TRUE(RelayAnswer(text, t, AddedFields{.token_ids = true}).has_value());
    EXPECT_TRUE(t.bad_index);
    EXPECT_FALSE(t.Trusted());
    EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty());
    if (t.choices.contains(0)) {
      EXPECT_EQ(t.choices.at(0).token_ids, (std::vector<std::int64_t>{7, 8}));
    }
  }
  Trajectory one;
  ASSERT_TRUE(RelayAnswer(R"({"choices":[{"token_ids":[7,8]}]})", one, AddedFields{}));
  EXPECT_TRUE(one.Trusted());
  EXPECT_EQ(one.choices.at(0).token_ids, (std::vector<std::int64_t>{7, 8}));
}

// Proves the client's document keeps the engine's key order and leaves out exactly the added
// fields; would catch the answer re-sorted or an added field left in (or a client's own removed).
TEST(AnswerRelay, TheEngineOrderStaysAndOnlyAddedFieldsGo) {
  const std::string text =
      R"({"id":"c","choices":[{"text":"a","token_ids":[1],"logprobs":{"token_logprobs":[-1]},)"
      R"("prompt_token_ids":[2]}],"prompt_token_ids":[3],"usage":{"prompt_tokens":1}})";
  Trajectory t;
  EXPECT_EQ(RelayAnswer(text, t, AddedFields{.token_ids = true, .usage = true, .logprobs = true}),
            R"({"id":"c","choices":[{"text":"a","logprobs":null}]})");
  Trajectory own;
  EXPECT_EQ(
      RelayAnswer(text, own, AddedFields{}),
      R"({"id":"c","choices":[{"text":"a","token_ids":[1],"logprobs":{"token_logprobs":[-1]},)"
      R"("prompt_token_ids":[2]}],"prompt_token_ids":[3],"usage":{"prompt_tokens":1}})");
  EXPECT_EQ(own.choices.at(0).token_ids, (std::vector<std::int64_t>{1}));
}

// Proves what simdjson does not read, or reads ambiguously, is left to the nlohmann path with the
// trace untouched: an answer past kRelayAnswerBytesMax (its document would sit outside the body
// budget), not JSON, not an object, too deep, a number past 64 bits, a -0 token id (an integer
// to nlohmann, the same 0 as "0" to simdjson); would catch a relay that answers them itself and
// so judges them differently, or a trace absorbed twice.
TEST(AnswerRelay, WhatItCannotReadAlikeIsLeftToTheSlowPath) {
  const std::string deep = std::string(200, '[') + std::string(200, ']');
  const std::string large = R"({"text":")" + std::string(kRelayAnswerBytesMax, 'a') + R"("})";
  for (const std::string& text :
       {large, std::string("not json"), std::string("[1]"), std::string(R"({"a":1} x)"),
        std::string(R"({"a":"\ud800"})"), std::string(R"({"choices":[{"token_ids":[-0]}]})"),
        std::string(R"({"n":184467440737095516150})"), R"({"a":)" + deep + "}"}) {
    SCOPED_TRACE(text);
    Trajectory t;
    EXPECT_FALSE(RelayAnswer(text, t, AddedFields{.token_ids = true}).has_value());
    EXPECT_EQ(t.entries, 0u);
    EXPECT_TRUE(t.choices.empty());
  }
}

}  // namespace
}  // namespace rc::service
