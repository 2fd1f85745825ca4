// `rolloutcore audit JOURNAL`: integrity, lifecycle history, provenance, trajectory checks.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "audit/audit.h"
#include "effects/http/weight_digest.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "journal/codec.h"
#include "journal/json.h"
#include "statemachine/describe.h"
#include "statemachine/text.h"

namespace rc::cli {
namespace {

// `--expect-head SEQ:HEXHASH`: the journal must still hold record SEQ with that hash. This is the
// only check that sees acknowledged groups cut away exactly at a WAL batch boundary of a crashed
// journal: a client kept the head (AppendResult last_seq, last_hash) it was acknowledged.
bool CheckExpectedHead(journal::Journal& j, const std::string& spec, std::FILE* out) {
  const std::size_t colon = spec.find(':');
  std::uint64_t seq = 0;
  Result<journal::Hash> hash = Status::InvalidArgument("missing ':'");
  if (colon != std::string::npos) {
    const std::string digits = spec.substr(0, colon);
    if (!digits.empty() && digits.size() <= 19 &&
        digits.find_first_not_of("0123456789") == std::string::npos) {
      seq = std::strtoull(digits.c_str(), nullptr, 10);  // <= 19 digits: no overflow
    }
    hash = journal::ParseHashHex(spec.substr(colon + 1));
  }
  if (seq == 0 || !hash.ok()) {
    std::fprintf(
        out, "expected head: FAILED: '%s' is not SEQ:HEXHASH (%s)\n",
        text::escape_line(spec).c_str(),
        text::escape_line(hash.ok() ? "seq must be >= 1" : hash.status().message()).c_str());
    return false;
  }
  Result<journal::Record> r = j.Read(seq);
  if (!r.ok()) {
    std::fprintf(
        out, "expected head: FAILED: seq %llu is missing (the journal ends at seq %llu): %s\n",
        static_cast<unsigned long long>(seq), static_cast<unsigned long long>(j.head_seq()),
        text::escape_line(r.status().ToString()).c_str());
    return false;
  }
  if (r->hash != *hash) {
    std::fprintf(out, "expected head: FAILED: seq %llu has hash %s, not %s\n",
                 static_cast<unsigned long long>(seq), journal::HashHex(r->hash).c_str(),
                 journal::HashHex(*hash).c_str());
    return false;
  }
  std::fprintf(out, "expected head: OK: seq %llu hash %s is in the journal\n",
               static_cast<unsigned long long>(seq), journal::HashHex(*hash).c_str());
  return true;
}

struct Opts {
  std::string path;
  std::string rollout;
  std::string trajectories;
  std::string engine;
  std::string fleet_engine;  // a fleet's journal: the engine --engine is
  // Not yet measured on a real engine (docs/audit.md, "Re-verification"); a bf16 engine may
  // score a token a little differently in prefill than when it sampled it.
  double logprob_tolerance = 0.5;  // nats; docs/audit.md: measured on vLLM 0.25.1, bf16
  bool greedy = false;
  bool json = false;
  std::string expect_head;
  // The report's lines: stdout, or stderr with --json so that stdout is one JSON document.
  std::FILE* lines() const { return json ? stderr : stdout; }
};

int ShowProvenance(journal::Journal& j, const Opts& o, const std::string& torn, bool head_ok) {
  auto p = audit::Provenance(j, o.rollout);
  if (!p.ok()) {
    std::fprintf(stderr, "rolloutcore audit: %s\n",
                 text::escape_line(p.status().ToString()).c_str());
    return p.status().code() == Code::kCorruption ? audit::kExitJournalDamaged : audit::kExitUsage;
  }
  std::printf("%s\n", audit::ProvenanceJson(*p, o.json ? -1 : 2).c_str());
  // With --json, stdout is the one JSON document: the damage goes to stderr (and the exit code).
  if (!torn.empty()) {
    std::fprintf(o.lines(), "audit: JOURNAL DAMAGED: %s\n", text::escape_line(torn).c_str());
  }
  return head_ok && torn.empty() ? audit::kExitOk : audit::kExitJournalDamaged;
}

// The journal's trajectories for --engine: past kTrajectoriesMax its most recent ones, and the
// report says how many of how many. Parts that cannot be joined are damage: a journal finding,
// and the report goes on without them.
void ReadJournalTrajectories(journal::Journal& j, const Opts& o, audit::Verdict& verdict,
                             audit::JournalTrajectories& out) {
  auto ts = audit::SampleTrajectoriesFromJournal(j);
  if (!ts.ok()) {
    const std::string why = "trajectories in the journal: " + ts.status().ToString();
    std::fprintf(o.lines(), "%s\n", text::escape_line(why).c_str());
    verdict.journal_failures.push_back(why);
    return;
  }
  std::fprintf(o.lines(), "%s\n", text::escape_line(audit::FormatJournalTrajectories(*ts)).c_str());
  out = std::move(ts.value());
}

// The trajectories to re-verify: the file's (cross-checked against the journal's bindings), or
// the journal's own when only --engine is given. A mismatch is an engine finding; the file's lines
// that hold no trajectory are skipped and reported (audit::AddSkippedLines says which change the
// exit code). A file that cannot be read, or holds more than kTrajectoriesMax, is a usage error.
int CheckTrajectories(journal::Journal& j, const Opts& o, audit::Verdict& verdict,
                      audit::JournalTrajectories& out) {
  if (o.trajectories.empty() && o.engine.empty()) return audit::kExitOk;
  if (o.trajectories.empty()) {
    ReadJournalTrajectories(j, o, verdict, out);
    return audit::kExitOk;
  }
  auto file = audit::ReadTrajectoriesFile(o.trajectories);
  if (!file.ok()) {
    std::fprintf(stderr, "rolloutcore audit: %s\n",
                 text::escape_line(file.status().ToString()).c_str());
    return audit::kExitUsage;
  }
  std::vector<audit::Trajectory>& ts = file->trajectories;
  auto failures = audit::CrossCheckTrajectories(j, ts);
  std::fprintf(o.lines(),
               "trajectories file: %zu, binding mismatches: %zu, lines skipped: %llu (torn %llu, "
               "damaged %llu)\n",
               ts.size(), failures.size(), static_cast<unsigned long long>(file->skipped()),
               static_cast<unsigned long long>(file->torn),
               static_cast<unsigned long long>(file->damaged));
  for (const auto& f : failures) {
    std::fprintf(o.lines(), "  MISMATCH: %s\n", text::escape_line(f).c_str());
    verdict.engine_findings.push_back(f);
  }
  audit::AddSkippedLines(*file, o.trajectories, verdict);
  if (ts.empty()) {
    verdict.engine_findings.push_back(
        "the trajectories file holds no trajectory: nothing to check");
  }
  out.total = ts.size();  // a file's trajectories are all offered
  out.trajectories = std::move(ts);
  return audit::kExitOk;
}

// Compares the weights the engine holds with the digest journaled for the version it reports.
void CheckDigest(journal::Journal& j, const Opts& o, effects::EngineClient& engine,
                 audit::Verdict& verdict) {
  const ValidationObserved served = engine.WeightInfo();
  if (!served.http.ok_2xx()) {
    verdict.engine_findings.push_back("weight digest: the engine did not report its label (" +
                                      describe(served.http) + ")");
    std::fprintf(o.lines(), "weight digest: the engine did not report its label\n");
    return;
  }
  const WeightDigest live = effects::ReadWeightDigest(engine);
  audit::DigestCheck check;
  j.ReadFleetState([&](const FleetState& f) {
    check = audit::CheckEngineDigest(engine_state(f, o.fleet_engine), served.reported_label, live);
  });
  std::fprintf(o.lines(), "%s\n", text::escape_line(check.line).c_str());
  for (std::string& f : check.findings) verdict.engine_findings.push_back(std::move(f));
}

// Each rollout's line, then the totals; the failures (and "checked 0 of N") become findings.
audit::ReverifySummary Reverify(const Opts& o, effects::EngineClient& engine,
                                const audit::JournalTrajectories& trajectories,
                                audit::Verdict& verdict) {
  audit::ReverifySummary s =
      audit::ReverifyFromJournal(engine, trajectories, o.logprob_tolerance, o.greedy);
  for (const audit::ReverifyResult& r : s.rollouts) {
    std::fprintf(o.lines(), "  %s\n", audit::FormatReverify(r).c_str());
  }
  std::fprintf(o.lines(), "%s\n", audit::FormatReverifySummary(s, o.engine).c_str());
  for (std::string& f : audit::ReverifyFindings(s)) verdict.engine_findings.push_back(std::move(f));
  return s;
}

// A finite number >= 0. CLI::NonNegativeNumber refuses only what compares `< 0`, which NaN does
// not: a NaN tolerance would count every re-scored token over it, an infinite one none. The text
// is read with CLI11's own conversion, the one the option then stores.
const CLI::Validator kFiniteNonNegative(
    [](std::string& input) -> std::string {
      double v = 0;
      if (!CLI::detail::lexical_cast(input, v) || !std::isfinite(v) || v < 0) {
        return "must be a finite number >= 0 (nats), got '" + text::escape_line(input) + "'";
      }
      return std::string();
    },
    "FINITE >= 0");

}  // namespace

Runner add_audit(CLI::App& app) {
  auto o = std::make_shared<Opts>();
  app.add_option("journal", o->path, "Journal directory")->required();
  app.add_option("--rollout", o->rollout, "Show the provenance of one rollout");
  app.add_option("--trajectories", o->trajectories,
                 "Trajectories JSON-lines file (written by `serve`) to cross-check");
  app.add_option("--engine", o->engine,
                 "Re-score trajectories (from --trajectories, else the journal's) of the version "
                 "this engine serves (URL)");
  app.add_option("--fleet-engine", o->fleet_engine,
                 "In a fleet's journal: the name of the engine --engine is (its digest is "
                 "checked against that engine's recorded ones)");
  app.add_option("--logprob-tolerance,--tolerance", o->logprob_tolerance,
                 "Largest accepted |recorded - re-scored logprob| per output token, in nats "
                 "(default 0.5: 2.6x the largest difference measured between vLLM's batched "
                 "sampling and its batch-1 re-scoring in bf16)")
      ->check(kFiniteNonNegative);
  app.add_flag("--greedy", o->greedy, "Trajectories were sampled greedily: require top-1 tokens");
  app.add_flag("--json", o->json,
               "JSON output (the verdict with its findings, or the provenance with --rollout)");
  app.add_option("--expect-head", o->expect_head,
                 "SEQ:HEXHASH of an acknowledged head: the journal must still hold that record "
                 "with that hash");
  return [o]() -> int {
    journal::Options options;
    options.read_only = true;
    options.create_if_missing = false;
    auto opened = journal::Journal::Open(o->path, options);
    if (!opened.ok()) {
      std::fprintf(stderr, "rolloutcore audit: %s\n",
                   text::escape_line(opened.status().ToString()).c_str());
      // A journal that exists but fails its checks is damaged; anything else is a usage error.
      return opened.status().code() == Code::kCorruption ? audit::kExitJournalDamaged
                                                         : audit::kExitUsage;
    }
    journal::Journal& j = **opened;
    NoteLiveWriter(j, "audit");
    const std::string torn = j.recovery().torn_tail;
    const bool head_ok = o->expect_head.empty() || CheckExpectedHead(j, o->expect_head, o->lines());
    if (!o->rollout.empty()) return ShowProvenance(j, *o, torn, head_ok);
    auto report = audit::AuditJournal(j);
    if (!report.ok()) {
      std::fprintf(stderr, "rolloutcore audit: %s\n",
                   text::escape_line(report.status().ToString()).c_str());
      return audit::kExitJournalDamaged;
    }
    audit::Verdict verdict = audit::MakeVerdict(*report);
    if (!torn.empty()) verdict.journal_failures.push_back(torn);
    if (!head_ok) {
      verdict.journal_failures.push_back(
          "--expect-head: the acknowledged head is not in the journal");
    }
    audit::JournalTrajectories trajectories;
    if (int rc = CheckTrajectories(j, *o, verdict, trajectories); rc != audit::kExitOk) return rc;
    std::optional<audit::ReverifySummary> reverified;
    if (!o->engine.empty() && j.is_fleet() != !o->fleet_engine.empty()) {
      std::fprintf(stderr, "rolloutcore audit: %s\n",
                   j.is_fleet() ? "the journal holds a fleet: name the engine with --fleet-engine"
                                : "--fleet-engine names an engine of a fleet's journal");
      return audit::kExitUsage;
    }
    if (!o->fleet_engine.empty() && j.fleet_state().engines.count(o->fleet_engine) == 0) {
      std::fprintf(stderr, "rolloutcore audit: no engine '%s' in the fleet\n",
                   text::escape_line(o->fleet_engine).c_str());
      return audit::kExitUsage;
    }
    if (!o->engine.empty()) {
      effects::EngineClient engine(o->engine);
      CheckDigest(j, *o, engine, verdict);
      reverified = Reverify(*o, engine, trajectories, verdict);
    }
    if (o->json) {
      std::printf(
          "%s\n",
          audit::VerdictJson(*report, verdict, -1, reverified ? &*reverified : nullptr).c_str());
      return audit::RenderAudit(*report, verdict, o->path).exit_code;
    }
    audit::AuditOutput out = audit::RenderAudit(*report, verdict, o->path);
    std::printf("%s", out.text.c_str());
    return out.exit_code;
  };
}

}  // namespace rc::cli
