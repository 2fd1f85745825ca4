#include "audit/audit.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string_view>
#include <type_traits>
#include <utility>

#include "effects/file_kind.h"
#include "effects/http/response_parsers.h"
#include "journal/json.h"
#include "statemachine/describe.h"
#include "statemachine/fleet_history.h"
#include "statemachine/quote.h"
#include "statemachine/text.h"

namespace rc::audit {
namespace {

using nlohmann::json;

// Every string that reaches audit's text (report lines, failure and detail messages) passes
// through here whatever its origin: identities, labels and ids are client text, and one record
// must stay one line (a "\n" in a checkpoint forged report lines, a NUL truncated them).
std::string E(const std::string& s) { return text::escape_line(s); }

// Tracks the committed generations while scanning, keyed by generation.
class VersionTable {
 public:
  void Observe(const journal::Record& r, const State& before) {
    if (const auto* c = std::get_if<StateChanged>(&r.event);
        c != nullptr && c->from == Lifecycle::kUninitialized && c->to == Lifecycle::kReady) {
      VersionRecord v;
      v.version = WeightVersion{0, before.bootstrap ? before.bootstrap->label : ""};
      v.identity = before.bootstrap ? before.bootstrap->identity : WeightIdentity{};
      v.published_seq = r.seq;
      versions_[0] = v;
    }
    if (const auto* p = std::get_if<VersionPublished>(&r.event)) {
      VersionRecord v;
      v.version = p->version;
      v.identity = p->identity;
      v.update_id = p->update_id;
      v.restore = before.update.has_value() && before.update->restore;
      v.published_seq = r.seq;
      versions_[p->version.generation] = v;
    }
    if (const auto* a = std::get_if<RolloutAdmitted>(&r.event)) {
      versions_[a->version.generation].rollouts_admitted++;
    }
    if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
      auto it = before.active.find(f->rollout_id);
      if (it != before.active.end()) versions_[it->second.version.generation].rollouts_finished++;
    }
  }
  std::vector<VersionRecord> list() const {
    std::vector<VersionRecord> out;
    for (const auto& [g, v] : versions_) out.push_back(v);
    return out;
  }
  std::optional<VersionRecord> find(std::uint64_t generation) const {
    auto it = versions_.find(generation);
    if (it == versions_.end()) return std::nullopt;
    return it->second;
  }

 private:
  std::map<std::uint64_t, VersionRecord> versions_;
};

// Appends to a bounded list; the count stays exact past the bound.
void Note(std::vector<RolloutNote>& list, std::uint64_t& count, RolloutNote note) {
  count++;
  if (list.size() < kRolloutNotesMax) list.push_back(std::move(note));
}

// Follows rollouts and the lifecycle through the records to find the rollouts a READY taint
// makes suspect. Reads only the records' own fields (seq, wall time, event): the fold's legality
// is the history checker's verdict.
class EngineWatch {
 public:
  void Observe(const journal::Record& r) {
    if (r.cause_seq == 0) CloseGroup();
    if (const auto* a = std::get_if<RolloutAdmitted>(&r.event)) {
      active_[a->rollout_id] = RolloutNote{a->rollout_id, a->version, r.seq, 0, 0, ""};
    } else if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
      OnFinish(*f, r);
    } else if (const auto* c = std::get_if<StateChanged>(&r.event)) {
      OnChange(*c, r);
    } else if (const auto* u = std::get_if<UpdateEnded>(&r.event)) {
      // The fold journals UpdateEnded before the transition it ends with, in the same group.
      if (u->outcome == UpdateOutcome::kTainted) {
        tainted_end_ = PlanOf(u->update_id) + " " + Quoted(u->update_id) +
                       " ended tainted at seq " + std::to_string(r.seq) +
                       " without a transition to TAINTED";
      }
    }
    NotePlan(r.event);
    if (std::holds_alternative<RecoveryStarted>(r.event)) recovery_window_start_ = prev_wall_;
    if (r.cause_seq == 0) last_input_ = r.event;
    prev_wall_ = r.wall_time_ms;
  }

  EngineHealth Finish(const State& state) && {
    CloseGroup();
    h_.lifecycle = state.lifecycle;
    return std::move(h_);
  }

 private:
  // The plan each request starts: its ends name it by kind, so a sleep is never called an update.
  void NotePlan(const Event& e) {
    if (const auto* u = std::get_if<UpdateRequested>(&e)) {
      plan_ = {"update", u->update_id};
    } else if (const auto* q = std::get_if<RestoreRequested>(&e)) {
      plan_ = {"restore", q->restore_id};
    } else if (const auto* sl = std::get_if<SleepRequested>(&e)) {
      plan_ = {"sleep", sl->sleep_id};
    } else if (const auto* w = std::get_if<WakeRequested>(&e)) {
      plan_ = {"wake-up", w->wake_id};
    }
  }

  // "sleep_failed, sleep 's-3'": the open taint's cause and the plan it struck, if any.
  std::string TaintCause() const {
    std::string out = cause_name(h_.taint_cause);
    if (!h_.taint_update_id.empty()) out += ", " + h_.taint_plan + " " + Quoted(h_.taint_update_id);
    return out;
  }

  std::string PlanOf(const std::string& id) const {
    return id == plan_.second ? plan_.first : "update";
  }

  void OnFinish(const RolloutFinished& f, const journal::Record& r) {
    auto it = active_.find(f.rollout_id);
    if (it == active_.end()) return;  // an illegal finish: the history checker names it
    RolloutNote note = std::move(it->second);
    active_.erase(it);
    note.finished_seq = r.seq;
    note.finished_wall_ms = r.wall_time_ms;
    if (f.outcome == RolloutOutcome::kExpired) {
      Note(h_.expired, h_.expired_count, WithWhy(note, "expired: its lease lapsed"));
    } else if (f.outcome == RolloutOutcome::kAbandoned) {
      Note(h_.abandoned, h_.abandoned_count, WithWhy(note, "abandoned: its client vanished"));
    }
    auto s = suspect_index_.find(note.rollout_id);
    if (s != suspect_index_.end()) {  // active at the taint, finished after it
      h_.suspect[s->second].finished_seq = r.seq;
      h_.suspect[s->second].finished_wall_ms = r.wall_time_ms;
      return;
    }
    if (h_.tainted) return;
    // Only finishes since the last READY entry can fall in a window (see OnChange).
    if (finished_.size() >= kRolloutNotesMax) {
      finished_.pop_front();
      h_.finishes_truncated = true;
    }
    finished_.push_back(std::move(note));
  }

  static RolloutNote WithWhy(RolloutNote note, std::string why) {
    note.why = std::move(why);
    return note;
  }

  // An UpdateEnded{tainted} whose group held no transition to TAINTED.
  void CloseGroup() {
    if (!tainted_end_.empty()) h_.unexplained_taints.push_back(std::move(tainted_end_));
    tainted_end_.clear();
  }

  // A restore with proof ended the open taint: the engine serves a proven version again.
  void OnRestored(const journal::Record& r) {
    h_.restored_count++;
    if (h_.restored.size() < kRolloutNotesMax) {
      h_.restored.push_back("seq " + std::to_string(r.seq) + ": READY again after a restore; it " +
                            "ends the taint at seq " + std::to_string(h_.taint_seq) + " (" +
                            TaintCause() + ")");
    }
    h_.tainted = false;
    h_.taint_seq = 0;
    h_.taint_wall_ms = 0;
    h_.taint_detail.clear();
    h_.taint_plan.clear();
    h_.taint_update_id.clear();
  }

  void OnChange(const StateChanged& c, const journal::Record& r) {
    if (c.to == Lifecycle::kTainted) tainted_end_.clear();
    if (c.to == Lifecycle::kReady && h_.tainted) OnRestored(r);
    if (c.to == Lifecycle::kReady) {
      ready_wall_ = r.wall_time_ms;
      finished_.clear();
    }
    if (c.to != Lifecycle::kTainted || h_.tainted) return;
    h_.tainted = true;
    h_.taint_seq = r.seq;
    h_.taint_wall_ms = r.wall_time_ms;
    h_.taint_cause = c.cause;
    h_.taint_from = c.from;
    h_.taint_detail = c.detail;
    const bool engine_taint = c.from == Lifecycle::kReady || c.from == Lifecycle::kSleeping;
    h_.taint_plan = engine_taint ? "" : plan_.first;
    h_.taint_update_id = engine_taint ? "" : plan_.second;
    // A plan's taint: no binding was active while the weights could change. An engine taint
    // while asleep opens the window like one in READY: the sleep drained the rollouts and admits
    // none, but those that finished before it may have been served by the engine found now. So
    // does another process answering a plan's resume: a drain that gave up left rollouts bound,
    // and the process that replaced the verified one may have served them. So does a transfer
    // that met someone else's open weight session: it may have changed the weights while the
    // engine served, since the engine was last verified.
    if (!engine_taint && c.from != Lifecycle::kResuming && !MetForeignSession()) return;
    SetWindow();
    if (MetForeignSession()) h_.window_source += "; the update met someone else's weight session";
    CollectSuspects();
  }

  bool MetForeignSession() const {
    const auto* t = std::get_if<TransferObserved>(&last_input_);
    return t != nullptr && t->foreign_session;
  }

  // The window opens when the executor last knew the verified engine served: the monitor's
  // last_ok_wall_ms; for a probe after an executor restart, the last record before the
  // RecoveryStarted (nobody watched in between). Never before the engine was verified READY:
  // earlier finishes ran before the drain of an update whose validation checked the instance.
  void SetWindow() {
    h_.window_known = true;
    h_.window_start_wall_ms = ready_wall_;
    h_.window_source = "the engine's verification (READY)";
    if (const auto* m = std::get_if<EngineMonitored>(&last_input_); m && m->last_ok_wall_ms > 0) {
      h_.window_start_wall_ms = std::max(ready_wall_, m->last_ok_wall_ms);
      h_.window_source = "the monitor's last sight of the verified engine";
    } else if (std::holds_alternative<EngineProbed>(last_input_) && recovery_window_start_) {
      h_.window_start_wall_ms = std::max(ready_wall_, *recovery_window_start_);
      h_.window_source = "the last record before the executor restarted";
    }
  }

  void CollectSuspects() {
    for (const RolloutNote& f : finished_) {
      // Inclusive: a finish in the same millisecond as the last good sight is not proven clean.
      if (f.finished_wall_ms < h_.window_start_wall_ms) continue;
      AddSuspect(
          f, "finished at wall " + std::to_string(f.finished_wall_ms) + " ms, inside the window");
    }
    for (const auto& [id, a] : active_) AddSuspect(a, "active at the taint");
    finished_.clear();
    std::sort(h_.suspect.begin(), h_.suspect.end(), [](const RolloutNote& x, const RolloutNote& y) {
      return x.admitted_seq < y.admitted_seq;
    });
    suspect_index_.clear();
    for (std::size_t i = 0; i < h_.suspect.size(); ++i)
      suspect_index_[h_.suspect[i].rollout_id] = i;
  }

  void AddSuspect(const RolloutNote& n, const std::string& why) {
    Note(h_.suspect, h_.suspect_count, WithWhy(n, why));
  }

  EngineHealth h_;
  std::map<std::string, RolloutNote> active_;
  std::deque<RolloutNote> finished_;  // finished since the last READY entry, before any taint
  std::map<std::string, std::size_t> suspect_index_;
  std::int64_t prev_wall_ = 0;
  std::optional<std::int64_t> recovery_window_start_;
  std::int64_t ready_wall_ = 0;
  Event last_input_;
  std::string tainted_end_;  // an UpdateEnded{tainted} waiting for its group's transition
  std::pair<std::string, std::string> plan_;  // the last plan requested: its kind and its id
};

// One engine's view while scanning: its version table and its health watch.
struct EnginePass {
  VersionTable versions;
  EngineWatch watch;
};

// The rollout a record names (its admission, finish or trajectory part); nullptr for any other.
// The journal files these records, and only these, under the id in its rollout index.
const std::string* RolloutNamed(const Event& e) {
  if (const auto* a = std::get_if<RolloutAdmitted>(&e)) return &a->rollout_id;
  if (const auto* f = std::get_if<RolloutFinished>(&e)) return &f->rollout_id;
  if (const auto* t = std::get_if<TrajectoryRecorded>(&e)) return &t->rollout_id;
  return nullptr;
}

// One pass over the journal's records: each engine's version table and health, and the fleet's
// fold. A journal of one engine is the fleet of the unnamed engine "". An engine removed and
// joined again is a new life, audited apart ("e (life 2)"): its generations start again.
struct Pass {
  std::map<std::string, EnginePass> engines;  // by LifeName
  std::map<std::string, std::uint32_t> lives;
  FleetState fleet;
  bool named = false;  // some record names an engine or is the fleet's own

  std::string LifeName(const std::string& engine) const {
    auto it = lives.find(engine);
    const std::uint32_t life = it == lives.end() ? 1 : it->second;
    return life <= 1 ? engine : engine + " (life " + std::to_string(life) + ")";
  }

  void Observe(const journal::Record& r) {
    named = named || !r.engine.empty() || is_fleet_event(r.event);
    if (const auto* joined = std::get_if<EngineJoined>(&r.event)) lives[joined->engine]++;
    if (!is_fleet_event(r.event)) {
      EnginePass& e = engines[LifeName(r.engine)];
      e.versions.Observe(r, engine_state(fleet, r.engine));
      e.watch.Observe(r);
    }
    // The fold here only feeds the version tables; legality is the history checker's verdict.
    fleet_apply(fleet, FleetEvent{r.engine, r.event}).IgnoreError();
  }
};

// Whether a trajectory part keeps the two rules the fold reads of its tokens (statemachine/
// lifecycle.cc check_binding): at most kTrajectoryTokensPerRecordMax tokens, and no logprobs or
// one per output token.
bool WithinFoldRules(const TrajectoryRecorded& t) {
  return t.prompt_token_ids.size() + t.output_token_ids.size() <= kTrajectoryTokensPerRecordMax &&
         (t.output_logprobs.empty() || t.output_logprobs.size() == t.output_token_ids.size());
}

// What the history checker is given of a record. The fold reads of a trajectory part only its
// rollout id and the rules above, and no message names an input's tokens, so a part recorded as
// an input that keeps them is held as its id and part number: the checker's verdict and state
// are those of the whole record, and the history holds no tokens. A part that breaks a rule, or
// is recorded as a decision (whose message describes it), is held whole, as written.
FleetHistoryEntry HistoryEntryOf(const journal::Record& r) {
  const auto* t = std::get_if<TrajectoryRecorded>(&r.event);
  if (t == nullptr || r.cause_seq != 0 || !WithinFoldRules(*t)) {
    return FleetHistoryEntry{r.seq, r.cause_seq, r.engine, r.event};
  }
  return FleetHistoryEntry{r.seq, r.cause_seq, r.engine,
                           TrajectoryRecorded{t->rollout_id, t->part}};
}

// Rollout-index mismatches named in a report; the rest are counted.
constexpr std::size_t kIndexFindingsMax = 20;

// Cross-checks the rollout index (Journal::RolloutSeqs) with the records as the scan meets them:
// every record that names a rollout must be listed under that id, and every seq listed under it
// must hold a record that names it. Memory: the listed seqs of the rollouts met and not finished
// (a finished one's are let go once each was met) and the first kIndexFindingsMax findings. The
// index's point key of an id (its admission seq) is not read: Journal does not expose it.
class IndexCheck {
 public:
  explicit IndexCheck(journal::Journal& journal) : journal_(journal) {}

  void Observe(const journal::Record& r) {
    const std::string* id = RolloutNamed(r.event);
    if (id == nullptr) return;
    auto it = open_.find(*id);
    if (it == open_.end()) it = Load(*id, r.seq);
    Listed& listed = it->second;
    Meet(it->first, listed, r);
    listed.finished = listed.finished || std::holds_alternative<RolloutFinished>(r.event);
    if (listed.finished && listed.next == listed.seqs.size()) open_.erase(it);
  }

  // The findings, raw. `whole`: the scan reached the head, so a listed seq the scan met no record
  // of the rollout at is a mismatch, unless a writer appended that record after the scan ended
  // (a journal read beside its writer); else the seqs past where the scan stopped were never
  // checked.
  std::vector<std::string> Finish(bool whole) && {
    for (auto& [id, listed] : open_) {
      for (; whole && listed.next < listed.seqs.size(); ++listed.next) {
        if (!NamesAt(id, listed.seqs[listed.next])) Unmet(id, listed.seqs[listed.next]);
      }
    }
    if (mismatches_ > findings_.size()) {
      findings_.push_back("rollout index: " + std::to_string(mismatches_ - findings_.size()) +
                          " more mismatches");
    }
    return std::move(findings_);
  }

 private:
  struct Listed {
    std::vector<std::uint64_t> seqs;  // ascending (the index's keys end in BE64(seq))
    std::size_t next = 0;             // seqs[next] is the next record expected to name it
    bool finished = false;
  };

  // The id's listed seqs, from a record at `seq`: the first this scan meets, or the first since
  // its finish let them go. Seqs below it are that earlier life's (met and checked then) or
  // records that do not name the rollout.
  std::map<std::string, Listed>::iterator Load(const std::string& id, std::uint64_t seq) {
    Listed listed;
    Result<std::vector<std::uint64_t>> seqs = journal_.RolloutSeqs(id);
    if (seqs.ok()) {
      listed.seqs = std::move(seqs.value());
    } else if (Named()) {
      findings_.push_back("rollout index: the seqs of " + Quoted(E(id)) +
                          " cannot be read: " + seqs.status().ToString());
    }
    for (; listed.next < listed.seqs.size() && listed.seqs[listed.next] < seq; ++listed.next) {
      if (!NamesAt(id, listed.seqs[listed.next])) Unmet(id, listed.seqs[listed.next]);
    }
    return open_.emplace(id, std::move(listed)).first;
  }

  // A record naming `id`: the seqs listed before it hold records that do not name it, and it
  // must be the next one listed.
  void Meet(const std::string& id, Listed& listed, const journal::Record& r) {
    for (; listed.next < listed.seqs.size() && listed.seqs[listed.next] < r.seq; ++listed.next) {
      Unmet(id, listed.seqs[listed.next]);
    }
    if (listed.next < listed.seqs.size() && listed.seqs[listed.next] == r.seq) {
      ++listed.next;
    } else if (Named()) {
      findings_.push_back("rollout index: seq " + std::to_string(r.seq) + " (" +
                          event_name(r.event) + ") names rollout " + Quoted(E(id)) +
                          " but the index does not list it under that id");
    }
  }

  // A seq listed under `id` whose record does not name it.
  void Unmet(const std::string& id, std::uint64_t seq) {
    if (!Named()) return;
    Result<journal::Record> r = journal_.Read(seq);
    const std::string* named = r.ok() ? RolloutNamed(r->event) : nullptr;
    const std::string there = !r.ok() ? "no record is there (" + r.status().ToString() + ")"
                                      : std::string("the record there is ") + event_name(r->event) +
                                            (named == nullptr ? "" : " of " + Quoted(E(*named)));
    findings_.push_back("rollout index: seq " + std::to_string(seq) + " is listed under " +
                        Quoted(E(id)) + " but " + there);
  }

  bool NamesAt(const std::string& id, std::uint64_t seq) {
    Result<journal::Record> r = journal_.Read(seq);
    const std::string* named = r.ok() ? RolloutNamed(r->event) : nullptr;
    return named != nullptr && *named == id;
  }

  // Counts a mismatch; true while it is among the first kIndexFindingsMax, named in full.
  bool Named() { return ++mismatches_ <= kIndexFindingsMax; }

  journal::Journal& journal_;
  std::map<std::string, Listed> open_;
  std::vector<std::string> findings_;
  std::uint64_t mismatches_ = 0;
};

// The torn WAL tails executors' starts recorded (journal/recorded_torn_tails.h), each a journal
// failure.
class TornTails {
 public:
  void Observe(const journal::Record& r) { journal::NoteRecordedTornTail(r, last_, kept_, count_); }

  // Into the report: each one kept is a journal failure naming its record, the rest counted.
  void Finish(AuditReport& report) && {
    for (const RecordedTornTail& t : kept_) {
      report.failures.push_back(
          "seq " + std::to_string(t.seq) + " (RecoveryStarted" +
          (t.engine.empty() ? "" : " of engine " + Quoted(t.engine)) +
          ") recorded what the journal's open before that executor start found: " + t.sentence);
    }
    if (count_ > kept_.size()) {
      report.failures.push_back(std::to_string(count_ - kept_.size()) +
                                " more torn WAL tails recorded");
    }
    report.torn_tails = std::move(kept_);
    report.torn_tails_count = count_;
  }

 private:
  std::vector<RecordedTornTail> kept_;
  std::uint64_t count_ = 0;
  std::string last_;  // the sentence of the last one met
};

// The whole-journal scan: the pass, the rollout index's cross-check, and the history the
// checker is given. The history is the one thing held per record (statemachine's checkers take
// it whole): one entry each, a trajectory part's without its tokens (HistoryEntryOf). A deque,
// so that it grows without a copy and is handed over a block at a time.
struct Scanned {
  Pass pass;
  std::deque<FleetHistoryEntry> history;
  std::uint64_t records = 0;
  Status scanned;
  std::vector<std::string> index_failures;
  TornTails torn_tails;
};

Scanned ScanAll(journal::Journal& journal) {
  Scanned out;
  IndexCheck index(journal);
  out.scanned = journal.Scan(1, 0, [&](const journal::Record& r) {
    out.pass.Observe(r);
    index.Observe(r);
    out.torn_tails.Observe(r);
    out.history.push_back(HistoryEntryOf(r));
    out.records++;
    return Status::OK();
  });
  out.index_failures = std::move(index).Finish(out.scanned.ok());
  return out;
}

// The history as `Entry`s (HistoryEntry, or FleetHistoryEntry), taken from the front of `from` so
// that only one copy of it is held at a time.
template <typename Entry>
std::vector<Entry> TakeHistory(std::deque<FleetHistoryEntry>& from) {
  std::vector<Entry> out;
  out.reserve(from.size());
  while (!from.empty()) {
    FleetHistoryEntry& e = from.front();
    if constexpr (std::is_same_v<Entry, HistoryEntry>) {
      out.push_back(HistoryEntry{e.seq, e.cause_seq, std::move(e.event)});
    } else {
      out.push_back(std::move(e));
    }
    from.pop_front();
  }
  return out;
}

void AddSummary(HistorySummary& sum, const HistorySummary& s) {
  sum.entries += s.entries;
  sum.inputs += s.inputs;
  sum.updates_requested += s.updates_requested;
  sum.updates_committed += s.updates_committed;
  sum.updates_refused += s.updates_refused;
  sum.updates_tainted += s.updates_tainted;
  sum.recoveries += s.recoveries;
  sum.restores_requested += s.restores_requested;
  sum.sleeps_requested += s.sleeps_requested;
  sum.sleeps_committed += s.sleeps_committed;
  sum.wakes_requested += s.wakes_requested;
  sum.wakes_committed += s.wakes_committed;
}

void AuditOneEngine(journal::Journal& journal, Scanned& scanned, AuditReport& report) {
  report.history = check_history(TakeHistory<HistoryEntry>(scanned.history));
  EnginePass& engine = scanned.pass.engines[""];
  report.versions = engine.versions.list();
  report.state = report.history.state;
  report.engine = std::move(engine.watch).Finish(report.state);
  const State head = journal.state();
  if (report.history.ok && report.chain_ok && !(head == report.state)) {
    report.failures.push_back("the journal's folded state differs from the audit's refold");
  }
}

void AuditFleet(journal::Journal& journal, Scanned& scanned, AuditReport& report) {
  report.fleet = true;
  const FleetHistoryReport checked =
      check_fleet_history(TakeHistory<FleetHistoryEntry>(scanned.history));
  Pass& pass = scanned.pass;
  report.history.ok = checked.ok;
  report.history.first_bad_seq = checked.first_bad_seq;
  report.history.message = checked.message;
  for (const auto& [life, summary] : checked.engines) AddSummary(report.history.summary, summary);
  report.fleet_updates = checked.fleet_updates;
  std::map<std::string, const State*> current;  // the fleet's engines, by life name
  for (const auto& [name, state] : checked.state.engines) current[pass.LifeName(name)] = &state;
  for (auto& [life, engine] : pass.engines) {
    EngineAudit& out = report.engines[life];
    out.versions = engine.versions.list();
    auto it = current.find(life);
    out.removed = it == current.end();
    if (!out.removed) out.state = *it->second;
    out.health = std::move(engine.watch).Finish(out.state);
  }
  // Engines that joined and journaled nothing of their own yet.
  for (const auto& [life, state] : current) {
    report.engines.try_emplace(life, EngineAudit{{}, *state, false, {}});
  }
  const FleetState head = journal.fleet_state();
  if (checked.ok && report.chain_ok && !(head == checked.state)) {
    report.failures.push_back("the journal's folded fleet differs from the audit's refold");
  }
}

}  // namespace

Result<AuditReport> AuditJournal(journal::Journal& journal) {
  AuditReport report;
  Scanned scanned = ScanAll(journal);
  report.records = scanned.records;
  if (!scanned.scanned.ok()) {
    report.chain_ok = false;
    report.failures.push_back("chain: " + scanned.scanned.ToString());
  }
  Status checksums = journal.VerifyChecksum();
  if (!checksums.ok()) {
    report.checksums_ok = false;
    report.failures.push_back("checksums: " + checksums.ToString());
  }
  for (std::string& f : scanned.index_failures) report.failures.push_back(std::move(f));
  std::move(scanned.torn_tails).Finish(report);
  // What a restart loads (the newest snapshot and the records after it): a snapshot that is not
  // of these records (its chain hash) would start serve from a state they never reached.
  if (scanned.scanned.ok()) {
    Status restart = journal.LoadFleetState().status();
    if (!restart.ok()) report.failures.push_back("restart state: " + restart.ToString());
  }
  if (scanned.pass.named) {
    AuditFleet(journal, scanned, report);
  } else {
    AuditOneEngine(journal, scanned, report);
  }
  if (!report.history.ok) {
    report.failures.push_back("history: seq " + std::to_string(report.history.first_bad_seq) +
                              ": " + report.history.message);
  }
  report.ok = report.failures.empty();
  return report;
}

namespace {

// A record the rollout index lists for p.rollout_id: it must name that rollout, the first one
// must be its admission (an id is used once, by its admission first), and none may follow its
// finish; Corruption otherwise.
Status TakeIndexed(const journal::Record& r, RolloutProvenance& p) {
  const std::string* named = RolloutNamed(r.event);
  const std::string at = "the rollout index names seq " + std::to_string(r.seq) + " for " +
                         Quoted(E(p.rollout_id)) + " but ";
  if (named == nullptr || *named != p.rollout_id) {
    return Status::Corruption(at + "the record there is " + event_name(r.event) +
                              (named == nullptr ? "" : " of " + Quoted(E(*named))));
  }
  const auto* admitted = std::get_if<RolloutAdmitted>(&r.event);
  if ((admitted != nullptr) != (p.admitted_seq == 0)) {
    return Status::Corruption(at + (admitted != nullptr ? "it was admitted before, at seq " +
                                                              std::to_string(p.admitted_seq)
                                                        : "its admission comes later or never"));
  }
  if (p.finish) {
    return Status::Corruption(at + "it finished before, at seq " + std::to_string(p.finished_seq));
  }
  if (admitted != nullptr) {
    p.binding = *admitted;
    p.admitted_seq = r.seq;
    p.engine = r.engine;
  } else if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
    p.finish = *f;
    p.finished_seq = r.seq;
  }
  return Status::OK();
}

// A record the index does not list for `rollout_id` must not name it: a provenance without it
// would show another end, or none, or no rollout at all.
Status CheckUnlisted(const journal::Record& r, const std::string& rollout_id) {
  const std::string* named = RolloutNamed(r.event);
  if (named == nullptr || *named != rollout_id) return Status::OK();
  return Status::Corruption("seq " + std::to_string(r.seq) + " (" + event_name(r.event) +
                            ") names rollout " + Quoted(E(rollout_id)) +
                            " but the rollout index does not list it");
}

// Provenance's scan: the seqs the rollout index lists for one rollout, met against the records
// in seq order (see Provenance).
class ProvenanceScan {
 public:
  ProvenanceScan(const std::string& rollout_id, std::vector<std::uint64_t> seqs)
      : seqs_(std::move(seqs)) {
    p_.rollout_id = rollout_id;
  }

  Status Run(journal::Journal& journal) {
    const Status st = journal.Scan(1, 0, [&](const journal::Record& r) { return Visit(r); });
    return complete_ ? Status::OK() : st;
  }

  Result<RolloutProvenance> Finish() && {
    const std::string& id = p_.rollout_id;
    if (next_ != seqs_.size()) {  // only a seq 0 (no record has it) is left unvisited
      return Status::Corruption("the rollout index names seq " + std::to_string(seqs_[next_]) +
                                " for " + Quoted(E(id)) + ", which no record has");
    }
    if (p_.admitted_seq == 0) {  // the index lists nothing, and no record names it
      return Status::NotFound("no rollout " + Quoted(E(id)) + " in the journal");
    }
    const std::uint64_t generation = p_.binding.version.generation;
    auto v = pass_.engines[pass_.LifeName(p_.engine)].versions.find(generation);
    if (!v) {
      return Status::Corruption("rollout " + Quoted(E(id)) + " is bound to generation " +
                                std::to_string(generation) + " which was never committed");
    }
    p_.version = *v;
    return std::move(p_);
  }

 private:
  // OK to go on; a non-OK status ends the scan: Corruption, or complete_ once one record past the
  // finish (its prev_hash vouches for the finish) is reached with every listed seq met.
  Status Visit(const journal::Record& r) {
    if (p_.finish && next_ == seqs_.size()) {
      complete_ = true;
      return Status::Rejected("provenance complete");
    }
    if (p_.admitted_seq == 0) pass_.Observe(r);  // the generations, up to the admission
    if (next_ < seqs_.size() && seqs_[next_] == r.seq) {
      ++next_;
      return TakeIndexed(r, p_);
    }
    return CheckUnlisted(r, p_.rollout_id);
  }

  std::vector<std::uint64_t> seqs_;  // ascending (the index's keys end in BE64(seq))
  std::size_t next_ = 0;             // seqs_[next_] is the next record the index lists
  RolloutProvenance p_;
  Pass pass_;
  bool complete_ = false;
};

}  // namespace

// One scan from seq 1 reads every record the index lists and checks every other record against
// it: the index lists exactly the records that name the rollout (decoded and chain-verified, so
// nothing shown rests on a record the chain does not vouch for, nor on an index that lost one).
// A record's bytes are vouched for by the next record's prev_hash, or by the head hash the open
// checked: the scan stops one record past the finish once every listed seq was met (no record of
// an accepted history names a finished rollout), and reads to the head when the rollout has no
// finish or the index lists nothing, since only then are "not finished" and "no such rollout"
// proven. The generation's origin is what that scan saw up to the admission. In a fleet,
// generations are the admitting engine's own.
Result<RolloutProvenance> Provenance(journal::Journal& journal, const std::string& rollout_id) {
  auto seqs = journal.RolloutSeqs(rollout_id);
  if (!seqs.ok()) return seqs.status();
  // The index names only records it was written with: one past the head was lost (damage).
  if (!seqs->empty() && seqs->back() > journal.head_seq()) {
    return Status::Corruption("the rollout index names seq " + std::to_string(seqs->back()) +
                              " for " + Quoted(E(rollout_id)) +
                              " but no record is stored there (the " + "journal ends at seq " +
                              std::to_string(journal.head_seq()) + ")");
  }
  ProvenanceScan scan(rollout_id, std::move(seqs.value()));
  RC_RETURN_IF_ERROR(scan.Run(journal));
  return std::move(scan).Finish();
}

namespace {

// What one rollout's trajectory has joined so far, held against RolloutTrajectoryBounds.
struct JoinedCount {
  std::size_t parts = 0;
  std::size_t tokens = 0;  // prompt and output
};

// Counts part `t`, recorded at `seq`, into `joined`; a Corruption naming the seq, the rollout and
// the bound when it would pass one (nothing counted then), so that no rollout's joined trajectory
// outgrows its bounds whatever the journal holds.
Status CountPart(const TrajectoryRecorded& t, std::uint64_t seq,
                 const RolloutTrajectoryBounds& bounds, JoinedCount& joined) {
  RC_CHECK(joined.parts <= bounds.parts_per_rollout_max &&
           joined.tokens <= bounds.tokens_per_rollout_max);
  const std::string at =
      "seq " + std::to_string(seq) + ": the trajectory of rollout " + Quoted(E(t.rollout_id));
  if (joined.parts == bounds.parts_per_rollout_max) {
    return Status::Corruption(at + " has more than " +
                              std::to_string(bounds.parts_per_rollout_max) +
                              " parts, the most one rollout's trajectory may hold");
  }
  const std::size_t tokens = t.prompt_token_ids.size() + t.output_token_ids.size();
  if (tokens > bounds.tokens_per_rollout_max - joined.tokens) {
    return Status::Corruption(at + " has more than " +
                              std::to_string(bounds.tokens_per_rollout_max) +
                              " tokens (prompt and output), the most one rollout's trajectory "
                              "may hold");
  }
  joined.parts++;
  joined.tokens += tokens;
  return Status::OK();
}

// A rollout admitted and not finished: its binding, and where its trajectory's parts go.
struct OpenRollout {
  RolloutAdmitted binding;
  std::uint64_t admitted_seq = 0;
  std::uint32_t next_part = 0;
  std::optional<std::uint64_t> ordinal;  // its trajectory's number in the journal, from part 0
  JoinedCount joined;
};

// The most recent `bound` trajectories of a journal, fed its records in seq order. Only open
// rollouts are followed (a part is legal only while its rollout is active), so memory holds the
// window and the open rollouts, never the whole run.
class TrajectoryWindow {
 public:
  TrajectoryWindow(std::size_t bound, RolloutTrajectoryBounds per_rollout)
      : bound_(bound), per_rollout_(per_rollout) {
    RC_CHECK(bound_ >= 1);
  }

  Status Observe(const journal::Record& r) {
    if (const auto* a = std::get_if<RolloutAdmitted>(&r.event)) {
      open_[a->rollout_id] = OpenRollout{*a, r.seq, 0, std::nullopt, JoinedCount{}};
    } else if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
      open_.erase(f->rollout_id);
    } else if (const auto* t = std::get_if<TrajectoryRecorded>(&r.event)) {
      return OnPart(*t, r.seq);
    }
    return Status::OK();
  }

  JournalTrajectories Finish() && {
    RC_CHECK(kept_.size() <= bound_ && kept_.size() <= total_);
    JournalTrajectories out;
    out.total = total_;
    out.trajectories.assign(std::make_move_iterator(kept_.begin()),
                            std::make_move_iterator(kept_.end()));
    return out;
  }

 private:
  Status OnPart(const TrajectoryRecorded& t, std::uint64_t seq) {
    auto it = open_.find(t.rollout_id);
    if (it == open_.end() || t.part != it->second.next_part) {
      return Status::Corruption("seq " + std::to_string(seq) + ": trajectory part " +
                                std::to_string(t.part) + " of " + Quoted(E(t.rollout_id)) +
                                " out of order or without an open admission");
    }
    OpenRollout& open = it->second;
    RC_RETURN_IF_ERROR(CountPart(t, seq, per_rollout_, open.joined));
    open.next_part++;
    if (t.part == 0) open.ordinal = Start(open);
    Trajectory* kept = Kept(*open.ordinal);
    if (kept != nullptr) Append(t, *kept);  // else it left the window: counted, not kept
    return Status::OK();
  }

  // A new trajectory enters the window; the oldest leaves it past the bound.
  std::uint64_t Start(const OpenRollout& open) {
    Trajectory tr;
    tr.rollout_id = open.binding.rollout_id;
    tr.admission_seq = open.admitted_seq;
    tr.version = open.binding.version;
    tr.identity = open.binding.identity;
    kept_.push_back(std::move(tr));
    if (kept_.size() > bound_) kept_.pop_front();
    return total_++;
  }

  // The window holds ordinals [total_ - kept_.size(), total_).
  Trajectory* Kept(std::uint64_t ordinal) {
    RC_CHECK(ordinal < total_);
    const std::uint64_t first = total_ - kept_.size();
    return ordinal < first ? nullptr : &kept_[ordinal - first];
  }

  // One logprob slot per output token, never more (the logprobs are bounded by the tokens).
  static void Append(const TrajectoryRecorded& t, Trajectory& tr) {
    tr.prompt.insert(tr.prompt.end(), t.prompt_token_ids.begin(), t.prompt_token_ids.end());
    tr.output.insert(tr.output.end(), t.output_token_ids.begin(), t.output_token_ids.end());
    for (std::size_t i = 0; i < t.output_token_ids.size(); ++i) {
      const bool has = i < t.output_logprobs.size() && t.output_logprobs[i] == t.output_logprobs[i];
      tr.logprobs.push_back(has ? std::optional<double>(t.output_logprobs[i]) : std::nullopt);
    }
    RC_CHECK(tr.logprobs.size() == tr.output.size());
  }

  std::size_t bound_;
  RolloutTrajectoryBounds per_rollout_;
  std::map<std::string, OpenRollout> open_;
  std::deque<Trajectory> kept_;
  std::uint64_t total_ = 0;  // trajectories seen (part 0s)
};

}  // namespace

// Past the bound the most recent trajectories are offered, not the first or an even spread:
// re-verification can check only those of the version the engine serves now, which is the
// journal's latest, so older ones would mostly be skipped; and the recent ones are the rollouts
// the engine under audit served.
Result<JournalTrajectories> SampleTrajectoriesFromJournal(journal::Journal& journal,
                                                          std::size_t bound,
                                                          RolloutTrajectoryBounds per_rollout) {
  TrajectoryWindow window(bound, per_rollout);
  Status st = journal.Scan(1, 0, [&](const journal::Record& r) { return window.Observe(r); });
  if (!st.ok()) return st;
  return std::move(window).Finish();
}

Result<std::vector<Trajectory>> TrajectoriesFromJournal(journal::Journal& journal) {
  Result<JournalTrajectories> t = SampleTrajectoriesFromJournal(journal);
  if (!t.ok()) return t.status();
  if (t->trajectories.size() < t->total) {
    return Status::Rejected("the journal holds " + std::to_string(t->total) +
                            " trajectories, more than the " + std::to_string(kTrajectoriesMax) +
                            " one read returns: SampleTrajectoriesFromJournal reads the most "
                            "recent and counts the rest");
  }
  return std::move(t->trajectories);
}

namespace {

// The label whose recorded digest `combined` is, or "" when none.
std::string LabelWithDigest(const State& s, const std::string& combined) {
  for (const auto& [label, digest] : s.label_digests) {
    if (digest == combined) return label;
  }
  return {};
}

DigestCheck Finding(DigestCheck::Result result, std::string line) {
  DigestCheck c;
  c.result = result;
  c.line = line;
  c.findings.push_back(std::move(line));
  return c;
}

}  // namespace

DigestCheck CheckEngineDigest(const State& s, const std::string& engine_label,
                              const WeightDigest& live) {
  using R = DigestCheck::Result;
  if (s.label_digests.empty()) {
    return DigestCheck{R::kNotRecorded, "weight digest: the journal records none", {}};
  }
  if (!live.present()) {
    return Finding(R::kUnavailable, "weight digest: the engine computes none (" + live.error + ")");
  }
  const std::string short_live = live.combined.substr(0, 16);
  auto recorded = s.label_digests.find(engine_label);
  if (recorded == s.label_digests.end()) {
    const std::string match = LabelWithDigest(s, live.combined);
    return Finding(
        R::kDrift,
        "weight digest: the engine reports " + Quoted(engine_label) +
            ", which this journal never committed with a digest; its weights " + short_live +
            (match.empty() ? " match no committed version" : " are those of " + Quoted(match)));
  }
  if (recorded->second == live.combined) {
    return DigestCheck{R::kMatch,
                       "weight digest: the engine holds " + Quoted(engine_label) +
                           " as journaled (" + live.algorithm + ":" + short_live + ")",
                       {}};
  }
  std::string line = "weight drift: the engine reports " + Quoted(engine_label) +
                     " but its digest " + short_live + " is not the journaled " +
                     recorded->second.substr(0, 16);
  if (engine_label == s.committed.label) line += digest_difference(s.committed_digest, live);
  return Finding(R::kDrift, std::move(line));
}

namespace {

// Typed reads of one trajectory line's fields: a field of another type is an error, never an
// exception (the line is outside text). Absent fields read as their default.
bool ReadText(const json& j, const char* key, std::string& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_string()) return false;
  out = it->get<std::string>();
  return true;
}

// An integer of Int's range; anything else (a float, a string, out of range) is refused.
template <typename Int>
bool AsInt(const json& v, Int& out) {
  if (v.is_number_unsigned()) {
    const std::uint64_t u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<Int>::max())) return false;
    out = static_cast<Int>(u);
    return true;
  }
  if (!v.is_number_integer() || !std::is_signed_v<Int>) return false;
  const std::int64_t i = v.get<std::int64_t>();
  if (i < static_cast<std::int64_t>(std::numeric_limits<Int>::min()) ||
      i > static_cast<std::int64_t>(std::numeric_limits<Int>::max())) {
    return false;
  }
  out = static_cast<Int>(i);
  return true;
}

template <typename Int>
bool ReadInt(const json& j, const char* key, Int& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  return AsInt(*it, out);
}

// An object field (absent or null: the empty object).
bool ReadObject(const json& j, const char* key, const json*& out) {
  static const json kEmpty = json::object();
  auto it = j.find(key);
  out = &kEmpty;
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_object()) return false;
  out = &*it;
  return true;
}

// A boolean field (absent or null: false).
bool ReadBool(const json& j, const char* key, bool& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_boolean()) return false;
  out = it->get<bool>();
  return true;
}

// A field the line may leave out (absent or null: nullopt); of another type, an error.
bool ReadOptionalText(const json& j, const char* key, std::optional<std::string>& out) {
  std::string text;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!ReadText(j, key, text)) return false;
  out = std::move(text);
  return true;
}
bool ReadOptionalCount(const json& j, const char* key, std::optional<std::uint64_t>& out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  std::uint64_t n = 0;
  if (!AsInt(*it, n)) return false;
  out = n;
  return true;
}

// null: the rollout ended before the engine reported any token (e.g. its client went away);
// the line is still the product's own record and is read as "no tokens".
bool ReadTokenIds(const json& a, std::vector<std::int32_t>& dst) {
  if (a.is_null()) return true;
  if (!a.is_array() || a.size() > kTrajectoryTokensMax) return false;
  for (const json& t : a) {
    std::int32_t id = 0;
    if (!AsInt(t, id)) return false;
    dst.push_back(id);
  }
  return true;
}

// The writer's bounds on a line's choices (service/proxy_stream.h: kTrajectoryChoicesMax kept,
// each index below kRequestChoicesMax); a line past them is none it wrote.
constexpr std::size_t kLineChoicesMax = 1024;
constexpr std::int64_t kChoiceIndexEnd = std::int64_t{1} << 16;

// A choice's logprobs: absent or null (none), else an array of numbers and nulls (a token the
// engine gave none for), one per output token.
bool ReadLogprobs(const json& choice, std::vector<std::optional<double>>& dst) {
  auto lps = choice.find("logprobs");
  if (lps == choice.end() || lps->is_null()) return true;
  if (!lps->is_array() || lps->size() > kTrajectoryTokensMax) return false;
  for (const json& lp : *lps) {
    if (!lp.is_number() && !lp.is_null()) return false;
    dst.push_back(lp.is_number() ? std::optional<double>(lp.get<double>()) : std::nullopt);
  }
  return true;
}

// Every choice, each by its own index (an integer in [0, kChoiceIndexEnd), given once): choice 0
// into `t` (the journal's parts hold that one), the others read for their shape only. The writer
// writes them as a map by index, so a repeated or missing index is no line it wrote; indexes may
// skip (a choice the engine never answered).
bool ReadOutputs(const json& j, Trajectory& t, std::string& why) {
  auto it = j.find("outputs");
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_array()) return (why = "outputs is not an array", false);
  if (it->size() > kLineChoicesMax) return (why = "more choices than the writer keeps", false);
  std::set<std::int64_t> seen;
  for (const json& choice : *it) {
    if (!choice.is_object()) return (why = "a choice is not an object", false);
    std::int64_t index = -1;
    auto at = choice.find("index");
    if (at == choice.end() || !AsInt(*at, index) || index < 0 || index >= kChoiceIndexEnd) {
      return (why = "a choice without an index in [0, 65536)", false);
    }
    if (!seen.insert(index).second) {
      return (why = "choice index " + std::to_string(index) + " given twice", false);
    }
    std::vector<std::int32_t> ids;
    std::vector<std::optional<double>> lps;
    auto tok = choice.find("token_ids");
    if (tok != choice.end() && !ReadTokenIds(*tok, ids)) return (why = "bad token_ids", false);
    if (!ReadLogprobs(choice, lps)) return (why = "bad logprobs", false);
    t.output_tokens_all += ids.size();  // at most kLineChoicesMax * kTrajectoryTokensMax
    if (index == 0) {
      t.output = std::move(ids);
      t.logprobs = std::move(lps);
    } else {
      t.other_tokens = t.other_tokens || !ids.empty();
    }
  }
  t.choices = seen.size();
  t.has_choice0 = seen.count(0) != 0;
  return true;
}

// The line without the run of zero bytes a crash may leave at its end (the file's size reached
// the disk, its data did not); nullopt when a zero byte is left inside it. A JSON parser stops
// at a zero byte, so `<a valid line>\0<anything>` would read as the valid line: the writer never
// writes a zero byte inside a line (its JSON escapes every control character).
std::optional<std::string_view> WithoutZeroTail(std::string_view line) {
  while (!line.empty() && line.back() == '\0') line.remove_suffix(1);
  if (line.find('\0') != std::string_view::npos) return std::nullopt;
  return line;
}

Result<Trajectory> ParseTrajectoryLine(const std::string& line) {
  const std::optional<std::string_view> text = WithoutZeroTail(line);
  if (!text) {
    return Status::InvalidArgument("a zero byte at byte " + std::to_string(line.find('\0') + 1) +
                                   ", before the line's end");
  }
  const json j = effects::parse_outside_json(*text);
  if (!j.is_object()) return Status::InvalidArgument("not a JSON object");
  Trajectory t;
  const json* v = nullptr;
  const json* id = nullptr;
  const bool typed =
      ReadText(j, "rollout_id", t.rollout_id) && ReadInt(j, "admission_seq", t.admission_seq) &&
      ReadObject(j, "version", v) && ReadObject(j, "identity", id) &&
      ReadInt(*v, "generation", t.version.generation) && ReadText(*v, "label", t.version.label) &&
      ReadText(*id, "manifest_digest", t.identity.manifest_digest) &&
      ReadText(*id, "content_digest", t.identity.content_digest) &&
      ReadText(*id, "checkpoint", t.identity.checkpoint) && ReadText(*id, "run", t.identity.run) &&
      ReadInt(*id, "step", t.identity.step) && ReadText(j, "engine", t.engine) &&
      ReadInt(j, "fleet_generation", t.fleet_generation) && ReadBool(j, "truncated", t.truncated) &&
      ReadOptionalText(j, "outcome", t.outcome) &&
      ReadOptionalCount(j, "prompt_tokens", t.prompt_tokens) &&
      ReadOptionalCount(j, "completion_tokens", t.completion_tokens);
  if (!typed) return Status::InvalidArgument("a field has the wrong type or range");
  if (t.rollout_id.empty() || t.admission_seq == 0) {
    return Status::InvalidArgument("missing rollout_id/admission_seq");
  }
  auto prompt = j.find("prompt_token_ids");
  if (prompt != j.end() && !ReadTokenIds(*prompt, t.prompt)) {
    return Status::InvalidArgument("bad prompt_token_ids");
  }
  std::string why;
  if (!ReadOutputs(j, t, why)) return Status::InvalidArgument(why);
  return t;
}

// The trajectories file, closed on every path.
struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

enum class LineRead : std::uint8_t { kLine, kEnd, kTooLong, kError };

// One line without its newline, at most kTrajectoryLineBytesMax bytes; a last line without a
// newline is a line. A longer one keeps its first kTrajectoryLineBytesMax bytes in `line` and is
// read past to its end, unstored; `rest_zeros` tells whether what was read past was all zero
// bytes. A read error is told from the end of the file (ferror).
LineRead ReadLine(std::FILE* f, std::string& line, bool& rest_zeros) {
  line.clear();
  rest_zeros = true;
  bool too_long = false;
  for (int c = std::getc(f); c != EOF; c = std::getc(f)) {
    if (c == '\n') break;
    too_long = too_long || line.size() >= kTrajectoryLineBytesMax;
    if (too_long) {
      rest_zeros = rest_zeros && c == '\0';
    } else {
      line.push_back(static_cast<char>(c));
    }
  }
  if (std::ferror(f) != 0) return LineRead::kError;
  if (too_long) return LineRead::kTooLong;
  return line.empty() && std::feof(f) != 0 ? LineRead::kEnd : LineRead::kLine;
}

// Keeps only where the parser stopped on an error; builds no document, so a line of any depth
// costs no stack.
struct ErrorPosition {
  std::size_t position = 0;
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const json::string_t&) { return true; }
  bool string(json::string_t&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_object(std::size_t) { return true; }
  bool key(json::string_t&) { return true; }
  bool end_object() { return true; }
  bool start_array(std::size_t) { return true; }
  bool end_array() { return true; }
  bool parse_error(std::size_t at, const std::string&, const nlohmann::detail::exception&) {
    position = at;
    return false;
  }
};

// Whether `line` is a JSON text cut short: the parser ran out of input inside the document. Zero
// bytes at its end are stripped first: a crash can leave a write's tail as zeros (the file's size
// reached the disk, its data did not).
bool CutShort(std::string_view line) {
  while (!line.empty() && line.back() == '\0') line.remove_suffix(1);
  if (line.empty()) return true;
  // The parser stops at a zero byte as at the input's end: one inside is damage, never a cut.
  if (line.find('\0') != std::string_view::npos) return false;
  ErrorPosition sax;
  return !json::sax_parse(line, &sax) && sax.position > line.size();
}

// One line that holds no trajectory: counted as torn or damaged, named while few are. `torn`
// when only its end is missing (the parser ran out of input), its zero tail aside.
void Skip(TrajectoriesFile& file, std::size_t line_no, const std::string& line, bool torn,
          const Status& why) {
  (torn ? file.torn : file.damaged)++;
  std::vector<SkippedLine>& named = torn ? file.torn_lines : file.damaged_lines;
  if (named.size() >= kSkippedLinesNamedMax) return;
  const std::string kept = std::to_string(line.size()) + " bytes";
  const bool whole = line.size() < kTrajectoryLineBytesMax;  // else only its start was kept
  named.push_back(SkippedLine{
      line_no, torn ? "cut short after " + (whole ? kept : "over " + kept) : why.message()});
}

// A whole line followed by a run of zeros past the line bound (a crash after a batched write):
// its trajectory, as the same line with a shorter zero tail is read. False when it holds none.
bool ReadZeroPadded(TrajectoriesFile& file, std::size_t line_no, std::string line) {
  while (!line.empty() && line.back() == '\0') line.pop_back();
  Result<Trajectory> t = ParseTrajectoryLine(line);
  if (!t.ok()) return false;
  t->line_no = line_no;
  file.trajectories.push_back(std::move(t.value()));
  return true;
}

// "line 3 (why), line 9 (why), and 4 more".
std::string NamedLines(const std::vector<SkippedLine>& named, std::uint64_t count) {
  std::string out;
  for (const SkippedLine& l : named) {
    out += (out.empty() ? "line " : ", line ") + std::to_string(l.line_no) + " (" + l.why + ")";
  }
  if (count > named.size()) out += ", and " + std::to_string(count - named.size()) + " more";
  return out;
}

}  // namespace

// Torn lines never change the exit code: the writer leaves one whenever its process dies inside a
// write, and carries on after it, so any file of a run that crashed holds one, and what it tells
// is only that one rollout's line is missing (the journal still holds its binding and its
// trajectory). Failing the audit for it would fail every audit of that file for ever. Damaged
// lines are an engine finding (exit 1), however few: the writer never writes one, so the file was
// changed after it was written, and a verdict that the rollouts' outputs were checked cannot rest
// on a file something else altered. Both name their lines, so many torn lines (more than the
// executor's crashes) can be read for what they are.
void AddSkippedLines(const TrajectoriesFile& file, const std::string& path, Verdict& verdict) {
  const std::string of = "trajectories file " + path + ": ";
  if (file.torn > 0) {
    verdict.notes.push_back(of + std::to_string(file.torn) +
                            " torn lines skipped (a write cut short by a crash or a failed "
                            "write; their rollouts are missing from the file, not from the "
                            "journal): " +
                            NamedLines(file.torn_lines, file.torn));
  }
  if (file.damaged > 0) {
    verdict.engine_findings.push_back(of + std::to_string(file.damaged) +
                                      " lines hold no trajectory and are not what its writer "
                                      "leaves (the file was damaged or edited), skipped: " +
                                      NamedLines(file.damaged_lines, file.damaged));
  }
}

namespace {

// The trajectories file at `path`, open for reading, or why not, decided before anything is read:
// O_NONBLOCK keeps the open of a FIFO from waiting for ever for a writer, and anything but a
// regular file (a FIFO, directory, socket or device, whose reads may block or never end) is
// refused. A regular file's reads ignore O_NONBLOCK.
Result<File> OpenTrajectoriesFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    return Status::NotFound("cannot open trajectories file " + path + " (" + std::strerror(errno) +
                            ")");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::IOError("cannot stat trajectories file " + path + " (" + std::strerror(err) +
                           ")");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument("trajectories file " + Quoted(path) + " is " +
                                   effects::NotRegularKind(st.st_mode) +
                                   ", not a regular file: refused before reading it");
  }
  File in(::fdopen(fd, "rb"));
  if (in == nullptr) {
    const int err = errno;
    ::close(fd);
    return Status::IOError("cannot read trajectories file " + path + " (" + std::strerror(err) +
                           ")");
  }
  return in;
}

}  // namespace

Result<TrajectoriesFile> ReadTrajectoriesFile(const std::string& path) {
  Result<File> opened = OpenTrajectoriesFile(path);
  if (!opened.ok()) return opened.status();
  File in = std::move(opened.value());
  TrajectoriesFile out;
  std::string line;
  for (std::size_t line_no = 1;; ++line_no) {
    bool rest_zeros = true;
    const LineRead read = ReadLine(in.get(), line, rest_zeros);
    if (read == LineRead::kEnd) break;
    const std::string at = path + ":" + std::to_string(line_no) + ": ";
    if (read == LineRead::kError)
      return Status::IOError(at + "read error: " + std::strerror(errno));
    // Blank lines count too: every line the loop reads is bounded, not only trajectories.
    if (line_no > kTrajectoriesMax) {
      const std::string max = std::to_string(kTrajectoriesMax);
      return Status::InvalidArgument("trajectories file " + E(path) + " has more than " + max +
                                     " lines: a file may hold at most " + max +
                                     " trajectories, split it (a journal's own may be more: "
                                     "its most recent " +
                                     max + " are re-verified)");
    }
    // A write's tail lost in a crash can be a run of zeros longer than any line: torn, as a
    // shorter one is. Anything else that long is no line the writer wrote.
    if (read == LineRead::kTooLong && rest_zeros && ReadZeroPadded(out, line_no, line)) continue;
    if (read == LineRead::kTooLong) {
      Skip(out, line_no, line, rest_zeros && CutShort(line),
           Status::InvalidArgument("a line longer than " + std::to_string(kTrajectoryLineBytesMax) +
                                   " bytes"));
      continue;
    }
    if (line.empty()) continue;
    Result<Trajectory> t = ParseTrajectoryLine(line);
    if (t.ok()) {
      t->line_no = line_no;
      out.trajectories.push_back(std::move(t.value()));
    } else {
      Skip(out, line_no, line, CutShort(line), t.status());
    }
  }
  return out;
}

Result<std::vector<Trajectory>> LoadTrajectories(const std::string& path) {
  Result<TrajectoriesFile> file = ReadTrajectoriesFile(path);
  if (!file.ok()) return file.status();
  const SkippedLine* first = nullptr;
  for (const auto* named : {&file->torn_lines, &file->damaged_lines}) {
    if (!named->empty() && (first == nullptr || named->front().line_no < first->line_no)) {
      first = &named->front();
    }
  }
  if (first != nullptr) {
    return Status::InvalidArgument(path + ":" + std::to_string(first->line_no) + ": " + first->why);
  }
  return std::move(file->trajectories);
}

namespace {

// A trajectory's field longer than this is quoted by its first bytes and its length.
constexpr std::size_t kQuotedFieldBytesMax = 1024;

// One field of a binding as a finding quotes it: raw (a finding is escaped whole where it is
// printed, once), cut to kQuotedFieldBytesMax (a trajectories file's line may be 16 MiB, all of
// it one field) with its length said.
std::string QuotedField(const std::string& value) {
  if (value.size() <= kQuotedFieldBytesMax) return Quoted(value);
  return Quoted(text::utf8_prefix(value, kQuotedFieldBytesMax)) + "... (" +
         std::to_string(value.size()) + " bytes)";
}
std::string QuotedField(std::int64_t value) { return std::to_string(value); }
std::string QuotedField(std::uint64_t value) { return std::to_string(value); }

// "FIELD is A in the trajectory, B in the journal" when the two differ.
template <typename T>
void AddDifference(const char* field, const T& claimed, const T& bound,
                   std::vector<std::string>& out) {
  if (claimed == bound) return;
  out.push_back(std::string(field) + " is " + QuotedField(claimed) + " in the trajectory, " +
                QuotedField(bound) + " in the journal");
}

// Each field of a trajectory's version and identity that differs from the journal's binding,
// named as the trajectories file names it. The structured bindings stop compiling when
// WeightVersion or WeightIdentity gains a field: name it here too.
std::vector<std::string> BindingDifferences(const Trajectory& t, const RolloutAdmitted& a) {
  const auto& [generation, label] = t.version;
  const auto& [manifest_digest, content_digest, checkpoint, run, step] = t.identity;
  std::vector<std::string> out;
  AddDifference("version.generation", generation, a.version.generation, out);
  AddDifference("version.label", label, a.version.label, out);
  AddDifference("identity.manifest_digest", manifest_digest, a.identity.manifest_digest, out);
  AddDifference("identity.content_digest", content_digest, a.identity.content_digest, out);
  AddDifference("identity.checkpoint", checkpoint, a.identity.checkpoint, out);
  AddDifference("identity.run", run, a.identity.run, out);
  AddDifference("identity.step", step, a.identity.step, out);
  return out;
}

// What the record a trajectory names as its admission is, when it is not that admission.
std::string WhatTheSeqHolds(const Result<journal::Record>& r, std::uint64_t seq) {
  const std::string at = "seq " + std::to_string(seq);
  if (!r.ok()) return at + " cannot be read (" + r.status().ToString() + ")";
  const auto* a = std::get_if<RolloutAdmitted>(&r->event);
  if (a == nullptr) return at + " holds " + event_name(r->event) + ", no admission";
  return at + " admits rollout " + QuotedField(a->rollout_id);
}

std::string Join(const std::vector<std::string>& parts, const std::string& separator) {
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : separator) + p;
  return out;
}

}  // namespace

std::vector<std::string> CrossCheckTrajectories(journal::Journal& journal,
                                                const std::vector<Trajectory>& trajectories) {
  std::vector<std::string> failures;
  for (const Trajectory& t : trajectories) {
    auto r = journal.Read(t.admission_seq);
    const RolloutAdmitted* a = r.ok() ? std::get_if<RolloutAdmitted>(&r->event) : nullptr;
    if (a == nullptr || a->rollout_id != t.rollout_id) {
      failures.push_back("trajectory " + QuotedField(t.rollout_id) + " names admission seq " +
                         std::to_string(t.admission_seq) +
                         ", which is not its admission: " + WhatTheSeqHolds(r, t.admission_seq));
      continue;
    }
    const std::vector<std::string> differ = BindingDifferences(t, *a);
    // The fields compared are the whole binding: no mismatch goes unnamed, none is invented.
    RC_CHECK(differ.empty() == (a->version == t.version && a->identity == t.identity));
    if (!differ.empty()) {
      failures.push_back("trajectory " + QuotedField(t.rollout_id) +
                         " differs from its binding at seq " + std::to_string(t.admission_seq) +
                         ": " + Join(differ, "; "));
    }
  }
  return failures;
}

namespace {

// "FIELD has A entries in the line, B in the journal", or "FIELD[i] is X in the line, Y in the
// journal (and K more)" at the first entry that differs; nothing when the lists are equal.
template <typename T, typename Show>
void AddListDifference(const std::string& field, const std::vector<T>& line,
                       const std::vector<T>& journaled, Show show, std::vector<std::string>& out) {
  if (line.size() != journaled.size()) {
    out.push_back(field + " has " + std::to_string(line.size()) + " entries in the line, " +
                  std::to_string(journaled.size()) + " in the journal");
    return;
  }
  std::size_t first = line.size(), count = 0;
  for (std::size_t i = 0; i < line.size(); ++i) {
    if (line[i] == journaled[i]) continue;
    first = std::min(first, i);
    ++count;
  }
  if (count == 0) return;
  out.push_back(field + "[" + std::to_string(first) + "] is " + show(line[first]) +
                " in the line, " + show(journaled[first]) + " in the journal" +
                (count > 1 ? " (and " + std::to_string(count - 1) + " more)" : ""));
}

std::string ShowId(std::int32_t id) { return std::to_string(id); }
std::string ShowLogprob(const std::optional<double>& lp) {
  if (!lp) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", *lp);
  return buf;
}

// A logprob as the journal holds it: rounded to float32. Lines written before serve rounded them
// hold the engine's double; one past float's range (no journaled value) is kept as it is.
std::optional<double> AsJournaled(const std::optional<double>& lp) {
  if (!lp || !std::isfinite(*lp) || std::fabs(*lp) > std::numeric_limits<float>::max()) return lp;
  return static_cast<double>(static_cast<float>(*lp));
}

// One logprob per output token as the journal holds it: the recorded ones, none past them.
std::vector<std::optional<double>> PerToken(const Trajectory& t, std::size_t tokens) {
  std::vector<std::optional<double>> out(tokens);
  for (std::size_t i = 0; i < tokens && i < t.logprobs.size(); ++i) {
    out[i] = AsJournaled(t.logprobs[i]);
  }
  return out;
}

// Each field of a line's trajectory that differs from the journal's parts of it.
std::vector<std::string> TokenDifferences(const Trajectory& line, const Trajectory& journaled) {
  std::vector<std::string> out;
  if (line.choices > 0 && !line.has_choice0) out.push_back("outputs holds no choice 0");
  AddListDifference("prompt_token_ids", line.prompt, journaled.prompt, ShowId, out);
  AddListDifference("outputs[0].token_ids", line.output, journaled.output, ShowId, out);
  // The journal holds each logprob as float32: the line's is compared as the journal would hold
  // it (serve writes it rounded so; older files hold the engine's double).
  const std::size_t tokens = std::max(line.output.size(), journaled.output.size());
  AddListDifference("outputs[0].logprobs", PerToken(line, tokens), PerToken(journaled, tokens),
                    ShowLogprob, out);
  return out;
}

std::string LineOf(const Trajectory& t) {
  return "trajectory " + QuotedField(t.rollout_id) + " (line " + std::to_string(t.line_no) + ")";
}

// Up to kSkippedLinesNamedMax names, then "and N more".
void AddNamed(std::vector<std::string>& named, std::uint64_t& count, std::string name) {
  if (count++ < kSkippedLinesNamedMax) named.push_back(std::move(name));
}
std::string NamedList(const std::vector<std::string>& named, std::uint64_t count) {
  std::string out = Join(named, ", ");
  if (count > named.size()) out += ", and " + std::to_string(count - named.size()) + " more";
  return out;
}

// CompareTrajectoriesFile's scan: the journal's records in seq order against the file's lines,
// indexed by (rollout_id, admission_seq).
class FileComparer {
 public:
  FileComparer(const TrajectoriesFile& file, std::map<std::string, std::uint64_t> generations,
               bool fleet, std::uint64_t head_seq, RolloutTrajectoryBounds per_rollout)
      : file_(file),
        generations_(std::move(generations)),
        fleet_(fleet),
        head_seq_(head_seq),
        per_rollout_(per_rollout),
        contradicted_(file.trajectories.size(), false) {
    for (std::size_t i = 0; i < file.trajectories.size(); ++i) {
      const Trajectory& t = file.trajectories[i];
      lines_[{t.rollout_id, t.admission_seq}].push_back(i);
    }
    for (const auto& [key, at] : lines_) {
      if (at.size() > 1) Duplicated(at);
    }
  }

  Status Observe(const journal::Record& r) {
    if (const auto* a = std::get_if<RolloutAdmitted>(&r.event)) {
      Admitted(*a, r);
    } else if (const auto* t = std::get_if<TrajectoryRecorded>(&r.event)) {
      return Part(*t, r.seq);
    } else if (const auto* f = std::get_if<RolloutFinished>(&r.event)) {
      auto it = open_.find(f->rollout_id);
      if (it != open_.end()) {
        Settle(it->second, f, r.seq);
        open_.erase(it);
      }
    }
    return Status::OK();
  }

  FileComparison Finish() && {
    for (auto& [id, open] : open_) Settle(open, nullptr, 0);
    out_.differing =
        static_cast<std::uint64_t>(std::count(contradicted_.begin(), contradicted_.end(), true));
    if (out_.missing > 0) {
      out_.notes.push_back(std::to_string(out_.missing) +
                           " of the journal's trajectories have no line in the file (a torn or "
                           "damaged line, a line its writer dropped, or a rotated file; the "
                           "journal's own are what is re-verified): " +
                           NamedList(missing_named_, out_.missing));
    }
    if (unjournaled_ > 0) {
      out_.notes.push_back(std::to_string(unjournaled_) +
                           " lines hold tokens the journal recorded no trajectory for, as their "
                           "writer does for a trace it cut (`truncated`) or one past the parts' "
                           "bound: not checked, and not re-verifiable: " +
                           NamedList(unjournaled_named_, unjournaled_));
    }
    return std::move(out_);
  }

 private:
  // A rollout admitted and not finished, and its journal trajectory while it has a line.
  struct Open {
    std::string rollout_id;
    std::uint64_t admitted_seq = 0;
    const Trajectory* line = nullptr;  // the first of its lines, if any
    std::uint64_t first_part_seq = 0;  // 0: no TrajectoryRecorded yet
    JoinedCount joined;                // every part, joined or not, within per_rollout_
    Trajectory journaled;              // joined only when `line` is set
  };

  void Duplicated(const std::vector<std::size_t>& at) {
    const Trajectory& first = file_.trajectories[at.front()];
    std::vector<std::string> numbers;
    for (std::size_t i = 0; i < at.size() && i < kSkippedLinesNamedMax; ++i) {
      numbers.push_back(std::to_string(file_.trajectories[at[i]].line_no));
    }
    out_.findings.push_back("trajectory " + QuotedField(first.rollout_id) + " admitted at seq " +
                            std::to_string(first.admission_seq) + " has " +
                            std::to_string(at.size()) + " lines in the file (lines " +
                            Join(numbers, ", ") + (at.size() > numbers.size() ? ", ..." : "") +
                            "): its writer writes one per rollout");
    // The first is held against the journal; each one past it is a line the writer never wrote.
    for (std::size_t i = 1; i < at.size(); ++i) contradicted_[at[i]] = true;
  }

  // A finding about `line`, which the journal then contradicts (counted once however many).
  void Found(const Trajectory& line, std::string finding) {
    out_.findings.push_back(std::move(finding));
    const auto index = static_cast<std::size_t>(&line - file_.trajectories.data());
    RC_CHECK(index < contradicted_.size());
    contradicted_[index] = true;
  }

  void Admitted(const RolloutAdmitted& a, const journal::Record& r) {
    Open open;
    open.rollout_id = a.rollout_id;
    open.admitted_seq = r.seq;
    auto it = lines_.find({a.rollout_id, r.seq});
    if (it != lines_.end()) {
      open.line = &file_.trajectories[it->second.front()];
      for (std::size_t i : it->second) CheckAdmitter(file_.trajectories[i], a, r);
    }
    open_[a.rollout_id] = std::move(open);
  }

  // In a fleet, the line's engine and fleet generation are those of the record that admitted it;
  // in a journal of one engine it names neither.
  void CheckAdmitter(const Trajectory& line, const RolloutAdmitted& a, const journal::Record& r) {
    std::uint64_t generation = 0;
    if (fleet_) {
      auto g = generations_.find(a.version.label);
      if (g != generations_.end()) generation = g->second;
    }
    std::vector<std::string> differ;
    if (line.engine != r.engine) {
      differ.push_back("engine is " + QuotedField(line.engine) + " in the line, " +
                       QuotedField(r.engine) + " in the journal");
    }
    if (line.fleet_generation != generation) {
      differ.push_back("fleet_generation is " + std::to_string(line.fleet_generation) +
                       " in the line, " + std::to_string(generation) + " in the journal");
    }
    if (differ.empty()) return;
    Found(line, LineOf(line) + " differs from its admitting record at seq " +
                    std::to_string(r.seq) + ": " + Join(differ, "; "));
  }

  // One logprob slot per output token, never more (the logprobs are bounded by the tokens).
  Status Part(const TrajectoryRecorded& t, std::uint64_t seq) {
    auto it = open_.find(t.rollout_id);
    if (it == open_.end()) return Status::OK();  // damage SampleTrajectoriesFromJournal reports
    Open& open = it->second;
    RC_RETURN_IF_ERROR(CountPart(t, seq, per_rollout_, open.joined));
    if (open.first_part_seq == 0) open.first_part_seq = seq;
    if (open.line == nullptr) return Status::OK();
    Trajectory& j = open.journaled;
    j.prompt.insert(j.prompt.end(), t.prompt_token_ids.begin(), t.prompt_token_ids.end());
    j.output.insert(j.output.end(), t.output_token_ids.begin(), t.output_token_ids.end());
    for (std::size_t i = 0; i < t.output_token_ids.size(); ++i) {
      const bool has = i < t.output_logprobs.size() && !std::isnan(t.output_logprobs[i]);
      j.logprobs.push_back(has ? std::optional<double>(t.output_logprobs[i]) : std::nullopt);
    }
    RC_CHECK(j.logprobs.size() == j.output.size());
    return Status::OK();
  }

  // The rollout's end: `finish` at `finished_seq`, or none when the journal ends with it open.
  void Settle(const Open& open, const RolloutFinished* finish, std::uint64_t finished_seq) {
    if (open.line == nullptr) {
      if (open.first_part_seq != 0) {
        AddNamed(missing_named_, out_.missing,
                 QuotedField(open.rollout_id) + " (TrajectoryRecorded at seq " +
                     std::to_string(open.first_part_seq) + ")");
      }
      return;
    }
    const Trajectory& line = *open.line;
    if (finish == nullptr) {
      Unfinished(line);
    } else {
      CheckFinish(line, *finish, finished_seq);
    }
    if (open.first_part_seq == 0) {
      if (finish != nullptr) Unjournaled(line, *finish, finished_seq);
      return;
    }
    const std::vector<std::string> differ = TokenDifferences(line, open.journaled);
    if (differ.empty()) return;
    Found(line, LineOf(line) +
                    " differs from the journal's trajectory (TrajectoryRecorded from seq " +
                    std::to_string(open.first_part_seq) + "): " + Join(differ, "; "));
  }

  // The writer writes a line only once the rollout's RolloutFinished is durable, and the file is
  // read before the journal: a line that says anything of its rollout's end is none it wrote.
  void Unfinished(const Trajectory& line) {
    const bool says = line.outcome || line.prompt_tokens || line.completion_tokens ||
                      !line.prompt.empty() || line.output_tokens_all > 0;
    if (!says) return;
    Found(line, LineOf(line) + " says how its rollout ended, but the journal has not finished it " +
                    "(admitted at seq " + std::to_string(line.admission_seq) +
                    ", no RolloutFinished through the journal's head at seq " +
                    std::to_string(head_seq_) + "): its writer writes a line only once the " +
                    "finish is durable");
  }

  // The line's outcome and counts (those it gives) against the RolloutFinished journaled from the
  // same values, and its token ids against those counts (the writer's counts never fall below the
  // ids it keeps).
  void CheckFinish(const Trajectory& line, const RolloutFinished& f, std::uint64_t seq) {
    std::vector<std::string> differ;
    if (line.outcome && *line.outcome != outcome_name(f.outcome)) {
      differ.push_back("outcome is " + QuotedField(*line.outcome) + " in the line, " +
                       QuotedField(std::string(outcome_name(f.outcome))) + " in the journal");
    }
    AddCount("prompt_tokens", line.prompt_tokens, f.prompt_tokens, differ);
    AddCount("completion_tokens", line.completion_tokens, f.completion_tokens, differ);
    if (line.prompt.size() > f.prompt_tokens || line.output_tokens_all > f.completion_tokens) {
      differ.push_back("the line holds " + std::to_string(line.prompt.size()) + " prompt and " +
                       std::to_string(line.output_tokens_all) +
                       " output token ids, more than the journal's prompt_tokens " +
                       std::to_string(f.prompt_tokens) + " or completion_tokens " +
                       std::to_string(f.completion_tokens) + " count");
    }
    if (differ.empty()) return;
    Found(line, LineOf(line) + " differs from its rollout's RolloutFinished at seq " +
                    std::to_string(seq) + ": " + Join(differ, "; "));
  }

  static void AddCount(const char* field, const std::optional<std::uint64_t>& line,
                       std::uint32_t journaled, std::vector<std::string>& differ) {
    if (!line || *line == journaled) return;
    differ.push_back(std::string(field) + " is " + std::to_string(*line) + " in the line, " +
                     std::to_string(journaled) + " in the journal");
  }

  // A line of a finished rollout the journal holds no trajectory for: consistent when it holds no
  // token; a note when its writer could not journal it (CheckFinish has held its tokens within the
  // finish's counts); otherwise tokens nothing vouches for.
  void Unjournaled(const Trajectory& line, const RolloutFinished& f, std::uint64_t seq) {
    if (line.prompt.empty() && line.output.empty() && !line.other_tokens) return;
    const bool within =
        line.prompt.size() <= f.prompt_tokens && line.output_tokens_all <= f.completion_tokens;
    if (!within) return;  // CheckFinish found it
    // Past the parts' bound its writer journals no parts and keeps only the line.
    const std::size_t tokens = line.prompt.size() + line.output.size();
    if (line.truncated || tokens > kTrajectoryTokensPerRolloutMax) {
      AddNamed(unjournaled_named_, unjournaled_, LineOf(line));
      return;
    }
    Found(line, LineOf(line) +
                    " holds token ids, but the journal recorded no trajectory for its "
                    "rollout (admitted at seq " +
                    std::to_string(line.admission_seq) + ", finished at seq " +
                    std::to_string(seq) + ") and the line does not say truncated");
  }

  const TrajectoriesFile& file_;
  std::map<std::string, std::uint64_t> generations_;  // a fleet's label -> fleet generation
  bool fleet_;
  std::uint64_t head_seq_;
  RolloutTrajectoryBounds per_rollout_;
  std::vector<bool> contradicted_;  // per line of file_.trajectories
  std::map<std::pair<std::string, std::uint64_t>, std::vector<std::size_t>> lines_;
  std::map<std::string, Open> open_;
  FileComparison out_;
  std::vector<std::string> missing_named_;
  std::uint64_t unjournaled_ = 0;
  std::vector<std::string> unjournaled_named_;
};

}  // namespace

Result<FileComparison> CompareTrajectoriesFile(journal::Journal& journal,
                                               const TrajectoriesFile& file,
                                               RolloutTrajectoryBounds per_rollout) {
  std::map<std::string, std::uint64_t> generations;
  journal.ReadFleetState([&](const FleetState& f) { generations = f.label_generation; });
  const std::uint64_t head = journal.head_seq();
  FileComparer comparer(file, std::move(generations), journal.is_fleet(), head, per_rollout);
  Status st = journal.Scan(1, head, [&](const journal::Record& r) { return comparer.Observe(r); });
  if (!st.ok()) return st;
  return std::move(comparer).Finish();
}

std::string FormatTrajectoriesFileCounts(const TrajectoriesFileCounts& c) {
  return "trajectories file: " + std::to_string(c.trajectories) +
         ", binding mismatches: " + std::to_string(c.binding_mismatches) +
         ", lines skipped: " + std::to_string(c.torn + c.damaged) + " (torn " +
         std::to_string(c.torn) + ", damaged " + std::to_string(c.damaged) +
         "), lines the journal contradicts: " + std::to_string(c.contradicted) +
         ", journal trajectories without a line: " + std::to_string(c.without_line);
}

std::string Quoted(std::string_view s) {
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

int Verdict::exit_code() const {
  if (!journal_intact()) return kExitJournalDamaged;
  return engine_healthy() ? kExitOk : kExitEngineUnhealthy;
}

namespace {

// One engine's findings; `who` is "the engine" or "engine 'a'" (raw: escaped when printed).
void EngineFindings(const State& state, const EngineHealth& e, const std::string& who, Verdict& v) {
  if (state.lifecycle == Lifecycle::kTainted || e.tainted) {
    v.engine_findings.push_back(
        who + " is TAINTED since seq " + std::to_string(e.taint_seq) + " (" +
        lifecycle_name(e.taint_from) + " -> TAINTED, cause " + cause_name(e.taint_cause) +
        (e.taint_update_id.empty() ? "" : ", " + e.taint_plan + " " + Quoted(e.taint_update_id)) +
        (e.taint_detail.empty() ? "" : ": " + e.taint_detail) + ")");
  }
  const std::string of = who == "the engine" ? "" : " of " + who;
  if (e.suspect_count > 0) {
    v.engine_findings.push_back(std::to_string(e.suspect_count) + " rollouts" + of +
                                " are suspect: another engine may have served them");
  }
  for (const std::string& u : e.unexplained_taints) {
    v.engine_findings.push_back(of.empty() ? u : who + ": " + u);
  }
}

}  // namespace

Verdict MakeVerdict(const AuditReport& r) {
  Verdict v;
  v.journal_failures = r.failures;
  if (!r.fleet) {
    EngineFindings(r.state, r.engine, "the engine", v);
    return v;
  }
  for (const auto& [name, engine] : r.engines) {
    EngineFindings(engine.state, engine.health, "engine " + Quoted(name), v);
  }
  return v;
}

namespace {

void FormatSummary(const AuditReport& r, std::ostringstream& out) {
  out << "records: " << r.records << "; hash chain " << (r.chain_ok ? "OK" : "BROKEN")
      << "; RocksDB checksums " << (r.checksums_ok ? "OK" : "FAILED") << "; lifecycle history "
      << (r.history.ok ? "OK" : "VIOLATED") << "\n";
  const HistorySummary& s = r.history.summary;
  out << "updates: requested " << s.updates_requested << " (+ restores " << s.restores_requested
      << "); committed " << s.updates_committed << ", refused " << s.updates_refused << ", tainted "
      << s.updates_tainted << " (restores included); recoveries " << s.recoveries << "\n";
  out << "sleeps: requested " << s.sleeps_requested << ", committed " << s.sleeps_committed
      << "; wake-ups: requested " << s.wakes_requested << ", committed " << s.wakes_committed
      << " (they keep the committed version)\n";
}

void FormatVersions(const std::vector<VersionRecord>& versions, std::ostringstream& out) {
  out << "versions:\n";
  for (const VersionRecord& v : versions) {
    out << "  " << E(v.version.label) << " (generation " << v.version.generation << ") "
        << (v.update_id.empty() ? std::string("bootstrap")
                                : (v.restore ? "restore " : "update ") + Quoted(E(v.update_id)))
        << " at seq " << v.published_seq << ": ckpt=" << E(v.identity.checkpoint)
        << " step=" << v.identity.step
        << " manifest=" << E(v.identity.manifest_digest.substr(0, 12)) << "; rollouts admitted "
        << v.rollouts_admitted << ", finished " << v.rollouts_finished << "\n";
  }
}

// A bounded list: a header with the exact count, the first kReportRolloutsMax entries, then
// how many were left out (kept in the report or beyond kRolloutNotesMax).
void FormatRollouts(const char* title, const char* tag, const std::vector<RolloutNote>& list,
                    std::uint64_t count, std::ostringstream& out) {
  out << title << ": " << count << "\n";
  const std::size_t shown = std::min<std::size_t>(list.size(), kReportRolloutsMax);
  for (std::size_t i = 0; i < shown; ++i) {
    const RolloutNote& n = list[i];
    out << "  " << tag << " " << Quoted(E(n.rollout_id)) << " version "
        << Quoted(E(n.version.label)) << " admitted at seq " << n.admitted_seq << ", "
        << (n.finished_seq == 0 ? std::string("not finished")
                                : "finished at seq " + std::to_string(n.finished_seq))
        << ": " << E(n.why) << "\n";
  }
  if (count > shown) out << "  ... and " << (count - shown) << " more\n";
}

void FormatEngine(const EngineHealth& e, std::ostringstream& out) {
  if (e.tainted) {
    out << "taint: seq " << e.taint_seq << " at wall " << e.taint_wall_ms << " ms, "
        << lifecycle_name(e.taint_from) << " -> TAINTED, cause " << cause_name(e.taint_cause)
        << ": " << E(e.taint_detail) << "\n";
  }
  if (e.window_known) {
    out << "suspect window: from wall " << e.window_start_wall_ms << " ms (" << e.window_source
        << ") to the taint at wall " << e.taint_wall_ms << " ms\n";
  }
  if (e.tainted || e.suspect_count > 0) {
    FormatRollouts("suspect rollouts", "SUSPECT", e.suspect, e.suspect_count, out);
  }
  for (const std::string& line : e.restored) out << "restored: " << E(line) << "\n";
  if (e.restored_count > e.restored.size()) {
    out << "restored: ... and " << (e.restored_count - e.restored.size()) << " more\n";
  }
  if (e.finishes_truncated) {
    out << "suspect rollouts: the window may hold more than the last " << kRolloutNotesMax
        << " finishes kept\n";
  }
  FormatRollouts("expired rollouts (informational)", "EXPIRED", e.expired, e.expired_count, out);
  FormatRollouts("abandoned rollouts (informational)", "ABANDONED", e.abandoned, e.abandoned_count,
                 out);
}

// The two halves of the verdict, then exactly one final "audit: ..." line.
void FormatVerdict(const Verdict& v, const std::string& journal_path, std::ostringstream& out) {
  out << "journal: " << (v.journal_intact() ? "INTACT" : "DAMAGED") << "\n";
  for (const std::string& f : v.journal_failures) out << "audit FAILURE: " << E(f) << "\n";
  out << "engine: " << (v.engine_healthy() ? "HEALTHY" : "NOT HEALTHY") << "\n";
  for (const std::string& f : v.engine_findings) out << "audit ENGINE: " << E(f) << "\n";
  for (const std::string& n : v.notes) out << "audit NOTE: " << E(n) << "\n";
  switch (v.exit_code()) {
    case kExitOk:
      out << "audit: OK\n";
      break;
    case kExitEngineUnhealthy:
      // A command to copy: the path is one shell word (shell_quote: already one printable line),
      // after `--`, so that a path beginning with `-` is read as the journal, never as an option.
      out << "audit: ENGINE NOT HEALTHY: the journal is intact and explains it: "
          << "rolloutcore replay -- " << text::shell_quote(journal_path) << "\n";
      break;
    default:
      out << "audit: JOURNAL DAMAGED: nothing it says can be trusted\n";
      break;
  }
}

// A fleet: how its updates ended, then each engine's versions, state and health.
void FormatFleet(const AuditReport& r, std::ostringstream& out) {
  out << "fleet: " << r.engines.size() << " engines audited; fleet updates ended:";
  for (const auto& [outcome, n] : r.fleet_updates) {
    out << " " << fleet_outcome_name(outcome) << " " << n;
  }
  out << (r.fleet_updates.empty() ? " none\n" : "\n");
  for (const auto& [name, engine] : r.engines) {
    out << "engine " << Quoted(E(name)) << (engine.removed ? " (removed)" : "") << ":\n";
    FormatVersions(engine.versions, out);
    out << "state: " << E(describe(engine.state)) << "\n";
    FormatEngine(engine.health, out);
  }
}

}  // namespace

AuditOutput RenderAudit(const AuditReport& report, const Verdict& verdict,
                        const std::string& journal_path) {
  std::ostringstream out;
  FormatSummary(report, out);
  if (report.fleet) {
    FormatFleet(report, out);
  } else {
    FormatVersions(report.versions, out);
    out << "state: " << E(describe(report.state)) << "\n";
    FormatEngine(report.engine, out);
  }
  FormatVerdict(verdict, journal_path, out);
  return AuditOutput{out.str(), verdict.exit_code()};
}

std::string FormatReport(const AuditReport& r) {
  return RenderAudit(r, MakeVerdict(r), "JOURNAL").text;
}

namespace {

json NotesJson(const std::vector<RolloutNote>& list) {
  json out = json::array();
  for (const RolloutNote& n : list) {
    out.push_back({{"rollout_id", n.rollout_id},
                   {"version", journal::WeightVersionToJson(n.version)},
                   {"admitted_seq", n.admitted_seq},
                   {"finished_seq", n.finished_seq},
                   {"finished_wall_ms", n.finished_wall_ms},
                   {"why", n.why}});
  }
  return out;
}

}  // namespace

namespace {

// JSON of journal text, never thrown on (invalid UTF-8 is replaced) and printable ASCII only:
// --json is read a line at a time, and a raw U+2028/U+2029, NEL, DEL or other C1 or bidi control
// recorded from an engine's answer would split the line for consumers that honour it.
std::string DumpAscii(const json& j, int indent) {
  return j.dump(indent, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
}

json HealthJson(const EngineHealth& e) {
  json engine = {
      {"lifecycle", lifecycle_name(e.lifecycle)},   {"tainted", e.tainted},
      {"suspect_count", e.suspect_count},           {"suspect", NotesJson(e.suspect)},
      {"expired_count", e.expired_count},           {"expired", NotesJson(e.expired)},
      {"abandoned_count", e.abandoned_count},       {"abandoned", NotesJson(e.abandoned)},
      {"unexplained_taints", e.unexplained_taints}, {"restored", e.restored},
      {"restored_count", e.restored_count}};
  if (e.tainted) {
    engine["taint"] = {{"seq", e.taint_seq},
                       {"plan", e.taint_plan},
                       {"plan_id", e.taint_update_id},
                       {"wall_ms", e.taint_wall_ms},
                       {"from", lifecycle_name(e.taint_from)},
                       {"cause", cause_name(e.taint_cause)},
                       {"detail", e.taint_detail}};
  }
  if (e.window_known) {
    engine["window"] = {{"start_wall_ms", e.window_start_wall_ms},
                        {"source", e.window_source},
                        {"end_wall_ms", e.taint_wall_ms}};
  }
  return engine;
}

// The same counts, under the same names, as FormatTrajectoriesFileCounts's line.
json TrajectoriesFileJson(const TrajectoriesFileCounts& c) {
  return {{"trajectories", c.trajectories},
          {"binding_mismatches", c.binding_mismatches},
          {"lines_skipped", c.torn + c.damaged},
          {"torn", c.torn},
          {"damaged", c.damaged},
          {"lines_the_journal_contradicts", c.contradicted},
          {"journal_trajectories_without_a_line", c.without_line}};
}

json TornTailsJson(const std::vector<RecordedTornTail>& list) {
  json out = json::array();
  for (const RecordedTornTail& t : list) {
    json torn = {{"seq", t.seq}, {"bytes_unread", t.bytes_unread}, {"sentence", t.sentence}};
    if (!t.engine.empty()) torn["engine"] = t.engine;
    out.push_back(std::move(torn));
  }
  return out;
}

}  // namespace

std::string VerdictJson(const AuditReport& r, const Verdict& v, int indent,
                        const ReverifySummary* reverify) {
  json out = {{"journal_intact", v.journal_intact()},
              {"journal_failures", v.journal_failures},
              {"engine_healthy", v.engine_healthy()},
              {"engine_findings", v.engine_findings},
              {"notes", v.notes},
              {"exit_code", v.exit_code()},
              {"records", r.records},
              {"engine", r.fleet ? json(nullptr) : HealthJson(r.engine)}};
  if (r.fleet) {
    json engines = json::object();
    for (const auto& [name, engine] : r.engines) {
      engines[name] = HealthJson(engine.health);
      engines[name]["removed"] = engine.removed;
    }
    out["engines"] = std::move(engines);
  }
  out["recorded_torn_tails_count"] = r.torn_tails_count;
  out["recorded_torn_tails"] = TornTailsJson(r.torn_tails);
  if (reverify != nullptr) out["reverification"] = ReverifyJson(*reverify);
  if (v.trajectories_file) out["trajectories_file"] = TrajectoriesFileJson(*v.trajectories_file);
  return DumpAscii(out, indent);
}

std::string ProvenanceJson(const RolloutProvenance& p, int indent) {
  json out = {{"rollout_id", p.rollout_id},
              {"admitted_seq", p.admitted_seq},
              {"binding", journal::EventToJson(p.binding)},
              {"finished_seq", p.finished_seq},
              {"finish", p.finish ? journal::EventToJson(*p.finish) : json()},
              {"version",
               {{"version", journal::WeightVersionToJson(p.version.version)},
                {"identity", journal::WeightIdentityToJson(p.version.identity)},
                {"update_id", p.version.update_id},
                {"published_seq", p.version.published_seq}}}};
  if (!p.engine.empty()) out["engine"] = p.engine;
  return DumpAscii(out, indent);
}

}  // namespace rc::audit
