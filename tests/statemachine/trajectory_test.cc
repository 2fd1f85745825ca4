// TrajectoryRecorded: a rollout's tokens and logprobs, kept in the journal for the audit.
#include <gtest/gtest.h>

#include <cmath>

#include "tests/statemachine/helpers.h"

namespace rc::test {
namespace {

// Proves a trajectory is accepted for an active rollout (in any part count), changes nothing but
// the event count, and passes the history checker; would catch a trajectory event that disturbs
// the lifecycle or is refused for a legitimate rollout.
TEST(Trajectory, RecordedForAnActiveRollout) {
  Driver d;
  d.to_ready();
  const std::string id = d.admit();
  State before = d.s;
  EXPECT_TRUE(d.ok(TrajectoryRecorded{id, 0, {1, 2, 3}, {97, 98}, {-0.5f, NAN}}).empty());
  EXPECT_TRUE(d.ok(TrajectoryRecorded{id, 1, {}, {99}, {}}).empty());
  before.counters.events += 2;
  EXPECT_EQ(d.s, before);
  d.ok(RolloutFinished{id, RolloutOutcome::kCompleted, 3, 3});
  HistoryReport h = check_history(d.history);
  EXPECT_TRUE(h.ok) << h.first_bad_seq << ": " << h.message;
}

// Proves trajectories are refused for a rollout that is not active (never admitted, or already
// finished), over the per-record token bound, or with a logprob count that does not match the
// output; would catch unbounded records or trajectories attributable to no binding.
TEST(Trajectory, RefusedWhenUnboundOrMalformed) {
  Driver d;
  d.to_ready();
  EXPECT_EQ(d.rejected(TrajectoryRecorded{"ghost", 0, {1}, {2}, {}}), Code::kNotFound);
  const std::string id = d.admit();
  std::vector<std::int32_t> many(kTrajectoryTokensPerRecordMax, 7);
  EXPECT_EQ(d.rejected(TrajectoryRecorded{id, 0, many, {1}, {}}), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(TrajectoryRecorded{id, 0, {1}, {2, 3}, {-1.0f}}), Code::kInvalidArgument);
  EXPECT_EQ(d.rejected(TrajectoryRecorded{"", 0, {1}, {2}, {}}), Code::kInvalidArgument);
  d.ok(RolloutFinished{id, RolloutOutcome::kCompleted, 1, 1});
  EXPECT_EQ(d.rejected(TrajectoryRecorded{id, 0, {1}, {2}, {}}), Code::kNotFound);
}

// Proves equality treats "not reported" (NaN) logprobs as equal, so replay's decision and codec
// round-trip comparisons hold for trajectories; would catch a NaN != NaN false mismatch.
TEST(Trajectory, EqualityTreatsNaNAsNotReported) {
  const TrajectoryRecorded a{"r", 0, {1}, {2, 3}, {NAN, -1.0f}};
  TrajectoryRecorded b = a;
  EXPECT_EQ(a, b);
  b.output_logprobs[1] = -1.5f;
  EXPECT_FALSE(a == b);
  b.output_logprobs = {-2.0f, -1.0f};
  EXPECT_FALSE(a == b);
}

}  // namespace
}  // namespace rc::test
