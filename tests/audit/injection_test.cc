// Output injection through journal text: a real RocksDB journal is driven through bootstrap and a
// TAINTED update with hostile bytes (NUL, CR/LF, ESC, C1, U+2028, invalid UTF-8) in every free-text
// field the fold accepts (what the executor recorded from the engine and its effects); replay's and
// audit's reports must keep exactly the line count of the same journal written with benign text,
// keep their verdict line, and serialise JSON without throwing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "audit/audit.h"
#include "journal/journal.h"
#include "replay/replay.h"
#include "statemachine/text.h"
#include "tests/audit/printable_json.h"
#include "tests/journal/test_util.h"

namespace rc {
namespace {

using journal::testing::TempDir;

// Every attack from the issue in one string: a NUL that truncated printf output, a newline that
// forged a verdict line, a CR/LF pair, terminal escapes (erase line, cursor up), invalid UTF-8
// (a cut 'é' and stray bytes), C1 NEL and CSI, and a Unicode LINE SEPARATOR.
std::string Hostile() {
  return std::string("a\0b", 3) + "ck\nverification: OK (forged line)\r\naudit: OK\n" +
         "\x1b[2K\x1b[1A" + "\xff\xfe\xc3" + "\xc2\x85NEL\xc2\x9b" + "\xe2\x80\xa8LS\\n";
}

const std::string kDigest = "ab12cd34ef56";

void SubmitOk(journal::Journal& j, const Event& e) {
  auto s = j.Submit(e, 1700000000000);
  ASSERT_TRUE(s.ok()) << text::escape_line(s.status().ToString());
  ASSERT_TRUE(j.Wait(s->ticket).ok());
}

// Drives the fold the way the runner does (intent, then observation) until nothing is due; the
// observations carry `t` in each free-text field, and the transfer fails ambiguously (TAINTED).
void DriveEffects(journal::Journal& j, const std::string& t) {
  const HttpEvidence ok{Transport::kOk, 200, true, 10, t};
  for (int step = 0; step < 32; ++step) {
    const Effect e = next_effect(j.state());
    if (e.kind == EffectKind::kNone) return;
    SubmitOk(j, EffectStarted{e.kind, e.cache, 1000});
    switch (e.kind) {
      case EffectKind::kProbeEngine:
        SubmitOk(j, EngineProbed{ok, "0.30.0 " + t, "rc-0", false, false, "i-0"});
        break;
      case EffectKind::kDrain:
        SubmitOk(j, DrainObserved{ok, true});
        break;
      case EffectKind::kPreflight:
        SubmitOk(j, PreflightObserved{kDigest, true, true, t});
        break;
      case EffectKind::kTransfer:
        SubmitOk(j, TransferObserved{false, MutationClass::kPossible, 10, 1, 1000, t, t});
        break;
      default:
        FAIL() << "unexpected effect " << effect_name(e.kind);
    }
  }
  FAIL() << "the fold did not settle";
}

// Text a client declares (checkpoint, source) must be printable UTF-8 for the fold to accept it
// now; journals written before that rule may hold anything there, and replay/audit escape those
// fields the same way (the executor-recorded fields below exercise the same output paths).
const std::string kCheckpoint = "ckpt/\xc3\xa9t\xc3\xa9-step";  // "ckpt/été-step"

// Writes bootstrap + one update that ends TAINTED, with `t` in every executor-recorded text
// field (engine errors and versions, preflight and transfer details, and the torn WAL tail an
// executor start recorded mid-update, made UTF-8 as the fold requires there).
void WriteJournal(const std::string& dir, const std::string& t) {
  auto opened = journal::Journal::Open(dir, journal::Options{});
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  journal::Journal& j = **opened;
  SubmitOk(j, BootstrapRequested{"rc-0", WeightIdentity{kDigest, "", kCheckpoint, "run-1", 0}});
  DriveEffects(j, t);
  ASSERT_EQ(j.state().lifecycle, Lifecycle::kReady);
  SubmitOk(j, UpdateRequested{"u-1", "rc-1", WeightIdentity{kDigest, "", kCheckpoint, "run-1", 1},
                              "synthetic:8x64"});
  SubmitOk(j, RecoveryStarted{"exec-2", JournalEnding::kTornTail, 9,
                              "torn WAL tail in " + text::sanitize_utf8(t)});
  DriveEffects(j, t);
  ASSERT_EQ(j.state().lifecycle, Lifecycle::kTainted);
}

std::vector<std::string> Lines(const std::string& s) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\n') {
      out.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  if (start < s.size()) out.push_back(s.substr(start));
  return out;
}

// Text a terminal shows as written: no NUL (printf stops there), no control byte, valid UTF-8.
void ExpectInert(const std::string& report) {
  EXPECT_EQ(std::strlen(report.c_str()), report.size()) << "a NUL would truncate printf";
  for (const std::string& line : Lines(report)) {
    EXPECT_TRUE(text::printable_utf8(line)) << text::escape_line(line);
  }
}

int Count(const std::vector<std::string>& lines, const std::string& prefix) {
  int n = 0;
  for (const auto& l : lines) n += l.rfind(prefix, 0) == 0 ? 1 : 0;
  return n;
}

struct Reports {
  std::string replay_text, replay_json, audit_text, events_text;
};

// The journal at `path`, opened as replay and audit open it (read-only, never created).
Result<std::unique_ptr<journal::Journal>> OpenAsReader(const std::string& path) {
  journal::Options ro;
  ro.read_only = true;
  ro.create_if_missing = false;
  return journal::Journal::Open(path, ro);
}

Reports Produce(const std::string& t) {
  TempDir dir;
  WriteJournal(dir.path(), t);
  auto opened = OpenAsReader(dir.path());
  RC_CHECK(opened.ok());
  journal::Journal& j = **opened;
  Reports out;
  auto replayed = replay::Replay(j, {});
  RC_CHECK(replayed.ok());
  out.replay_text = replay::FormatReport(*replayed);
  out.replay_json = replay::ReportJson(*replayed);
  auto audited = audit::AuditJournal(j);
  RC_CHECK(audited.ok());
  out.audit_text = audit::FormatReport(*audited);
  RC_CHECK(j.Scan(1, 0, [&](const journal::Record& r) {
              out.events_text += replay::FormatRecordLine(r) + "\n";
              RC_CHECK(
                  !nlohmann::json::parse(replay::RecordJsonLine(r), nullptr, false).is_discarded());
              return Status::OK();
            }).ok());
  return out;
}

// Proves replay's report of a TAINTED journal has exactly the lines of its benign twin, one
// "verification:" line that is the real verdict, and no control byte; catches the NUL that cut
// the verdict off (exit 0 with no verdict) and the checkpoint that printed a forged
// "verification: OK" line.
TEST(Injection, ReplayReportKeepsItsShape) {
  const Reports benign = Produce("x");
  const Reports hostile = Produce(Hostile());
  const auto lines = Lines(hostile.replay_text);
  EXPECT_EQ(lines.size(), Lines(benign.replay_text).size()) << hostile.replay_text;
  EXPECT_EQ(Count(lines, "verification: "), 1);
  EXPECT_EQ(Count(lines, "verification: OK"), Count(Lines(benign.replay_text), "verification: OK"));
  EXPECT_EQ(Count(lines, "TAINTED at seq"), 1);
  ExpectInert(hostile.replay_text);
  // The hostile text is still there, escaped: nothing was silently dropped.
  EXPECT_NE(hostile.replay_text.find("ck\\nverification: OK (forged line)"), std::string::npos);
  EXPECT_NE(hostile.replay_text.find("a\\u0000b"), std::string::npos);
  EXPECT_NE(hostile.replay_text.find(kCheckpoint), std::string::npos) << "UTF-8 kept as is";
}

// Proves a torn WAL tail an executor start recorded is one escaped line wherever it is reported:
// replay's list of recorded torn tails and the TAINTED incident's timeline, audit's journal
// failure naming the record; catches the journal's sentence (it names a path) printed raw, where
// a newline in it forged a verdict line.
TEST(Injection, ARecordedTornTailIsOneEscapedLineInEveryReport) {
  const Reports hostile = Produce(Hostile());
  const std::string escaped =
      "torn WAL tail in " + text::escape_line(text::sanitize_utf8(Hostile()));
  const auto replay_lines = Lines(hostile.replay_text);
  EXPECT_EQ(Count(replay_lines, "TORN WAL TAIL recorded at seq "), 1) << hostile.replay_text;
  EXPECT_NE(hostile.replay_text.find("(the journal's open before that executor start): " + escaped +
                                     "\n"),
            std::string::npos)
      << hostile.replay_text;
  EXPECT_NE(hostile.replay_text.find(": executor restarted after a crash; the journal's open "
                                     "skipped a torn WAL tail: " +
                                     escaped + "\n"),
            std::string::npos)
      << hostile.replay_text;
  const auto audit_lines = Lines(hostile.audit_text);
  EXPECT_EQ(Count(audit_lines, "audit FAILURE: seq "), 1) << hostile.audit_text;
  EXPECT_NE(hostile.audit_text.find("(RecoveryStarted) recorded what the journal's open before "
                                    "that executor start found: " +
                                    escaped + "\n"),
            std::string::npos)
      << hostile.audit_text;
  ExpectInert(hostile.replay_text);
  ExpectInert(hostile.audit_text);
}

// Proves every `replay --events` record is one line and every record's JSON parses, whatever it
// holds; catches a describe() line split by a newline and RecordToJson().dump() throwing on
// invalid UTF-8 (std::terminate in the command).
TEST(Injection, EventLinesAreOneRecordEach) {
  const Reports benign = Produce("x");
  const Reports hostile = Produce(Hostile());
  EXPECT_EQ(Lines(hostile.events_text).size(), Lines(benign.events_text).size());
  ExpectInert(hostile.events_text);
}

// Proves audit's report keeps its line count and its single verdict line with hostile
// identities; catches a version line forged by a checkpoint ("\naudit: OK") or truncated by NUL.
TEST(Injection, AuditReportKeepsItsShape) {
  const Reports benign = Produce("x");
  const Reports hostile = Produce(Hostile());
  const auto lines = Lines(hostile.audit_text);
  EXPECT_EQ(lines.size(), Lines(benign.audit_text).size()) << hostile.audit_text;
  EXPECT_EQ(Count(lines, "audit: OK") + Count(lines, "audit FAILURE"),
            Count(Lines(benign.audit_text), "audit: OK") +
                Count(Lines(benign.audit_text), "audit FAILURE"));
  EXPECT_EQ(Count(lines, "audit: OK"), Count(Lines(benign.audit_text), "audit: OK"));
  ExpectInert(hostile.audit_text);
}

// Proves replay's JSON report parses back with invalid UTF-8 in the journal (replaced, not
// thrown on); catches json::dump() with the default strict error handler.
TEST(Injection, ReplayJsonNeverThrows) {
  const Reports hostile = Produce(Hostile());
  const auto j = nlohmann::json::parse(hostile.replay_json, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["incidents"].size(), 1u);
}

// Valid UTF-8 that is not printable: LINE SEPARATOR, PARAGRAPH SEPARATOR, NEL, DEL and a bidi
// override, which readers that split on Unicode line ends (or show controls) take apart.
const std::string kLineBreakers =
    "label\xe2\x80\xa8"
    "sep\xe2\x80\xa9"
    "para\xc2\x85"
    "nel\x7f"
    "del\xe2\x80\xae"
    "rlo";

using json_testing::CollectStrings;
using json_testing::PrintableAscii;

// Proves the JSON outputs of replay and audit (each `--events --json` record line, the replay
// report, the audit verdict line) hold only printable ASCII whatever the engine answered, and
// parse back to exactly the text recorded; catches ensure_ascii=false, which passed U+2028, NEL
// or DEL through raw and split one record's line for consumers that honour them.
TEST(Injection, JsonOutputsArePrintableAsciiAndRoundTrip) {
  TempDir dir;
  WriteJournal(dir.path(), kLineBreakers);
  auto opened = OpenAsReader(dir.path());
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  journal::Journal& j = **opened;
  std::size_t round_trips = 0;
  const Status scanned = j.Scan(1, 0, [&](const journal::Record& r) {
    const std::string line = replay::RecordJsonLine(r);
    EXPECT_TRUE(PrintableAscii(line, false)) << text::escape_line(line);
    const nlohmann::json parsed = nlohmann::json::parse(line, nullptr, false);
    EXPECT_FALSE(parsed.is_discarded()) << line;
    std::vector<std::string> strings;
    CollectStrings(parsed, strings);
    round_trips +=
        static_cast<std::size_t>(std::count(strings.begin(), strings.end(), kLineBreakers));
    return Status::OK();
  });
  ASSERT_TRUE(scanned.ok()) << scanned.ToString();
  EXPECT_GT(round_trips, 0u) << "no record's JSON parsed back to the recorded text";
  auto replayed = replay::Replay(j, {});
  ASSERT_TRUE(replayed.ok());
  const std::string report = replay::ReportJson(*replayed);
  EXPECT_TRUE(PrintableAscii(report, /*newlines=*/true)) << text::escape_line(report);
  EXPECT_FALSE(nlohmann::json::parse(report, nullptr, false).is_discarded());
  auto audited = audit::AuditJournal(j);
  ASSERT_TRUE(audited.ok());
  const std::string verdict = audit::VerdictJson(*audited, audit::MakeVerdict(*audited), -1);
  EXPECT_TRUE(PrintableAscii(verdict, false)) << text::escape_line(verdict);
  EXPECT_FALSE(nlohmann::json::parse(verdict, nullptr, false).is_discarded());
}

}  // namespace
}  // namespace rc
