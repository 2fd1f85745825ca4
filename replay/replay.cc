#include "replay/replay.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <map>
#include <optional>
#include <sstream>

#include "journal/json.h"
#include "statemachine/describe.h"
#include "statemachine/quote.h"
#include "statemachine/text.h"

namespace rc::replay {
namespace {

// Every string that reaches replay's text output passes through here, whatever its origin (event
// fields are client/engine text: a NUL truncated the report, a "\n" forged a verdict line).
std::string E(const std::string& s) { return text::escape_line(s); }

// An id or label between quotes, escaped, each quote inside it doubled (`a'b` -> `'a''b'`, as
// audit::Quoted writes them): an id holding `' took the engine back to '` cannot close its field
// and forge the rest of the line.
std::string Q(const std::string& s) { return text::quoted(E(s)); }

// JSON that holds journal strings: invalid UTF-8 is replaced, never thrown on, and everything
// outside printable ASCII is a \u escape (ensure_ascii). Consumers read these outputs a line at a
// time: raw U+2028/U+2029, NEL, DEL or another C1 or bidi control from an engine's answer would
// split one record's line for those that honour them.
std::string DumpSafe(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

// The decisions recorded after an input, waiting to be compared with decide()'s.
struct PendingInput {
  std::uint64_t seq = 0;
  std::vector<FleetEvent> expected;
  std::size_t matched = 0;
};

// "engine 'a': " for a fleet's engine; "" for the one engine of a journal that names none.
std::string EnginePrefix(const std::string& engine) {
  return engine.empty() ? "" : "engine " + Q(engine) + ": ";
}

std::string Describe(const FleetEvent& e) {
  return (e.engine.empty() ? "" : "[" + e.engine + "] ") + describe(e.event);
}

// The plan in flight (an update, a restore, a sleep or a wake-up), as the colocated lines and the
// taint readings need it: what it was, and what the engine answered about its memory.
struct PlanTrace {
  enum class Kind : std::uint8_t { kUpdate, kRestore, kSleep, kWake };
  Kind kind = Kind::kUpdate;
  std::string id;
  std::uint64_t request_seq = 0;
  std::uint8_t level = 0;  // a sleep's level, or the level a plan from sleep woke the engine from
  bool from_sleep = false;
  bool sleep_answered = false;  // a SleepObserved arrived; sleep_memory is its memory
  DeviceMemory sleep_memory;
  std::optional<DeviceMemory> weights_woken;  // memory of the 2xx answer of each /wake_up tag
  std::optional<DeviceMemory> kv_woken;
  std::optional<UpdateEnded> end;
  bool colocated() const { return kind == Kind::kSleep || kind == Kind::kWake || from_sleep; }
};

const char* KindName(const PlanTrace& p) {
  switch (p.kind) {
    case PlanTrace::Kind::kSleep:
      return "sleep";
    case PlanTrace::Kind::kWake:
      return "wake-up";
    case PlanTrace::Kind::kRestore:
      return p.from_sleep ? "restore from sleep" : "restore";
    case PlanTrace::Kind::kUpdate:
      break;
  }
  return p.from_sleep ? "update from sleep" : "update";
}

std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  return s;
}

std::string Version(const WeightVersion& v) {
  return Q(v.label) + " (generation " + std::to_string(v.generation) + ")";
}

// "60.00 GiB freed (device free 10.00 -> 70.00 of 80.00 GiB)": what the engine's workers reported
// around /sleep (freed) or /wake_up (taken back), summed over workers.
std::string MemoryMoved(const DeviceMemory& m, bool freed) {
  if (!m.known) return "device memory not reported";
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const double before = static_cast<double>(m.free_bytes_before) / kGiB;
  const double after = static_cast<double>(m.free_bytes_after) / kGiB;
  char text[160];
  std::snprintf(text, sizeof text, "%.2f GiB %s (device free %.2f -> %.2f of %.2f GiB)",
                freed ? after - before : before - after, freed ? "freed" : "taken back", before,
                after, static_cast<double>(m.total_bytes) / kGiB);
  return text;
}

std::string WokenText(const char* pool, const std::optional<DeviceMemory>& m) {
  return std::string(pool) + ": " + (m ? MemoryMoved(*m, false) : std::string("not woken"));
}

// What the engine's memory did during the plan.
std::string MemoryText(const PlanTrace& p) {
  if (p.kind == PlanTrace::Kind::kSleep) {
    return p.sleep_answered ? "its workers reported " + MemoryMoved(p.sleep_memory, true)
                            : std::string("/sleep never answered");
  }
  return WokenText("weights", p.weights_woken) + ", " + WokenText("KV cache", p.kv_woken);
}

// Where a refused plan left the engine.
std::string AfterRefusal(const State& s) {
  switch (s.lifecycle) {
    case Lifecycle::kReady:
      return "serving " + Version(s.committed) + " again";
    case Lifecycle::kSleeping:
      return "still asleep at level " + std::to_string(s.sleep_level);
    default:
      return std::string("now ") + lifecycle_name(s.lifecycle);
  }
}

// How the plan ended, from its UpdateEnded and the state after the transition that ended it.
std::string OutcomeText(const PlanTrace& p, const State& s, std::uint64_t end_seq) {
  if (!p.end)
    return std::string("in flight where replay stopped (") + lifecycle_name(s.lifecycle) + ")";
  switch (p.end->outcome) {
    case UpdateOutcome::kCommitted:
      if (p.kind == PlanTrace::Kind::kSleep) return "committed: asleep on " + Version(s.committed);
      if (p.kind == PlanTrace::Kind::kWake) {
        return "committed: " + Version(s.committed) + " proven again, serving";
      }
      return "committed: published " + Version(s.committed);
    case UpdateOutcome::kRefused:
      return "refused: " + E(p.end->reason) + "; " + AfterRefusal(s);
    case UpdateOutcome::kTainted:
      return "tainted: " + E(p.end->reason) + " (see TAINTED at seq " + std::to_string(end_seq) +
             ")";
  }
  return "ended with an unknown outcome";
}

ColocatedStep StepLine(const PlanTrace& p, const State& s, std::uint64_t end_seq) {
  ColocatedStep step{"", p.request_seq, end_seq, p.id, KindName(p), ""};
  step.line = Upper(step.kind) + " " + Q(p.id) + " (seq " + std::to_string(p.request_seq) + "-" +
              (end_seq == 0 ? std::string("") : std::to_string(end_seq)) +
              "): " + (p.kind == PlanTrace::Kind::kSleep ? "level " : "from level ") +
              std::to_string(p.level) + "; " + MemoryText(p) + "; " + OutcomeText(p, s, end_seq);
  return step;
}

// What an executor's start found of the journal, as its RecoveryStarted recorded it.
std::string RestartText(const RecoveryStarted& rs) {
  if (is_stalled_plan_retry(rs)) return "the stalled plan tried again: the engine answered";
  switch (rs.journal_ending) {
    case JournalEnding::kNotRecorded:
      break;
    case JournalEnding::kNewJournal:
      return "executor started on a new journal";
    case JournalEnding::kCleanClose:
      return "executor restarted after a clean close";
    case JournalEnding::kCrash:
      return "executor restarted after a crash (no clean close)";
    case JournalEnding::kTornTail:
      return "executor restarted after a crash; the journal's open skipped a torn WAL tail: " +
             E(rs.journal_torn_tail);
  }
  return "executor restarted";
}

// One line of evidence for a TAINTED incident's timeline ("" when the record adds none).
std::string EvidenceLine(const journal::Record& r) {
  std::ostringstream out;
  if (const auto* e = std::get_if<EffectStarted>(&r.event)) {
    if (e->kind == EffectKind::kTransfer) {
      out << "  seq " << r.seq << ": transfer intent durable (deadline " << e->deadline_ms
          << " ms) - from here on the engine's weights may have changed\n";
    } else if (e->kind == EffectKind::kSleep) {
      out << "  seq " << r.seq << ": sleep intent durable (deadline " << e->deadline_ms
          << " ms) - from here on the engine may release its memory\n";
    }
  } else if (const auto* o = std::get_if<TransferObserved>(&r.event)) {
    out << "  seq " << r.seq << ": transfer " << (o->acknowledged ? "acknowledged" : "failed")
        << ", mutation " << mutation_name(o->mutation) << ", " << o->bytes_sent << " bytes / "
        << o->tensors_sent << " tensors in " << o->duration_us / 1000 << " ms"
        << (o->error.empty() ? "" : ": " + E(o->error)) << "\n";
  } else if (const auto* c = std::get_if<CacheResetObserved>(&r.event)) {
    out << "  seq " << r.seq << ": " << cache_name(c->cache) << " cache reset "
        << E(describe(c->http)) << " success=" << (c->reported_success ? "true" : "false")
        << (c->success_unreported ? " (not reported by the engine)" : "") << "\n";
  } else if (const auto* v = std::get_if<ValidationObserved>(&r.event)) {
    out << "  seq " << r.seq << ": validation " << E(describe(v->http)) << " reported "
        << Q(v->reported_label)
        << (v->is_paused_known && !v->is_paused ? " from an engine not paused" : "") << "\n";
  } else if (const auto* sl = std::get_if<SleepObserved>(&r.event)) {
    out << "  seq " << r.seq << ": sleep at level " << static_cast<int>(sl->level) << " answered "
        << E(describe(sl->http)) << ", is_sleeping "
        << (sl->is_sleeping_known ? (sl->is_sleeping ? "true" : "false") : "unknown") << "; "
        << MemoryMoved(sl->memory, true) << "\n";
  } else if (const auto* w = std::get_if<WakeObserved>(&r.event)) {
    out << "  seq " << r.seq << ": wake-up of the "
        << (w->tag == WakeTag::kWeights ? "weights" : "KV cache") << " answered "
        << E(describe(w->http)) << "; " << MemoryMoved(w->memory, false) << "\n";
  } else if (const auto* rs = std::get_if<RecoveryStarted>(&r.event)) {
    out << "  seq " << r.seq << ": " << RestartText(*rs) << "\n";
  }
  return out.str();
}

// What one engine's records say beyond legality: its plans, its TAINTED incidents and their
// evidence, its restores and colocated steps. Reads the engine's state from the fleet's fold.
class EngineTrace {
 public:
  EngineTrace(ReplayReport& report, std::string engine)
      : report_(report), engine_(std::move(engine)) {}

  // Keeps the records of the plan in flight so a TAINTED incident can be explained; called after
  // the record was folded.
  void Track(const journal::Record& r);

  void Finish() {
    if (plan_ && plan_->colocated()) AddStep(StepLine(*plan_, st(), 0));
  }

 private:
  const State& st() const { return engine_state(report_.fleet, engine_); }

  // The plan a request starts (the state already holds it), then its evidence and its end.
  void TrackPlan(const journal::Record& r) {
    if (const auto* u = std::get_if<UpdateRequested>(&r.event)) {
      StartPlan(PlanTrace::Kind::kUpdate, u->update_id, r.seq);
    } else if (const auto* q = std::get_if<RestoreRequested>(&r.event)) {
      StartPlan(PlanTrace::Kind::kRestore, q->restore_id, r.seq);
    } else if (const auto* sl = std::get_if<SleepRequested>(&r.event)) {
      StartPlan(PlanTrace::Kind::kSleep, sl->sleep_id, r.seq);
    } else if (const auto* w = std::get_if<WakeRequested>(&r.event)) {
      StartPlan(PlanTrace::Kind::kWake, w->wake_id, r.seq);
    }
    if (!plan_) return;
    if (const auto* o = std::get_if<SleepObserved>(&r.event)) {
      plan_->sleep_answered = true;
      plan_->sleep_memory = o->memory;
    } else if (const auto* w = std::get_if<WakeObserved>(&r.event); w && w->http.ok_2xx()) {
      (w->tag == WakeTag::kWeights ? plan_->weights_woken : plan_->kv_woken) = w->memory;
    } else if (const auto* e = std::get_if<UpdateEnded>(&r.event); e && e->update_id == plan_->id) {
      plan_->end = *e;
    }
  }

  void StartPlan(PlanTrace::Kind kind, const std::string& id, std::uint64_t seq) {
    const UpdatePlan& u = *st().update;
    plan_ = PlanTrace{kind, id, seq};
    plan_->from_sleep = u.from_sleep || u.wake_first;
    plan_->level = u.sleep_level > 0 ? u.sleep_level : st().sleep_level;
  }

  void EndPlan(std::uint64_t seq) {
    if (plan_->colocated()) AddStep(StepLine(*plan_, st(), seq));
    if (plan_->kind == PlanTrace::Kind::kSleep && st().lifecycle == Lifecycle::kSleeping) {
      last_sleep_ = *plan_;
      last_sleep_seq_ = seq;
    }
    plan_.reset();
  }

  void AddStep(ColocatedStep step) {
    step.engine = engine_;
    if (!engine_.empty()) step.line = EnginePrefix(engine_) + step.line;
    report_.colocated_count++;
    if (report_.colocated.size() >= kColocatedStepsMax) report_.colocated.pop_front();
    report_.colocated.push_back(std::move(step));
  }

  TaintIncident Explain(std::uint64_t taint_seq) const;
  void ExplainPlan(const TaintRecord& t, std::ostringstream& out) const;
  void ExplainReading(const TaintRecord& t, std::ostringstream& out) const;
  void ExplainRecovery(std::ostringstream& out) const;
  RestoreProof ExplainRestore(std::uint64_t seq, const VersionPublished& p) const;
  const RestoreRequested* RestoreInFlight() const;

  static constexpr std::size_t kTimelineRecordsMax = 4096;
  ReplayReport& report_;
  const std::string engine_;
  std::vector<journal::Record> update_records_;
  std::uint64_t last_taint_seq_ = 0;
  std::optional<PlanTrace> plan_;
  std::optional<PlanTrace> last_sleep_;  // the sleep that put the engine to sleep last
  std::uint64_t last_sleep_seq_ = 0;     // ... and the transition into SLEEPING that ended it
};

void EngineTrace::Track(const journal::Record& r) {
  if (std::holds_alternative<UpdateRequested>(r.event) ||
      std::holds_alternative<RestoreRequested>(r.event) ||
      std::holds_alternative<SleepRequested>(r.event) ||
      std::holds_alternative<WakeRequested>(r.event)) {
    update_records_.clear();
  }
  TrackPlan(r);
  if (st().update.has_value() || std::holds_alternative<StateChanged>(r.event) ||
      std::holds_alternative<UpdateEnded>(r.event)) {
    if (update_records_.size() < kTimelineRecordsMax) update_records_.push_back(r);
  }
  const auto* changed = std::get_if<StateChanged>(&r.event);
  if (changed != nullptr && changed->to == Lifecycle::kTainted) {
    report_.incidents.push_back(Explain(r.seq));
    last_taint_seq_ = r.seq;
  }
  const auto* published = std::get_if<VersionPublished>(&r.event);
  if (published != nullptr && st().update->restore) {
    report_.restores.push_back(ExplainRestore(r.seq, *published));
  }
  const bool settled = changed != nullptr &&
                       (changed->to == Lifecycle::kReady || changed->to == Lifecycle::kSleeping);
  if (settled) update_records_.clear();
  if (plan_ && !st().update.has_value()) EndPlan(r.seq);
}

// The restore request among the records of the update in flight, if it is a restore.
const RestoreRequested* EngineTrace::RestoreInFlight() const {
  for (const journal::Record& r : update_records_) {
    if (const auto* q = std::get_if<RestoreRequested>(&r.event)) return q;
  }
  return nullptr;
}

RestoreProof EngineTrace::ExplainRestore(std::uint64_t seq, const VersionPublished& p) const {
  RestoreProof proof;
  proof.engine = engine_;
  proof.publish_seq = seq;
  proof.restore_id = p.update_id;
  const RestoreRequested* q = RestoreInFlight();
  std::ostringstream out;
  out << EnginePrefix(engine_) << "RESTORED at seq " << seq << ": restore " << Q(p.update_id)
      << " took the engine back to " << Q(p.version.label) << " (generation "
      << p.version.generation << ", checkpoint " << Q(p.identity.checkpoint) << ")"
      << (q == nullptr ? ""
          : q->adopt   ? " by adopting the engine as found"
                       : " by reloading " + E(q->source_uri))
      << "\n";
  out << "  proof: the weight digest " << E(p.engine_digest.substr(0, 16))
      << " taken while paused equals the one recorded when " << Q(p.version.label)
      << " was served; every cache was reset after the reload";
  if (plan_ && plan_->from_sleep) {
    out << "\n  the engine was tainted asleep (level " << static_cast<int>(plan_->level)
        << "): the restore woke it fully (weights, then KV cache) before its drain, then reloaded "
           "and validated it paused";
  }
  if (last_taint_seq_ != 0) out << "\n  it ends the TAINTED incident at seq " << last_taint_seq_;
  proof.explanation = out.str();
  return proof;
}

TaintIncident EngineTrace::Explain(std::uint64_t taint_seq) const {
  TaintIncident incident;
  incident.taint_seq = taint_seq;
  incident.timeline = update_records_;
  const TaintRecord& t = *st().taint;
  incident.update_id = t.update_id;
  incident.engine = engine_;
  std::ostringstream out;
  // One line per fact: every field below is escaped, so the explanation's line count is fixed
  // by this code and never by what the journal holds.
  out << EnginePrefix(engine_) << "TAINTED at seq " << taint_seq << " from "
      << lifecycle_name(t.from) << " (" << cause_name(t.cause) << "): " << E(t.detail) << "\n";
  ExplainPlan(t, out);
  for (const journal::Record& r : update_records_) out << EvidenceLine(r);
  ExplainReading(t, out);
  out << "  nothing was published and no rollout was admitted after this point.\n";
  ExplainRecovery(out);
  incident.explanation = out.str();
  return incident;
}

// What was in flight when the taint struck: an update or restore, a sleep or a wake-up (both keep
// the committed version), or nothing (the engine itself changed while serving or asleep).
void EngineTrace::ExplainPlan(const TaintRecord& t, std::ostringstream& out) const {
  const State& state = st();
  const std::string committed = Version(state.committed);
  const PlanTrace::Kind kind = plan_ ? plan_->kind : PlanTrace::Kind::kUpdate;
  if (t.update_id.empty()) {
    out << "  no update in flight; committed version " << committed;
    if (t.from == Lifecycle::kSleeping) {
      out << ", asleep at level " << static_cast<int>(state.sleep_level);
      if (last_sleep_) {
        out << " since seq " << last_sleep_seq_ << " (sleep " << Q(last_sleep_->id) << ")";
      }
    }
    out << "\n";
  } else if (kind == PlanTrace::Kind::kSleep) {
    out << "  sleep " << Q(t.update_id) << " at level " << static_cast<int>(plan_->level)
        << " kept " << committed << ", the committed version (a sleep publishes nothing)\n";
  } else if (kind == PlanTrace::Kind::kWake) {
    out << "  wake-up " << Q(t.update_id) << " from level " << static_cast<int>(plan_->level)
        << " kept " << committed << ", the committed version (a wake-up publishes nothing)\n";
  } else {
    out << "  update " << Q(t.update_id) << " targeted " << Q(t.target.label) << " (generation "
        << t.target.generation << "); last committed version " << Q(state.committed.label)
        << " (generation " << state.committed.generation << ")\n";
  }
}

void EngineTrace::ExplainReading(const TaintRecord& t, std::ostringstream& out) const {
  bool intent = false;
  for (const journal::Record& r : update_records_) {
    const auto* e = std::get_if<EffectStarted>(&r.event);
    intent = intent || (e != nullptr && e->kind == EffectKind::kTransfer);
  }
  switch (t.cause) {
    case Cause::kTransferAmbiguous:
    case Cause::kRecoveredAmbiguous:
      out << "  reading: the transfer " << (intent ? "had started" : "state is unknown")
          << " and did not complete cleanly, so the engine may hold a mix of "
          << Q(st().committed.label) << " and " << Q(t.target.label)
          << " tensors. Neither version can be claimed.\n";
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
    case Cause::kSleepFailed:
      out << "  reading: the sleep may have released the engine's memory without it reporting "
             "asleep (vLLM unmaps before its last check can fail); what its weights and KV "
             "cache hold is unknown until proven.\n";
      break;
    case Cause::kWakeFailed:
      out << (RestoreInFlight() != nullptr
                  ? "  reading: the restore could not wake the engine before its drain; it stays "
                    "TAINTED and may still sleep, and the next restore wakes it again.\n"
                  : "  reading: the wake-up of the weights did not answer cleanly, so they may be "
                    "mapped again (after level 1, overwritten by the host copy) or still asleep; "
                    "what the engine holds is unknown until proven.\n");
      break;
    case Cause::kEngineSleptExternally:
      out << "  reading: someone slept the engine while the plan held it paused, and the resume "
             "set its scheduler running on memory it had released; what it holds is unknown, and "
             "a restore wakes it before proving its weights.\n";
      break;
    case Cause::kEngineWokenExternally:
      out << "  reading: someone resumed the sleeping engine outside RolloutCore; it would serve "
             "from memory it had released to the trainer, so nothing it holds can be claimed.\n";
      break;
    default:
      break;
  }
}

// The restore that would bring it back, or why none can be proven.
void EngineTrace::ExplainRecovery(std::ostringstream& out) const {
  const State& state = st();
  if (state.label_digests.count(state.committed.label) == 0) {
    out << "  recover: no weight digest was recorded for " << Q(state.committed.label)
        << ", so no restore can be proven: restart the engine from a known checkpoint and "
           "start a new journal.";
    return;
  }
  // A command to copy: the label is one shell word (text::shell_quote), never text the shell
  // runs, whatever the trainer named the version, and joined to its option by `=`, so that a
  // label beginning with `-` is read as the option's value, never as an option.
  out << "  recover: restore it with proof, e.g. `rolloutcore restore --label="
      << text::shell_quote(state.committed.label) << " --source <where its weights are>`";
  if (state.sleep_level > 0) {
    out << ": the engine may be asleep (level " << static_cast<int>(state.sleep_level)
        << "), so the restore wakes it fully (weights, then KV cache) before it drains and reloads"
        << (state.sleep_level == 1 ? " (or --adopt: the weights it wakes with are proven as found)"
                                   : "")
        << "; it serves again only if its weight digest equals the recorded one.";
    return;
  }
  out << " (or --adopt for an engine restarted on that checkpoint): it serves again only if its "
         "weight digest equals the recorded one.";
}

// Re-derives every recorded decision with the fleet fold (a journal of one engine is the fleet of
// the unnamed engine, folded exactly as the single-engine fold) and hands each engine's records
// to its trace.
class Replayer {
 public:
  explicit Replayer(ReplayReport& report) : report_(report) {}

  Status Visit(const journal::Record& r) {
    report_.records++;
    report_.last_seq = r.seq;
    // A recorded torn tail is listed whatever failed before it: audit lists every one too.
    NoteTornTail(r);
    if (!report_.ok) return Status::OK();  // keep counting; the first failure is what matters
    const FleetEvent e{r.engine, r.event};
    if (r.cause_seq == 0) {
      if (!CloseInput()) return Status::OK();
      Result<std::vector<FleetEvent>> decided = fleet_decide(report_.fleet, e);
      if (!decided.ok()) {
        return Fail(r.seq, std::string("recorded input ") + event_name(r.event) +
                               " is rejected by decide(): " + decided.status().ToString());
      }
      pending_ = PendingInput{r.seq, std::move(decided.value()), 0};
      report_.inputs++;
    } else {
      RC_RETURN_IF_ERROR(MatchDecision(r, e));
      if (!report_.ok) return Status::OK();
    }
    if (const auto* gone = std::get_if<EngineRemoved>(&r.event)) EndTrace(gone->engine);
    Status applied = fleet_apply(report_.fleet, e);
    if (!applied.ok()) return Fail(r.seq, "illegal record: " + applied.ToString());
    if (!is_fleet_event(r.event)) Trace(r.engine).Track(r);
    return Status::OK();
  }

  void Finish() {
    if (!CloseInput()) return;
    for (auto& [engine, trace] : traces_) trace.Finish();
  }

 private:
  Status MatchDecision(const journal::Record& r, const FleetEvent& e) {
    if (r.cause_seq != pending_.seq) {
      return Fail(r.seq, "derived record names cause seq " + std::to_string(r.cause_seq) +
                             " but the open input is seq " + std::to_string(pending_.seq));
    }
    if (pending_.matched >= pending_.expected.size() ||
        !(pending_.expected[pending_.matched] == e)) {
      std::string want = pending_.matched < pending_.expected.size()
                             ? Describe(pending_.expected[pending_.matched])
                             : "nothing";
      return Fail(r.seq,
                  "non-determinism: recorded " + Describe(e) + " but decide() derives " + want);
    }
    pending_.matched++;
    return Status::OK();
  }

  // A torn tail an executor's start recorded; the same open's, recorded again by the next member
  // of a fleet (its sentence names the seq the open recovered through), is the one already kept.
  void NoteTornTail(const journal::Record& r) {
    journal::NoteRecordedTornTail(r, last_torn_tail_, report_.torn_tails, report_.torn_tails_count);
  }

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

  // One trace per engine life: an engine removed and joined again starts a new one.
  EngineTrace& Trace(const std::string& engine) {
    auto it = traces_.find(engine);
    if (it == traces_.end()) it = traces_.try_emplace(engine, report_, engine).first;
    return it->second;
  }

  void EndTrace(const std::string& engine) {
    auto it = traces_.find(engine);
    if (it == traces_.end()) return;
    it->second.Finish();
    traces_.erase(it);
  }

  ReplayReport& report_;
  PendingInput pending_;
  std::map<std::string, EngineTrace> traces_;
  std::string last_torn_tail_;  // the sentence of the last torn tail noted
};

// The last seq from `seq` on that still belongs to the group of `input_seq` (its decisions follow
// it contiguously). A record that cannot be read ends the span on itself: the scan reports it.
std::uint64_t GroupEnd(journal::Journal& journal, std::uint64_t input_seq, std::uint64_t seq,
                       std::uint64_t head) {
  while (seq < head) {
    Result<journal::Record> next = journal.Read(seq + 1);
    if (next.ok() && next->cause_seq != input_seq) break;
    ++seq;
    if (!next.ok()) break;
  }
  return seq;
}

}  // namespace

Result<FoldEnd> ResolveUntil(journal::Journal& journal, std::uint64_t until_seq) {
  FoldEnd end{until_seq, 0, until_seq};
  if (until_seq == 0) return end;
  const std::uint64_t head = journal.head_seq();
  if (until_seq > head) {
    return Status::InvalidArgument("seq " + std::to_string(until_seq) +
                                   " lies past the journal's head (seq " + std::to_string(head) +
                                   "): nothing is recorded there");
  }
  Result<journal::Record> at = journal.Read(until_seq);
  if (!at.ok()) return end;  // the scan meets the same record and reports it
  end.input_seq = at->cause_seq == 0 ? at->seq : at->cause_seq;
  end.end_seq = GroupEnd(journal, end.input_seq, until_seq, head);
  return end;
}

namespace {

// What serve restarts from is the newest snapshot and the records after it, not this refold:
// a snapshot the hash chain does not cover (edited, copied from another journal, a codec fault)
// would start serve from a state the records never reached, so the two must be equal. A writer
// may have appended since the scan read its head: its state then counts other records, and is
// not compared.
void CheckRestartState(journal::Journal& journal, ReplayReport& report) {
  RC_CHECK(report.ok);
  Result<FleetState> loaded = journal.LoadFleetState();
  if (!loaded.ok()) {
    report.ok = false;
    report.read_failure = loaded.status().code();
    report.first_bad_seq = report.last_seq;
    report.error = "the state a restart loads could not be read: " + loaded.status().ToString();
    return;
  }
  if (loaded->events != report.fleet.events || *loaded == report.fleet) return;
  report.ok = false;
  report.read_failure = Code::kCorruption;
  report.first_bad_seq = report.last_seq;
  report.error =
      "the state a restart loads (the newest snapshot and the records after it) differs from "
      "this refold of every record: the snapshot is damaged or not this journal's";
}

}  // namespace

Result<ReplayReport> Replay(journal::Journal& journal, const ReplayOptions& options) {
  Result<FoldEnd> until = ResolveUntil(journal, options.until_seq);
  if (!until.ok()) return until.status();
  ReplayReport report;
  report.until = *until;
  Replayer replayer(report);
  Status scanned =
      journal.Scan(1, until->end_seq, [&](const journal::Record& r) { return replayer.Visit(r); });
  if (!scanned.ok()) {
    // A chain, decode or contiguity failure. The report keeps its first failure (seq and reason):
    // one a record showed before the scan stopped stays, with the scan's appended as a note.
    report.read_failure = scanned.code();
    if (report.ok) {
      report.ok = false;
      report.first_bad_seq = report.last_seq + 1;
      report.error = scanned.ToString();
    } else {
      report.error += "; then the scan stopped: " + scanned.ToString();
    }
  } else if (report.ok) {
    replayer.Finish();  // may find the last group short of its decisions
    if (report.ok && options.until_seq == 0) CheckRestartState(journal, report);
  }
  if (auto it = report.fleet.engines.find(""); it != report.fleet.engines.end()) {
    report.state = it->second;
  }
  return report;
}

namespace {

// The state and counters of one engine: two lines, each prefixed by `prefix`.
void EngineLines(const State& state, const std::string& prefix, std::ostringstream& out) {
  out << prefix << "state: " << E(describe(state)) << "\n";
  const Counters& c = state.counters;
  out << prefix << "rollouts: admitted " << c.rollouts_admitted << ", completed "
      << c.rollouts_completed << ", aborted " << c.rollouts_aborted << ", abandoned "
      << c.rollouts_abandoned << "; updates: requested " << c.updates_requested << ", committed "
      << c.updates_committed << ", refused " << c.updates_refused << "; restores: requested "
      << c.restores_requested << ", proven " << c.restores_committed << "; sleeps: requested "
      << c.sleeps_requested << ", committed " << c.sleeps_committed << "; wake-ups: requested "
      << c.wakes_requested << ", committed " << c.wakes_committed << "; recoveries " << c.recoveries
      << "\n";
}

std::string FleetUpdateText(const FleetUpdate& u) {
  std::string out = "fleet update " + Q(u.request.update_id) + " (" +
                    fleet_update_mode_name(u.request.mode) + " to " + Q(u.request.target_label) +
                    ") open:";
  for (const auto& [engine, status] : u.members) {
    out += " " + Q(engine) + "=" + member_status_name(status);
  }
  return out + (u.cancelled ? "; cancelled: " + E(*u.cancelled) : "");
}

// A fleet of named engines: the fleet's line, then each engine's.
void FleetLines(const FleetState& fleet, std::ostringstream& out) {
  out << "fleet: " << fleet.engines.size() << " engines, " << fleet.leaving.size()
      << " leaving; staleness_max " << fleet.policy.staleness_max << ", min_serving "
      << fleet.policy.min_serving << "; " << fleet.label_generation.size()
      << " generations; fleet updates ended " << fleet.fleet_updates_ended << "\n";
  if (fleet.update) out << FleetUpdateText(*fleet.update) << "\n";
  for (const auto& [engine, state] : fleet.engines) {
    const std::optional<std::uint64_t> g = fleet_generation(fleet, engine);
    EngineLines(state,
                "engine " + Q(engine) + " (fleet generation " +
                    (g ? std::to_string(*g) : std::string("none")) + "): ",
                out);
  }
}

// What the state lines reflect when a seq was asked for: the state after the end of its group.
std::string UntilLine(const FoldEnd& u) {
  const std::string asked = std::to_string(u.requested);
  if (u.input_seq == 0) return "until: seq " + asked + " (its record could not be read)";
  const std::string group = "input seq " + std::to_string(u.input_seq);
  if (u.end_seq == u.requested) {
    return "until: the state after seq " + asked + ", the end of the group of " + group;
  }
  const std::string end = std::to_string(u.end_seq);
  return "until: seq " + asked + " lies inside the group of " + group + " (seqs " +
         std::to_string(u.input_seq) + "-" + end +
         "), which decide() derived and the journal wrote whole: folded through seq " + end +
         ", so the state below is the state after seq " + end + ", the group's end";
}

// Each torn WAL tail the records say an open found: one line each, escaped.
void TornTailLines(const ReplayReport& report, std::ostringstream& out) {
  for (const RecordedTornTail& t : report.torn_tails) {
    out << "TORN WAL TAIL recorded at seq " << t.seq
        << (t.engine.empty() ? "" : " by engine " + Q(t.engine))
        << " (the journal's open before that executor start): " << E(t.sentence) << "\n";
  }
  if (report.torn_tails_count > report.torn_tails.size()) {
    out << "TORN WAL TAIL: " << report.torn_tails_count - report.torn_tails.size()
        << " more recorded (replay --events shows them)\n";
  }
}

}  // namespace

std::string FormatReport(const ReplayReport& report, const std::string& journal_failure) {
  std::ostringstream out;
  out << "records: " << report.records << " (inputs re-decided: " << report.inputs << "), last seq "
      << report.last_seq << "\n";
  if (report.until.requested != 0) out << UntilLine(report.until) << "\n";
  if (report.fleet.named) {
    FleetLines(report.fleet, out);
  } else {
    EngineLines(report.state, "", out);
  }
  if (!report.ok) {
    out << "verification: FAILED at seq " << report.first_bad_seq << ": " << E(report.error)
        << "\n";
  }
  if (!journal_failure.empty()) {
    out << "verification: FAILED: " << E(journal_failure) << "\n";
  } else if (report.ok) {
    out << "verification: OK (hash chain, legality of every record, every decision reproduced)\n";
  }
  TornTailLines(report, out);
  if (report.colocated_count > report.colocated.size()) {
    out << "sleeps and wake-ups: the first " << report.colocated_count - report.colocated.size()
        << " of " << report.colocated_count << " are not kept (replay --events shows them)\n";
  }
  for (const ColocatedStep& c : report.colocated) out << c.line << "\n";
  for (const TaintIncident& i : report.incidents) out << i.explanation << "\n";
  for (const RestoreProof& r : report.restores) out << r.explanation << "\n";
  return out.str();
}

std::string ReportJson(const ReplayReport& report) {
  nlohmann::json j;
  j["records"] = report.records;
  j["inputs"] = report.inputs;
  j["last_seq"] = report.last_seq;
  if (report.until.requested != 0) {
    j["until"] = {{"requested", report.until.requested},
                  {"group_input_seq", report.until.input_seq},
                  {"folded_through", report.until.end_seq}};
  }
  j["ok"] = report.ok;
  if (!report.ok) {
    j["first_bad_seq"] = report.first_bad_seq;
    j["error"] = report.error;
  }
  // A fleet has no one state: "state" is null and "fleet" holds each engine's.
  j["state"] = report.fleet.named ? nlohmann::json(nullptr) : journal::StateToJson(report.state);
  if (report.fleet.named) j["fleet"] = journal::FleetStateToJson(report.fleet);
  j["incidents"] = nlohmann::json::array();
  for (const TaintIncident& i : report.incidents) {
    nlohmann::json inc;
    if (!i.engine.empty()) inc["engine"] = i.engine;
    inc["taint_seq"] = i.taint_seq;
    inc["update_id"] = i.update_id;
    inc["explanation"] = i.explanation;
    inc["timeline"] = nlohmann::json::array();
    for (const journal::Record& r : i.timeline) inc["timeline"].push_back(journal::RecordToJson(r));
    j["incidents"].push_back(std::move(inc));
  }
  j["restores"] = nlohmann::json::array();
  for (const RestoreProof& r : report.restores) {
    nlohmann::json proof = {{"publish_seq", r.publish_seq},
                            {"restore_id", r.restore_id},
                            {"explanation", r.explanation}};
    if (!r.engine.empty()) proof["engine"] = r.engine;
    j["restores"].push_back(std::move(proof));
  }
  j["recorded_torn_tails_count"] = report.torn_tails_count;
  j["recorded_torn_tails"] = nlohmann::json::array();
  for (const RecordedTornTail& t : report.torn_tails) {
    nlohmann::json torn = {
        {"seq", t.seq}, {"bytes_unread", t.bytes_unread}, {"sentence", t.sentence}};
    if (!t.engine.empty()) torn["engine"] = t.engine;
    j["recorded_torn_tails"].push_back(std::move(torn));
  }
  j["colocated_count"] = report.colocated_count;
  j["colocated"] = nlohmann::json::array();
  for (const ColocatedStep& c : report.colocated) {
    nlohmann::json step = {{"request_seq", c.request_seq},
                           {"end_seq", c.end_seq},
                           {"plan_id", c.plan_id},
                           {"kind", c.kind},
                           {"line", c.line}};
    if (!c.engine.empty()) step["engine"] = c.engine;
    j["colocated"].push_back(std::move(step));
  }
  return DumpSafe(j, 2);
}

std::string FormatRecordLine(const journal::Record& r) {
  char seq[32];
  std::snprintf(seq, sizeof seq, "%8llu ", static_cast<unsigned long long>(r.seq));
  return seq + std::string(r.cause_seq == 0 ? "" : "  -> ") +
         (r.engine.empty() ? "" : "[" + E(r.engine) + "] ") + E(describe(r.event));
}

std::string RecordJsonLine(const journal::Record& r) {
  return DumpSafe(journal::RecordToJson(r), -1);
}

}  // namespace rc::replay
