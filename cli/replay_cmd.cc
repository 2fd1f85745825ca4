// `rolloutcore replay JOURNAL`: works on a journal a live writer holds (secondary instance); a
// journal no writer holds opens read-only with its live files and WAL tail checked.
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/number_args.h"
#include "journal/json.h"
#include "replay/replay.h"
#include "statemachine/quote.h"
#include "statemachine/text.h"

namespace rc::cli {
namespace {

// Exit codes as audit's: 1 the journal does not verify, 2 it cannot be read (a wrong path, a
// writer's lock) or the command line asks for what it does not hold, 3 it is damaged (the open or
// the refold found records lost or altered). main.cc adds 4: the report could not be written.
int Refused(const Status& why) {
  std::fprintf(stderr, "rolloutcore replay: %s\n", text::escape_line(why.ToString()).c_str());
  return why.code() == Code::kCorruption ? 3 : 2;
}

// A usage error on stderr, one escaped line (it quotes the command line); exit 2, nothing run.
int Usage(const std::string& why) {
  std::fprintf(stderr, "rolloutcore replay: %s\n", text::escape_line(why).c_str());
  return 2;
}

// `--until`'s text as a seq, or a usage error quoting it. Seqs start at 1, so 0 names no record
// and is refused like any other text that is not one: the whole journal is replayed by leaving
// --until out, never by a value that looks like a seq.
Result<std::uint64_t> ParseUntil(const std::string& typed) {
  Result<std::uint64_t> seq =
      ParseWholeNumberOption("--until", typed, 1, std::numeric_limits<std::uint64_t>::max());
  if (!seq.ok()) {
    return Status::InvalidArgument(seq.status().message() +
                                   "; seqs start at 1: leave --until out to replay the whole "
                                   "journal");
  }
  return seq;
}

// A seq past the head is a question the journal cannot answer, never a verification failure.
int UntilRefused(const std::string& typed, const Status& why) {
  return Usage("--until " + text::quoted(typed) + ": " + why.message());
}

// --events: each record the report folds, through `end_seq` (0: the head), one line each.
void PrintEvents(journal::Journal& j, std::uint64_t end_seq, bool json) {
  Status st = j.Scan(1, end_seq, [&](const journal::Record& r) {
    const std::string line = json ? replay::RecordJsonLine(r) : replay::FormatRecordLine(r);
    std::printf("%s\n", line.c_str());
    return Status::OK();
  });
  if (!st.ok())
    std::fprintf(stderr, "scan stopped: %s\n", text::escape_line(st.ToString()).c_str());
}

// Why the verdict fails for a torn WAL tail ("" when none): the one this open found (`torn`), or
// the first one an executor's start recorded (replay lists them all). Either way the records the
// torn batch held are lost, and the journal's WAL shows the recorded ones no more.
std::string TornTailVerdict(const std::string& torn, const replay::ReplayReport& report) {
  if (!torn.empty() || report.torn_tails.empty()) return torn;
  const replay::RecordedTornTail& first = report.torn_tails.front();
  return "torn WAL tail recorded at seq " + std::to_string(first.seq) + ": " + first.sentence;
}

void PrintReport(const replay::ReplayReport& report, const std::string& torn, bool json) {
  const std::string failed = TornTailVerdict(torn, report);
  if (json) {
    nlohmann::json out = nlohmann::json::parse(replay::ReportJson(report));
    if (!torn.empty()) out["torn_tail"] = text::sanitize_utf8(torn);
    if (!failed.empty()) out["ok"] = false;
    // One line of printable ASCII (replay::ReportJson's reason): \u escapes, never raw text.
    std::printf(
        "%s\n",
        out.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("%s", replay::FormatReport(report, failed).c_str());
  }
}

struct Opts {
  std::string path;
  CLI::Option* path_given = nullptr;  // an empty text is given, and refused
  bool json = false;
  bool events = false;
  std::string until_typed;       // --until as typed: read by ParseUntil
  CLI::Option* until = nullptr;  // whether it was given (an empty text is given, and refused)
};

// The seq replay::ReplayOptions takes for --until: 0 (the whole journal) when it was left out.
Result<std::uint64_t> UntilSeq(const Opts& o) {
  if (o.until->count() == 0) return std::uint64_t{0};
  return ParseUntil(o.until_typed);
}

}  // namespace

Runner add_replay(CLI::App& app) {
  auto opts = std::make_shared<Opts>();
  opts->path_given = app.add_option("journal", opts->path, "Journal directory")->required();
  app.add_flag("--json", opts->json, "Print the report as JSON");
  app.add_flag("--events", opts->events, "Print every record before the report");
  opts->until = app.add_option("--until", opts->until_typed,
                               "Fold up to this seq (1 or more): through the end of its decision "
                               "group (its input and the decisions derived from it), which the "
                               "report names; without it, the whole journal");
  return [opts]() -> int {
    // A usage error the options alone decide is refused before the journal is opened.
    const Status path =
        CheckTextOptions({{"journal", opts->path_given, &opts->path, TextKind::kPath}});
    if (!path.ok()) return Usage(path.message());
    const Result<std::uint64_t> until_seq = UntilSeq(*opts);
    if (!until_seq.ok()) return Usage(until_seq.status().message());
    if (Status files = CheckJournalFiles(opts->path); !files.ok()) return Usage(files.ToString());
    journal::Options options;
    options.read_only = true;
    options.create_if_missing = false;
    auto opened = journal::Journal::Open(opts->path, options);
    if (!opened.ok()) return Refused(opened.status());
    journal::Journal& j = **opened;
    NoteLiveWriter(j, "replay");
    const std::string torn = j.recovery().torn_tail;
    // Resolved before anything is printed, so --events lists exactly the records the report folds.
    Result<replay::FoldEnd> until = replay::ResolveUntil(j, *until_seq);
    if (!until.ok()) return UntilRefused(opts->until_typed, until.status());
    if (opts->events) PrintEvents(j, until->end_seq, opts->json);
    auto report = replay::Replay(j, replay::ReplayOptions{*until_seq});
    if (!report.ok()) return Refused(report.status());
    PrintReport(*report, torn, opts->json);
    if (report->read_failure != Code::kOk) return report->read_failure == Code::kCorruption ? 3 : 2;
    return report->ok && TornTailVerdict(torn, *report).empty() ? 0 : 1;
  };
}

}  // namespace rc::cli
