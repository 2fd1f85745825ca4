// `rolloutcore audit JOURNAL`: integrity, lifecycle history, provenance, trajectory checks.
#include <cstdio>
#include <memory>
#include <string>

#include "audit/audit.h"
#include "cli/commands.h"
#include "journal/codec.h"
#include "journal/json.h"
#include "statemachine/text.h"

namespace rc::cli {
namespace {

// The report with its "audit: OK" verdict replaced by `verdict` (appended when absent): a
// journal-level failure such as a torn tail is never printed as OK.
std::string ReplaceOkVerdict(std::string report, const std::string& verdict) {
  const std::string ok = "audit: OK";
  const std::size_t at = report.find(ok);
  if (at == std::string::npos || (at > 0 && report[at - 1] != '\n')) return report + verdict + "\n";
  const std::size_t end = report.find('\n', at);
  return report.replace(at, end == std::string::npos ? std::string::npos : end - at, verdict);
}

// `--expect-head SEQ:HEXHASH`: the journal must still hold record SEQ with that hash. This is the
// only check that sees acknowledged groups cut away exactly at a WAL batch boundary of a crashed
// journal: a client kept the head (AppendResult last_seq, last_hash) it was acknowledged.
bool CheckExpectedHead(journal::Journal& j, const std::string& spec) {
  const std::size_t colon = spec.find(':');
  std::uint64_t seq = 0;
  Result<journal::Hash> hash = Status::InvalidArgument("missing ':'");
  if (colon != std::string::npos) {
    const std::string digits = spec.substr(0, colon);
    if (!digits.empty() && digits.size() <= 19 && digits.find_first_not_of("0123456789") == std::string::npos) {
      seq = std::stoull(digits);
    }
    hash = journal::ParseHashHex(spec.substr(colon + 1));
  }
  if (seq == 0 || !hash.ok()) {
    std::printf("expected head: FAILED: '%s' is not SEQ:HEXHASH (%s)\n", text::escape_line(spec).c_str(),
                text::escape_line(hash.ok() ? "seq must be >= 1" : hash.status().message()).c_str());
    return false;
  }
  Result<journal::Record> r = j.Read(seq);
  if (!r.ok()) {
    std::printf("expected head: FAILED: seq %llu is missing (the journal ends at seq %llu): %s\n",
                static_cast<unsigned long long>(seq), static_cast<unsigned long long>(j.head_seq()),
                text::escape_line(r.status().ToString()).c_str());
    return false;
  }
  if (r->hash != *hash) {
    std::printf("expected head: FAILED: seq %llu has hash %s, not %s\n", static_cast<unsigned long long>(seq),
                journal::HashHex(r->hash).c_str(), journal::HashHex(*hash).c_str());
    return false;
  }
  std::printf("expected head: OK: seq %llu hash %s is in the journal\n", static_cast<unsigned long long>(seq),
              journal::HashHex(*hash).c_str());
  return true;
}

}  // namespace

Runner add_audit(CLI::App& app) {
  struct Opts {
    std::string path;
    std::string rollout;
    std::string trajectories;
    std::string engine;
    double tolerance = 1e-3;
    bool greedy = false;
    bool json = false;
    std::string expect_head;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("journal", o->path, "Journal directory")->required();
  app.add_option("--rollout", o->rollout, "Show the provenance of one rollout");
  app.add_option("--trajectories", o->trajectories,
                 "Trajectories JSON-lines file (written by `serve`) to cross-check");
  app.add_option("--engine", o->engine,
                 "Re-score trajectories (from --trajectories, else the journal's) of the version "
                 "this engine serves (URL)");
  app.add_option("--tolerance", o->tolerance, "Largest accepted |logprob difference|");
  app.add_flag("--greedy", o->greedy, "Trajectories were sampled greedily: require top-1 tokens");
  app.add_flag("--json", o->json, "JSON output (provenance only)");
  app.add_option("--expect-head", o->expect_head,
                 "SEQ:HEXHASH of an acknowledged head: the journal must still hold that record "
                 "with that hash");
  return [o]() -> int {
    journal::Options options;
    options.read_only = true;
    options.create_if_missing = false;
    auto opened = journal::Journal::Open(o->path, options);
    if (!opened.ok()) {
      std::fprintf(stderr, "rolloutcore audit: %s\n", text::escape_line(opened.status().ToString()).c_str());
      return 2;
    }
    journal::Journal& j = **opened;
    const std::string torn = j.recovery().torn_tail;
    const bool head_ok = o->expect_head.empty() || CheckExpectedHead(j, o->expect_head);
    if (!o->rollout.empty()) {
      auto p = audit::Provenance(j, o->rollout);
      if (!p.ok()) {
        std::fprintf(stderr, "rolloutcore audit: %s\n", text::escape_line(p.status().ToString()).c_str());
        return 1;
      }
      nlohmann::json out = {
          {"rollout_id", p->rollout_id},
          {"admitted_seq", p->admitted_seq},
          {"binding", journal::EventToJson(p->binding)},
          {"finished_seq", p->finished_seq},
          {"finish", p->finish ? journal::EventToJson(*p->finish) : nlohmann::json()},
          {"version",
           {{"version", journal::WeightVersionToJson(p->version.version)},
            {"identity", journal::WeightIdentityToJson(p->version.identity)},
            {"update_id", p->version.update_id},
            {"published_seq", p->version.published_seq}}}};
      std::printf("%s\n", out.dump(o->json ? -1 : 2).c_str());
      if (!torn.empty()) std::printf("audit FAILURE: %s\n", text::escape_line(torn).c_str());
      return head_ok && torn.empty() ? 0 : 1;
    }
    auto report = audit::AuditJournal(j);
    if (!report.ok()) {
      std::fprintf(stderr, "rolloutcore audit: %s\n", text::escape_line(report.status().ToString()).c_str());
      return 2;
    }
    if (torn.empty()) {
      std::printf("%s", audit::FormatReport(*report).c_str());
    } else {
      std::printf("%s", ReplaceOkVerdict(audit::FormatReport(*report),
                                         "audit FAILURE: " + text::escape_line(torn)).c_str());
    }
    bool ok = report->ok && torn.empty() && head_ok;
    std::vector<audit::Trajectory> trajectories;
    if (!o->trajectories.empty()) {
      auto ts = audit::LoadTrajectories(o->trajectories);
      if (!ts.ok()) {
        std::fprintf(stderr, "rolloutcore audit: %s\n", text::escape_line(ts.status().ToString()).c_str());
        return 2;
      }
      auto failures = audit::CrossCheckTrajectories(j, *ts);
      std::printf("trajectories file: %zu, binding mismatches: %zu\n", ts->size(),
                  failures.size());
      for (const auto& f : failures) std::printf("  MISMATCH: %s\n", text::escape_line(f).c_str());
      ok = ok && failures.empty();
      trajectories = std::move(ts.value());
    } else if (!o->engine.empty()) {
      auto ts = audit::TrajectoriesFromJournal(j);
      if (!ts.ok()) {
        std::fprintf(stderr, "rolloutcore audit: %s\n", text::escape_line(ts.status().ToString()).c_str());
        return 2;
      }
      std::printf("trajectories in the journal: %zu\n", ts->size());
      trajectories = std::move(ts.value());
    }
    if (!o->engine.empty()) {
      effects::EngineClient engine(o->engine);
      std::size_t checked = 0, bad = 0;
      for (const auto& t : trajectories) {
        audit::ReverifyResult r = audit::Reverify(engine, t, o->tolerance, o->greedy);
        if (!r.checked) continue;
        checked++;
        if (!r.ok) {
          bad++;
          std::printf("  REVERIFY FAILED %s: %s\n", text::escape_line(r.rollout_id).c_str(),
                      text::escape_line(r.detail).c_str());
        }
      }
      std::printf("re-verified against %s: %zu trajectories checked, %zu failed\n",
                  text::escape_line(o->engine).c_str(), checked, bad);
      ok = ok && bad == 0;
    }
    return ok ? 0 : 1;
  };
}

}  // namespace rc::cli
