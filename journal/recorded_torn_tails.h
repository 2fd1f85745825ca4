// The torn WAL tails executors' starts recorded, as replay and audit both list them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "journal/journal.h"
#include "statemachine/events.h"

namespace rc::journal {

// A torn WAL tail an executor's start recorded (RecoveryStarted with JournalEnding::kTornTail):
// the journal's open before that start could not read the tail of its WAL, and the records the
// torn batch held, if any, are lost. The WAL that showed it is gone once the journal is written
// on; the record keeps it.
struct RecordedTornTail {
  std::string engine;     // the engine whose record it is ("" in a journal of one engine)
  std::uint64_t seq = 0;  // the RecoveryStarted record
  std::uint64_t bytes_unread = 0;
  std::string sentence;  // the journal's own account, raw (escaped on output)
};
// The first ones are kept; the count stays exact.
inline constexpr std::size_t kRecordedTornTailsMax = 256;

// Notes `r` if it records a torn tail. A fleet's members each record the open they started from
// (its sentence names the seq that open recovered through): one torn tail is listed once, at the
// first record that names it. `last` holds the sentence of the last one noted.
inline void NoteRecordedTornTail(const Record& r, std::string& last,
                                 std::vector<RecordedTornTail>& kept, std::uint64_t& count) {
  const auto* rs = std::get_if<RecoveryStarted>(&r.event);
  if (rs == nullptr || rs->journal_ending != JournalEnding::kTornTail) return;
  if (rs->journal_torn_tail == last) return;
  last = rs->journal_torn_tail;
  count++;
  if (kept.size() >= kRecordedTornTailsMax) return;
  kept.push_back(
      RecordedTornTail{r.engine, r.seq, rs->journal_bytes_unread, rs->journal_torn_tail});
}

}  // namespace rc::journal
