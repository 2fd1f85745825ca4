// Replay and audit of colocated journals (real RocksDB, no engine): sleeps and wake-ups are plans
// that keep the committed version, so they are counted and explained as such, never as updates,
// and their UpdateEnded records are not update episodes. The trainer's ids and labels stay inside
// their quotes on replay's lines, and one shell word in the restore command it suggests.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "audit/audit.h"
#include "journal/journal.h"
#include "replay/replay.h"
#include "statemachine/text.h"
#include "tests/audit/quoting.h"
#include "tests/journal/test_util.h"
#include "tests/statemachine/helpers.h"

namespace rc {
namespace {

using journal::testing::TempDir;
using test::digest_of;
using test::identity;

constexpr std::uint64_t kGiB = 1ull << 30;
const HttpEvidence kOk{Transport::kOk, 200, true, 10, ""};

// What the scripted engine answers to the colocated effects; every other effect succeeds.
struct EngineScript {
  HttpEvidence sleep = kOk;
  DeviceMemory sleep_memory{true, 10 * kGiB, 70 * kGiB, 80 * kGiB};
  HttpEvidence wake_weights = kOk;
  DeviceMemory wake_weights_memory{true, 70 * kGiB, 54 * kGiB, 80 * kGiB};
  DeviceMemory wake_kv_memory{true, 54 * kGiB, 10 * kGiB, 80 * kGiB};
};

// The weights each label names on this engine (the restore must find rc-1's again).
WeightDigest DigestOf(const std::string& label) {
  return digest_of(label == "rc-0" ? "111" : "222");
}

// Drives a real journal the way the runner does: each input submitted at a later wall time, and
// every effect next_effect() names answered by the scripted engine until nothing is due.
class Writer {
 public:
  explicit Writer(journal::Journal& j) : j_(j) {}

  void Submit(const Event& e) {
    wall_ms_ += 10;
    auto s = j_.Submit(e, wall_ms_);
    ASSERT_TRUE(s.ok()) << text::escape_line(describe(e) + ": " + s.status().ToString());
    ASSERT_TRUE(j_.Wait(s->ticket).ok());
  }

  std::int64_t wall_ms() const { return wall_ms_; }

  // What the executor's engine monitor journals when it sees a change (here: in SLEEPING).
  void Monitor(const std::string& instance, bool paused, std::int64_t last_ok_wall_ms) {
    EngineMonitored m{kOk, j_.state().committed.label, true, paused, instance, last_ok_wall_ms};
    m.updates_seen = monitor_epoch(j_.state());
    Submit(m);
  }

  void Drive(const EngineScript& engine = {}) {
    for (int step = 0; step < 64; ++step) {
      const Effect e = next_effect(j_.state());
      if (e.kind == EffectKind::kNone) return;
      Submit(EffectStarted{e.kind, e.cache, 1000, e.wake});
      Submit(Observe(e, engine));
    }
    FAIL() << "the fold did not settle: " << describe(j_.state());
  }

  void Bootstrap() {
    Submit(BootstrapRequested{"rc-0", identity('a', 0)});
    Drive();
    ASSERT_EQ(j_.state().lifecycle, Lifecycle::kReady);
  }

  void Rollout(const std::string& id) {
    Submit(make_admission(j_.state(), id));
    Submit(RolloutFinished{id, RolloutOutcome::kCompleted, 3, 5});
  }

  void Sleep(const std::string& id, const EngineScript& engine = {}) {
    Submit(SleepRequested{id, 1});
    Drive(engine);
  }

  // The trainer's next step written straight into the sleeping engine (same manifest).
  void UpdateFromSleep(const std::string& id, const std::string& label) {
    ASSERT_EQ(j_.state().lifecycle, Lifecycle::kSleeping);
    Submit(UpdateRequested{id, label, identity('a', 2), "vllm-ipc:/run/rc/step-2.json"});
    Drive();
  }

 private:
  Event Observe(const Effect& e, const EngineScript& engine) const {
    const State s = j_.state();
    switch (e.kind) {
      case EffectKind::kProbeEngine: {
        EngineProbed p{kOk, "0.25.1", s.bootstrap->label, true, false, "i-1"};
        p.digest = DigestOf(s.bootstrap->label);
        return p;
      }
      case EffectKind::kDrain:
        return DrainObserved{kOk, true};
      case EffectKind::kPreflight:
        return PreflightObserved{s.update->identity.manifest_digest, true, true, "fits"};
      case EffectKind::kTransfer:
        return TransferObserved{true, MutationClass::kComplete, 1 << 20, 3,
                                5000, s.update->target.label,   ""};
      case EffectKind::kResetCache:
        return CacheResetObserved{e.cache, kOk, true};
      case EffectKind::kValidate: {
        ValidationObserved v{kOk, s.update->target.label, true, "", "i-1", {}, true, true};
        v.digest = DigestOf(s.update->target.label);
        return v;
      }
      case EffectKind::kResume:
        return ResumeObserved{kOk, true, false, s.engine_instance};
      case EffectKind::kSleep: {
        const bool asleep = engine.sleep.ok_2xx();
        return SleepObserved{engine.sleep, s.update->sleep_level, asleep, asleep,
                             engine.sleep_memory};
      }
      case EffectKind::kWake:
        if (e.wake == WakeTag::kWeights) {
          return WakeObserved{engine.wake_weights, e.wake, false, true, engine.wake_weights_memory};
        }
        return WakeObserved{kOk, e.wake, true, false, engine.wake_kv_memory, s.engine_instance};
      default:
        ADD_FAILURE() << "unexpected effect " << effect_name(e.kind);
        return DrainTimedOut{};
    }
  }

  journal::Journal& j_;
  std::int64_t wall_ms_ = 1000;
};

journal::Journal& Open(std::unique_ptr<journal::Journal>& holder, const std::string& dir) {
  auto opened = journal::Journal::Open(dir, journal::Options{});
  RC_CHECK(opened.ok());
  holder = std::move(opened.value());
  return *holder;
}

struct Outputs {
  replay::ReplayReport replay;
  std::string replay_text;
  audit::AuditReport audit;
  audit::AuditOutput audit_out;
};

// Replays and audits `dir` read-only, as the CLI does.
Outputs Read(const std::string& dir) {
  journal::Options ro;
  ro.read_only = true;
  ro.create_if_missing = false;
  auto opened = journal::Journal::Open(dir, ro);
  RC_CHECK(opened.ok());
  Outputs out;
  auto replayed = replay::Replay(**opened, {});
  RC_CHECK(replayed.ok());
  out.replay = std::move(replayed.value());
  out.replay_text = replay::FormatReport(out.replay);
  auto audited = audit::AuditJournal(**opened);
  RC_CHECK(audited.ok());
  out.audit = std::move(audited.value());
  out.audit_out = audit::RenderAudit(out.audit, audit::MakeVerdict(out.audit), "J");
  return out;
}

std::vector<std::string> Lines(const std::string& s) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\n') continue;
    out.push_back(s.substr(start, i - start));
    start = i + 1;
  }
  if (start < s.size()) out.push_back(s.substr(start));
  return out;
}

// The lines of `text` that start with `prefix`.
std::vector<std::string> Starting(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  for (const std::string& l : Lines(text)) {
    if (l.rfind(prefix, 0) == 0) out.push_back(l);
  }
  return out;
}

// The names a trainer chose in the loop below: the label of its update (the one restored after the
// taint), the id of the sleep that fails and the id of the restore.
struct LoopNames {
  std::string label = "rc-1";
  std::string failed_sleep = "s-3";
  std::string restore = "x-1";
};

// The colocated trainer loop with every kind of plan: bootstrap, a rollout, a sleep, an update
// from SLEEPING, a rollout, a sleep, a level-1 wake-up, a rollout, a sleep that fails with a 500
// (TAINTED, sleep_failed), a restore with proof (which wakes the engine first), a rollout.
void WriteTrainerLoop(const std::string& dir, const LoopNames& names = {}) {
  std::unique_ptr<journal::Journal> holder;
  Writer w(Open(holder, dir));
  w.Bootstrap();
  w.Rollout("r0");
  w.Sleep("s-1");
  w.UpdateFromSleep("u-1", names.label);
  w.Rollout("r1");
  w.Sleep("s-2");
  w.Submit(WakeRequested{"w-1"});
  w.Drive();
  w.Rollout("r2");
  EngineScript fails;
  fails.sleep = HttpEvidence{Transport::kOk, 500, true, 10, "out of memory"};
  w.Sleep(names.failed_sleep, fails);
  ASSERT_EQ(holder->state().lifecycle, Lifecycle::kTainted);
  w.Submit(RestoreRequested{names.restore, names.label, "vllm-ipc:/run/rc/step-2.json"});
  w.Drive();
  ASSERT_EQ(holder->state().lifecycle, Lifecycle::kReady);
  w.Rollout("r3");
}

// Proves replay counts sleeps and wake-ups apart from updates and gives each sleep, wake-up and
// update or restore from SLEEPING exactly one line with its level, its memory and its outcome;
// catches a replay that counts a sleep (or a wake-up) as an update, or drops a sleep's line.
TEST(ColocatedReplay, SleepsAndWakeUpsAreCountedApartFromUpdates) {
  TempDir dir;
  WriteTrainerLoop(dir.path());
  const Outputs o = Read(dir.path());
  ASSERT_TRUE(o.replay.ok) << o.replay.error;
  const Counters& c = o.replay.state.counters;
  EXPECT_EQ(c.updates_requested, 1u);
  EXPECT_EQ(c.updates_committed, 1u);
  EXPECT_EQ(c.sleeps_requested, 3u);
  EXPECT_EQ(c.wakes_committed, 1u);
  EXPECT_EQ(Starting(o.replay_text, "rollouts: "),
            std::vector<std::string>{
                "rollouts: admitted 4, completed 4, aborted 0, abandoned 0; updates: requested 1, "
                "committed 1, refused 0; restores: requested 1, proven 1; sleeps: requested 3, "
                "committed 2; wake-ups: requested 1, committed 1; recoveries 0"})
      << o.replay_text;
  const std::vector<std::string> expected = {
      "SLEEP 's-1' (seq 7-15): level 1; its workers reported 60.00 GiB freed (device free 10.00 "
      "-> 70.00 of 80.00 GiB); committed: asleep on 'rc-0' (generation 0)",
      "UPDATE FROM SLEEP 'u-1' (seq 16-40): from level 1; weights: 16.00 GiB taken back (device "
      "free 70.00 -> 54.00 of 80.00 GiB), KV cache: 44.00 GiB taken back (device free 54.00 -> "
      "10.00 of 80.00 GiB); committed: published 'rc-1' (generation 1)",
      "SLEEP 's-2' (seq 43-51): level 1; its workers reported 60.00 GiB freed (device free 10.00 "
      "-> 70.00 of 80.00 GiB); committed: asleep on 'rc-1' (generation 1)",
      "WAKE-UP 'w-1' (seq 52-70): from level 1; weights: 16.00 GiB taken back (device free 70.00 "
      "-> 54.00 of 80.00 GiB), KV cache: 44.00 GiB taken back (device free 54.00 -> 10.00 of "
      "80.00 GiB); committed: 'rc-1' (generation 1) proven again, serving",
      "SLEEP 's-3' (seq 73-81): level 1; its workers reported 60.00 GiB freed (device free 10.00 "
      "-> 70.00 of 80.00 GiB); tainted: sleep at level 1 may have released memory: "
      "transport=ok status=500 error=out of memory (see TAINTED at seq 81)",
      "RESTORE FROM SLEEP 'x-1' (seq 82-111): from level 1; weights: 16.00 GiB taken back (device "
      "free 70.00 -> 54.00 of 80.00 GiB), KV cache: 44.00 GiB taken back (device free 54.00 -> "
      "10.00 of 80.00 GiB); committed: published 'rc-1' (generation 2)",
  };
  std::vector<std::string> steps;
  for (const replay::ColocatedStep& step : o.replay.colocated) steps.push_back(step.line);
  EXPECT_EQ(steps, expected);
  std::vector<std::string> printed;
  for (const std::string& l : Lines(o.replay_text)) {
    for (const char* kind : {"SLEEP ", "WAKE-UP ", "UPDATE FROM SLEEP ", "RESTORE FROM SLEEP "}) {
      if (l.rfind(kind, 0) == 0) printed.push_back(l);
    }
  }
  EXPECT_EQ(printed, expected) << o.replay_text;
  EXPECT_EQ(o.replay.colocated_count, 6u);
  EXPECT_EQ(o.replay.incidents.size(), 1u);
  ASSERT_EQ(o.replay.restores.size(), 1u);
  const auto json = nlohmann::json::parse(replay::ReportJson(o.replay), nullptr, false);
  ASSERT_FALSE(json.is_discarded());
  EXPECT_EQ(json["colocated"].size(), 6u);
  EXPECT_EQ(json["colocated"][3]["kind"], "wake-up");
}

// Proves a replay that stops inside a sleep names it in flight instead of inventing an outcome;
// catches a sleep whose line is dropped (or reported committed) when --until cuts it.
TEST(ColocatedReplay, SleepInFlightWhereReplayStops) {
  TempDir dir;
  WriteTrainerLoop(dir.path());
  journal::Options ro;
  ro.read_only = true;
  ro.create_if_missing = false;
  auto opened = journal::Journal::Open(dir.path(), ro);
  ASSERT_TRUE(opened.ok());
  auto report = replay::Replay(**opened, replay::ReplayOptions{11});  // s-1 reached QUIESCED
  ASSERT_TRUE(report.ok());
  ASSERT_TRUE(report->ok) << report->error;
  ASSERT_EQ(report->colocated.size(), 1u);
  EXPECT_EQ(report->colocated[0].line,
            "SLEEP 's-1' (seq 7-): level 1; /sleep never answered; in flight where replay "
            "stopped (QUIESCED)");
  EXPECT_EQ(report->colocated[0].end_seq, 0u);
}

// Each seq's decision group: the seq of its input and the seq of the group's last record.
struct GroupSpan {
  std::uint64_t input = 0;
  std::uint64_t end = 0;
};

// The group of every seq of `j`, indexed by seq (entry 0 unused), from a full scan.
std::vector<GroupSpan> GroupSpans(journal::Journal& j) {
  std::vector<GroupSpan> spans(1);
  const Status scanned = j.Scan(1, 0, [&](const journal::Record& r) {
    const std::uint64_t input = r.cause_seq == 0 ? r.seq : r.cause_seq;
    for (std::uint64_t seq = input; seq < r.seq; ++seq) spans[seq].end = r.seq;
    spans.push_back(GroupSpan{input, r.seq});
    return Status::OK();
  });
  RC_CHECK(scanned.ok());
  return spans;
}

// Proves `replay --until S` verifies a healthy colocated journal for every S, an input or a
// decision before its group's last included: it folds through the end of S's group (the state a
// refold to that end gives), names the group, and the sleep that group ends gets its whole line.
// Catches the cut group reported as "non-determinism: decide() derives N decisions for seq S but
// M were recorded", which also dropped the colocated lines, and a seq past the head reported as a
// verification failure instead of refused.
TEST(ColocatedReplay, UntilAnySeqFoldsThroughTheEndOfItsGroup) {
  TempDir dir;
  WriteTrainerLoop(dir.path());
  journal::Options ro;
  ro.read_only = true;
  ro.create_if_missing = false;
  auto opened = journal::Journal::Open(dir.path(), ro);
  ASSERT_TRUE(opened.ok());
  journal::Journal& j = **opened;
  const std::vector<GroupSpan> spans = GroupSpans(j);
  for (std::uint64_t seq = 1; seq < spans.size(); ++seq) {
    auto report = replay::Replay(j, replay::ReplayOptions{seq});
    ASSERT_TRUE(report.ok()) << seq << ": " << report.status().ToString();
    ASSERT_TRUE(report->ok) << "--until " << seq << ": " << report->error;
    EXPECT_EQ(report->last_seq, spans[seq].end) << seq;
    EXPECT_EQ(report->until.input_seq, spans[seq].input) << seq;
    Result<State> refolded = j.Refold(spans[seq].end);
    ASSERT_TRUE(refolded.ok()) << refolded.status().ToString();
    EXPECT_EQ(report->state, *refolded) << seq;
    if (seq >= 7 && seq <= 15) {
      EXPECT_EQ(report->colocated.size(), 1u) << seq;  // s-1, in flight or ended
    }
  }
  const GroupSpan ends_s1 = spans[15];  // the group whose last transition ends s-1 (seq 7-15)
  ASSERT_LT(ends_s1.input, 15u);
  ASSERT_EQ(ends_s1.end, 15u);
  auto report = replay::Replay(j, replay::ReplayOptions{ends_s1.input});
  ASSERT_TRUE(report.ok());
  ASSERT_EQ(report->colocated.size(), 1u);
  EXPECT_EQ(report->colocated[0].end_seq, 15u) << report->colocated[0].line;
  const std::string in = std::to_string(ends_s1.input);
  const std::string text = replay::FormatReport(*report);
  EXPECT_NE(text.find("\nuntil: seq " + in + " lies inside the group of input seq " + in +
                      " (seqs " + in +
                      "-15), which decide() derived and the journal wrote whole: "
                      "folded through seq 15"),
            std::string::npos)
      << text;
  auto past = replay::Replay(j, replay::ReplayOptions{spans.size()});
  ASSERT_FALSE(past.ok()) << replay::FormatReport(*past);
  EXPECT_EQ(past.status().code(), Code::kInvalidArgument);
  EXPECT_NE(past.status().message().find("past the journal's head (seq " +
                                         std::to_string(spans.size() - 1) + ")"),
            std::string::npos)
      << past.status().message();
}

// Proves the sleep_failed incident reads as a sleep (its plan line, the /sleep evidence, a reading
// and a recover hint saying the restore wakes the engine first) and the restore says it woke it;
// catches a sleep's taint explained as an update that "targeted" a version, or with no reading.
TEST(ColocatedReplay, SleepFailedTaintIsExplained) {
  TempDir dir;
  WriteTrainerLoop(dir.path());
  const Outputs o = Read(dir.path());
  ASSERT_EQ(o.replay.incidents.size(), 1u);
  EXPECT_EQ(o.replay.incidents[0].update_id, "s-3");
  EXPECT_EQ(Lines(o.replay.incidents[0].explanation),
            (std::vector<std::string>{
                "TAINTED at seq 81 from QUIESCED (sleep_failed): sleep at level 1 may have "
                "released memory: transport=ok status=500 error=out of memory",
                "  sleep 's-3' at level 1 kept 'rc-1' (generation 1), the committed version (a "
                "sleep publishes nothing)",
                "  seq 78: sleep intent durable (deadline 1000 ms) - from here on the engine may "
                "release its memory",
                "  seq 79: sleep at level 1 answered http 500 10us error=out of memory, "
                "is_sleeping unknown; 60.00 GiB freed (device free 10.00 -> 70.00 of 80.00 GiB)",
                "  reading: the sleep may have released the engine's memory without it reporting "
                "asleep (vLLM unmaps before its last check can fail); what its weights and KV "
                "cache hold is unknown until proven.",
                "  nothing was published and no rollout was admitted after this point.",
                "  recover: restore it with proof, e.g. `rolloutcore restore --label=rc-1 "
                "--source <where its weights are>`: the engine may be asleep (level 1), so the "
                "restore wakes it fully (weights, then KV cache) before it drains and reloads (or "
                "--adopt: "
                "the weights it wakes with are proven as found); it serves again only if its "
                "weight digest equals the recorded one."}));
  const std::vector<std::string> restored = Lines(o.replay.restores[0].explanation);
  ASSERT_EQ(restored.size(), 4u) << o.replay.restores[0].explanation;
  EXPECT_EQ(restored[2],
            "  the engine was tainted asleep (level 1): the restore woke it fully (weights, then "
            "KV cache) before its drain, then reloaded and validated it paused");
  EXPECT_EQ(restored[3], "  it ends the TAINTED incident at seq 81");
}

// Proves a wake-up whose /wake_up of the weights timed out is explained as a wake-up (line,
// reading, recover hint naming the sleep level); catches a wake_failed taint with no reading.
TEST(ColocatedReplay, WakeFailedTaintIsExplained) {
  TempDir dir;
  {
    std::unique_ptr<journal::Journal> holder;
    Writer w(Open(holder, dir.path()));
    w.Bootstrap();
    w.Sleep("s-1");
    w.Submit(WakeRequested{"w-1"});
    EngineScript timeout;
    timeout.wake_weights = HttpEvidence{Transport::kTimeout, 0, false, 10, "deadline"};
    w.Drive(timeout);
    ASSERT_EQ(holder->state().lifecycle, Lifecycle::kTainted);
  }
  const Outputs o = Read(dir.path());
  ASSERT_TRUE(o.replay.ok) << o.replay.error;
  ASSERT_EQ(o.replay.colocated.size(), 2u);
  EXPECT_EQ(o.replay.colocated[1].line,
            "WAKE-UP 'w-1' (seq 14-19): from level 1; weights: not woken, KV cache: not woken; "
            "tainted: wake-up of the weights may have mapped or overwritten them: "
            "transport=timeout status=0 error=deadline (see TAINTED at seq 19)");
  ASSERT_EQ(o.replay.incidents.size(), 1u);
  const std::vector<std::string> lines = Lines(o.replay.incidents[0].explanation);
  EXPECT_EQ(lines[1],
            "  wake-up 'w-1' from level 1 kept 'rc-0' (generation 0), the committed version (a "
            "wake-up publishes nothing)");
  EXPECT_EQ(Starting(o.replay.incidents[0].explanation, "  reading: "),
            std::vector<std::string>{
                "  reading: the wake-up of the weights did not answer cleanly, so they may be "
                "mapped again (after level 1, overwritten by the host copy) or still asleep; what "
                "the engine holds is unknown until proven."});
  EXPECT_EQ(Starting(o.replay.incidents[0].explanation, "  recover: ").size(), 1u);
  EXPECT_NE(lines.back().find("the engine may be asleep (level 1)"), std::string::npos)
      << lines.back();
}

// Proves an engine resumed behind RolloutCore's back while asleep is explained from the sleep it
// was in (no plan in flight, the sleep's seq and id) with its own reading; catches an engine
// taint printed as "update ''" or without a reading.
TEST(ColocatedReplay, EngineWokenExternallyIsExplained) {
  TempDir dir;
  {
    std::unique_ptr<journal::Journal> holder;
    Writer w(Open(holder, dir.path()));
    w.Bootstrap();
    w.Sleep("s-1");
    w.Monitor("i-1", /*paused=*/false, w.wall_ms());
    ASSERT_EQ(holder->state().lifecycle, Lifecycle::kTainted);
  }
  const Outputs o = Read(dir.path());
  ASSERT_EQ(o.replay.incidents.size(), 1u);
  const std::vector<std::string> lines = Lines(o.replay.incidents[0].explanation);
  ASSERT_EQ(lines.size(), 5u) << o.replay.incidents[0].explanation;
  EXPECT_EQ(lines[0],
            "TAINTED at seq 15 from SLEEPING (engine_woken_externally): the sleeping engine was "
            "resumed outside RolloutCore");
  EXPECT_EQ(lines[1],
            "  no update in flight; committed version 'rc-0' (generation 0), asleep at level 1 "
            "since seq 13 (sleep 's-1')");
  EXPECT_EQ(lines[2],
            "  reading: someone resumed the sleeping engine outside RolloutCore; it would serve "
            "from memory it had released to the trainer, so nothing it holds can be claimed.");
  EXPECT_NE(lines[4].find("the restore wakes it fully"), std::string::npos) << lines[4];
  // The audit names it as the engine's taint (no plan), with nothing suspect: the monitor saw the
  // verified engine after every rollout finished.
  EXPECT_EQ(o.audit.engine.taint_plan, "");
  EXPECT_EQ(o.audit.engine.suspect_count, 0u);
  EXPECT_EQ(o.audit_out.exit_code, audit::kExitEngineUnhealthy);
}

// Proves a hostile engine error recorded by a failing sleep stays inside its lines: the replay
// and audit reports have the line count of a benign twin and no control byte; catches a sleep
// line or a sleep reading that prints outside text raw (a "\n" forging a verdict line).
TEST(ColocatedReplay, OutsideTextNeverBreaksASleepLine) {
  const std::string hostile = std::string("a\0b", 3) + "\nverification: OK\r\n\x1b[2K\xff";
  auto produce = [](const std::string& error) {
    TempDir dir;
    {
      std::unique_ptr<journal::Journal> holder;
      Writer w(Open(holder, dir.path()));
      w.Bootstrap();
      EngineScript fails;
      fails.sleep = HttpEvidence{Transport::kOk, 500, true, 10, error};
      w.Sleep("s-1", fails);
    }
    return Read(dir.path());
  };
  const Outputs benign = produce("x");
  const Outputs forged = produce(hostile);
  EXPECT_EQ(Lines(forged.replay_text).size(), Lines(benign.replay_text).size())
      << forged.replay_text;
  EXPECT_EQ(Lines(forged.audit_out.text).size(), Lines(benign.audit_out.text).size());
  EXPECT_EQ(Starting(forged.replay_text, "SLEEP ").size(), 1u);
  EXPECT_EQ(Starting(forged.replay_text, "verification: ").size(), 1u);
  for (const std::string& text : {forged.replay_text, forged.audit_out.text}) {
    for (const std::string& l : Lines(text)) EXPECT_TRUE(text::printable_utf8(l)) << l;
  }
}

// Proves the audit of the whole colocated loop passes: the sleeps' and the wake-up's UpdateEnded
// are not update episodes (counts, no finding), rollouts stay bound to the version the sleep kept,
// and the restore is named as such; catches an audit that flags (or counts) a sleep's
// UpdateEnded as an update's, e.g. the tainted sleep as a tainted update.
TEST(ColocatedAudit, SleepEndsAreNotUpdateEpisodes) {
  TempDir dir;
  WriteTrainerLoop(dir.path());
  const Outputs o = Read(dir.path());
  EXPECT_TRUE(o.audit.ok) << o.audit_out.text;
  EXPECT_TRUE(o.audit.failures.empty());
  EXPECT_EQ(o.audit_out.exit_code, audit::kExitOk) << o.audit_out.text;
  const HistorySummary& s = o.audit.history.summary;
  EXPECT_EQ(s.updates_requested, 1u);
  EXPECT_EQ(s.updates_committed, 2u);  // u-1 and the restore x-1
  EXPECT_EQ(s.updates_tainted, 0u);    // s-3 ended tainted: a sleep, not an update
  EXPECT_EQ(s.sleeps_committed, 2u);
  EXPECT_EQ(Starting(o.audit_out.text, "updates: "),
            std::vector<std::string>{"updates: requested 1 (+ restores 1); committed 2, refused "
                                     "0, tainted 0 (restores included); recoveries 0"});
  EXPECT_EQ(Starting(o.audit_out.text, "sleeps: "),
            std::vector<std::string>{"sleeps: requested 3, committed 2; wake-ups: requested 1, "
                                     "committed 1 (they keep the committed version)"});
  ASSERT_EQ(o.audit.versions.size(), 3u);  // bootstrap, u-1, the restore: no sleep publishes
  EXPECT_EQ(o.audit.versions[1].update_id, "u-1");
  EXPECT_EQ(o.audit.versions[1].rollouts_admitted, 2u);  // r1 before s-2, r2 after the wake-up
  EXPECT_TRUE(o.audit.versions[2].restore);
  EXPECT_EQ(Starting(o.audit_out.text, "  rc-1 (generation 2) ")[0].find("restore 'x-1' at seq"),
            std::string("  rc-1 (generation 2) ").size());
  EXPECT_EQ(Starting(o.audit_out.text, "restored: "),
            std::vector<std::string>{"restored: seq 111: READY again after a restore; it ends "
                                     "the taint at seq 81 (sleep_failed, sleep 's-3')"});
  journal::Options ro;
  ro.read_only = true;
  ro.create_if_missing = false;
  auto opened = journal::Journal::Open(dir.path(), ro);
  ASSERT_TRUE(opened.ok());
  auto r2 = audit::Provenance(**opened, "r2");  // admitted after the wake-up
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(r2->version.version, (WeightVersion{1, "rc-1"}));
  EXPECT_EQ(r2->version.update_id, "u-1");
}

// Proves a journal left TAINTED by a sleep names the sleep in the verdict (not an update) and
// makes nothing suspect (the sleep drained every rollout first); catches a sleep's taint called
// an update's, or one that opens a window over rollouts the verified engine served.
TEST(ColocatedAudit, SleepTaintNamesTheSleep) {
  TempDir dir;
  {
    std::unique_ptr<journal::Journal> holder;
    Writer w(Open(holder, dir.path()));
    w.Bootstrap();
    w.Rollout("r0");
    EngineScript fails;
    fails.sleep = HttpEvidence{Transport::kTimeout, 0, false, 10, "deadline"};
    w.Sleep("s-1", fails);
  }
  const Outputs o = Read(dir.path());
  EXPECT_TRUE(o.audit.ok) << o.audit_out.text;
  EXPECT_EQ(o.audit.engine.taint_plan, "sleep");
  EXPECT_EQ(o.audit.engine.suspect_count, 0u);
  EXPECT_TRUE(o.audit.engine.unexplained_taints.empty());
  EXPECT_EQ(Starting(o.audit_out.text, "audit ENGINE: "),
            std::vector<std::string>{
                "audit ENGINE: the engine is TAINTED since seq 15 (QUIESCED -> TAINTED, cause "
                "sleep_failed, sleep 's-1': sleep at level 1 may have released memory: "
                "transport=timeout status=0 error=deadline)"});
  EXPECT_EQ(o.audit_out.exit_code, audit::kExitEngineUnhealthy);
}

// Proves another engine process found while asleep makes the rollouts that finished after the
// monitor's last sight of the verified engine (before the sleep) suspect, and only those;
// catches an audit that ignores taints from SLEEPING, which would clear rollouts the replaced
// engine may have served before the sleep drained it.
TEST(ColocatedAudit, EngineReplacedWhileAsleepOpensTheWindow) {
  TempDir dir;
  std::int64_t last_ok_wall_ms = 0;
  {
    std::unique_ptr<journal::Journal> holder;
    Writer w(Open(holder, dir.path()));
    w.Bootstrap();
    w.Rollout("before");
    last_ok_wall_ms = w.wall_ms() + 5;
    w.Rollout("after");
    w.Sleep("s-1");
    w.Monitor("i-2", /*paused=*/true, last_ok_wall_ms);
    ASSERT_EQ(holder->state().lifecycle, Lifecycle::kTainted);
  }
  const Outputs o = Read(dir.path());
  EXPECT_TRUE(o.audit.ok) << o.audit_out.text;
  const audit::EngineHealth& e = o.audit.engine;
  EXPECT_EQ(e.taint_cause, Cause::kEngineReplaced);
  EXPECT_EQ(e.taint_from, Lifecycle::kSleeping);
  EXPECT_TRUE(e.window_known);
  EXPECT_EQ(e.window_start_wall_ms, last_ok_wall_ms);
  ASSERT_EQ(e.suspect.size(), 1u) << o.audit_out.text;
  EXPECT_EQ(e.suspect[0].rollout_id, "after");
}

// The quoted fields of `line` as a report reader reads them (a doubled quote is one quote), where
// the line is literals[0], a field, literals[1], a field, ..., the last literal, then anything;
// where the line departs from that shape, one last entry says so.
std::vector<std::string> QuotedFields(const std::string& line,
                                      const std::vector<std::string>& literals) {
  std::vector<std::string> fields;
  std::size_t pos = 0;
  for (std::size_t i = 0; i < literals.size(); ++i) {
    if (line.compare(pos, literals[i].size(), literals[i]) != 0) {
      fields.push_back("(departs at: " + line.substr(pos) + ")");
      return fields;
    }
    pos += literals[i].size();
    if (i + 1 == literals.size()) return fields;
    const std::optional<std::string> field = quoting_testing::ReadQuoted(line, pos);
    if (!field) {
      fields.push_back("(no field at: " + line.substr(pos) + ")");
      return fields;
    }
    fields.push_back(*field);
  }
  return fields;
}

// `line` from the first `from` on ("" when absent).
std::string From(const std::string& line, const std::string& from) {
  const std::size_t at = line.find(from);
  return at == std::string::npos ? std::string() : line.substr(at);
}

// Proves the restore command replay suggests for a TAINTED engine hands the shell the committed
// label as exactly one argument (quotes, `;`, `|`, `$(...)` and a backslash included), joined to
// `--label=` so that a label beginning with `-` is the option's value, in the text report and in
// --json's incidents[].explanation; catches the label printed between bare single quotes, where
// `'; CMD; '` in a trainer's label ran CMD when the operator ran the command, and a label printed
// as a word of its own after `--label`, where a parser may take `--adopt` for an option.
TEST(ReplayQuoting, TheSuggestedRestoreCommandTakesTheLabelAsOneArgument) {
  for (const std::string label :
       {"rc-7'; echo INJECTED \\x $(echo sub) | cat; echo '", "--adopt"}) {
    LoopNames names;
    names.label = label;
    TempDir dir;
    WriteTrainerLoop(dir.path(), names);
    const Outputs o = Read(dir.path());
    ASSERT_TRUE(o.replay.ok) << o.replay.error;
    ASSERT_EQ(o.replay.incidents.size(), 1u);
    const auto json = nlohmann::json::parse(replay::ReportJson(o.replay), nullptr, false);
    ASSERT_FALSE(json.is_discarded());
    const std::string open = "`rolloutcore restore ";
    const std::string close = " --source <where its weights are>`";
    for (const std::string& explanation :
         {o.replay.incidents[0].explanation,
          json["incidents"][0]["explanation"].get<std::string>()}) {
      const std::vector<std::string> recover = Starting(explanation, "  recover: ");
      ASSERT_EQ(recover.size(), 1u) << explanation;
      const std::size_t from = recover[0].find(open);
      const std::size_t to = recover[0].find(close);
      ASSERT_NE(from, std::string::npos) << recover[0];
      ASSERT_NE(to, std::string::npos) << recover[0];
      ASSERT_LT(from + open.size(), to) << recover[0];
      const std::string option = recover[0].substr(from + open.size(), to - from - open.size());
      EXPECT_EQ(quoting_testing::ShellWords(option), std::vector<std::string>{"--label=" + label})
          << recover[0];
    }
  }
}

// Proves an id or label holding `' took the engine back to '` stays inside its quotes on each
// replay line that names it (the restore's proof, the colocated steps, the incident's plan line),
// read back whole by a reader that takes a doubled quote as one, with the line's own words after
// it; catches ids printed between bare quotes, where a restore id forged the version it restored.
TEST(ReplayQuoting, AQuoteInAnIdCannotForgeTheLine) {
  LoopNames names;
  names.label = "rc-1' (generation 9) 'rc-good";
  names.failed_sleep = "s-3' at level 2 kept 'rc-good";
  names.restore = "x-1' took the engine back to 'rc-good";
  TempDir dir;
  WriteTrainerLoop(dir.path(), names);
  const Outputs o = Read(dir.path());
  ASSERT_TRUE(o.replay.ok) << o.replay.error;
  ASSERT_EQ(o.replay.restores.size(), 1u);
  const std::vector<std::string> restored = Lines(o.replay.restores[0].explanation);
  ASSERT_GE(restored.size(), 2u) << o.replay.restores[0].explanation;
  EXPECT_EQ(
      QuotedFields(From(restored[0], ": restore "),
                   {": restore ", " took the engine back to ", " (generation 2, checkpoint "}),
      (std::vector<std::string>{names.restore, names.label}))
      << restored[0];
  EXPECT_EQ(QuotedFields(From(restored[1], " recorded when "), {" recorded when ", " was served;"}),
            std::vector<std::string>{names.label})
      << restored[1];
  ASSERT_EQ(o.replay.incidents.size(), 1u);
  const std::vector<std::string> incident = Lines(o.replay.incidents[0].explanation);
  ASSERT_GE(incident.size(), 2u) << o.replay.incidents[0].explanation;
  EXPECT_EQ(QuotedFields(incident[1], {"  sleep ", " at level 1 kept ",
                                       " (generation 1), the committed version"}),
            (std::vector<std::string>{names.failed_sleep, names.label}))
      << incident[1];
  std::vector<std::string> steps;
  for (const replay::ColocatedStep& step : o.replay.colocated) {
    if (step.plan_id == names.failed_sleep) {
      steps.push_back(step.line);
      EXPECT_EQ(QuotedFields(step.line, {"SLEEP ", " (seq "}),
                std::vector<std::string>{names.failed_sleep})
          << step.line;
    } else if (step.plan_id == names.restore) {
      steps.push_back(step.line);
      EXPECT_EQ(QuotedFields(step.line, {"RESTORE FROM SLEEP ", " (seq "}),
                std::vector<std::string>{names.restore})
          << step.line;
      EXPECT_EQ(QuotedFields(From(step.line, "; committed: published "),
                             {"; committed: published ", " (generation 2)"}),
                std::vector<std::string>{names.label})
          << step.line;
    }
  }
  EXPECT_EQ(steps.size(), 2u);
}

}  // namespace
}  // namespace rc
