// The history checker (see history.h). Each group (an input and the entries derived from it) is
// checked against the contract BEFORE it touches the fold, then re-decided: the recorded derived
// events must equal decide(state before the input, input). Only then is the group applied, so a
// forged history is reported, never folded into a state whose invariants would abort.
#include "statemachine/history.h"

#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>

#include "statemachine/describe.h"

namespace rc {
namespace {

struct Checker {
  State state;
  HistorySummary summary;
  // Independent bookkeeping (not read from the fold): the generation each active rollout was
  // admitted under, and the label VALIDATING saw for the update in flight.
  std::map<std::string, std::uint64_t> admitted_generation;
  std::optional<std::string> validated_label;
  std::string validated_digest;  // the combined digest of the validation that saw the target
  std::string target_label;
  std::set<std::string> used_rollout_ids;  // every id ever admitted
  // The digest each label was first served with (bootstrap or publish), and whether the update
  // in flight is a restore, which must come back with exactly that digest.
  std::map<std::string, std::string> served_digest;
  bool restoring = false;
  // Colocated mode, from the observations alone: pools the engine has not woken since its last
  // sleep, and the ids of sleeps and wake-ups (their ends are not updates).
  bool weights_asleep = false;
  bool kv_asleep = false;
  std::set<std::string> same_version_ids;

  // Contract checks on an input, before decide. Empty when fine.
  std::string check_input(const Event& e) const {
    // After a taint only recovery, and the end of rollouts that were active when it struck (an
    // engine taint in READY leaves them running; they are suspect, never silently dropped).
    const bool after_taint_ok =
        std::holds_alternative<RecoveryStarted>(e) || std::holds_alternative<RestoreRequested>(e) ||
        std::holds_alternative<RolloutFinished>(e) || std::holds_alternative<TrajectoryRecorded>(e);
    if (state.lifecycle == Lifecycle::kTainted && !after_taint_ok) {
      return std::string(event_name(e)) +
             " after TAINTED (only a restore, RecoveryStarted and the end of active rollouts may "
             "follow)";
    }
    if (family_of(e) == Family::kDecision) {
      return std::string("decision ") + event_name(e) + " recorded as an input (cause_seq 0)";
    }
    if (const auto* a = std::get_if<RolloutAdmitted>(&e)) {
      if (state.lifecycle != Lifecycle::kReady || state.update.has_value()) {
        return "admission of rollout '" + a->rollout_id + "' outside READY (state " +
               lifecycle_name(state.lifecycle) + ")";
      }
      if (used_rollout_ids.count(a->rollout_id) != 0) {
        return "rollout id '" + a->rollout_id + "' admitted again (ids are unique per journal)";
      }
    }
    if (const auto* f = std::get_if<RolloutFinished>(&e)) {
      if (f->outcome == RolloutOutcome::kAbandoned) {
        return "rollout '" + f->rollout_id + "' abandoned as an input (only recovery records it)";
      }
    }
    if (const auto* x = std::get_if<EffectStarted>(&e)) {
      // From the checker's own bookkeeping, not the fold's: an independent second opinion.
      if (x->kind == EffectKind::kTransfer && !admitted_generation.empty()) {
        return "transfer intent (mutation) while " + std::to_string(admitted_generation.size()) +
               " binding(s) are active, e.g. '" + admitted_generation.begin()->first + "'";
      }
      if (x->kind == EffectKind::kTransfer && weights_asleep) {
        return "transfer intent while the engine's weights are asleep (never woken since /sleep)";
      }
    }
    return {};
  }

  // Contract checks on a derived event, from the bookkeeping alone (nothing forged is applied
  // before the checks ran). Empty when fine.
  std::string check_derived(const Event& e) const {
    const std::string active = admitted_generation.empty()
                                   ? std::string()
                                   : "rollout '" + admitted_generation.begin()->first +
                                         "' admitted under generation " +
                                         std::to_string(admitted_generation.begin()->second);
    if (const auto* p = std::get_if<VersionPublished>(&e)) {
      if (!validated_label.has_value() || *validated_label != p->version.label) {
        return "version '" + p->version.label + "' published but VALIDATING " +
               (validated_label ? "saw '" + *validated_label + "'" : std::string("never saw it"));
      }
      if (!active.empty()) {
        return active + " still active when generation " + std::to_string(p->version.generation) +
               " was published (spans two versions)";
      }
      if (p->engine_digest != validated_digest) {
        return "version '" + p->version.label + "' published with weight digest '" +
               p->engine_digest + "' but VALIDATING saw '" + validated_digest + "'";
      }
      if (state.committed_digest.present() && p->engine_digest.empty()) {
        return "version '" + p->version.label +
               "' published without a weight digest in a journal that records them";
      }
      auto served = served_digest.find(p->version.label);
      if (restoring && (served == served_digest.end() || served->second != p->engine_digest)) {
        return "restore published '" + p->version.label + "' with weight digest '" +
               p->engine_digest + "' but it was served with '" +
               (served == served_digest.end() ? std::string("none") : served->second) + "'";
      }
    }
    if (const auto* c = std::get_if<StateChanged>(&e)) {
      if (c->from == Lifecycle::kValidating && c->to == Lifecycle::kResuming &&
          !validated_label.has_value()) {
        return "VALIDATING -> RESUMING (validated) but VALIDATING never saw the target label '" +
               target_label + "'";
      }
      if (c->to == Lifecycle::kQuiesced && !active.empty()) {
        return "QUIESCED while " + active + " is active: it would span two versions";
      }
      if (c->from == Lifecycle::kTainted && !restoring) {
        return "TAINTED left without a restore request";
      }
      if (c->to == Lifecycle::kReady && kv_asleep) {
        return "READY while the KV cache sleeps (never woken since /sleep)";
      }
    }
    return {};
  }

  // Bookkeeping after an event (input or derived) was applied.
  void note_before_apply(const Event& e) {
    // Before its own decisions are checked: TAINTED -> DRAINING needs to know it is a restore.
    if (std::holds_alternative<RestoreRequested>(e)) restoring = true;
    note_woken(e);
    if (const auto* v = std::get_if<ValidationObserved>(&e)) {
      if (state.lifecycle == Lifecycle::kValidating && v->http.ok_2xx() && v->checks_passed &&
          v->reported_label == target_label) {
        validated_label = v->reported_label;
        validated_digest = v->digest.combined;
      }
    }
  }

  // Which pools sleep: every one from a sleep that may have happened, each woken by its answer.
  void note_sleep(const Event& e) {
    if (const auto* c = std::get_if<StateChanged>(&e)) {
      if (c->to == Lifecycle::kSleeping && c->cause == Cause::kSlept) {
        weights_asleep = kv_asleep = true;
      }
      if (c->to == Lifecycle::kTainted &&
          (c->cause == Cause::kSleepFailed || c->cause == Cause::kEngineSleptExternally)) {
        weights_asleep = kv_asleep = true;
      }
    }
  }

  // An input's own evidence, before its decisions are checked: a woken pool is awake for them.
  void note_woken(const Event& e) {
    if (const auto* w = std::get_if<WakeObserved>(&e); w != nullptr && w->http.ok_2xx()) {
      (w->tag == WakeTag::kWeights ? weights_asleep : kv_asleep) = false;
    }
  }

  // Sleeps and wake-ups keep the committed version: the checker validates them against it.
  void note_same_version(const Event& e) {
    if (const auto* sl = std::get_if<SleepRequested>(&e)) {
      summary.sleeps_requested++;
      same_version_ids.insert(sl->sleep_id);
    } else if (const auto* w = std::get_if<WakeRequested>(&e)) {
      summary.wakes_requested++;
      same_version_ids.insert(w->wake_id);
      validated_label.reset();
      validated_digest.clear();
      target_label = state.committed.label;
      restoring = false;
    }
  }

  void note_end(const UpdateEnded& d) {
    if (same_version_ids.count(d.update_id) != 0) {
      if (d.outcome == UpdateOutcome::kCommitted) {
        (state.lifecycle == Lifecycle::kQuiesced ? summary.sleeps_committed
                                                 : summary.wakes_committed)++;
      }
      return;
    }
    switch (d.outcome) {
      case UpdateOutcome::kCommitted:
        summary.updates_committed++;
        break;
      case UpdateOutcome::kRefused:
        summary.updates_refused++;
        break;
      case UpdateOutcome::kTainted:
        summary.updates_tainted++;
        break;
    }
  }

  std::string note_after_apply(const Event& e) {
    note_sleep(e);
    note_same_version(e);
    if (const auto* u = std::get_if<UpdateRequested>(&e)) {
      summary.updates_requested++;
      validated_label.reset();
      validated_digest.clear();
      target_label = u->target_label;
      restoring = false;
    } else if (const auto* r = std::get_if<RestoreRequested>(&e)) {
      summary.restores_requested++;
      validated_label.reset();
      validated_digest.clear();
      target_label = r->label;
    } else if (const auto* p = std::get_if<VersionPublished>(&e)) {
      if (!p->engine_digest.empty()) served_digest.emplace(p->version.label, p->engine_digest);
    } else if (const auto* c = std::get_if<StateChanged>(&e);
               c != nullptr && c->from == Lifecycle::kUninitialized &&
               state.committed_digest.present()) {
      served_digest.emplace(state.committed.label, state.committed_digest.combined);
    } else if (const auto* a = std::get_if<RolloutAdmitted>(&e)) {
      admitted_generation[a->rollout_id] = a->version.generation;
      used_rollout_ids.insert(a->rollout_id);
      VersionRollouts& v = summary.rollouts_by_generation[a->version.generation];
      v.label = a->version.label;
      v.admitted++;
    } else if (const auto* f = std::get_if<RolloutFinished>(&e)) {
      auto it = admitted_generation.find(f->rollout_id);
      if (it == admitted_generation.end()) return "rollout '" + f->rollout_id + "' never admitted";
      const std::uint64_t gen = it->second;
      admitted_generation.erase(it);
      if (gen != state.committed.generation) {
        return "rollout '" + f->rollout_id + "' admitted under generation " + std::to_string(gen) +
               " finished under generation " + std::to_string(state.committed.generation);
      }
      summary.rollouts_by_generation[gen].finished++;
    } else if (const auto* d = std::get_if<UpdateEnded>(&e)) {
      note_end(*d);
      validated_label.reset();
    } else if (std::holds_alternative<RecoveryStarted>(e)) {
      summary.recoveries++;
    }
    return {};
  }
};

std::string describe_all(const std::vector<Event>& events) {
  if (events.empty()) return "(none)";
  std::string out;
  for (const Event& e : events) {
    if (!out.empty()) out += "; ";
    out += describe(e);
  }
  return out;
}

}  // namespace

HistoryReport check_history(const std::vector<HistoryEntry>& history) {
  Checker c;
  HistoryReport report;
  auto fail = [&](std::uint64_t seq, std::string message) {
    report.ok = false;
    report.first_bad_seq = seq;
    report.message = "seq " + std::to_string(seq) + ": " + std::move(message);
    report.summary = c.summary;
    report.state = c.state;
    return report;
  };

  std::uint64_t last_seq = 0;
  std::size_t i = 0;
  while (i < history.size()) {
    const HistoryEntry& in = history[i];
    if (in.seq == 0 || in.seq <= last_seq) {
      return fail(in.seq, "seq not increasing (previous " + std::to_string(last_seq) + ")");
    }
    if (in.cause_seq != 0) {
      return fail(in.seq, std::string("derived ") + event_name(in.event) + " without its input " +
                              "(cause_seq " + std::to_string(in.cause_seq) +
                              " is not the input just before it)");
    }
    if (std::string why = c.check_input(in.event); !why.empty()) return fail(in.seq, why);

    // The group: the entries right after the input that name it as their cause.
    std::size_t end = i + 1;
    std::vector<Event> recorded;
    last_seq = in.seq;
    while (end < history.size() && history[end].cause_seq == in.seq) {
      if (history[end].seq <= last_seq) {
        return fail(history[end].seq,
                    "seq not increasing (previous " + std::to_string(last_seq) + ")");
      }
      last_seq = history[end].seq;
      recorded.push_back(history[end].event);
      ++end;
    }

    // Contract checks on the derived events first: a forged group gets the specific message.
    c.note_before_apply(in.event);
    for (std::size_t k = i + 1; k < end; ++k) {
      if (std::string why = c.check_derived(history[k].event); !why.empty()) {
        return fail(history[k].seq, why);
      }
    }

    Result<std::vector<Event>> decided = decide(c.state, in.event);
    if (!decided.ok()) {
      return fail(in.seq, std::string("illegal ") + event_name(in.event) + " in " +
                              lifecycle_name(c.state.lifecycle) + ": " +
                              decided.status().ToString());
    }
    if (decided.value() != recorded) {
      return fail(in.seq, std::string("decisions for ") + event_name(in.event) +
                              " differ from decide(): recorded [" + describe_all(recorded) +
                              "], decide() gives [" + describe_all(decided.value()) + "]");
    }

    // Apply the input, then each derived event, with the contract checks around each.
    c.summary.inputs++;
    for (std::size_t k = i; k < end; ++k) {
      const HistoryEntry& h = history[k];
      if (Status st = apply(c.state, h.event); !st.ok()) {
        return fail(h.seq, std::string("illegal ") + event_name(h.event) + ": " + st.ToString());
      }
      if (std::string why = c.note_after_apply(h.event); !why.empty()) return fail(h.seq, why);
      c.summary.entries++;
    }
    i = end;
  }
  report.summary = c.summary;
  report.state = c.state;
  return report;
}

}  // namespace rc
