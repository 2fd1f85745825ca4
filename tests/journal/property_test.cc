// Property tests (rapidcheck): codec round trips of random events of every type, snapshot + tail
// equals a full refold on random legal histories, and reopen reproduces the state before close.
#include <gtest/gtest.h>

#include "journal/codec.h"
#include "journal/journal.h"
#include "journal/testing/random_history.h"
#include "tests/journal/test_util.h"

#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

namespace rc::journal {
namespace {

// Proves any event with arbitrary field values (random bytes in strings, any in-range enum)
// round-trips through the record codec; catches truncation, sign or width bugs in a field.
RC_GTEST_PROP(CodecProperty, RandomEventsRoundTrip, (std::uint64_t seed)) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 50; ++i) {
    Record in;
    in.seq = rng();
    in.wall_time_ms = static_cast<std::int64_t>(rng());
    in.cause_seq = rng();
    for (auto& b : in.prev_hash) b = static_cast<std::uint8_t>(rng());
    in.event = testing::RandomEvent(rng);
    const std::string bytes = EncodeRecord(in);
    Result<Record> out = DecodeRecord(bytes);
    RC_ASSERT(out.ok());
    RC_ASSERT(out->event == in.event);
    RC_ASSERT(out->seq == in.seq && out->wall_time_ms == in.wall_time_ms &&
              out->cause_seq == in.cause_seq && out->prev_hash == in.prev_hash);
  }
}

// Proves the snapshot codec round-trips folded states of random legal histories; catches a
// State field the snapshot forgets (e.g. drain_seen or the taint record).
RC_GTEST_PROP(CodecProperty, FoldedStatesRoundTrip, (std::uint64_t seed)) {
  const auto events = *::rc::gen::inRange<std::size_t>(1, 400);
  State s;
  testing::RandomHistory(seed, events, &s);
  Result<State> out = DecodeState(EncodeState(s));
  RC_ASSERT(out.ok());
  RC_ASSERT(*out == s);
}

// Proves that for random legal histories and snapshot intervals, LoadState (latest snapshot +
// tail) equals a full Refold and the live fold, and that a reopen reproduces the state before
// close; catches a snapshot written at the wrong seq or a tail scan that skips events.
RC_GTEST_PROP(StoreProperty, SnapshotPlusTailEqualsRefoldAndReopen, (std::uint64_t seed)) {
  const auto events = *::rc::gen::inRange<std::size_t>(1, 250);
  const auto every = *::rc::gen::inRange<std::uint64_t>(0, 40);
  testing::TempDir dir;
  Options o;
  o.sync = false;
  o.snapshot_every = every;
  State expected;
  const auto groups = testing::RandomHistory(seed, events, &expected);
  std::unique_ptr<Journal> j;
  {
    auto opened = Journal::Open(dir.path(), o);
    RC_ASSERT(opened.ok());
    j = std::move(opened.value());
  }
  for (const auto& g : groups) {
    AppendRequest r;
    r.events = g;
    r.expected_head_seq = j->head_seq();
    RC_ASSERT(j->Append(r).ok());
  }
  RC_ASSERT(j->state() == expected);
  Result<State> loaded = j->LoadState();
  Result<State> refold = j->Refold();
  RC_ASSERT(loaded.ok() && refold.ok());
  RC_ASSERT(*loaded == expected);
  RC_ASSERT(*refold == expected);
  const Hash head = j->head_hash();
  j.reset();
  auto reopened = Journal::Open(dir.path(), o);
  RC_ASSERT(reopened.ok());
  RC_ASSERT((*reopened)->state() == expected);
  RC_ASSERT((*reopened)->head_hash() == head);
}

}  // namespace
}  // namespace rc::journal
