// Small helpers shared by the service's files (service.cc, admission.cc, trainer_api.cc,
// metrics_render.cc, proxy_exchange.cc). Not part of the service's interface.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "effects/clock.h"
#include "effects/runner.h"
#include "journal/journal.h"
#include "statemachine/events.h"
#include "statemachine/quote.h"
#include "statemachine/state.h"
#include "statemachine/status.h"
#include "statemachine/text.h"

namespace rc::service::internal {

inline std::int64_t wall_ms() { return effects::wall_now_ms(); }

inline bool IsDecision(const Event& e) { return family_of(e) == Family::kDecision; }

// Outside text (engine bodies, client ids, journal details) as one log line.
inline std::string Esc(const std::string& s) { return rc::text::escape_line(s); }

// The exception being handled, as text: call only from inside a catch block.
inline std::string CurrentExceptionText() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

// A command for the operator to copy: the journal's path is one shell word whatever it holds
// (shell_quote's result is already one printable line; escape_line would double a backslash).
inline std::string ReplayHint(const std::string& journal_path) {
  return "explain it with: rolloutcore replay -- " + rc::text::shell_quote(journal_path);
}

// The answer counters of a request refused before anything of it was journaled.
struct UnjournaledRefusalCounters {
  std::atomic<std::uint64_t>* refused;   // the fold's lifecycle refusal (Rejected)
  std::atomic<std::uint64_t>* invalid;   // a request the fold found invalid (InvalidArgument)
  std::atomic<std::uint64_t>* conflict;  // an id in use for another body (Conflict)
};

// The codes of a refusal before anything was journaled (the fold's verdicts on the request).
inline bool IsUnjournaledRefusal(Code code) {
  return code == Code::kRejected || code == Code::kInvalidArgument || code == Code::kConflict;
}

// Counts the refusal by why, so an invalid request never shows as a conflict on /metrics.
inline void CountUnjournaledRefusal(Code code, const UnjournaledRefusalCounters& c) {
  RC_CHECK(IsUnjournaledRefusal(code));
  if (code == Code::kInvalidArgument) {
    ++*c.invalid;
  } else if (code == Code::kRejected) {
    ++*c.refused;
  } else {
    ++*c.conflict;
  }
}

// Journal errors after which nothing more may be decided or acknowledged.
inline bool IsJournalFailure(const Status& st) {
  return st.code() == Code::kIOError || st.code() == Code::kCorruption ||
         st.code() == Code::kInternal || st.code() == Code::kTimeout;
}

inline nlohmann::json TimingsJson(const effects::PhaseTimings& t) {
  return {{"drain_us", t.drain_us},       {"preflight_us", t.preflight_us},
          {"transfer_us", t.transfer_us}, {"invalidate_us", t.invalidate_us},
          {"validate_us", t.validate_us}, {"resume_us", t.resume_us},
          {"sleep_us", t.sleep_us},       {"wake_weights_us", t.wake_weights_us},
          {"wake_kv_us", t.wake_kv_us},   {"journal_us", t.journal_us},
          {"total_us", t.total_us}};
}

// The HTTP status an ended update or restore answers with.
inline int OutcomeHttpStatus(UpdateOutcome o) {
  switch (o) {
    case UpdateOutcome::kCommitted:
      return 200;
    case UpdateOutcome::kRefused:
      return 422;
    case UpdateOutcome::kTainted:
      return 500;
  }
  return 500;
}

// The journal's record of an update or a restore by its id: its request and, once it ended, its
// outcome. Scans the durable journal, at most `records_max` records back from durable_seq. One
// plan runs at a time, so the first UpdateEnded of the id after its request is that request's
// end: a later one is another kind's plan of the same id (each kind has its own ids).
template <class Request>
struct RequestLookup {
  std::optional<Request> request;
  std::optional<UpdateEnded> ended;
};

// `from_seq` (when not 0, the request's own seq, as the runner found it) starts the scan there.
template <class Request, class IdOf>
Result<RequestLookup<Request>> LookUpRequest(journal::Journal& j, const std::string& id,
                                             std::uint64_t durable_seq, std::uint64_t records_max,
                                             IdOf id_of, std::uint64_t from_seq = 0) {
  RequestLookup<Request> out;
  std::uint64_t from = durable_seq > records_max ? durable_seq - records_max + 1 : 1;
  if (from_seq != 0 && from_seq <= durable_seq) from = std::max(from, from_seq);
  Status st = j.Scan(from, durable_seq, [&](const journal::Record& r) {
    if (const auto* q = std::get_if<Request>(&r.event); q != nullptr && id_of(*q) == id) {
      out.request = *q;
      out.ended.reset();
    } else if (const auto* e = std::get_if<UpdateEnded>(&r.event)) {
      if (out.request && !out.ended && e->update_id == id) out.ended = *e;
    }
    return Status::OK();
  });
  if (!st.ok()) return st;
  return out;
}

}  // namespace rc::service::internal

namespace rc::service {

// The reason Shutdown cancels an open fleet update with; its end then names it after
// "cancelled: ", by which the fleet API tells the shutdown's cancel from an operator's.
inline constexpr const char* kShutdownCancelReason = "serve is shutting down";
struct DurableHead;
// The state as the trainer API reports it (/v1/state and every update or restore answer).
nlohmann::json SummaryJson(const State& s, const DurableHead& head);
}  // namespace rc::service
