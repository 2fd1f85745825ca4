// The proxy's reading of engine responses (service/proxy_stream.h) as pure functions: what a
// trace takes from completions and chat chunks, its bound, the journal parts it becomes, and the
// event a client receives.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "service/byte_budget.h"
#include "service/proxy_stream.h"
#include "service/trajectory_line.h"

namespace rc::service {
namespace {

// Proves that a completion (token_ids, logprobs.token_logprobs) and chat chunks (delta.token_ids,
// logprobs.content) fill the same trace, with usage, prompt and finish reason; would catch one of
// Absorb's steps dropping a shape, or taking a later prompt over the first.
TEST(ProxyStreamTrace, CompletionAndChatShapesFillOneTrace) {
  Trajectory completion;
  completion.Absorb(json::parse(R"({
    "prompt_token_ids": [1, 2, 3],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    "choices": [{"index": 0, "token_ids": [7, 8], "finish_reason": "stop",
                 "logprobs": {"token_logprobs": [-0.5, null]}}]})"));
  EXPECT_EQ(completion.prompt_token_ids, json::parse("[1, 2, 3]"));
  EXPECT_EQ(completion.choices.at(0).token_ids, (std::vector<std::int64_t>{7, 8}));
  EXPECT_EQ(completion.choices.at(0).logprobs, json::parse("[-0.5, null]"));
  EXPECT_EQ(completion.choices.at(0).finish_reason, "stop");
  EXPECT_EQ(completion.prompt_count(), 3u);
  EXPECT_EQ(completion.completion_count(), 2u);
  EXPECT_EQ(completion.entries, 4u);
  EXPECT_FALSE(completion.truncated);

  Trajectory chat;
  chat.Absorb(json::parse(R"({"choices": [{"prompt_token_ids": [4, 5],
    "delta": {"token_ids": [9]}, "logprobs": {"content": [{"logprob": -1.0}]}}]})"));
  chat.Absorb(json::parse(R"({"prompt_token_ids": [6], "choices": [{"index": 0,
    "delta": {"token_ids": [10]}, "logprobs": {"content": ["not an object"]},
    "finish_reason": "length"}]})"));
  EXPECT_EQ(chat.prompt_token_ids, json::parse("[4, 5]"));  // the first prompt seen is kept
  EXPECT_EQ(chat.choices.at(0).token_ids, (std::vector<std::int64_t>{9, 10}));
  EXPECT_EQ(chat.choices.at(0).logprobs, json::parse("[-1.0, null]"));
  EXPECT_EQ(chat.choices.at(0).finish_reason, "length");
  EXPECT_EQ(chat.completion_count(), 2u);  // no usage: counted from the token ids
}

// Proves that outside text of another shape is ignored, never fatal: a non-object document or
// choice; a non-integer token id cuts the trace there (counted, truncated), and a prompt of
// non-integer ids is a cut prompt; would catch a split step that assumes the shape its caller
// used to check, or choice 0 journaled without its prompt.
TEST(ProxyStreamTrace, OtherShapesAreIgnored) {
  Trajectory t;
  t.Absorb(json::parse("[1, 2]"));
  t.Absorb(json::parse(R"({"choices": "no", "usage": [1]})"));
  t.Absorb(json::parse(R"({"choices": [3, {"index": 0, "token_ids": [1, "a", 2.5, 4]}]})"));
  EXPECT_EQ(t.choices.size(), 1u);
  EXPECT_EQ(t.choices.at(0).token_ids, (std::vector<std::int64_t>{1}));
  EXPECT_EQ(t.entries, 2u);
  EXPECT_TRUE(t.truncated);
  EXPECT_FALSE(t.usage_prompt.has_value());
  EXPECT_TRUE(t.prompt_token_ids.is_null());
  EXPECT_FALSE(t.prompt_cut);
  t.Absorb(json::parse(R"({"prompt_token_ids": [1.0, 2]})"));  // no exact token ids
  EXPECT_TRUE(t.prompt_token_ids.is_null());
  EXPECT_TRUE(t.prompt_cut) << "choice 0 would be journaled without its prompt";
}

// Proves the per-rollout bound: offered one more entry than kTrajectoryEntriesMax, the trace keeps
// exactly the bound and says it was truncated; would catch TakeEntry counting past its bound.
TEST(ProxyStreamTrace, EntriesStopAtTheirBound) {
  Trajectory t;
  json ids = json::array();
  for (std::size_t i = 0; i < kTrajectoryEntriesMax; ++i) ids.push_back(1);
  t.Absorb(json{{"choices", json::array({json{{"token_ids", std::move(ids)}}})}});
  EXPECT_EQ(t.entries, kTrajectoryEntriesMax);
  EXPECT_FALSE(t.truncated);
  t.Absorb(json::parse(R"({"choices": [{"token_ids": [2]}]})"));
  EXPECT_EQ(t.entries, kTrajectoryEntriesMax);
  EXPECT_EQ(t.choices.at(0).token_ids.size(), kTrajectoryEntriesMax);
  EXPECT_TRUE(t.truncated);
  EXPECT_TRUE(t.choices.at(0).cut) << "the choice that lost a token must say so";
  t.Absorb(json::parse(R"({"choices": [{"index": 1, "logprobs": {"token_logprobs": [-1]}}]})"));
  EXPECT_TRUE(t.choices.at(1).cut);
  EXPECT_FALSE(t.prompt_cut);
  json prompt = json::array();
  for (std::size_t i = 0; i <= kTrajectoryEntriesMax; ++i) prompt.push_back(1);
  t.Absorb(json{{"prompt_token_ids", std::move(prompt)}});
  EXPECT_TRUE(t.prompt_cut);
}

// Proves what an engine sends beside the numbers costs the trace nothing: a logprob that is not a
// number is kept as null, an over-long finish reason is dropped, and choice indexes stop at
// kTrajectoryChoicesMax; catches an engine growing one rollout's trace without bound (megabyte
// objects as logprobs, a new choice per chunk, a finish_reason of any length).
TEST(ProxyStreamTrace, WhatIsNotANumberCostsNothing) {
  Trajectory t;
  const json big = json::object({{"pad", std::string(100000, 'x')}});
  t.Absorb(json{{"choices", json::array({json{{"index", 0},
                                              {"token_ids", {7}},
                                              {"logprobs", {{"token_logprobs", {big}}}},
                                              {"finish_reason", std::string(1000, 'r')}}})}});
  ASSERT_EQ(t.choices.at(0).logprobs.size(), 1u);
  EXPECT_TRUE(t.choices.at(0).logprobs[0].is_null());
  EXPECT_TRUE(t.choices.at(0).finish_reason.empty());
  for (std::size_t i = 1; i <= kTrajectoryChoicesMax + 5; ++i) {
    t.Absorb(json{{"choices", json::array({json{{"index", i}, {"token_ids", {1}}}})}});
  }
  EXPECT_EQ(t.choices.size(), kTrajectoryChoicesMax);
  EXPECT_TRUE(t.truncated);
}

// Proves how a trace becomes journal parts: prompt tokens first, then output tokens, at most
// kTrajectoryTokensPerRecordMax per part, parts numbered densely from 0, logprobs aligned with
// the output tokens (NaN where none was reported); would catch NextPart's cursors drifting across
// the prompt/output boundary.
TEST(ProxyStreamParts, PromptFirstThenOutputWithinTheRecordBound) {
  const std::size_t per = kTrajectoryTokensPerRecordMax;
  Trajectory t;
  json prompt = json::array();
  for (std::size_t i = 0; i < per + 1; ++i) prompt.push_back(static_cast<int>(i));
  json out = json::array();
  json lps = json::array();
  for (std::size_t i = 0; i < per; ++i) {
    out.push_back(static_cast<int>(100000 + i));
    lps.push_back(i == 0 ? json() : json(-0.25));
  }
  t.Absorb(json{{"prompt_token_ids", prompt},
                {"choices", json::array({json{{"token_ids", out},
                                              {"logprobs", {{"token_logprobs", lps}}}}})}});
  const std::vector<TrajectoryRecorded> parts = JournalTrajectoryParts("r1", t);
  ASSERT_EQ(parts.size(), 3u);
  for (std::size_t i = 0; i < parts.size(); ++i) {
    EXPECT_EQ(parts[i].rollout_id, "r1");
    EXPECT_EQ(parts[i].part, i);
    EXPECT_LE(parts[i].prompt_token_ids.size() + parts[i].output_token_ids.size(), per);
    EXPECT_EQ(parts[i].output_logprobs.size(), parts[i].output_token_ids.size());
  }
  EXPECT_EQ(parts[0].prompt_token_ids.size(), per);
  EXPECT_TRUE(parts[0].output_token_ids.empty());
  EXPECT_EQ(parts[1].prompt_token_ids, (std::vector<std::int32_t>{static_cast<int>(per)}));
  EXPECT_EQ(parts[1].output_token_ids.size(), per - 1);
  EXPECT_EQ(parts[1].output_token_ids.front(), 100000);
  EXPECT_TRUE(std::isnan(parts[1].output_logprobs.front()));
  EXPECT_FLOAT_EQ(parts[1].output_logprobs.back(), -0.25f);
  EXPECT_EQ(parts[2].output_token_ids,
            (std::vector<std::int32_t>{static_cast<int>(100000 + per - 1)}));
  EXPECT_TRUE(JournalTrajectoryParts("r2", Trajectory{}).empty());
}

// Proves token ids the journal's 32-bit fields cannot hold exactly (past 2^31, negative past its
// range, not integers) journal no trajectory parts rather than other tokens. Catches ids narrowed
// unchecked, which recorded in the journal other tokens than the trajectory line holds.
TEST(ProxyStreamParts, IdsTheJournalCannotHoldExactlyJournalNoParts) {
  auto parts_of = [](const json& prompt, const std::vector<std::int64_t>& output) {
    Trajectory t;
    t.prompt_token_ids = prompt;
    t.choices[0].token_ids = output;
    return JournalTrajectoryParts("r1", t).size();
  };
  EXPECT_EQ(parts_of(json::array({1, 2}), {3, 2147483647}), 1u);
  EXPECT_EQ(parts_of(json::array({1, 2}), {3, 2147483648LL}), 0u);
  EXPECT_EQ(parts_of(json::array({1, 4294967296ULL}), {3}), 0u);
  EXPECT_EQ(parts_of(json::array({1, -2147483649LL}), {3}), 0u);
  EXPECT_EQ(parts_of(json::array({1, 2.5}), {3}), 0u);
}

// Proves a logprob past float's range is journaled as the infinity of its sign, and one within
// it as the nearest float; it would catch a plain double-to-float conversion of an out-of-range
// value (undefined behaviour, which the sanitizer builds report).
TEST(ProxyStreamParts, LogprobsPastFloatRangeAreJournaledAsInfinities) {
  Trajectory t;
  t.prompt_token_ids = json::array({1});
  t.choices[0].token_ids = {2, 3, 4};
  t.choices[0].logprobs = json::array({-1e39, 1e300, -0.5});
  const std::vector<TrajectoryRecorded> parts = JournalTrajectoryParts("r1", t);
  ASSERT_EQ(parts.size(), 1u);
  ASSERT_EQ(parts[0].output_logprobs.size(), 3u);
  EXPECT_TRUE(std::isinf(parts[0].output_logprobs[0]) && parts[0].output_logprobs[0] < 0);
  EXPECT_TRUE(std::isinf(parts[0].output_logprobs[1]) && parts[0].output_logprobs[1] > 0);
  EXPECT_EQ(parts[0].output_logprobs[2], -0.5f);
}

// Proves a logprob is the same figure in the trajectory line and in the journal: the engine's
// -0.1 and 1e-50 (completions) and -0.3 (chat) are kept as the journal's float holds them, and
// the line prints a number that parses back to exactly the journaled float. Catches the line
// keeping the engine's double (-0.1 in the line, -0.10000000149011612 journaled; 1e-50 in the
// line, 0 journaled) while both claim to hold the same trajectory.
TEST(ProxyStreamParts, ALogprobIsTheSameFigureInTheLineAndTheJournal) {
  for (const char* doc : {R"({"prompt_token_ids": [1], "choices": [{"index": 0,
      "token_ids": [5, 6, 7], "logprobs": {"token_logprobs": [-0.1, 1e-50, -1e-50]}}]})",
                          R"({"prompt_token_ids": [1], "choices": [{"index": 0,
      "delta": {"token_ids": [5]}, "logprobs": {"content": [{"logprob": -0.3}]}}]})"}) {
    Trajectory t;
    t.Absorb(json::parse(doc));
    const std::vector<TrajectoryRecorded> parts = JournalTrajectoryParts("r1", t);
    ASSERT_EQ(parts.size(), 1u) << doc;
    const std::vector<float>& journaled = parts[0].output_logprobs;
    RolloutAdmitted binding;
    binding.rollout_id = "r1";
    const std::string line = TrajectoryLineText(
        TrajectoryLineFields{binding, 1, "/v1/completions", false, "", "completed", "", t});
    const json lps = json::parse(line)["outputs"][0]["logprobs"];
    ASSERT_EQ(lps.size(), journaled.size()) << line;
    for (std::size_t i = 0; i < journaled.size(); ++i) {
      const double printed = lps[i].get<double>();
      EXPECT_EQ(printed, static_cast<double>(journaled[i])) << line << " logprob " << i;
      EXPECT_EQ(std::signbit(printed), std::signbit(journaled[i])) << line << " logprob " << i;
    }
  }
}

// Proves an engine's token id that is no integer within int64 (2^64-1, 2^63, 11.5, "x") cuts the
// trace (truncated, no journal parts) instead of being narrowed or skipped. Catches 2^64-1 read
// as -1 (another token recorded in the line and the journal) and a skipped id that pairs every
// later logprob with the wrong token in the journal's parts.
TEST(ProxyStreamParts, AnIdThatIsNoTokenCutsTheTrace) {
  for (const char* bad : {"18446744073709551615", "9223372036854775808", "11.5", "\"x\""}) {
    Trajectory t;
    t.Absorb(json::parse(std::string(R"({"choices": [{"token_ids": [5, )") + bad +
                         R"(, 7], "logprobs": {"token_logprobs": [-1, -2, -3]}}]})"));
    EXPECT_TRUE(t.truncated) << bad;
    EXPECT_EQ(t.choices.at(0).token_ids, (std::vector<std::int64_t>{5})) << bad;
    EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty()) << bad;
  }
  Trajectory fine;
  fine.Absorb(json::parse(R"({"choices": [{"token_ids": [5, 2147483647, -2147483648]}]})"));
  EXPECT_FALSE(fine.truncated);
  EXPECT_EQ(JournalTrajectoryParts("r1", fine).size(), 1u);
}

// Proves every number a trace keeps from an engine is one the journal holds exactly: a token id
// past int32 (output or prompt) and a logprob past float's range cut the trace (truncated, no
// parts) instead of sitting in the trajectory line while the journal holds none or an infinity.
// Catches 2^40 or 9223372036854775807 kept in the line with no journaled trajectory, and 1e300
// written to the line as journaled +inf.
TEST(ProxyStreamTrace, NumbersTheJournalCannotHoldCutTheTrace) {
  for (const char* doc : {R"({"choices": [{"index": 0, "token_ids": [5, 1099511627776]}]})",
                          R"({"choices": [{"index": 0, "token_ids": [5, 9223372036854775807]}]})",
                          R"({"choices": [{"index": 0, "token_ids": [5, -2147483649]}]})",
                          R"({"choices": [{"index": 0, "token_ids": [5, 6],
            "logprobs": {"token_logprobs": [-0.5, 1e300]}}]})",
                          R"({"choices": [{"index": 0, "token_ids": [5, 6],
            "logprobs": {"content": [{"logprob": -1e39}, {"logprob": -1}]}}]})"}) {
    Trajectory t;
    t.Absorb(json::parse(doc));
    EXPECT_TRUE(t.truncated) << doc;
    EXPECT_TRUE(t.Truncated()) << doc;
    EXPECT_TRUE(t.choices.at(0).cut) << doc;
    EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty()) << doc;
  }
  Trajectory prompt;
  prompt.Absorb(json::parse(R"({"prompt_token_ids": [1, 4294967296], "choices": []})"));
  EXPECT_TRUE(prompt.prompt_cut);
  EXPECT_TRUE(prompt.prompt_token_ids.is_null()) << "the line would hold an id the journal lacks";
  EXPECT_EQ(prompt.prompt_count(), 0u);
}

// Proves a choice index that is no choice of the request (2^64-1, 2^32, 99999999,
// kRequestChoicesMax, -1, 1.0, "0", null) makes the trace untrusted: the choice is not kept under
// any index, the line says truncated, nothing is journaled, and the counts come from the ids it
// kept. Catches 2^64-1 recorded as choice -1 and the journal holding choice 0 with an empty
// output while the rollout counts the bogus choice's tokens.
TEST(ProxyStreamTrace, AChoiceIndexThatIsNoChoiceMakesTheTraceUntrusted) {
  for (const char* index :
       {"18446744073709551615", "4294967296", "99999999", "65536", "-1", "1.0", "\"0\"", "null"}) {
    Trajectory t;
    t.Absorb(json::parse(std::string(R"({"prompt_token_ids": [1, 2], "choices": [{"index": )") +
                         index + R"(, "token_ids": [7, 8, 9]}]})"));
    EXPECT_TRUE(t.choices.empty()) << index;
    EXPECT_TRUE(t.bad_index) << index;
    EXPECT_FALSE(t.Trusted()) << index;
    EXPECT_TRUE(t.Truncated()) << index;
    EXPECT_EQ(t.completion_count(), 0u) << index;
    EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty()) << index;
  }
  Trajectory last;
  last.Absorb(json::parse(R"({"choices": [{"index": 0, "token_ids": [7]},
      {"index": 65535, "token_ids": [8]}]})"));
  EXPECT_TRUE(last.Trusted()) << "the largest index a request may ask for is a choice";
  EXPECT_EQ(JournalTrajectoryParts("r1", last).size(), 1u);
}

// Proves a choice filed under no index of its own is no choice: one without "index" beside other
// choices, or an index repeated within one document (a completion, or one streamed chunk), makes
// the trace untrusted (the line says truncated, nothing is journaled, the repeat is not kept),
// while a one-choice document without an index is choice 0 and a stream's chunks name an index
// again and again. Catches the reported answer {"choices":[{"token_ids":[7,8]},{"token_ids":[9]}]}
// journaled as choice 0 = [7, 8, 9], a trajectory the engine never produced, with truncated false.
TEST(ProxyStreamTrace, AnUnnumberedOrRepeatedChoiceIsNoChoice) {
  for (const char* choices :
       {R"([{"token_ids": [7, 8]}, {"token_ids": [9]}])",
        R"([{"index": 0, "token_ids": [7, 8]}, {"token_ids": [9]}])",
        R"([{"index": 0, "token_ids": [7, 8]}, {"index": 0, "token_ids": [9]}])",
        R"([{"index": 0, "token_ids": [7, 8]}, {"index": 1, "token_ids": [9]},
            {"index": 1, "token_ids": [10]}])"}) {
    Trajectory t;
    t.Absorb(json::parse(std::string(R"({"prompt_token_ids": [1, 2], "choices": )") + choices +
                         R"(, "usage": {"prompt_tokens": 2, "completion_tokens": 4}})"));
    EXPECT_TRUE(t.bad_index) << choices;
    EXPECT_FALSE(t.Trusted()) << choices;
    EXPECT_TRUE(t.Truncated()) << choices;
    EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty()) << choices;
    const auto zero = t.choices.find(0);
    if (zero != t.choices.end()) {
      EXPECT_EQ(zero->second.token_ids, (std::vector<std::int64_t>{7, 8})) << choices;
    }
  }
  Trajectory repeated_in_a_chunk;
  const json chunk = json::parse(R"({"choices": [{"index": 0, "delta": {"token_ids": [7]}},
      {"index": 0, "delta": {"token_ids": [8]}}]})");
  EXPECT_TRUE(PassChunk(repeated_in_a_chunk, chunk, AddedFields{}).has_value());
  EXPECT_TRUE(repeated_in_a_chunk.bad_index) << "a repeat within one streamed chunk";

  Trajectory one;
  one.Absorb(json::parse(R"({"prompt_token_ids": [1], "choices": [{"token_ids": [7, 8]}]})"));
  EXPECT_TRUE(one.Trusted()) << "a one-choice document may leave its index out";
  EXPECT_EQ(one.choices.at(0).token_ids, (std::vector<std::int64_t>{7, 8}));
  Trajectory streamed;
  for (const char* chunk : {R"({"prompt_token_ids": [1], "choices": [{"index": 0,
                               "delta": {"token_ids": [7]}}, {"index": 1, "delta": {}}]})",
                            R"({"choices": [{"index": 1, "delta": {"token_ids": [9]}},
                               {"index": 0, "delta": {"token_ids": [8]}}]})",
                            R"({"choices": [{"delta": {"token_ids": [10]}}]})"}) {
    ASSERT_TRUE(PassChunk(streamed, json::parse(chunk), AddedFields{}).has_value());
  }
  EXPECT_FALSE(streamed.bad_index) << "chunks naming an index again are how a stream goes on";
  EXPECT_TRUE(streamed.Trusted());
  EXPECT_EQ(streamed.choices.at(0).token_ids, (std::vector<std::int64_t>{7, 8, 10}));
  EXPECT_EQ(streamed.choices.at(1).token_ids, (std::vector<std::int64_t>{9}));
  EXPECT_EQ(JournalTrajectoryParts("r1", streamed).size(), 1u);
}

// Proves choice 0's journal parts are not made up when the answer has choices but no choice 0:
// nothing is journaled and the line says truncated. Catches the journal recording an empty
// output for choice 0 while the line shows the engine's tokens under another index.
TEST(ProxyStreamTrace, ChoicesWithoutChoiceZeroJournalNothing) {
  Trajectory t;
  t.Absorb(json::parse(R"({"prompt_token_ids": [1], "choices": [{"index": 3,
      "token_ids": [7, 8, 9]}]})"));
  EXPECT_FALSE(t.truncated);
  EXPECT_FALSE(t.Trusted());
  EXPECT_TRUE(t.Truncated());
  EXPECT_EQ(t.completion_count(), 3u);
  EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty());
  Trajectory prompt_only;  // no choice yet (a stream cut before its first token): the prompt
  prompt_only.Absorb(json::parse(R"({"prompt_token_ids": [1], "choices": []})"));
  EXPECT_TRUE(prompt_only.Trusted());
  EXPECT_EQ(JournalTrajectoryParts("r1", prompt_only).size(), 1u);
}

// Proves a usage the journal cannot hold (past uint32) or that counts fewer tokens than the ids
// the engine sent is not believed: both counts fall back to the kept ids (the one figure the
// journal's RolloutFinished and the line then share), the line says truncated and no parts are
// journaled; a believable usage (even above the ids, which a cut stream may lack) is the count.
// Catches completion_tokens 2^64-1 written to the line while the journal clamps it to 2^32-1.
TEST(ProxyStreamTrace, AnUnbelievableUsageIsNotTheCount) {
  const auto traced = [](const char* usage) {
    Trajectory t;
    t.Absorb(json::parse(std::string(R"({"prompt_token_ids": [1, 2], "usage": )") + usage +
                         R"(, "choices": [{"index": 0, "token_ids": [7, 8, 9]}]})"));
    return t;
  };
  for (const char* usage : {R"({"prompt_tokens": 2, "completion_tokens": 18446744073709551615})",
                            R"({"prompt_tokens": 4294967296, "completion_tokens": 3})",
                            R"({"prompt_tokens": 2, "completion_tokens": 2})",
                            R"({"prompt_tokens": 1, "completion_tokens": 3})"}) {
    const Trajectory t = traced(usage);
    EXPECT_FALSE(t.UsageBelievable()) << usage;
    EXPECT_EQ(t.prompt_count(), 2u) << usage;
    EXPECT_EQ(t.completion_count(), 3u) << usage;
    EXPECT_TRUE(t.Truncated()) << usage;
    EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty()) << usage;
  }
  const Trajectory fine = traced(R"({"prompt_tokens": 4294967295, "completion_tokens": 30})");
  EXPECT_TRUE(fine.UsageBelievable());
  EXPECT_EQ(fine.prompt_count(), 4294967295u);
  EXPECT_EQ(fine.completion_count(), 30u);
  EXPECT_FALSE(fine.Truncated());
  EXPECT_EQ(JournalTrajectoryParts("r1", fine).size(), 1u);
}

// Proves a trajectory the parts cannot hold whole (a prompt and an output of the entry bound
// each) journals no parts, and a cut trace none either. Catches parts silently stopping at
// kTrajectoryPartsMax, which the audit would re-verify as the whole trajectory.
TEST(ProxyStreamParts, ATrajectoryIsJournaledWholeOrNotAtAll) {
  Trajectory t;
  json ids = json::array();
  for (std::size_t i = 0; i < kTrajectoryEntriesMax; ++i) ids.push_back(1);
  t.prompt_token_ids = ids;
  t.choices[0].token_ids.assign(kTrajectoryEntriesMax, 2);
  EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty());
  t.choices[0].token_ids.assign(kTrajectoryTokensPerRecordMax, 2);
  EXPECT_EQ(JournalTrajectoryParts("r1", t).size(), kTrajectoryPartsMax);
  t.choices[0].cut = true;
  EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty());
  t.choices[0].cut = false;
  t.prompt_cut = true;
  EXPECT_TRUE(JournalTrajectoryParts("r1", t).empty());
}

// Proves a cut in another choice (an id that is no token, or choice indexes past their bound)
// still journals choice 0 whole, and that choice 0 has its place after the bound; catches one
// trace-wide flag that drops the journaled choice's parts for another choice's fault (the audit
// then finds no trajectory for a rollout whose choice 0 the engine sent whole).
TEST(ProxyStreamParts, ACutInAnotherChoiceStillJournalsChoiceZero) {
  Trajectory t;
  for (std::size_t i = 1; i <= kTrajectoryChoicesMax + 1; ++i) {
    t.Absorb(json{{"choices", json::array({json{{"index", i}, {"token_ids", {1}}}})}});
  }
  t.Absorb(json::parse(R"({"prompt_token_ids": [3, 4], "choices": [
      {"index": 0, "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -1.5]}},
      {"index": 1, "token_ids": ["x"]}]})"));
  EXPECT_TRUE(t.truncated);
  EXPECT_TRUE(t.choices.at(1).cut);
  EXPECT_FALSE(t.choices.at(0).cut);
  const std::vector<TrajectoryRecorded> parts = JournalTrajectoryParts("r1", t);
  ASSERT_EQ(parts.size(), 1u);
  EXPECT_EQ(parts[0].prompt_token_ids, (std::vector<std::int32_t>{3, 4}));
  EXPECT_EQ(parts[0].output_token_ids, (std::vector<std::int32_t>{5, 6}));
  EXPECT_EQ(parts[0].output_logprobs, (std::vector<float>{-0.5f, -1.5f}));
}

// Proves what a client receives of a streamed chunk: the fields the proxy added removed, and no
// event at all for the usage-only chunk it did not ask for, while the trace still takes both;
// would catch PassChunk stripping before the trace read the chunk.
TEST(ProxyStreamEvents, AddedFieldsAreStrippedAfterTheTraceTookThem) {
  Trajectory t;
  const json chunk = json::parse(R"({"prompt_token_ids": [1], "choices": [{"index": 0,
    "text": "hi", "token_ids": [5], "delta": {"token_ids": [6]}}]})");
  const AddedFields ids_and_usage{.token_ids = true, .usage = true};
  const std::optional<std::string> event = PassChunk(t, chunk, ids_and_usage);
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ(*event, R"(data: {"choices":[{"delta":{},"index":0,"text":"hi"}]})"
                    "\n\n");
  EXPECT_EQ(t.choices.at(0).token_ids, (std::vector<std::int64_t>{5}));

  const json usage = json::parse(R"({"choices": [], "usage": {"prompt_tokens": 1,
    "completion_tokens": 1}})");
  EXPECT_FALSE(PassChunk(t, usage, ids_and_usage).has_value());
  EXPECT_EQ(t.usage_completion, 1u);
  EXPECT_TRUE(PassChunk(t, usage, AddedFields{.token_ids = true}).has_value());
}

// A completion chunk's data padded with about `pad_bytes` of empty objects: a tree ~30 times its
// text.
std::string PaddedChunk(std::size_t pad_bytes) {
  std::string data = R"({"choices":[{"index":0,"text":"a","token_ids":[5]}],"pad":[{})";
  while (data.size() < pad_bytes) data += ",{}";
  return data + "]}";
}

// Proves a streamed event's hold takes StreamEventBytesBound (its nodes, not its text) before a
// large event is parsed, gives the previous event's share back before it takes the next one's,
// holds nothing for a small event, and gives all back on Release and when it dies. Catches the
// shares of the many events of one engine read added up (a stream refused for events long gone),
// a share kept past its event, and small chunks charged (two shared atomics on every token).
TEST(ProxyStreamEventHold, ALargeEventIsHeldWhileParsedAndASmallOneCostsNothing) {
  const std::string small = R"({"choices":[{"index":0,"text":"a","token_ids":[5]}]})";
  const std::string big = PaddedChunk(96 << 10);
  const std::uint64_t bound = StreamEventBytesBound(big);
  EXPECT_GT(bound, 30 * big.size()) << "the bound counts the text, not the nodes it makes";
  ByteBudget budget(std::uint64_t{64} << 20);
  ASSERT_LT(2 * bound, budget.max());
  {
    StreamEventHold hold(&budget);
    EXPECT_TRUE(hold.Take(small));
    EXPECT_EQ(budget.used(), 0u) << "a token's chunk was charged";
    EXPECT_TRUE(hold.Take(big));
    EXPECT_EQ(budget.used(), bound);
    EXPECT_EQ(hold.held(), bound);
    EXPECT_TRUE(hold.Take(big));
    EXPECT_EQ(budget.used(), bound) << "the previous event's share was kept";
    EXPECT_TRUE(hold.Take(small));
    EXPECT_EQ(budget.used(), 0u) << "a large event's share outlived it";
    EXPECT_TRUE(hold.Take(big));
    hold.Release();
    EXPECT_EQ(budget.used(), 0u);
    EXPECT_TRUE(hold.Take(big));
    EXPECT_FALSE(hold.refused());
  }
  EXPECT_EQ(budget.used(), 0u) << "a dying hold kept its share";
}

// Proves an event whose bound is more than the budget has left (though less than the budget) is
// refused before it is parsed, holding nothing and leaving what others hold as it was, and that
// the refusal stays while small events still pass. Catches a check against the budget's size
// rather than what is left, and a refusal that keeps part of what it asked for.
TEST(ProxyStreamEventHold, AnEventOverWhatIsLeftIsRefusedHoldingNothing) {
  const std::string big = PaddedChunk(96 << 10);
  const std::uint64_t bound = StreamEventBytesBound(big);
  ByteBudget budget(bound + bound / 2);
  BudgetHold other(&budget);
  ASSERT_TRUE(other.Grow(bound));
  StreamEventHold hold(&budget);
  EXPECT_FALSE(hold.Take(big));
  EXPECT_TRUE(hold.refused());
  EXPECT_EQ(hold.held(), 0u);
  EXPECT_EQ(budget.used(), bound) << "the refused event holds part of its bound";
  EXPECT_TRUE(hold.Take(R"({"choices":[]})"));
  EXPECT_TRUE(hold.refused()) << "the stream's refusal was forgotten";
  other.Release();
  EXPECT_TRUE(hold.Take(big)) << "refused with the whole budget free";
  hold.Release();
  EXPECT_EQ(budget.used(), 0u);
}

// Proves a stream's buffer hold costs nothing up to kStreamBufferUnheldBytesMax, holds exactly
// what the stream buffers past it (growing and shrinking with it, back to nothing once the stream
// buffers little), refuses what the budget cannot give while keeping what it held, and gives
// all back on Release and when it dies. Catches bytes a stalled client leaves buffered held
// short of what they are, a hold kept once the buffers emptied, and every read of a token stream
// charged (two shared atomics per event).
TEST(ProxyStreamBufferHold, HoldsWhatAStreamBuffersPastItsThreshold) {
  constexpr std::uint64_t kUnheld = kStreamBufferUnheldBytesMax;
  ByteBudget budget(std::uint64_t{1} << 20);
  BudgetHold other(&budget);
  {
    StreamBufferHold hold(&budget);
    EXPECT_TRUE(hold.HoldFor(300));
    EXPECT_TRUE(hold.HoldFor(kUnheld));
    EXPECT_EQ(budget.used(), 0u) << "a token's events were charged";
    EXPECT_TRUE(hold.HoldFor(kUnheld + 1));
    EXPECT_EQ(budget.used(), kUnheld + 1);
    EXPECT_TRUE(hold.HoldFor(600 << 10));
    EXPECT_EQ(budget.used(), 600u << 10);
    EXPECT_TRUE(hold.HoldFor(200 << 10));
    EXPECT_EQ(budget.used(), 200u << 10) << "the events written were still held";
    EXPECT_TRUE(hold.HoldFor(100));
    EXPECT_EQ(budget.used(), 0u) << "a stream buffering little kept its hold";
    EXPECT_TRUE(hold.HoldFor(300 << 10));
    ASSERT_TRUE(other.Grow((1 << 20) - (500 << 10)));
    EXPECT_FALSE(hold.HoldFor(600 << 10)) << "held past what the budget has left";
    EXPECT_EQ(hold.held(), 300u << 10) << "a refusal changed what was held";
    EXPECT_EQ(budget.used(), (1u << 20) - (200u << 10));
    EXPECT_TRUE(hold.HoldFor(400 << 10));
    hold.Release();
    EXPECT_EQ(hold.held(), 0u);
    EXPECT_TRUE(hold.HoldFor(150 << 10));
  }
  other.Release();
  EXPECT_EQ(budget.used(), 0u) << "a dying hold kept its share";
}

// Proves the pending SSE buffer a large event left (its bytes erased, its capacity kept) is given
// back to what it holds, so a token read's buffers count under kStreamBufferUnheldBytesMax again
// and hold nothing; while a buffer receiving an event (a quarter of its capacity or more) or
// within kSsePendingKeptBytesMax keeps its room. Catches a buffer of 64 KiB..1 MiB kept for the
// rest of its stream (held, and two atomics on the shared budget per token read), and one
// reallocated on every read while an event grows in it.
TEST(ProxyStreamBufferHold, ThePendingBufferALargeEventLeftIsGivenBack) {
  std::string left(std::size_t{300} << 10, 'b');
  left.erase(0, left.size() - 100);  // the event dispatched, the next one's first bytes kept
  ASSERT_GE(left.capacity(), std::size_t{300} << 10);
  TrimSsePending(left);
  EXPECT_EQ(left, std::string(100, 'b'));
  EXPECT_LE(left.capacity(), kSsePendingKeptBytesMax) << "the large event's room was kept";
  ByteBudget budget(std::uint64_t{1} << 20);
  StreamBufferHold hold(&budget);
  EXPECT_TRUE(hold.HoldFor(left.capacity() + (4 << 10)));  // and a token read's client events
  EXPECT_EQ(budget.used(), 0u) << "a token read after a large event was charged";

  std::string receiving(std::size_t{300} << 10, 'b');
  receiving.erase(0, std::size_t{200} << 10);  // an event being received: a third of the room
  const std::size_t room = receiving.capacity();
  TrimSsePending(receiving);
  EXPECT_EQ(receiving.capacity(), room) << "an event being received lost the room it grows into";
  EXPECT_EQ(receiving.size(), std::size_t{100} << 10);

  std::string within;
  within.reserve(kSsePendingKeptBytesMax / 2);
  within.append("ab");
  const std::size_t kept = within.capacity();
  TrimSsePending(within);
  EXPECT_EQ(within.capacity(), kept) << "a buffer within the kept bound was reallocated";
  EXPECT_EQ(within, "ab");
}

// Proves a hold moved to another (an answer's, handed to the connection that writes it) moves
// what it holds without touching the budget, the one moved from holding nothing, and that a hold
// resized holds exactly what it is asked for or, refused, what it held. Catches a hand-over that
// gives the answer's bytes back (or holds them twice) and a refused resize that half-applies.
TEST(ProxyStreamBufferHold, AHoldMovesWithWhatItHolds) {
  ByteBudget budget(1000);
  BudgetHold answer(&budget);
  ASSERT_TRUE(answer.Grow(600));
  BudgetHold handed = std::move(answer);
  EXPECT_EQ(handed.held(), 600u);
  EXPECT_EQ(answer.held(), 0u);  // NOLINT(bugprone-use-after-move): what a move leaves
  EXPECT_EQ(budget.used(), 600u);
  answer.Release();
  EXPECT_EQ(budget.used(), 600u);
  EXPECT_TRUE(handed.ResizeTo(200));
  EXPECT_EQ(budget.used(), 200u);
  EXPECT_TRUE(handed.ResizeTo(900));
  EXPECT_EQ(budget.used(), 900u);
  EXPECT_FALSE(handed.ResizeTo(1001));
  EXPECT_EQ(handed.held(), 900u);
  BudgetHold later(&budget);
  later = std::move(handed);
  EXPECT_EQ(later.held(), 900u);
  EXPECT_EQ(budget.used(), 900u);
  later = BudgetHold(&budget);
  EXPECT_EQ(budget.used(), 0u) << "a hold replaced kept what it held";
}

// Proves the proxy reads a client's stream_options as vLLM does: given as an object, it asks for
// usage unless include_usage is false (or null); absent, it does not. Catches usage removed from
// streams whose client asked for it through vLLM's default ({} or continuous_usage_stats alone).
TEST(ProxyStreamEvents, UsageIsTheClientsAsVllmReadsStreamOptions) {
  auto usage_added = [](const char* options) {
    json body = json::parse(
        std::string(R"({"prompt": "a", "stream": true)") +
        (options[0] == '\0' ? "" : std::string(", \"stream_options\": ") + options) + "}");
    const AddedFields added = AddTraceFields(ProxyRoute::kCompletions, true, body);
    EXPECT_EQ(body["stream_options"]["include_usage"], json(true)) << options;
    return added.usage;
  };
  EXPECT_TRUE(usage_added(""));
  EXPECT_TRUE(usage_added("null"));
  EXPECT_FALSE(usage_added("{}"));
  EXPECT_FALSE(usage_added(R"({"continuous_usage_stats": true})"));
  EXPECT_FALSE(usage_added(R"({"include_usage": true})"));
  EXPECT_TRUE(usage_added(R"({"include_usage": false})"));
  EXPECT_TRUE(usage_added(R"({"include_usage": null})"));
}

// Proves which requests get the sampled tokens' logprobs added, per route, in the form vLLM
// 0.25.1 reads, and that a client's own logprobs request (or one the engine must refuse) is left
// as written; would catch the proxy overriding a client's top-k, adding prompt logprobs through
// echo, or sending chat top_logprobs without logprobs.
TEST(ProxyTraceFields, LogprobsAreAddedOnlyWhereTheClientAskedForNone) {
  json c = json::parse(R"({"prompt": "x"})");
  EXPECT_TRUE(AddTraceFields(ProxyRoute::kCompletions, false, c).logprobs);
  EXPECT_EQ(c["logprobs"], 0);
  EXPECT_EQ(c["return_token_ids"], true);
  for (const char* kept :
       {R"({"logprobs": 3})", R"({"logprobs": 0})", R"({"echo": true})", R"({"logprobs": "x"})"}) {
    json body = json::parse(kept);
    const json before = body;
    EXPECT_FALSE(AddTraceFields(ProxyRoute::kCompletions, false, body).logprobs) << kept;
    EXPECT_EQ(body.value("logprobs", json()), before.value("logprobs", json())) << kept;
  }
  json null_lp = json::parse(R"({"logprobs": null, "echo": false})");
  EXPECT_TRUE(AddTraceFields(ProxyRoute::kCompletions, true, null_lp).logprobs);
  EXPECT_EQ(null_lp["logprobs"], 0);

  for (const char* none : {"{}", R"({"logprobs": false})", R"({"logprobs": null,
                           "top_logprobs": 0})"}) {
    json chat = json::parse(none);
    EXPECT_TRUE(AddTraceFields(ProxyRoute::kChat, true, chat).logprobs) << none;
    EXPECT_EQ(chat["logprobs"], true);
    EXPECT_EQ(chat["top_logprobs"], 0);
  }
  for (const char* kept : {R"({"logprobs": true, "top_logprobs": 2})", R"({"logprobs": true})",
                           R"({"top_logprobs": 2})", R"({"logprobs": 1})", R"({"echo": true})"}) {
    json chat = json::parse(kept);
    const json before = chat;
    EXPECT_FALSE(AddTraceFields(ProxyRoute::kChat, false, chat).logprobs) << kept;
    EXPECT_EQ(chat.value("logprobs", json()), before.value("logprobs", json())) << kept;
    EXPECT_EQ(chat.value("top_logprobs", json()), before.value("top_logprobs", json())) << kept;
  }

  json gen = json::parse(R"({"token_ids": [1]})");
  const AddedFields g = AddTraceFields(ProxyRoute::kGenerate, false, gen);
  EXPECT_TRUE(g.logprobs);
  EXPECT_FALSE(g.token_ids);
  EXPECT_EQ(gen["sampling_params"], json::parse(R"({"logprobs": 0})"));
  EXPECT_FALSE(gen.contains("return_token_ids"));
  json gen_asked = json::parse(R"({"token_ids": [1], "sampling_params": {"logprobs": 2}})");
  EXPECT_FALSE(AddTraceFields(ProxyRoute::kGenerate, false, gen_asked).logprobs);
  EXPECT_EQ(gen_asked["sampling_params"]["logprobs"], 2);
}

// Proves a client that asked for no logprobs gets each choice's logprobs back as null (vLLM's
// answer to it) in buffered answers and streamed chunks, while the trace keeps one logprob per
// output token; and that a client's own logprobs pass unchanged; would catch logprobs leaking to
// a client that did not ask, or being stripped before the trace took them.
TEST(ProxyStreamEvents, AddedLogprobsAreNullForTheClientAndKeptInTheTrace) {
  const json chunk = json::parse(R"({"choices": [{"index": 0, "text": "ab", "token_ids": [97, 98],
    "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25],
                 "top_logprobs": [{"a": -0.5}, {"b": -0.25}], "text_offset": [0, 1]}}]})");
  Trajectory t;
  const std::optional<std::string> event =
      PassChunk(t, chunk, AddedFields{.token_ids = true, .logprobs = true});
  ASSERT_TRUE(event.has_value());
  EXPECT_EQ(*event, "data: {\"choices\":[{\"index\":0,\"logprobs\":null,\"text\":\"ab\"}]}\n\n");
  EXPECT_EQ(t.choices.at(0).logprobs, json::parse("[-0.5, -0.25]"));

  Trajectory asked;
  const std::optional<std::string> own = PassChunk(asked, chunk, AddedFields{});
  ASSERT_TRUE(own.has_value());
  EXPECT_EQ(json::parse(own->substr(6)), chunk);

  json chat = json::parse(R"({"choices": [{"index": 0, "message": {"content": "a"},
    "logprobs": {"content": [{"token": "a", "logprob": -0.125, "top_logprobs": []}]}},
    {"index": 1, "message": {"content": "b"}}]})");
  Trajectory buffered;
  buffered.Absorb(chat);
  StripAdded(chat, AddedFields{.logprobs = true});
  EXPECT_TRUE(chat["choices"][0]["logprobs"].is_null());
  EXPECT_FALSE(chat["choices"][1].contains("logprobs"));  // never added where vLLM had none
  EXPECT_EQ(buffered.choices.at(0).logprobs, json::parse("[-0.125]"));
}

// Proves a completion with echo, whose logprobs score the prompt first, records only the output
// tokens' logprobs, aligned to its output token ids; would catch prompt logprobs recorded as the
// output's (every recorded logprob then belongs to another token).
TEST(ProxyStreamTrace, EchoedCompletionLogprobsAlignToTheOutput) {
  Trajectory t;
  t.Absorb(json::parse(R"({"choices": [{"index": 0, "token_ids": [7, 8],
    "logprobs": {"token_logprobs": [null, -3.0, -0.5, -0.25]}}]})"));
  EXPECT_EQ(t.choices.at(0).logprobs, json::parse("[-0.5, -0.25]"));
  EXPECT_EQ(t.entries, 4u);
}

// Whether CheckRequestChoices lets `body` (JSON text, "IDS" standing for a long list of token
// ids) through on `route`.
bool ChoicesFit(ProxyRoute route, std::string body) {
  json ids = json::array();
  for (int i = 0; i < 100000; ++i) ids.push_back(7);
  for (std::size_t at = body.find("IDS"); at != std::string::npos; at = body.find("IDS")) {
    body.replace(at, 3, ids.dump());
  }
  json doc = json::parse(body);
  return CheckRequestChoices(route, doc).ok();
}

// Proves CheckRequestChoices counts a request's choices as vLLM numbers them: one list of token
// ids is one prompt whatever its length, a list of strings or of token-id lists (or a mixed one)
// as many prompts as items, prompt_embeds adding theirs, n per prompt; chat and generate one
// prompt; `best_of`, no field of vLLM's requests, neither checked nor counted on any route. Would
// catch a long token-id prompt counted by its length (a request refused that the trace holds), a
// batch counted as one prompt (2 x 65536 choices admitted, indexes past the trace's bound), or a
// request refused for a `best_of` vLLM ignores.
TEST(ProxyRequestChoices, ChoicesAreCountedAsVllmNumbersThem) {
  constexpr auto kCompletions = ProxyRoute::kCompletions;
  EXPECT_TRUE(ChoicesFit(kCompletions, R"({"prompt": IDS, "n": 65536})"));
  EXPECT_TRUE(ChoicesFit(kCompletions, R"({"prompt": [IDS, IDS], "n": 32768})"));
  EXPECT_FALSE(ChoicesFit(kCompletions, R"({"prompt": [IDS, IDS], "n": 32769})"));
  EXPECT_FALSE(ChoicesFit(kCompletions, R"({"prompt": ["a", 1], "n": 32769})"));
  EXPECT_FALSE(ChoicesFit(kCompletions, R"({"prompt": ["a", "b"], "n": "32769"})"));
  EXPECT_TRUE(ChoicesFit(kCompletions, R"({"prompt_embeds": "e", "n": 65536})"));
  EXPECT_FALSE(ChoicesFit(kCompletions, R"({"prompt": "a", "prompt_embeds": "e", "n": 32769})"));
  EXPECT_TRUE(ChoicesFit(kCompletions, R"({"prompt": ["a", "b"], "n": 1, "best_of": 32769})"));
  EXPECT_TRUE(ChoicesFit(kCompletions, R"({"prompt": "a", "best_of": "two"})"));
  EXPECT_TRUE(ChoicesFit(kCompletions, R"({"prompt": "a", "best_of": null})"));
  EXPECT_TRUE(ChoicesFit(ProxyRoute::kChat, R"({"messages": [IDS, IDS, IDS], "n": 65536})"));
  EXPECT_TRUE(ChoicesFit(ProxyRoute::kChat, R"({"messages": [], "best_of": 65537})"));
  EXPECT_FALSE(ChoicesFit(ProxyRoute::kChat, R"({"messages": [], "n": 65537})"));
  EXPECT_TRUE(ChoicesFit(ProxyRoute::kGenerate, R"({"token_ids": IDS, "n": 70000})"));
  EXPECT_TRUE(ChoicesFit(ProxyRoute::kGenerate, R"({"sampling_params": {"n": 65536}})"));
  EXPECT_FALSE(ChoicesFit(ProxyRoute::kGenerate, R"({"sampling_params": {"n": 65537}})"));
  EXPECT_TRUE(ChoicesFit(ProxyRoute::kGenerate, R"({"sampling_params": {"best_of": 2.5}})"));
}

// `body` after CheckRequestChoices on `route`, with the check's status.
std::pair<Status, json> Checked(ProxyRoute route, json body) {
  Status st = CheckRequestChoices(route, body);
  return {std::move(st), std::move(body)};
}

// Proves `n` is read as vLLM's pydantic models read an `int` in lax mode, and that a value of
// another form is forwarded as the JSON integer it was read as: a float with no fractional part
// (65536.0 the bound), a string of digits with a sign, White_Space around (Unicode's too), leading
// zeros, a ".0" tail or underscores between digits, and true; on chat and in generate's
// sampling_params too. Would catch 2.0, "2" or 1.0 refused (the requests vLLM serves, as they
// were before the bound), or let through unchanged so the engine counts choices the proxy did not
// read (the engine's own reading of the text deciding the trace's choices).
TEST(ProxyRequestChoices, NIsReadAsVllmReadsAnIntAndForwardedAsThatInteger) {
  const std::vector<std::pair<json, std::int64_t>> accepted = {
      {json::parse("2.0"), 2},
      {json::parse("2e0"), 2},
      {json::parse("1.0"), 1},
      {json::parse("65536.0"), 65536},
      {"2", 2},
      {"  2 ", 2},
      {"\t2\n", 2},
      {"\u00a02\u3000", 2},  // NO-BREAK SPACE and IDEOGRAPHIC SPACE are White_Space
      {"+2", 2},
      {"002", 2},
      {"2.00", 2},
      {"1_0", 10},
      {"0_7", 7},
      {"65536", 65536},
      {true, 1}};
  for (const auto& [n, want] : accepted) {
    const auto [st, body] = Checked(ProxyRoute::kCompletions, {{"prompt", "a"}, {"n", n}});
    EXPECT_TRUE(st.ok()) << n.dump() << ": " << st.ToString();
    EXPECT_TRUE(body["n"].is_number_integer()) << n.dump() << " forwarded as " << body["n"];
    EXPECT_EQ(body["n"], want) << n.dump();
  }
  const auto [chat_st, chat] =
      Checked(ProxyRoute::kChat, {{"messages", json::array()}, {"n", "3"}});
  EXPECT_TRUE(chat_st.ok()) << chat_st.ToString();
  EXPECT_EQ(chat["n"], 3);
  EXPECT_TRUE(chat["n"].is_number_integer());
  const auto [gen_st, gen] =
      Checked(ProxyRoute::kGenerate, {{"token_ids", {1}}, {"sampling_params", {{"n", 4.0}}}});
  EXPECT_TRUE(gen_st.ok()) << gen_st.ToString();
  EXPECT_TRUE(gen["sampling_params"]["n"].is_number_integer());
  EXPECT_EQ(gen["sampling_params"]["n"], 4);
  // An integer is forwarded as the client wrote it.
  const auto [int_st, as_sent] = Checked(ProxyRoute::kCompletions, {{"prompt", "a"}, {"n", 2}});
  EXPECT_TRUE(int_st.ok());
  EXPECT_EQ(as_sent.dump(), R"({"n":2,"prompt":"a"})");
}

// Proves every `n` vLLM refuses stays a one-line 400 naming the field, and nothing throws: a
// fraction, a non-finite number (nlohmann's parser refuses 1e400 itself, so it is built here), a
// string pydantic reads no integer in ("2." and "1e3" included, a zero-width space not being
// White_Space), a list, and whole numbers outside 1..65536 in every form (65537.0, -0.0, false,
// past int64). Would catch a lax reading wider than vLLM's (a request admitted that the engine
// then refuses, or reads otherwise) or the bound checked on the wrong value.
TEST(ProxyRequestChoices, AnNVllmRefusesIsStillRefused) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<json> not_integers = {json::parse("2.5"),
                                          json::parse("1e-1"),
                                          inf,
                                          -inf,
                                          std::nan(""),
                                          "two",
                                          "2.",
                                          "2.5",
                                          "2.0.0",
                                          "1e3",
                                          "0x10",
                                          "",
                                          "  ",
                                          "1__0",
                                          "_1",
                                          "1_",
                                          "1_.0",
                                          "+-2",
                                          "--2",
                                          "-+2",
                                          "++2",
                                          "- 2",
                                          "\u200b2",
                                          "\uff12",
                                          json::array({2}),
                                          json::object()};
  for (const json& n : not_integers) {
    const auto [st, body] = Checked(ProxyRoute::kCompletions, {{"prompt", "a"}, {"n", n}});
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << n.dump();
    EXPECT_EQ(st.message(), "'n' must be an integer") << n.dump();
  }
  const std::vector<json> out_of_range = {json::parse("65537.0"),
                                          json::parse("-0.0"),
                                          json::parse("18446744073709551617"),
                                          json::parse("1e300"),
                                          0,
                                          -1,
                                          false,
                                          "0",
                                          "-0",
                                          "-1",
                                          " 65537 ",
                                          "99999999999999999999999999"};
  for (const json& n : out_of_range) {
    const auto [st, body] = Checked(ProxyRoute::kCompletions, {{"prompt", "a"}, {"n", n}});
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << n.dump();
    EXPECT_EQ(st.message(), "'n' must be in 1..65536") << n.dump();
  }
  const auto [gen_st, gen] =
      Checked(ProxyRoute::kGenerate, {{"token_ids", {1}}, {"sampling_params", {{"n", "2.5"}}}});
  EXPECT_EQ(gen_st.message(), "'sampling_params.n' must be an integer");
}

// Proves `n: null` is read per route as vLLM's models read it: chat's `n` is optional (null is
// one choice), completions' and generate's are not (a 400 before admission, as vLLM answers).
// Catches a request admitted durably that the engine then refuses for a null `n`.
TEST(ProxyRequestChoices, AnNullNIsOneChoiceOnlyWhereVllmAllowsNull) {
  const auto [chat_st, chat] =
      Checked(ProxyRoute::kChat, {{"messages", json::array()}, {"n", nullptr}});
  EXPECT_TRUE(chat_st.ok()) << chat_st.ToString();
  const auto [cmpl_st, cmpl] = Checked(ProxyRoute::kCompletions, {{"prompt", "a"}, {"n", nullptr}});
  EXPECT_EQ(cmpl_st.code(), Code::kInvalidArgument);
  EXPECT_EQ(cmpl_st.message(), "'n' must be an integer");
  const auto [gen_st, gen] =
      Checked(ProxyRoute::kGenerate, {{"token_ids", {1}}, {"sampling_params", {{"n", nullptr}}}});
  EXPECT_EQ(gen_st.code(), Code::kInvalidArgument);
  EXPECT_EQ(gen_st.message(), "'sampling_params.n' must be an integer");
}

}  // namespace
}  // namespace rc::service
