#include "sim/oracle.h"

#include <algorithm>
#include <string>
#include <variant>

namespace rc::sim {
namespace {

// The look names the process the fold verified, the committed label and the pause the fold's
// lifecycle expects (paused only when asleep), and no digest other than the committed one: what
// the contract calls vouching, read on the look's own fields.
template <class Look>
bool FieldsVouch(const State& before, const Look& e) {
  const bool asleep = before.lifecycle == Lifecycle::kSleeping;
  const bool digest_ok =
      !e.digest.present() ||
      (before.committed_digest.present() && e.digest.combined == before.committed_digest.combined);
  return e.http.ok_2xx() && e.reported_label == before.committed.label &&
         !e.engine_instance.empty() && e.engine_instance == before.engine_instance &&
         e.is_paused_known && e.is_paused == asleep && digest_ok;
}

// A look at a watched engine, as the rules for a pending re-verification need it, read before the
// fold takes it.
struct LookFacts {
  bool is_look = false;
  bool pending = false;           // a re-verification was pending before it
  std::uint32_t rules = 0;        // the journal's fold rules
  bool digest_committed = false;  // a committed weight digest exists to compare with
  bool unread = false;            // the look carries no weight digest
  bool vouched = false;
};

template <class Look>
LookFacts FactsOf(const State& before, const Look& e) {
  LookFacts f;
  f.is_look = true;
  f.pending = before.engine_recheck;
  f.rules = before.fold_rules;
  f.digest_committed = before.committed_digest.present();
  f.unread = !e.digest.present();
  f.vouched = FieldsVouch(before, e);
  return f;
}

LookFacts FactsOf(const State& before, const Event& e) {
  if (const auto* m = std::get_if<EngineMonitored>(&e)) return FactsOf(before, *m);
  const auto* p = std::get_if<EngineProbed>(&e);
  // A bootstrap's probe verifies the engine for the first time: nothing is pending then.
  if (p == nullptr || before.lifecycle == Lifecycle::kUninitialized) return {};
  return FactsOf(before, *p);
}

// The rule a look broke given whether the fold cleared the re-verification ("" when none).
std::string RuleBroken(const LookFacts& f, bool cleared) {
  if (!f.pending) return {};
  if (f.rules >= 1 && f.digest_committed && f.unread && cleared) {
    return "under fold rules " + std::to_string(f.rules) +
           " a look whose weight digest was not read cleared the pending re-verification";
  }
  if (f.rules >= 1 && f.digest_committed && !f.unread && f.vouched && !cleared) {
    return "a look that vouched for the verified process with the committed digest left the "
           "re-verification pending";
  }
  if (f.rules == 0 && f.unread && f.vouched && !cleared) {
    return "under fold rules 0 a look that vouched for the verified process and label left the "
           "re-verification pending (rules 0 clear it without a digest)";
  }
  return {};
}

void Count(const LookFacts& f, bool cleared, RecheckHistoryCounts& c) {
  if (!f.pending) return;
  c.clears += cleared ? 1 : 0;
  c.unread_kept += f.rules >= 1 && f.unread && f.vouched && !cleared ? 1 : 0;
  c.rules0_unread_clears += f.rules == 0 && f.unread && cleared ? 1 : 0;
}

// Whether a publish in `before` must carry a digest: the journal holds digests or the plan names
// the one it expects (VALIDATING then judged one).
bool PublishNeedsDigest(const State& before) {
  return before.committed_digest.present() ||
         (before.update.has_value() && !before.update->expected_digest.empty());
}

// The rules that are not about looks, for one record against the state before it; "" when kept.
std::string RecordBroken(const State& before, const Event& e, bool ready) {
  if (std::holds_alternative<RolloutAdmitted>(e) && before.engine_recheck) {
    return "an admission was journaled while a re-verification was pending";
  }
  if (std::holds_alternative<BootstrapRequested>(e) && ready) {
    return "a bootstrap was journaled after READY (it could change the journal's fold rules)";
  }
  const auto* v = std::get_if<VersionPublished>(&e);
  if (v != nullptr && v->engine_digest.empty() && PublishNeedsDigest(before)) {
    return "'" + v->update_id + "' published '" + v->version.label +
           "' without the weight digest its validation must have read";
  }
  return {};
}

}  // namespace

LookJudgement JudgeMonitorLook(const State& s, const EngineMonitored& m) {
  LookJudgement j;
  const bool predicted = look_clears_recheck(s, m);
  if (!s.engine_recheck) {
    if (predicted) j.broken = "look_clears_recheck holds with no re-verification pending";
    return j;
  }
  State after = s;
  if (!rc::apply(after, Event{m}).ok()) return j;
  const LookFacts f = FactsOf(s, m);
  j.judged = true;
  j.cleared = !after.engine_recheck;
  j.unread = f.unread;
  j.vouched = f.vouched;
  if (predicted != j.cleared) {
    j.broken = std::string("look_clears_recheck says the look ") +
               (predicted ? "clears" : "does not clear") +
               " the pending re-verification, the fold " + (j.cleared ? "clears it" : "keeps it");
    return j;
  }
  j.broken = RuleBroken(f, j.cleared);
  return j;
}

std::string CheckRecheckHistory(const std::vector<HistoryEntry>& history,
                                RecheckHistoryCounts* counts) {
  State s;
  bool ready = false;
  std::uint32_t rules_at_ready = 0;
  for (const HistoryEntry& h : history) {
    auto at = [&h](const std::string& why) { return "seq " + std::to_string(h.seq) + ": " + why; };
    const LookFacts look = FactsOf(s, h.event);
    std::string broken = RecordBroken(s, h.event, ready);
    if (!broken.empty()) return at(broken);
    if (!rc::apply(s, h.event).ok()) return {};
    if (!ready && s.lifecycle == Lifecycle::kReady) {
      ready = true;
      rules_at_ready = s.fold_rules;
    }
    if (ready && s.fold_rules != rules_at_ready) {
      return at("the fold rules changed from " + std::to_string(rules_at_ready) + " to " +
                std::to_string(s.fold_rules) + " after READY");
    }
    if (!look.is_look) continue;
    const bool cleared = look.pending && !s.engine_recheck;
    broken = RuleBroken(look, cleared);
    if (!broken.empty()) return at(broken);
    if (counts != nullptr) Count(look, cleared, *counts);
  }
  return {};
}

SleeperJudgement JudgeSleeper(const State& s, const SimEngine& e, std::int64_t now_us,
                              std::int64_t outside_us, std::int64_t grace_us) {
  SleeperJudgement j;
  const EngineTruth& t = e.truth();
  if (!s.engine_reachable || !t.alive) return j;
  const std::string pending = s.engine_recheck ? " (re-verification pending)" : "";
  if (e.instance_name() != s.engine_instance) {
    if (now_us - std::max(t.up_since_us, outside_us) <= grace_us)
      return j;  // the monitor's to taint
    j.judged = true;
    j.mismatch = "SLEEPING on '" + s.engine_instance + "'" + pending + " but '" +
                 e.instance_name() + "' answers since " +
                 std::to_string((now_us - t.up_since_us) / 1000) + " ms";
    return j;
  }
  const bool agrees = e.asleep() && t.paused && e.requests() == 0 && t.label == s.committed.label &&
                      t.sleep_level == s.sleep_level;
  if (!agrees && now_us - outside_us <= grace_us) return j;  // the monitor's to see
  j.judged = true;
  if (agrees) return j;
  j.mismatch = "SLEEPING at level " + std::to_string(s.sleep_level) + " on '" + s.committed.label +
               "'" + pending + " but the engine is " + (e.asleep() ? "asleep" : "awake") +
               " at level " + std::to_string(t.sleep_level) +
               (t.paused ? ", paused" : ", not paused") + ", holds " +
               std::to_string(e.requests()) + " request(s), labelled '" + t.label + "'";
  return j;
}

}  // namespace rc::sim
