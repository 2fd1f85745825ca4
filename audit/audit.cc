#include "audit/audit.h"

#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include "journal/json.h"
#include "statemachine/describe.h"
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

// One pass over the journal: chain (by Scan), history entries, the version table.
struct Pass {
  std::vector<HistoryEntry> history;
  VersionTable versions;
  State state;
  Status scanned;
};

Pass ScanAll(journal::Journal& journal) {
  Pass pass;
  pass.scanned = journal.Scan(1, 0, [&](const journal::Record& r) {
    pass.versions.Observe(r, pass.state);
    // The fold here only feeds the version table; legality is the history checker's verdict.
    apply(pass.state, r.event).IgnoreError();
    pass.history.push_back(HistoryEntry{r.seq, r.cause_seq, r.event});
    return Status::OK();
  });
  return pass;
}

}  // namespace

Result<AuditReport> AuditJournal(journal::Journal& journal) {
  AuditReport report;
  Pass pass = ScanAll(journal);
  report.records = pass.history.size();
  if (!pass.scanned.ok()) {
    report.chain_ok = false;
    report.failures.push_back("chain: " + pass.scanned.ToString());
  }
  Status checksums = journal.VerifyChecksum();
  if (!checksums.ok()) {
    report.checksums_ok = false;
    report.failures.push_back("checksums: " + checksums.ToString());
  }
  report.history = check_history(pass.history);
  if (!report.history.ok) {
    report.failures.push_back("history: seq " + std::to_string(report.history.first_bad_seq) +
                              ": " + report.history.message);
  }
  report.versions = pass.versions.list();
  report.state = report.history.state;
  const State head = journal.state();
  if (report.history.ok && report.chain_ok && !(head == report.state)) {
    report.failures.push_back("the journal's folded state differs from the audit's refold");
  }
  report.ok = report.failures.empty();
  return report;
}

Result<RolloutProvenance> Provenance(journal::Journal& journal, const std::string& rollout_id) {
  auto seqs = journal.RolloutSeqs(rollout_id);
  if (!seqs.ok()) return seqs.status();
  if (seqs->empty()) return Status::NotFound("no rollout '" + E(rollout_id) + "' in the journal");
  RolloutProvenance p;
  p.rollout_id = rollout_id;
  for (std::uint64_t seq : *seqs) {
    auto r = journal.Read(seq);
    if (!r.ok()) return r.status();
    if (const auto* a = std::get_if<RolloutAdmitted>(&r->event)) {
      p.binding = *a;
      p.admitted_seq = seq;
    } else if (const auto* f = std::get_if<RolloutFinished>(&r->event)) {
      p.finish = *f;
      p.finished_seq = seq;
    }
  }
  if (p.admitted_seq == 0) {
    return Status::Corruption("rollout '" + E(rollout_id) + "' is indexed but has no admission");
  }
  // The generation's origin: scan up to the admission (bounded by the journal's size).
  Pass pass;
  Status st = journal.Scan(1, p.admitted_seq, [&](const journal::Record& r) {
    pass.versions.Observe(r, pass.state);
    apply(pass.state, r.event).IgnoreError();
    return Status::OK();
  });
  if (!st.ok()) return st;
  auto v = pass.versions.find(p.binding.version.generation);
  if (!v) {
    return Status::Corruption("rollout '" + E(rollout_id) + "' is bound to generation " +
                              std::to_string(p.binding.version.generation) +
                              " which was never committed");
  }
  p.version = *v;
  return p;
}

Result<std::vector<Trajectory>> TrajectoriesFromJournal(journal::Journal& journal) {
  std::map<std::string, std::size_t> index;  // rollout id -> position in `out`
  std::map<std::string, RolloutAdmitted> bindings;
  std::map<std::string, std::uint64_t> admitted_at;
  std::map<std::string, std::uint32_t> next_part;
  std::vector<Trajectory> out;
  Status st = journal.Scan(1, 0, [&](const journal::Record& r) -> Status {
    if (const auto* a = std::get_if<RolloutAdmitted>(&r.event)) {
      bindings[a->rollout_id] = *a;
      admitted_at[a->rollout_id] = r.seq;
      next_part[a->rollout_id] = 0;
      index.erase(a->rollout_id);
      return Status::OK();
    }
    const auto* t = std::get_if<TrajectoryRecorded>(&r.event);
    if (t == nullptr) return Status::OK();
    auto b = bindings.find(t->rollout_id);
    if (b == bindings.end() || t->part != next_part[t->rollout_id]) {
      return Status::Corruption("seq " + std::to_string(r.seq) + ": trajectory part " +
                                std::to_string(t->part) + " of '" + E(t->rollout_id) +
                                "' out of order or without an admission");
    }
    next_part[t->rollout_id]++;
    auto [it, fresh] = index.try_emplace(t->rollout_id, out.size());
    if (fresh) {
      if (out.size() >= kTrajectoriesMax) return Status::InvalidArgument("too many trajectories");
      Trajectory tr;
      tr.rollout_id = t->rollout_id;
      tr.admission_seq = admitted_at[t->rollout_id];
      tr.version = b->second.version;
      tr.identity = b->second.identity;
      out.push_back(std::move(tr));
    }
    Trajectory& tr = out[it->second];
    tr.prompt.insert(tr.prompt.end(), t->prompt_token_ids.begin(), t->prompt_token_ids.end());
    tr.output.insert(tr.output.end(), t->output_token_ids.begin(), t->output_token_ids.end());
    for (std::size_t i = 0; i < t->output_token_ids.size(); ++i) {
      const bool has = i < t->output_logprobs.size() && t->output_logprobs[i] == t->output_logprobs[i];
      tr.logprobs.push_back(has ? std::optional<double>(t->output_logprobs[i]) : std::nullopt);
    }
    return Status::OK();
  });
  if (!st.ok()) return st;
  return out;
}

Result<std::vector<Trajectory>> LoadTrajectories(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot open trajectories file " + path);
  std::vector<Trajectory> out;
  std::string line;
  std::size_t line_no = 0;
  auto ints = [](const json& a, std::vector<std::int32_t>& dst) {
    if (!a.is_array() || a.size() > kTrajectoryTokensMax) return false;
    for (const json& t : a) {
      if (!t.is_number_integer()) return false;
      dst.push_back(t.get<std::int32_t>());
    }
    return true;
  };
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    if (out.size() >= kTrajectoriesMax) {
      return Status::InvalidArgument(path + ": more than " + std::to_string(kTrajectoriesMax) +
                                     " trajectories");
    }
    const json j = json::parse(line, nullptr, false);
    auto bad = [&](const std::string& why) {
      return Status::InvalidArgument(path + ":" + std::to_string(line_no) + ": " + why);
    };
    if (!j.is_object()) return bad("not a JSON object");
    Trajectory t;
    t.rollout_id = j.value("rollout_id", std::string());
    t.admission_seq = j.value("admission_seq", std::uint64_t{0});
    if (t.rollout_id.empty() || t.admission_seq == 0) return bad("missing rollout_id/admission_seq");
    const json& v = j.value("version", json::object());
    t.version.generation = v.value("generation", std::uint64_t{0});
    t.version.label = v.value("label", std::string());
    const json& id = j.value("identity", json::object());
    t.identity.manifest_digest = id.value("manifest_digest", std::string());
    t.identity.content_digest = id.value("content_digest", std::string());
    t.identity.checkpoint = id.value("checkpoint", std::string());
    t.identity.run = id.value("run", std::string());
    t.identity.step = id.value("step", std::int64_t{-1});
    if (!ints(j.value("prompt_token_ids", json()), t.prompt)) return bad("bad prompt_token_ids");
    const json& outputs = j.value("outputs", json::array());
    if (!outputs.is_array()) return bad("outputs is not an array");
    if (!outputs.empty()) {  // choice 0: the proxy records one trajectory per choice index
      if (!ints(outputs[0].value("token_ids", json::array()), t.output)) return bad("bad token_ids");
      const json& lps = outputs[0].value("logprobs", json::array());
      if (lps.is_array()) {
        for (const json& lp : lps) {
          t.logprobs.push_back(lp.is_number() ? std::optional<double>(lp.get<double>())
                                              : std::nullopt);
        }
      }
    }
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<std::string> CrossCheckTrajectories(journal::Journal& journal,
                                                const std::vector<Trajectory>& trajectories) {
  std::vector<std::string> failures;
  for (const Trajectory& t : trajectories) {
    auto r = journal.Read(t.admission_seq);
    const RolloutAdmitted* a = r.ok() ? std::get_if<RolloutAdmitted>(&r->event) : nullptr;
    if (a == nullptr || a->rollout_id != t.rollout_id) {
      failures.push_back("trajectory '" + E(t.rollout_id) + "' names admission seq " +
                         std::to_string(t.admission_seq) + ", which is not its admission");
      continue;
    }
    if (!(a->version == t.version) || !(a->identity == t.identity)) {
      failures.push_back("trajectory '" + E(t.rollout_id) + "' claims version '" +
                         E(t.version.label) + "' but the journal bound it to '" +
                         E(a->version.label) + "' (seq " +
                         std::to_string(t.admission_seq) + ")");
    }
  }
  return failures;
}

ReverifyResult Reverify(effects::EngineClient& engine, const Trajectory& t, double tolerance,
                        bool greedy) {
  ReverifyResult out;
  out.rollout_id = t.rollout_id;
  ValidationObserved served = engine.WeightInfo();
  if (!served.http.ok_2xx()) {
    out.detail = "engine unreachable: " + E(describe(served.http));
    return out;
  }
  if (served.reported_label != t.version.label) {
    out.detail = "engine serves '" + E(served.reported_label) + "', trajectory ran under '" +
                 E(t.version.label) + "'";
    return out;
  }
  if (t.output.empty() || t.prompt.empty()) {
    out.detail = "nothing to compare";
    return out;
  }
  json prompt = json::array();
  for (std::int32_t id : t.prompt) prompt.push_back(id);
  for (std::int32_t id : t.output) prompt.push_back(id);
  const json request = {{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0},
                        {"prompt_logprobs", 0}, {"cache_salt", "rolloutcore-audit"}};
  effects::HttpReply reply = engine.Completions(request);
  if (!reply.http.ok_2xx() || !reply.body.contains("choices")) {
    out.detail = "scoring request failed: " + E(describe(reply.http));
    return out;
  }
  const json& plp = reply.body["choices"][0].value("prompt_logprobs", json());
  if (!plp.is_array() || plp.size() != prompt.size()) {
    out.detail = "engine returned no prompt_logprobs of the expected length";
    return out;
  }
  out.checked = true;
  for (std::size_t k = 0; k < t.output.size(); ++k) {
    const json& entry = plp[t.prompt.size() + k];
    const std::string key = std::to_string(t.output[k]);
    if (!entry.is_object() || !entry.contains(key)) {
      out.logprob_mismatches++;
      continue;
    }
    const double engine_lp = entry[key].value("logprob", 0.0);
    const int rank = entry[key].value("rank", 0);
    if (rank != 1) out.not_top1++;
    out.tokens++;
    if (k < t.logprobs.size() && t.logprobs[k].has_value()) {
      const double diff = std::fabs(engine_lp - *t.logprobs[k]);
      out.max_abs_diff = std::max(out.max_abs_diff, diff);
      if (diff > tolerance) out.logprob_mismatches++;
    }
  }
  out.ok = out.logprob_mismatches == 0 && (!greedy || out.not_top1 == 0);
  std::ostringstream d;
  d << out.tokens << " tokens, " << out.logprob_mismatches << " logprob mismatches (max |diff| "
    << out.max_abs_diff << "), " << out.not_top1 << " not top-1";
  out.detail = d.str();
  return out;
}

std::string FormatReport(const AuditReport& r) {
  std::ostringstream out;
  out << "records: " << r.records << "; hash chain " << (r.chain_ok ? "OK" : "BROKEN")
      << "; RocksDB checksums " << (r.checksums_ok ? "OK" : "FAILED") << "; lifecycle history "
      << (r.history.ok ? "OK" : "VIOLATED") << "\n";
  const HistorySummary& s = r.history.summary;
  out << "updates: requested " << s.updates_requested << ", committed " << s.updates_committed
      << ", refused " << s.updates_refused << ", tainted " << s.updates_tainted
      << "; recoveries " << s.recoveries << "\n";
  out << "versions:\n";
  for (const VersionRecord& v : r.versions) {
    out << "  " << E(v.version.label) << " (generation " << v.version.generation << ") "
        << (v.update_id.empty() ? "bootstrap" : "update '" + E(v.update_id) + "'") << " at seq "
        << v.published_seq << ": ckpt=" << E(v.identity.checkpoint) << " step=" << v.identity.step
        << " manifest=" << E(v.identity.manifest_digest.substr(0, 12)) << "; rollouts admitted "
        << v.rollouts_admitted << ", finished " << v.rollouts_finished << "\n";
  }
  out << "state: " << E(describe(r.state)) << "\n";
  if (r.ok) {
    out << "audit: OK\n";
  } else {
    for (const std::string& f : r.failures) out << "audit FAILURE: " << E(f) << "\n";
  }
  return out.str();
}

std::string ProvenanceJson(const RolloutProvenance& p, int indent) {
  const json out = {
      {"rollout_id", p.rollout_id},
      {"admitted_seq", p.admitted_seq},
      {"binding", journal::EventToJson(p.binding)},
      {"finished_seq", p.finished_seq},
      {"finish", p.finish ? journal::EventToJson(*p.finish) : json()},
      {"version",
       {{"version", journal::WeightVersionToJson(p.version.version)},
        {"identity", journal::WeightIdentityToJson(p.version.identity)},
        {"update_id", p.version.update_id},
        {"published_seq", p.version.published_seq}}}};
  return out.dump(indent, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace);
}

std::string FormatReverifyFailure(const ReverifyResult& r) {
  return "REVERIFY FAILED " + E(r.rollout_id) + ": " + r.detail;
}

}  // namespace rc::audit
