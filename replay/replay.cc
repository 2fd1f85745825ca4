#include "replay/replay.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <sstream>

#include "journal/json.h"
#include "statemachine/describe.h"
#include "statemachine/text.h"

namespace rc::replay {
namespace {

// Every string that reaches replay's text output passes through here, whatever its origin (event
// fields are client/engine text: a NUL truncated the report, a "\n" forged a verdict line).
std::string E(const std::string& s) { return text::escape_line(s); }

// JSON that holds journal strings: invalid UTF-8 is replaced, never thrown on.
std::string DumpSafe(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

// The decisions recorded after an input, waiting to be compared with decide()'s.
struct PendingInput {
  std::uint64_t seq = 0;
  std::vector<Event> expected;
  std::size_t matched = 0;
};

class Replayer {
 public:
  explicit Replayer(ReplayReport& report) : report_(report) {}

  Status Visit(const journal::Record& r) {
    report_.records++;
    report_.last_seq = r.seq;
    if (!report_.ok) return Status::OK();  // keep counting; the first failure is what matters
    if (r.cause_seq == 0) {
      if (!CloseInput()) return Status::OK();
      Result<std::vector<Event>> decided = decide(report_.state, r.event);
      if (!decided.ok()) {
        return Fail(r.seq, std::string("recorded input ") + event_name(r.event) +
                               " is rejected by decide(): " + decided.status().ToString());
      }
      pending_ = PendingInput{r.seq, std::move(decided.value()), 0};
      report_.inputs++;
    } else {
      if (r.cause_seq != pending_.seq) {
        return Fail(r.seq, "derived record names cause seq " + std::to_string(r.cause_seq) +
                               " but the open input is seq " + std::to_string(pending_.seq));
      }
      if (pending_.matched >= pending_.expected.size() ||
          !(pending_.expected[pending_.matched] == r.event)) {
        std::string want = pending_.matched < pending_.expected.size()
                               ? describe(pending_.expected[pending_.matched])
                               : "nothing";
        return Fail(r.seq, "non-determinism: recorded " + describe(r.event) +
                               " but decide() derives " + want);
      }
      pending_.matched++;
    }
    Status applied = apply(report_.state, r.event);
    if (!applied.ok()) return Fail(r.seq, "illegal record: " + applied.ToString());
    Track(r);
    return Status::OK();
  }

  void Finish() { CloseInput(); }

 private:
  bool CloseInput() {
    if (pending_.seq != 0 && pending_.matched != pending_.expected.size()) {
      Fail(pending_.seq, "non-determinism: decide() derives " +
                             std::to_string(pending_.expected.size()) + " decisions for seq " +
                             std::to_string(pending_.seq) + " but " +
                             std::to_string(pending_.matched) + " were recorded")
          .IgnoreError();
      return false;
    }
    return true;
  }

  Status Fail(std::uint64_t seq, std::string why) {
    report_.ok = false;
    report_.first_bad_seq = seq;
    report_.error = std::move(why);
    return Status::OK();
  }

  // Keeps the records of the update in flight so a TAINTED incident can be explained.
  void Track(const journal::Record& r) {
    if (std::holds_alternative<UpdateRequested>(r.event) ||
        std::holds_alternative<RestoreRequested>(r.event)) {
      update_records_.clear();
    }
    if (report_.state.update.has_value() || std::holds_alternative<StateChanged>(r.event) ||
        std::holds_alternative<UpdateEnded>(r.event)) {
      if (update_records_.size() < kTimelineRecordsMax) update_records_.push_back(r);
    }
    const auto* changed = std::get_if<StateChanged>(&r.event);
    if (changed != nullptr && changed->to == Lifecycle::kTainted) {
      report_.incidents.push_back(Explain(r.seq));
      last_taint_seq_ = r.seq;
    }
    const auto* published = std::get_if<VersionPublished>(&r.event);
    if (published != nullptr && report_.state.update->restore) {
      report_.restores.push_back(ExplainRestore(r.seq, *published));
    }
    if (changed != nullptr && changed->to == Lifecycle::kReady) update_records_.clear();
  }

  TaintIncident Explain(std::uint64_t taint_seq) const;
  RestoreProof ExplainRestore(std::uint64_t seq, const VersionPublished& p) const;
  const RestoreRequested* RestoreInFlight() const;

  static constexpr std::size_t kTimelineRecordsMax = 4096;
  ReplayReport& report_;
  PendingInput pending_;
  std::vector<journal::Record> update_records_;
  std::uint64_t last_taint_seq_ = 0;
};

// The restore request among the records of the update in flight, if it is a restore.
const RestoreRequested* Replayer::RestoreInFlight() const {
  for (const journal::Record& r : update_records_) {
    if (const auto* q = std::get_if<RestoreRequested>(&r.event)) return q;
  }
  return nullptr;
}

RestoreProof Replayer::ExplainRestore(std::uint64_t seq, const VersionPublished& p) const {
  RestoreProof proof;
  proof.publish_seq = seq;
  proof.restore_id = p.update_id;
  const RestoreRequested* q = RestoreInFlight();
  std::ostringstream out;
  out << "RESTORED at seq " << seq << ": restore '" << E(p.update_id)
      << "' took the engine back to '" << E(p.version.label) << "' (generation "
      << p.version.generation << ", checkpoint '" << E(p.identity.checkpoint) << "')"
      << (q == nullptr ? ""
          : q->adopt   ? " by adopting the engine as found"
                       : " by reloading " + E(q->source_uri))
      << "\n";
  out << "  proof: the weight digest " << E(p.engine_digest.substr(0, 16))
      << " taken while paused equals the one recorded when '" << E(p.version.label)
      << "' was served; every cache was reset after the reload";
  if (last_taint_seq_ != 0) out << "\n  it ends the TAINTED incident at seq " << last_taint_seq_;
  proof.explanation = out.str();
  return proof;
}

TaintIncident Replayer::Explain(std::uint64_t taint_seq) const {
  TaintIncident incident;
  incident.taint_seq = taint_seq;
  incident.timeline = update_records_;
  const TaintRecord& t = *report_.state.taint;
  incident.update_id = t.update_id;
  std::ostringstream out;
  // One line per fact: every field below is escaped, so the explanation's line count is fixed
  // by this code and never by what the journal holds.
  out << "TAINTED at seq " << taint_seq << " from " << lifecycle_name(t.from) << " ("
      << cause_name(t.cause) << "): " << E(t.detail) << "\n";
  out << "  update '" << E(t.update_id) << "' targeted '" << E(t.target.label) << "' (generation "
      << t.target.generation << "); last committed version '" << E(report_.state.committed.label)
      << "' (generation " << report_.state.committed.generation << ")\n";
  bool intent = false;
  for (const journal::Record& r : update_records_) {
    if (const auto* e = std::get_if<EffectStarted>(&r.event);
        e != nullptr && e->kind == EffectKind::kTransfer) {
      intent = true;
      out << "  seq " << r.seq << ": transfer intent durable (deadline " << e->deadline_ms
          << " ms) - from here on the engine's weights may have changed\n";
    }
    if (const auto* o = std::get_if<TransferObserved>(&r.event)) {
      out << "  seq " << r.seq << ": transfer " << (o->acknowledged ? "acknowledged" : "failed")
          << ", mutation " << mutation_name(o->mutation) << ", " << o->bytes_sent << " bytes / "
          << o->tensors_sent << " tensors in " << o->duration_us / 1000 << " ms"
          << (o->error.empty() ? "" : ": " + E(o->error)) << "\n";
    }
    if (const auto* c = std::get_if<CacheResetObserved>(&r.event)) {
      out << "  seq " << r.seq << ": " << cache_name(c->cache) << " cache reset "
          << E(describe(c->http)) << " success=" << (c->reported_success ? "true" : "false")
          << (c->success_unreported ? " (not reported by the engine)" : "") << "\n";
    }
    if (const auto* v = std::get_if<ValidationObserved>(&r.event)) {
      out << "  seq " << r.seq << ": validation " << E(describe(v->http)) << " reported '"
          << E(v->reported_label) << "'\n";
    }
    if (std::holds_alternative<RecoveryStarted>(r.event)) {
      out << "  seq " << r.seq << ": executor restarted\n";
    }
  }
  switch (t.cause) {
    case Cause::kTransferAmbiguous:
    case Cause::kRecoveredAmbiguous:
      out << "  reading: the transfer " << (intent ? "had started" : "state is unknown")
          << " and did not complete cleanly, so the engine may hold a mix of '"
          << E(report_.state.committed.label) << "' and '" << E(t.target.label)
          << "' tensors. Neither version can be claimed.\n";
      break;
    case Cause::kCacheResetFailed:
      out << "  reading: the new weights landed but a cache computed by the old weights could "
             "not be shown to be cleared; serving would risk stale KV/encoder reuse.\n";
      break;
    case Cause::kValidationFailed:
      out << (RestoreInFlight() != nullptr
                  ? "  reading: the restore's reload did not bring back the recorded weights "
                    "(the source holds other weights, or the reload was partial); the engine "
                    "stays TAINTED.\n"
                  : "  reading: after the mutation the engine did not prove it serves the "
                    "target; the weights it holds are unknown.\n");
      break;
    default:
      break;
  }
  out << "  nothing was published and no rollout was admitted after this point.\n";
  const State& st = report_.state;
  if (st.label_digests.count(st.committed.label) != 0) {
    out << "  recover: restore it with proof, e.g. `rolloutcore restore --label '"
        << E(st.committed.label) << "' --source <where its weights are>` (or --adopt for an "
        << "engine restarted on that checkpoint): it serves again only if its weight digest "
        << "equals the recorded one.";
  } else {
    out << "  recover: no weight digest was recorded for '" << E(st.committed.label)
        << "', so no restore can be proven: restart the engine from a known checkpoint and "
           "start a new journal.";
  }
  incident.explanation = out.str();
  return incident;
}

}  // namespace

Result<ReplayReport> Replay(journal::Journal& journal, const ReplayOptions& options) {
  ReplayReport report;
  Replayer replayer(report);
  Status scanned = journal.Scan(1, options.until_seq,
                                [&](const journal::Record& r) { return replayer.Visit(r); });
  if (!scanned.ok()) {
    // A chain, decode or contiguity failure: report it with the seq the journal named.
    report.ok = false;
    report.error = scanned.ToString();
    if (report.first_bad_seq == 0) report.first_bad_seq = report.last_seq + 1;
    return report;
  }
  if (report.ok) replayer.Finish();
  return report;
}

std::string FormatReport(const ReplayReport& report) {
  std::ostringstream out;
  out << "records: " << report.records << " (inputs re-decided: " << report.inputs << "), last seq "
      << report.last_seq << "\n";
  out << "state: " << E(describe(report.state)) << "\n";
  const Counters& c = report.state.counters;
  out << "rollouts: admitted " << c.rollouts_admitted << ", completed " << c.rollouts_completed
      << ", aborted " << c.rollouts_aborted << ", abandoned " << c.rollouts_abandoned
      << "; updates: requested " << c.updates_requested << ", committed " << c.updates_committed
      << ", refused " << c.updates_refused << "; restores: requested " << c.restores_requested
      << ", proven " << c.restores_committed << "; recoveries " << c.recoveries << "\n";
  if (report.ok) {
    out << "verification: OK (hash chain, legality of every record, every decision reproduced)\n";
  } else {
    out << "verification: FAILED at seq " << report.first_bad_seq << ": " << E(report.error)
        << "\n";
  }
  for (const TaintIncident& i : report.incidents) out << i.explanation << "\n";
  for (const RestoreProof& r : report.restores) out << r.explanation << "\n";
  return out.str();
}

std::string ReportJson(const ReplayReport& report) {
  nlohmann::json j;
  j["records"] = report.records;
  j["inputs"] = report.inputs;
  j["last_seq"] = report.last_seq;
  j["ok"] = report.ok;
  if (!report.ok) {
    j["first_bad_seq"] = report.first_bad_seq;
    j["error"] = report.error;
  }
  j["state"] = journal::StateToJson(report.state);
  j["incidents"] = nlohmann::json::array();
  for (const TaintIncident& i : report.incidents) {
    nlohmann::json inc;
    inc["taint_seq"] = i.taint_seq;
    inc["update_id"] = i.update_id;
    inc["explanation"] = i.explanation;
    inc["timeline"] = nlohmann::json::array();
    for (const journal::Record& r : i.timeline) inc["timeline"].push_back(journal::RecordToJson(r));
    j["incidents"].push_back(std::move(inc));
  }
  j["restores"] = nlohmann::json::array();
  for (const RestoreProof& r : report.restores) {
    j["restores"].push_back({{"publish_seq", r.publish_seq},
                             {"restore_id", r.restore_id},
                             {"explanation", r.explanation}});
  }
  return DumpSafe(j, 2);
}

std::string FormatRecordLine(const journal::Record& r) {
  char seq[32];
  std::snprintf(seq, sizeof seq, "%8llu ", static_cast<unsigned long long>(r.seq));
  return seq + std::string(r.cause_seq == 0 ? "" : "  -> ") + E(describe(r.event));
}

std::string RecordJsonLine(const journal::Record& r) {
  return DumpSafe(journal::RecordToJson(r), -1);
}

}  // namespace rc::replay
