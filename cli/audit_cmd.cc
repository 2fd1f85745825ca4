// `rolloutcore audit JOURNAL`: integrity, lifecycle history, provenance, trajectory checks.
#include <cstdio>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "audit/audit.h"
#include "effects/http/weight_digest.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/number_args.h"
#include "journal/codec.h"
#include "journal/json.h"
#include "statemachine/describe.h"
#include "statemachine/quote.h"
#include "statemachine/text.h"

namespace rc::cli {
namespace {

// An acknowledged head a client kept (`--expect-head SEQ:HEXHASH`).
struct ExpectedHead {
  std::uint64_t seq = 0;
  journal::Hash hash{};
};

// `--expect-head: 'SPEC' is not SEQ:HEXHASH (WHY)`: a usage error.
Status ExpectHeadUsage(const std::string& spec, const std::string& why) {
  return Status::InvalidArgument("--expect-head: " + text::quoted(spec) + " is not SEQ:HEXHASH (" +
                                 why + ")");
}

// `--expect-head`'s text: SEQ (a whole number >= 1, digits only: cli/number_args.h) and 64 hex
// digits; a usage error quoting the text otherwise.
Result<ExpectedHead> ParseExpectedHead(const std::string& spec) {
  const std::size_t colon = spec.find(':');
  if (colon == std::string::npos) return ExpectHeadUsage(spec, "missing ':'");
  const Result<std::uint64_t> seq =
      ParseWholeNumber(spec.substr(0, colon), 1, std::numeric_limits<std::uint64_t>::max());
  if (!seq.ok()) return ExpectHeadUsage(spec, "seq " + seq.status().message());
  const Result<journal::Hash> hash = journal::ParseHashHex(spec.substr(colon + 1));
  if (!hash.ok()) return ExpectHeadUsage(spec, hash.status().message());
  return ExpectedHead{*seq, *hash};
}

// The journal must still hold record `head.seq` with that hash. This is the only check that sees
// acknowledged groups cut away exactly at a WAL batch boundary of a crashed journal: a client kept
// the head (AppendResult last_seq, last_hash) it was acknowledged.
bool CheckExpectedHead(journal::Journal& j, const ExpectedHead& head, std::FILE* out) {
  const auto seq = static_cast<unsigned long long>(head.seq);
  Result<journal::Record> r = j.Read(head.seq);
  if (!r.ok()) {
    std::fprintf(out,
                 "expected head: FAILED: seq %llu is missing (the journal ends at seq %llu): %s\n",
                 seq, static_cast<unsigned long long>(j.head_seq()),
                 text::escape_line(r.status().ToString()).c_str());
    return false;
  }
  if (r->hash != head.hash) {
    std::fprintf(out, "expected head: FAILED: seq %llu has hash %s, not %s\n", seq,
                 journal::HashHex(r->hash).c_str(), journal::HashHex(head.hash).c_str());
    return false;
  }
  std::fprintf(out, "expected head: OK: seq %llu hash %s is in the journal\n", seq,
               journal::HashHex(head.hash).c_str());
  return true;
}

struct Opts {
  std::string path;
  std::string rollout;
  std::string trajectories;
  std::string engine;
  std::string fleet_engine;  // a fleet's journal: the engine --engine is
  // docs/audit.md, "Re-verification": measured on vLLM 0.25.1, bf16; a bf16 engine may score a
  // token a little differently in prefill than when it sampled it.
  double logprob_tolerance_nats = 0.5;
  std::string logprob_tolerance_typed;       // read by ReadNumberOptions
  CLI::Option* logprob_tolerance = nullptr;  // whether it was given
  bool greedy = false;
  bool json = false;
  std::string expect_head_typed;       // read by ReadNumberOptions
  CLI::Option* expect_head = nullptr;  // whether it was given (an empty text is, and is refused)
  // Whether each text option was given (an empty text is, and ReadTextOptions refuses it).
  CLI::Option* path_given = nullptr;
  CLI::Option* rollout_given = nullptr;
  CLI::Option* trajectories_given = nullptr;
  CLI::Option* engine_given = nullptr;
  CLI::Option* fleet_engine_given = nullptr;
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

// A trajectories file held against the journal: each line's binding, then its tokens, logprobs,
// admitting engine and count against the journal's own trajectory (audit::CompareTrajectoriesFile).
// Each difference is an engine finding printed as a MISMATCH line; the file's lines that hold no
// trajectory are skipped and reported (audit::AddSkippedLines says which change the exit code);
// the journal's trajectories it lacks are a note. The file was read before the audit
// (ReadTrajectoriesOption).
void CheckTrajectoriesFile(journal::Journal& j, const Opts& o, const audit::TrajectoriesFile& file,
                           audit::Verdict& verdict) {
  const std::vector<audit::Trajectory>& ts = file.trajectories;
  std::vector<std::string> failures = audit::CrossCheckTrajectories(j, ts);
  const std::size_t binding = failures.size();
  Result<audit::FileComparison> compared = audit::CompareTrajectoriesFile(j, file);
  if (!compared.ok()) {
    const std::string why =
        "trajectories file against the journal: " + compared.status().ToString();
    std::fprintf(o.lines(), "%s\n", text::escape_line(why).c_str());
    verdict.journal_failures.push_back(why);
  }
  const audit::FileComparison none;
  const audit::FileComparison& c = compared.ok() ? *compared : none;
  // The text's summary line and --json's `trajectories_file` are these same counts.
  verdict.trajectories_file = audit::TrajectoriesFileCounts{.trajectories = ts.size(),
                                                            .binding_mismatches = binding,
                                                            .torn = file.torn,
                                                            .damaged = file.damaged,
                                                            .contradicted = c.differing,
                                                            .without_line = c.missing};
  std::fprintf(o.lines(), "%s\n",
               audit::FormatTrajectoriesFileCounts(*verdict.trajectories_file).c_str());
  failures.insert(failures.end(), c.findings.begin(), c.findings.end());
  for (const std::string& f : failures) {
    std::fprintf(o.lines(), "  MISMATCH: %s\n", text::escape_line(f).c_str());
    verdict.engine_findings.push_back(f);
  }
  for (const std::string& n : c.notes) {
    verdict.notes.push_back("trajectories file " + o.trajectories + ": " + n);
  }
  audit::AddSkippedLines(file, o.trajectories, verdict);
  // A file of torn lines only (its writer's first write cut by a crash) or none is what a writer
  // leaves; the journal's trajectories it lacks are noted above, and damaged lines are findings.
  if (ts.empty()) {
    verdict.notes.push_back("trajectories file " + o.trajectories +
                            " holds no trajectory: no line was checked");
  }
}

// The journal is the authority on what each rollout produced: with --engine its own trajectories
// are re-verified, whether or not a trajectories file is given (a file's line is only a copy,
// which CheckTrajectoriesFile holds against them).
void CheckTrajectories(journal::Journal& j, const Opts& o,
                       const std::optional<audit::TrajectoriesFile>& file, audit::Verdict& verdict,
                       audit::JournalTrajectories& out) {
  if (file.has_value()) CheckTrajectoriesFile(j, o, *file, verdict);
  if (!o.engine.empty()) ReadJournalTrajectories(j, o, verdict, out);
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
      audit::ReverifyFromJournal(engine, trajectories, o.logprob_tolerance_nats, o.greedy);
  for (const audit::ReverifyResult& r : s.rollouts) {
    std::fprintf(o.lines(), "  %s\n", audit::FormatReverify(r).c_str());
  }
  std::fprintf(o.lines(), "%s\n", audit::FormatReverifySummary(s, o.engine).c_str());
  for (std::string& f : audit::ReverifyFindings(s)) verdict.engine_findings.push_back(std::move(f));
  return s;
}

// Reads the options given as text (cli/number_args.h: CLI11's conversion is not strict) into
// `o`; a usage error quoting the text otherwise. `--expect-head` into `expected`.
Status ReadNumberOptions(Opts& o, std::optional<ExpectedHead>& expected) {
  if (o.logprob_tolerance->count() > 0) {
    const Result<double> nats = ParseNonNegativeDecimal(o.logprob_tolerance_typed);
    if (!nats.ok()) {
      return Status::InvalidArgument("--logprob-tolerance: " + nats.status().message());
    }
    o.logprob_tolerance_nats = *nats;
  }
  if (o.expect_head->count() > 0) {
    Result<ExpectedHead> parsed = ParseExpectedHead(o.expect_head_typed);
    if (!parsed.ok()) return parsed.status();
    expected = *parsed;
  }
  return Status::OK();
}

// The text options given, each by the rule of what it names (cli/cli_util.h); a usage error
// quoting the text otherwise. Once they pass, an empty text is an option left out.
Status ReadTextOptions(const Opts& o) {
  return CheckTextOptions(
      {{"journal", o.path_given, &o.path, TextKind::kPath},
       {"--rollout", o.rollout_given, &o.rollout, TextKind::kId},
       {"--trajectories", o.trajectories_given, &o.trajectories, TextKind::kPath},
       {"--engine", o.engine_given, &o.engine, TextKind::kUrl},
       {"--fleet-engine", o.fleet_engine_given, &o.fleet_engine, TextKind::kId}});
}

// Option combinations that no journal makes valid; "" when none.
std::string OptionsUsageError(const Opts& o) {
  if (!o.rollout.empty() &&
      (!o.trajectories.empty() || !o.engine.empty() || !o.fleet_engine.empty())) {
    return "--rollout shows one rollout's provenance: --trajectories, --engine and "
           "--fleet-engine audit the whole journal, give them without --rollout";
  }
  if (!o.fleet_engine.empty() && o.engine.empty()) {
    return "--fleet-engine names the engine --engine is: give --engine too";
  }
  return {};
}

// --engine and --fleet-engine against what the journal holds; "" when they agree.
std::string JournalUsageError(journal::Journal& j, const Opts& o) {
  if (o.engine.empty()) return {};
  if (j.is_fleet() && o.fleet_engine.empty()) {
    return "the journal holds a fleet: name the engine with --fleet-engine";
  }
  if (!j.is_fleet() && !o.fleet_engine.empty()) {
    return "--fleet-engine names an engine of a fleet's journal";
  }
  if (!o.fleet_engine.empty() && j.fleet_state().engines.count(o.fleet_engine) == 0) {
    return "no engine " + audit::Quoted(o.fleet_engine) + " in the fleet";
  }
  return {};
}

// A usage error on stderr (escaped: it may quote the command line); exit 2.
int Usage(const std::string& why) {
  std::fprintf(stderr, "rolloutcore audit: %s\n", text::escape_line(why).c_str());
  return audit::kExitUsage;
}

// `--trajectories FILE`, read whole before the audit: a file that cannot be read, or holds more
// than kTrajectoriesMax lines, is a usage error found before any verdict exists to be dropped.
Result<std::optional<audit::TrajectoriesFile>> ReadTrajectoriesOption(const Opts& o) {
  if (o.trajectories.empty()) return std::optional<audit::TrajectoriesFile>();
  auto file = audit::ReadTrajectoriesFile(o.trajectories);
  if (!file.ok()) return file.status();
  return std::optional<audit::TrajectoriesFile>(std::move(file.value()));
}

// The whole-journal audit, once every usage error has been refused: its report, the command's
// own findings, and exactly one verdict.
int AuditWhole(journal::Journal& j, const Opts& o, std::optional<audit::TrajectoriesFile> file,
               const std::string& torn, bool head_ok) {
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
  CheckTrajectories(j, o, file, verdict, trajectories);
  std::optional<audit::ReverifySummary> reverified;
  if (!o.engine.empty()) {
    effects::EngineClient engine(o.engine);
    CheckDigest(j, o, engine, verdict);
    reverified = Reverify(o, engine, trajectories, verdict);
  }
  const audit::AuditOutput out = audit::RenderAudit(*report, verdict, o.path);
  if (o.json) {
    std::printf(
        "%s\n",
        audit::VerdictJson(*report, verdict, -1, reverified ? &*reverified : nullptr).c_str());
  } else {
    std::printf("%s", out.text.c_str());
  }
  return out.exit_code;
}

}  // namespace

Runner add_audit(CLI::App& app) {
  auto o = std::make_shared<Opts>();
  o->path_given = app.add_option("journal", o->path, "Journal directory")->required();
  o->rollout_given = app.add_option("--rollout", o->rollout, "Show the provenance of one rollout");
  o->trajectories_given = app.add_option(
      "--trajectories", o->trajectories,
      "Trajectories JSON-lines file (written by `serve`) to check against the journal");
  o->engine_given =
      app.add_option("--engine", o->engine,
                     "Re-score the journal's trajectories of the version this engine serves (an "
                     "http:// or https:// URL)");
  o->fleet_engine_given =
      app.add_option("--fleet-engine", o->fleet_engine,
                     "In a fleet's journal: the name of the engine --engine is (its digest is "
                     "checked against that engine's recorded ones)");
  o->logprob_tolerance =
      app.add_option("--logprob-tolerance,--tolerance", o->logprob_tolerance_typed,
                     "Largest accepted |recorded - re-scored logprob| per output token, in nats: "
                     "a finite decimal number >= 0 such as 0.5 or 1e-3 (default 0.5: 2.6x the "
                     "largest difference measured between vLLM's batched sampling and its "
                     "batch-1 re-scoring in bf16)");
  app.add_flag("--greedy", o->greedy, "Trajectories were sampled greedily: require top-1 tokens");
  app.add_flag("--json", o->json,
               "JSON output (the verdict with its findings, or the provenance with --rollout)");
  o->expect_head =
      app.add_option("--expect-head", o->expect_head_typed,
                     "SEQ:HEXHASH of an acknowledged head: the journal must still hold that record "
                     "with that hash");
  // Every usage error is refused before the audit runs (before the journal is opened, where the
  // options alone decide it): a verdict is printed whole or not computed.
  return [o]() -> int {
    if (Status texts = ReadTextOptions(*o); !texts.ok()) return Usage(texts.message());
    if (std::string why = OptionsUsageError(*o); !why.empty()) return Usage(why);
    std::optional<ExpectedHead> expected;
    if (Status read = ReadNumberOptions(*o, expected); !read.ok()) return Usage(read.message());
    // Read before the journal is opened: serve writes a line only once its finish is durable, so
    // beside a live writer every line read now is in the journal opened next.
    auto file = ReadTrajectoriesOption(*o);
    if (!file.ok()) return Usage(file.status().ToString());
    if (Status files = CheckJournalFiles(o->path); !files.ok()) return Usage(files.ToString());
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
    if (std::string why = JournalUsageError(j, *o); !why.empty()) return Usage(why);
    const std::string torn = j.recovery().torn_tail;
    const bool head_ok = !expected || CheckExpectedHead(j, *expected, o->lines());
    if (!o->rollout.empty()) return ShowProvenance(j, *o, torn, head_ok);
    return AuditWhole(j, *o, std::move(file.value()), torn, head_ok);
  };
}

}  // namespace rc::cli
