// `rolloutcore replay` and `rolloutcore audit` as child processes on real RocksDB journals: every
// number on their command lines (replay --until, audit --expect-head's seq, audit
// --logprob-tolerance) is read strictly, and a command line either of them cannot take is a usage
// error: exit 2, nothing on stdout, one escaped line on stderr quoting what was typed.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "journal/codec.h"
#include "journal/journal.h"
#include "statemachine/text.h"
#include "tests/audit/cli_journals.h"
#include "tests/audit/cli_usage.h"
#include "tests/audit/run_cli.h"
#include "tests/journal/test_util.h"

namespace rc {
namespace {

using cli_testing::CliRun;
using cli_testing::ExpectUsageError;
using cli_testing::HashOf;
using cli_testing::kNotWholeNumbers;
using cli_testing::Lines;
using cli_testing::RunCli;
using cli_testing::WriteCleanJournal;
using journal::testing::TempDir;

// `rolloutcore replay`'s refusal of the --until text `typed`.
std::string UntilRefusal(const std::string& typed) {
  return "rolloutcore replay: --until: '" + text::escape_line(typed) +
         "' is not a whole number from 1 to 18446744073709551615 (digits only); seqs start at 1: "
         "leave --until out to replay the whole journal";
}

// Proves `replay --until` refuses 0 and every text that is not a seq of digits from 1 to 2^64-1
// as a usage error quoting it as typed (exit 2, one escaped line, nothing on stdout, --events and
// --json too), catching `--until 0` replaying the whole journal and `-1` or 2^64 clamped to
// 18446744073709551615 and refused with that number, which nobody typed.
TEST(CliArgs, ReplayUntilRefusesEveryTextThatIsNotASeq) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 2);  // head 6
  std::vector<std::string> refused = kNotWholeNumbers;
  refused.push_back("0");
  for (const std::string& typed : refused) {
    ExpectUsageError({"replay", dir.path(), "--until", typed}, UntilRefusal(typed));
  }
  ExpectUsageError({"replay", dir.path(), "--until", "-1", "--events", "--json"},
                   UntilRefusal("-1"));
}

// Proves `replay --until` reads leading zeros as digits, quotes the text as typed when the seq lies
// past the head (2^64-1 itself included) and replays the whole journal when left out, catching
// "--until 7: seq 7 ..." for a typed "0007", a number the user never typed.
TEST(CliArgs, ReplayUntilQuotesTheSeqAsTyped) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 2);  // head 6
  const CliRun zeros = RunCli({"replay", dir.path(), "--until", "0004"}, /*with_stderr=*/true);
  EXPECT_EQ(zeros.exit_code, 0) << zeros.out;
  EXPECT_NE(zeros.out.find("until: the state after seq 4, the end of the group of input seq 3"),
            std::string::npos)
      << zeros.out;
  ExpectUsageError(
      {"replay", dir.path(), "--until", "0007"},
      "rolloutcore replay: --until '0007': seq 7 lies past the journal's head (seq 6): "
      "nothing is recorded there");
  ExpectUsageError({"replay", dir.path(), "--until", "18446744073709551615"},
                   "rolloutcore replay: --until '18446744073709551615': seq 18446744073709551615 "
                   "lies past the journal's head (seq 6): nothing is recorded there");
  const CliRun whole = RunCli({"replay", dir.path()}, /*with_stderr=*/true);
  EXPECT_EQ(whole.exit_code, 0) << whole.out;
  EXPECT_NE(whole.out.find("last seq 6\n"), std::string::npos) << whole.out;
  EXPECT_EQ(whole.out.find("until:"), std::string::npos) << whole.out;
}

// Proves `audit --expect-head` reads its seq by the same rule (digits only, 1 to 2^64-1, leading
// zeros fine) and refuses an empty text, quoting the text typed, catching the 19-digit cap that
// refused a seq with leading zeros as "seq must be >= 1" and an empty --expect-head that skipped
// the check and audited OK.
TEST(CliArgs, AuditExpectHeadSeqIsReadStrictly) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 2);
  const std::string hash = journal::HashHex(HashOf(dir.path(), 5));
  std::vector<std::string> refused = kNotWholeNumbers;
  refused.push_back("0");
  for (const std::string& seq : refused) {
    const std::string spec = seq + ":" + hash;
    ExpectUsageError({"audit", dir.path(), "--expect-head", spec},
                     "rolloutcore audit: --expect-head: '" + text::escape_line(spec) +
                         "' is not SEQ:HEXHASH (seq '" + text::escape_line(seq) +
                         "' is not a whole number from 1 to 18446744073709551615 (digits only))");
  }
  ExpectUsageError({"audit", dir.path(), "--expect-head", ""},
                   "rolloutcore audit: --expect-head: '' is not SEQ:HEXHASH (missing ':')");
  const CliRun zeros =
      RunCli({"audit", dir.path(), "--expect-head", "00000000000000000000005:" + hash}, true);
  EXPECT_EQ(zeros.exit_code, 0) << zeros.out;
  EXPECT_NE(zeros.out.find("expected head: OK: seq 5 hash " + hash), std::string::npos)
      << zeros.out;
}

// Proves `audit --logprob-tolerance` (and its alias --tolerance) takes a finite decimal number
// >= 0 (0.25, 1e-3, 0, 2) and refuses NaN, infinities, signs, hex floats, spaces and values no
// double holds as a usage error quoting the text, catching CLI11's conversion, which took " 0.5"
// and "0x1p-3" and refused the rest with exit 105 and the text unescaped.
TEST(CliArgs, AuditLogprobToleranceIsReadStrictly) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 1);
  for (const std::string option : {"--logprob-tolerance", "--tolerance"}) {
    for (const std::string typed : {"nan", "-nan", "inf", "-0.5", "+0.5", "x", "0x1p-3", " 0.5",
                                    "0.5 ", ".5", "5.", "1e", "1e999", "1e-999", "", "0.5\n"}) {
      ExpectUsageError({"audit", dir.path(), option, typed},
                       "rolloutcore audit: --logprob-tolerance: '" + text::escape_line(typed) +
                           "' is not a finite number >= 0 written in decimal (such as 0.5 or "
                           "1e-3)");
    }
  }
  for (const std::string typed : {"0.25", "1e-3", "0", "2"}) {
    const CliRun run = RunCli({"audit", dir.path(), "--logprob-tolerance", typed}, true);
    EXPECT_EQ(run.exit_code, 0) << typed << ": " << run.out;
    EXPECT_NE(run.out.find("\naudit: OK\n"), std::string::npos) << typed << ": " << run.out;
  }
}

// Proves `audit`'s text options and `replay`'s and `audit`'s journal refuse an empty text, and
// audit's a text that is no value of its kind (a rollout id or engine name past 128 bytes or with
// a line break, an engine URL without http:// or a host), as a usage error quoting it before the
// journal is read, while a good one is taken. Catches `--rollout ''`, `--trajectories ''`,
// `--engine ''` and `--fleet-engine ''` read as the option left out: the whole journal audited,
// exit 0, as if nobody had asked for a rollout's provenance or an engine's re-scoring.
TEST(CliArgs, TextOptionsGivenAreNeverReadAsLeftOut) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 1);
  const std::string id = "' is not an id: 1 to 128 bytes of printable UTF-8";
  const std::string url =
      "' is not an http:// or https:// URL naming a host (printable ASCII, no spaces)";
  const std::string path = "'' is not a path (an empty one names nothing)";
  const std::string engine = "http://127.0.0.1:1";
  const std::string long_id(129, 'r');
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"audit", dir.path(), "--rollout", ""}, "audit: --rollout: '" + id},
      {{"audit", dir.path(), "--rollout", "r0\nr1"}, "audit: --rollout: 'r0\nr1" + id},
      {{"audit", dir.path(), "--rollout", long_id}, "audit: --rollout: '" + long_id + id},
      {{"audit", dir.path(), "--trajectories", ""}, "audit: --trajectories: " + path},
      {{"audit", dir.path(), "--engine", ""}, "audit: --engine: '" + url},
      {{"audit", dir.path(), "--engine", "127.0.0.1:8000"},
       "audit: --engine: '127.0.0.1:8000" + url},
      {{"audit", dir.path(), "--engine", "http://"}, "audit: --engine: 'http://" + url},
      {{"audit", dir.path(), "--engine", "http://a b"}, "audit: --engine: 'http://a b" + url},
      {{"audit", dir.path(), "--engine", engine, "--fleet-engine", ""},
       "audit: --fleet-engine: '" + id},
      {{"audit", ""}, "audit: journal: " + path},
      {{"replay", ""}, "replay: journal: " + path}};
  for (const auto& [args, why] : refused) {
    ExpectUsageError(args, "rolloutcore " + text::escape_line(why));
  }
  const CliRun provenance = RunCli({"audit", dir.path(), "--rollout", "r0"}, true);
  EXPECT_EQ(provenance.exit_code, 0) << provenance.out;
  EXPECT_NE(provenance.out.find("\"rollout_id\": \"r0\""), std::string::npos) << provenance.out;
}

// Proves a command line CLI11 itself refuses for replay or audit (an option without its value or
// given twice, an unknown option holding a line break, no journal) exits 2 with nothing on stdout
// and one escaped line on stderr naming the command, while --help still exits 0, catching
// CLI11's own exit codes (106, 109, 114) and its raw, multi-line message.
TEST(CliArgs, CommandLinesCli11RefusesExitAsUsageErrors) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 1);
  const std::vector<std::vector<std::string>> refused = {
      {"replay", dir.path(), "--until"},
      {"replay", dir.path(), "--until", "3", "--until", "4"},
      {"replay"},
      {"audit", dir.path(), "--tolerance"},
      {"audit", dir.path(), "--bogus\nverification: OK"},
      {"audit"}};
  cli_testing::ExpectCli11Refusals(refused,
                                   {{"replay", "--until"}, {"audit", "--logprob-tolerance"}});
}

// Proves a usage error quoting a value typed (replay --until, audit --expect-head,
// --logprob-tolerance, --rollout) prints it as one escaped line whose quoted field a reader takes
// whole when the value holds quotes, a line break and a control byte: each quote doubled, the rest
// escaped, the message's own words after the field. Catches the value put between bare quotes,
// where its own quote ended the field and the rest of it read as the message's words.
TEST(CliArgs, AValueTypedIsOneQuotedFieldOfOneLine) {
  TempDir dir;
  WriteCleanJournal(dir.path(), 1);
  const std::string typed = "7' is fine\n'\x1b[2K";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"replay", dir.path(), "--until", typed}, "rolloutcore replay: --until: "},
      {{"audit", dir.path(), "--expect-head", typed}, "rolloutcore audit: --expect-head: "},
      {{"audit", dir.path(), "--logprob-tolerance", typed},
       "rolloutcore audit: --logprob-tolerance: "},
      {{"audit", dir.path(), "--rollout", typed}, "rolloutcore audit: --rollout: "}};
  for (const auto& [args, before] : cases) {
    const CliRun out = RunCli(args, /*with_stderr=*/true);
    EXPECT_EQ(out.exit_code, 2) << text::escape_line(out.out);
    const std::vector<std::string> lines = Lines(out.out);
    ASSERT_EQ(lines.size(), 1u) << text::escape_line(out.out);
    ASSERT_EQ(lines[0].rfind(before, 0), 0u) << lines[0];
    std::size_t pos = before.size();
    EXPECT_EQ(quoting_testing::ReadQuoted(lines[0], pos), text::escape_line(typed)) << lines[0];
    EXPECT_EQ(lines[0].substr(pos, 8), " is not ") << lines[0];
  }
}

}  // namespace
}  // namespace rc
