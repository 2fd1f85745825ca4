// Tests of the offline audit: integrity and history verdicts, provenance queries, and
// token/logprob re-verification of trajectories against the vLLM test double over loopback.
#include <gtest/gtest.h>

#include <httplib.h>

#include <fstream>
#include <thread>

#include "audit/audit.h"
#include "tests/integration/harness.h"

namespace rc::itest {
namespace {

// A greedy trajectory generated on the double under the committed version.
audit::Trajectory Generate(Executor& x, const std::string& id, const std::string& prompt) {
  auto a = x.Admit(id);
  RC_CHECK(a.ok());
  nlohmann::json req = {{"prompt", prompt},
                        {"max_tokens", 12},
                        {"temperature", 0},
                        {"logprobs", 0},
                        {"return_token_ids", true}};
  auto reply = x.client->Completions(req);
  RC_CHECK(reply.http.ok_2xx());
  RC_CHECK(x.Finish(id, reply.body).ok());
  const auto& c = reply.body["choices"][0];
  audit::Trajectory t;
  t.rollout_id = id;
  t.version = a->version;
  t.identity = a->identity;
  t.admission_seq = x.journal->RolloutSeqs(id).value().front();
  for (const auto& v : c["prompt_token_ids"]) t.prompt.push_back(v.get<int>());
  for (const auto& v : c["token_ids"]) t.output.push_back(v.get<int>());
  for (const auto& v : c["logprobs"]["token_logprobs"]) t.logprobs.push_back(v.get<double>());
  return t;
}

// Journals one greedy rollout generated on the double as the proxy does: its admission, its
// trajectory as one TrajectoryRecorded part, its finish.
void JournalTrajectory(Executor& x, const std::string& id, const std::string& prompt) {
  ASSERT_TRUE(x.Admit(id).ok());
  const nlohmann::json req = {{"prompt", prompt},
                              {"max_tokens", 12},
                              {"temperature", 0},
                              {"logprobs", 0},
                              {"return_token_ids", true}};
  const effects::HttpReply reply = x.client->Completions(req);
  ASSERT_TRUE(reply.http.ok_2xx()) << reply.http.error;
  const auto& c = reply.body["choices"][0];
  TrajectoryRecorded part{id, 0, {}, {}, {}};
  for (const auto& v : c["prompt_token_ids"]) part.prompt_token_ids.push_back(v.get<int>());
  for (const auto& v : c["token_ids"]) part.output_token_ids.push_back(v.get<int>());
  for (const auto& v : c["logprobs"]["token_logprobs"]) {
    part.output_logprobs.push_back(v.get<float>());
  }
  auto s = x.journal->Submit(part, WallMs());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(x.journal->Wait(s->ticket).ok());
  ASSERT_TRUE(x.Finish(id, reply.body).ok());
}

// Submits one trajectory part of rollout `id` (the rollout must be open).
void SubmitPart(Executor& x, const std::string& id, std::uint32_t part,
                std::vector<std::int32_t> output) {
  TrajectoryRecorded t{id, part,
                       part == 0 ? std::vector<std::int32_t>{1, 2} : std::vector<std::int32_t>{},
                       output, std::vector<float>(output.size(), -0.5f)};
  auto s = x.journal->Submit(t, WallMs());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(x.journal->Wait(s->ticket).ok());
}

// Proves a journal written by real update cycles audits clean, with one version record per
// committed generation and per-version rollout counts; would catch an audit that misses a
// published version or attributes rollouts to the wrong one.
TEST(Audit, CleanJournalAndVersionTable) {
  Executor x;
  x.Bootstrap();
  Generate(x, "r0", "first prompt");
  ASSERT_TRUE(x.runner->Update(Update("u-1", "rc-1", 10)).ok());
  Generate(x, "r1", "second prompt");
  Generate(x, "r2", "third prompt");
  auto report = audit::AuditJournal(*x.journal);
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok) << audit::FormatReport(*report);
  ASSERT_EQ(report->versions.size(), 2u);
  EXPECT_EQ(report->versions[0].version.label, "rc-0");
  EXPECT_EQ(report->versions[0].rollouts_admitted, 1u);
  EXPECT_EQ(report->versions[1].version.label, "rc-1");
  EXPECT_EQ(report->versions[1].update_id, "u-1");
  EXPECT_EQ(report->versions[1].identity.step, 10);
  EXPECT_EQ(report->versions[1].rollouts_finished, 2u);
}

// Proves provenance names the binding, the finish and the update that published the rollout's
// generation; would catch provenance that reports the version served now instead of the one
// the rollout ran under.
TEST(Audit, ProvenanceOfARollout) {
  Executor x;
  x.Bootstrap();
  Generate(x, "old", "prompt");
  ASSERT_TRUE(x.runner->Update(Update("u-1", "rc-1", 7)).ok());
  Generate(x, "new", "prompt");
  auto old_p = audit::Provenance(*x.journal, "old");
  ASSERT_TRUE(old_p.ok()) << old_p.status().ToString();
  EXPECT_EQ(old_p->binding.version.label, "rc-0");
  EXPECT_TRUE(old_p->version.update_id.empty());
  ASSERT_TRUE(old_p->finish.has_value());
  EXPECT_GT(old_p->finished_seq, old_p->admitted_seq);
  auto new_p = audit::Provenance(*x.journal, "new");
  ASSERT_TRUE(new_p.ok());
  EXPECT_EQ(new_p->version.update_id, "u-1");
  EXPECT_EQ(new_p->version.identity.step, 7);
  EXPECT_LT(new_p->version.published_seq, new_p->admitted_seq);
  EXPECT_EQ(audit::Provenance(*x.journal, "nobody").status().code(), Code::kNotFound);
}

// Proves re-scoring a true greedy trajectory on an engine serving its version reproduces every
// logprob and top-1 token, while a tampered logprob, a tampered token, or an engine serving
// another version are reported; would catch a re-verifier that passes anything.
TEST(Audit, ReverifyTrajectoriesAgainstTheEngine) {
  Executor x;
  x.Bootstrap();
  audit::Trajectory t = Generate(x, "r", "the policy wrote this");
  audit::ReverifyResult ok = audit::Reverify(*x.client, t, 1e-9, /*greedy=*/true);
  EXPECT_TRUE(ok.checked) << ok.detail;
  EXPECT_TRUE(ok.ok) << ok.detail;
  EXPECT_EQ(ok.tokens, t.output.size());

  audit::Trajectory lp = t;
  *lp.logprobs[3] += 0.05;
  audit::ReverifyResult bad_lp = audit::Reverify(*x.client, lp, 1e-3, true);
  EXPECT_TRUE(bad_lp.checked);
  EXPECT_FALSE(bad_lp.ok);
  EXPECT_EQ(bad_lp.logprob_mismatches, 1u);

  audit::Trajectory tok = t;
  tok.output[5] = tok.output[5] == 'a' ? 'b' : 'a';
  audit::ReverifyResult bad_tok = audit::Reverify(*x.client, tok, 1e-3, true);
  EXPECT_FALSE(bad_tok.ok);
  EXPECT_GE(bad_tok.not_top1 + bad_tok.logprob_mismatches, 1u);

  ASSERT_TRUE(x.runner->Update(Update("u-1", "rc-1", 1)).ok());
  audit::ReverifyResult other = audit::Reverify(*x.client, t, 1e-9, true);
  EXPECT_FALSE(other.checked);
  EXPECT_NE(other.detail.find("rc-1"), std::string::npos) << other.detail;
}

// Proves trajectory files are parsed strictly (line numbers in errors) and cross-checked
// against the journal's bindings; would catch a trajectory that claims a version the journal
// never bound it to.
TEST(Audit, TrajectoryFileCrossCheck) {
  Executor x;
  x.Bootstrap();
  audit::Trajectory t = Generate(x, "r", "prompt");
  const std::string path = x.dir + "/trajectories.jsonl";
  {
    std::ofstream out(path);
    auto line = [](const audit::Trajectory& tr, const std::string& label) {
      nlohmann::json lps = nlohmann::json::array();
      for (const auto& lp : tr.logprobs) lps.push_back(lp ? nlohmann::json(*lp) : nlohmann::json());
      return nlohmann::json{
          {"rollout_id", tr.rollout_id},
          {"admission_seq", tr.admission_seq},
          {"version", {{"generation", tr.version.generation}, {"label", label}}},
          {"identity",
           {{"manifest_digest", tr.identity.manifest_digest},
            {"content_digest", tr.identity.content_digest},
            {"checkpoint", tr.identity.checkpoint},
            {"run", tr.identity.run},
            {"step", tr.identity.step}}},
          {"prompt_token_ids", tr.prompt},
          {"outputs", {{{"index", 0}, {"token_ids", tr.output}, {"logprobs", lps}}}}}
          .dump();
    };
    out << line(t, "rc-0") << "\n" << line(t, "rc-forged") << "\n";
  }
  auto loaded = audit::LoadTrajectories(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), 2u);
  EXPECT_EQ((*loaded)[0].output, t.output);
  auto failures = audit::CrossCheckTrajectories(*x.journal, *loaded);
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].find("rc-forged"), std::string::npos) << failures[0];

  { std::ofstream(path, std::ios::app) << "{not json\n"; }
  auto broken = audit::LoadTrajectories(path);
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find(":3:"), std::string::npos) << broken.status().message();
}

// Proves the audit reads the line serve writes for a rollout that ended before any token (its
// client left: prompt_token_ids null, outputs empty); would catch the audit refusing the
// product's own trajectories file (exit 2) as soon as one rollout was aborted.
TEST(Audit, TrajectoryLineOfAnAbortedRolloutIsRead) {
  Executor x;
  x.Bootstrap();
  audit::Trajectory t = Generate(x, "r", "prompt");
  const std::string path = x.dir + "/aborted.trajectories.jsonl";
  {
    std::ofstream out(path);
    out << nlohmann::json{{"rollout_id", "r"},
                          {"admission_seq", t.admission_seq},
                          {"version", {{"generation", 0}, {"label", "rc-0"}}},
                          {"outcome", "aborted"},
                          {"prompt_token_ids", nullptr},
                          {"outputs",
                           nlohmann::json::array({{{"index", 0}, {"token_ids", nullptr}}})}}
               .dump()
        << "\n";
  }
  auto loaded = audit::LoadTrajectories(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->size(), 1u);
  EXPECT_TRUE((*loaded)[0].prompt.empty());
  EXPECT_TRUE((*loaded)[0].output.empty());
}

// Proves a trajectory line whose fields have the wrong type or range is refused with its line
// number, never an exception; would catch `audit --trajectories` terminating on an uncaught
// nlohmann::type_error (a hand-edited or damaged file) instead of exiting with a clear error.
TEST(Audit, WronglyTypedTrajectoryLinesAreRefusedNotThrown) {
  Executor x;
  const std::string path = x.dir + "/typed.trajectories.jsonl";
  for (const char* line : {
           R"({"rollout_id": 7, "admission_seq": 1})",
           R"({"rollout_id": "r", "admission_seq": "1"})",
           R"({"rollout_id": "r", "admission_seq": -1})",
           R"({"rollout_id": "r", "admission_seq": 1, "version": 3})",
           R"({"rollout_id": "r", "admission_seq": 1, "version": {"label": 5}})",
           R"({"rollout_id": "r", "admission_seq": 1, "identity": {"step": "x"}})",
           R"({"rollout_id": "r", "admission_seq": 1, "prompt_token_ids": [1, 4294967296]})",
           R"({"rollout_id": "r", "admission_seq": 1, "prompt_token_ids": [1.5]})",
           R"({"rollout_id": "r", "admission_seq": 1, "outputs": [{"token_ids": ["a"]}]})",
       }) {
    {
      std::ofstream(path) << R"({"rollout_id": "ok", "admission_seq": 2})"
                          << "\n"
                          << line << "\n";
    }
    Result<std::vector<audit::Trajectory>> loaded = audit::LoadTrajectories(path);
    ASSERT_FALSE(loaded.ok()) << line;
    EXPECT_NE(loaded.status().message().find(":2:"), std::string::npos)
        << line << ": " << loaded.status().message();
  }
}

// Proves `audit --engine`'s digest check: the engine's digest is compared with the one journaled
// for the label it reports; would catch weights changed outside RolloutCore reading as healthy,
// and an engine that computes no digest passing a journal that records them.
TEST(Audit, EngineDigestAgainstTheJournal) {
  State s;
  s.committed = WeightVersion{1, "rc-1"};
  s.committed_digest.algorithm = "rcd1";
  s.committed_digest.combined = std::string(32, 'b');
  s.committed_digest.tensors = {{"w", std::string(32, '1')}};
  s.label_digests = {{"rc-0", std::string(32, 'a')}, {"rc-1", std::string(32, 'b')}};
  WeightDigest live = s.committed_digest;
  audit::DigestCheck ok = audit::CheckEngineDigest(s, "rc-1", live);
  EXPECT_EQ(ok.result, audit::DigestCheck::Result::kMatch);
  EXPECT_TRUE(ok.findings.empty());

  live.combined = std::string(32, 'c');
  live.tensors = {{"w", std::string(32, '2')}};
  audit::DigestCheck drift = audit::CheckEngineDigest(s, "rc-1", live);
  EXPECT_EQ(drift.result, audit::DigestCheck::Result::kDrift);
  ASSERT_EQ(drift.findings.size(), 1u);
  EXPECT_NE(drift.line.find("1 of 1 tensors differ: w"), std::string::npos) << drift.line;

  live.combined = std::string(32, 'a');  // rc-0's bytes under the label rc-1
  EXPECT_EQ(audit::CheckEngineDigest(s, "rc-1", live).result, audit::DigestCheck::Result::kDrift);
  audit::DigestCheck foreign = audit::CheckEngineDigest(s, "intruder", live);
  EXPECT_NE(foreign.line.find("are those of 'rc-0'"), std::string::npos) << foreign.line;

  WeightDigest none;
  none.error = "no extension";
  EXPECT_EQ(audit::CheckEngineDigest(s, "rc-1", none).result,
            audit::DigestCheck::Result::kUnavailable);
  EXPECT_FALSE(audit::CheckEngineDigest(s, "rc-1", none).findings.empty());
  EXPECT_TRUE(audit::CheckEngineDigest(State{}, "rc-1", none).findings.empty());
}

// Proves trajectories journaled as TrajectoryRecorded parts come back joined in order with
// their journal binding, re-verify against the engine, and that a tampered part fails; would
// catch a part lost or reordered, or a trajectory detached from its binding.
TEST(Audit, TrajectoriesFromTheJournal) {
  Executor x;
  x.Bootstrap();
  audit::Trajectory t = Generate(x, "r-live", "journaled trajectory prompt");
  // Generate() finished the rollout; record a second one with its trajectory in two parts, as
  // the proxy does, before its finish.
  auto a = x.Admit("r-j");
  ASSERT_TRUE(a.ok());
  std::vector<float> lps;
  for (const auto& lp : t.logprobs) lps.push_back(static_cast<float>(*lp));
  const std::size_t half = t.output.size() / 2;
  TrajectoryRecorded p0{"r-j", 0, t.prompt,
                        std::vector<std::int32_t>(t.output.begin(), t.output.begin() + half),
                        std::vector<float>(lps.begin(), lps.begin() + half)};
  TrajectoryRecorded p1{"r-j",
                        1,
                        {},
                        std::vector<std::int32_t>(t.output.begin() + half, t.output.end()),
                        std::vector<float>(lps.begin() + half, lps.end())};
  for (const auto& part : {p0, p1}) {
    auto s = x.journal->Submit(part, WallMs());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE(x.journal->Wait(s->ticket).ok());
  }
  ASSERT_TRUE(x.Finish("r-j", nlohmann::json::object()).ok());
  auto ts = audit::TrajectoriesFromJournal(*x.journal);
  ASSERT_TRUE(ts.ok()) << ts.status().ToString();
  ASSERT_EQ(ts->size(), 1u);
  const audit::Trajectory& got = (*ts)[0];
  EXPECT_EQ(got.rollout_id, "r-j");
  EXPECT_EQ(got.prompt, t.prompt);
  EXPECT_EQ(got.output, t.output);
  EXPECT_EQ(got.version.label, "rc-0");
  EXPECT_EQ(got.admission_seq, x.journal->RolloutSeqs("r-j").value().front());
  audit::ReverifyResult ok = audit::Reverify(*x.client, got, 1e-5, /*greedy=*/true);
  EXPECT_TRUE(ok.checked && ok.ok) << ok.detail;
  audit::Trajectory tampered = got;
  *tampered.logprobs[half] -= 0.5;
  EXPECT_FALSE(audit::Reverify(*x.client, tampered, 1e-5, true).ok);
  auto seqs = x.journal->RolloutSeqs("r-j");
  EXPECT_EQ(seqs->size(), 4u);  // admitted, two trajectory parts, finished
}

// Proves the re-verification's report: every rollout re-scored against the double it ran on is
// OK with its figures (tokens compared, top-1 matches, |diff| 0) and the totals add up, while a
// doctored trajectory (one logprob moved by 10x the tolerance) is reported FAILED under its
// rollout id, counted over tolerance, and becomes the one engine finding; would catch a report
// that hides which rollout failed, totals that disagree with the rollouts, or an OK summary
// over a failure.
TEST(Audit, ReverifyReportsEachRolloutAndTheTotals) {
  Executor x;
  x.Bootstrap();
  std::vector<audit::Trajectory> ts = {Generate(x, "r-a", "first rollout"),
                                       Generate(x, "r-b", "second rollout"),
                                       Generate(x, "r-c", "third rollout")};
  const audit::ReverifySummary clean = audit::ReverifyAll(*x.client, ts, 1e-3, /*greedy=*/true);
  EXPECT_EQ(clean.checked, 3u);
  EXPECT_EQ(clean.failed, 0u);
  EXPECT_EQ(clean.over_tolerance, 0u);
  EXPECT_EQ(clean.tokens, 36u);
  EXPECT_EQ(clean.compared, 36u);
  EXPECT_EQ(clean.top1, 36u);
  EXPECT_EQ(clean.max_abs_diff, 0.0);
  EXPECT_TRUE(clean.verified());
  EXPECT_TRUE(audit::ReverifyFindings(clean).empty());
  EXPECT_EQ(audit::FormatReverify(clean.rollouts[1]),
            "REVERIFY 'r-b': OK: 12 tokens compared, top-1 12 of 12 (required), max |diff| 0, "
            "mean |diff| 0 (tolerance 0.001)");
  EXPECT_EQ(audit::FormatReverifySummary(clean, "http://e"),
            "re-verification against http://e: 3 of 3 rollouts checked (0 skipped), 36 tokens "
            "compared, top-1 36 of 36 (required), max |diff| 0, mean |diff| 0 (tolerance 0.001): "
            "0 rollouts over tolerance, 0 failed: OK");

  *ts[1].logprobs[4] -= 0.01;
  const audit::ReverifySummary doctored = audit::ReverifyAll(*x.client, ts, 1e-3, true);
  EXPECT_EQ(doctored.checked, 3u);
  EXPECT_EQ(doctored.failed, 1u);
  EXPECT_EQ(doctored.over_tolerance, 1u);
  EXPECT_NEAR(doctored.max_abs_diff, 0.01, 1e-12);
  EXPECT_NEAR(doctored.mean_abs_diff(), 0.01 / 36, 1e-12);
  EXPECT_FALSE(doctored.verified());
  EXPECT_TRUE(doctored.rollouts[0].ok && doctored.rollouts[2].ok);
  const std::string line = audit::FormatReverify(doctored.rollouts[1]);
  EXPECT_EQ(line.rfind("REVERIFY 'r-b': FAILED: ", 0), 0u) << line;
  EXPECT_NE(line.find("; 1 over tolerance"), std::string::npos) << line;
  const std::string summary = audit::FormatReverifySummary(doctored, "http://e");
  EXPECT_NE(summary.find("1 rollouts over tolerance, 1 failed: FAILED"), std::string::npos)
      << summary;
  const std::vector<std::string> findings = audit::ReverifyFindings(doctored);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_NE(findings[0].find("rollout 'r-b' failed"), std::string::npos) << findings[0];
  const nlohmann::json j = audit::ReverifyJson(doctored);
  EXPECT_EQ(j["rollouts"][1]["rollout_id"], "r-b");
  EXPECT_EQ(j["rollouts"][1]["over_tolerance"], 1);
  EXPECT_EQ(j["verified"], false);
}

// Proves "0 checked" never reads as verified: no trajectories, or none the engine can score
// (it serves another version), give NOTHING VERIFIED and, when some were offered, a finding;
// and a token without a recorded logprob fails unless the greedy top-1 check verifies it; would
// catch an audit that prints OK over nothing compared.
TEST(Audit, NothingComparedIsNeverOk) {
  Executor x;
  x.Bootstrap();
  audit::Trajectory t = Generate(x, "r", "prompt");
  const audit::ReverifySummary none = audit::ReverifyAll(*x.client, {}, 1e-3, false);
  EXPECT_FALSE(none.verified());
  EXPECT_EQ(audit::FormatReverifySummary(none, "E"),
            "re-verification against E: 0 of 0 rollouts checked: NOTHING VERIFIED");

  audit::Trajectory unrecorded = t;
  unrecorded.logprobs.assign(t.output.size(), std::nullopt);
  const audit::ReverifyResult sampled = audit::Reverify(*x.client, unrecorded, 1e-3, false);
  EXPECT_TRUE(sampled.checked);
  EXPECT_FALSE(sampled.ok) << sampled.detail;
  EXPECT_EQ(sampled.unrecorded, t.output.size());
  EXPECT_NE(sampled.detail.find("12 without a recorded logprob"), std::string::npos)
      << sampled.detail;
  EXPECT_TRUE(audit::Reverify(*x.client, unrecorded, 1e-3, /*greedy=*/true).ok);

  ASSERT_TRUE(x.runner->Update(Update("u-1", "rc-1", 1)).ok());
  const audit::ReverifySummary other = audit::ReverifyAll(*x.client, {t}, 1e-3, true);
  EXPECT_EQ(other.checked, 0u);
  EXPECT_FALSE(other.verified());
  const std::string line = audit::FormatReverifySummary(other, "E");
  EXPECT_NE(line.find("NOTHING VERIFIED"), std::string::npos) << line;
  EXPECT_EQ(line.find("OK"), std::string::npos) << line;
  ASSERT_EQ(audit::ReverifyFindings(other).size(), 1u);
  EXPECT_EQ(audit::FormatReverify(other.rollouts[0]).rfind("REVERIFY 'r': SKIPPED: ", 0), 0u);
}

// An engine that serves label "rc-0" and answers every scoring request with `answer`.
struct ScriptedEngine {
  httplib::Server server;
  std::thread thread;
  int port = 0;
  explicit ScriptedEngine(const std::string* answer) {
    server.Get("/weight_info", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"weight_version": "rc-0"})", "application/json");
    });
    server.Post("/v1/completions", [answer](const httplib::Request&, httplib::Response& res) {
      res.set_content(*answer, "application/json");
    });
    port = server.bind_to_any_port("127.0.0.1");
    thread = std::thread([this] { server.listen_after_bind(); });  // bound: connects queue
  }
  ~ScriptedEngine() {
    server.stop();
    thread.join();
  }
};

// Proves an engine's scoring answer of any shape is a skip or a count, never an exception or an
// abort, and a rollout id that holds a newline stays on its one report line; would catch the
// re-verifier indexing the engine's JSON unchecked (an exception ends the audit) or a forged
// report line.
TEST(Audit, HostileScoringAnswersAreCountedNotThrown) {
  std::string answer;
  ScriptedEngine e(&answer);
  effects::EngineClient client("http://127.0.0.1:" + std::to_string(e.port));
  audit::Trajectory t;
  t.rollout_id = "r\naudit: OK";
  t.version.label = "rc-0";
  t.prompt = {1, 2};
  t.output = {97, 98, 99, 100, 101};
  t.logprobs = {-0.5, -0.5, -0.5, -0.5, -0.5};
  for (const char* skipped : {R"({"choices": {}})", R"({"choices": []})", R"({"choices": [3]})",
                              R"({"choices": [{"prompt_logprobs": [null]}]})", "[1]"}) {
    answer = skipped;
    const audit::ReverifyResult r = audit::Reverify(client, t, 1e-3, true);
    EXPECT_FALSE(r.checked) << skipped;
  }
  answer = R"({"choices": [{"prompt_logprobs": [null, null, "x", {"98": 5},
    {"99": {"logprob": "no", "rank": 1}}, {"100": {"logprob": -0.5, "rank": null}},
    {"101": {"logprob": -0.5, "rank": 1}}]}]})";
  const audit::ReverifyResult r = audit::Reverify(client, t, 1e-3, true);
  EXPECT_TRUE(r.checked);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.unscored, 3u);
  EXPECT_EQ(r.tokens, 2u);
  EXPECT_EQ(r.top1, 1u);
  EXPECT_EQ(r.not_top1, 1u);
  EXPECT_EQ(r.logprob_mismatches, 0u);
  const std::string line = audit::FormatReverify(r);
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  EXPECT_EQ(line.rfind("REVERIFY 'r\\naudit: OK': FAILED: ", 0), 0u) << line;
}

// Proves a journal holding more trajectories than the bound is re-verified in part, never called
// damaged: the most recent `bound` are offered whole, the total stays exact, the summary says
// "PARTIAL: 3 of 7 trajectories re-verified", the journal is INTACT and the exit code 0, or 1
// once an offered trajectory fails. Would catch the count past kTrajectoriesMax turned into a
// journal failure (the "JOURNAL DAMAGED" exit 3 of a long run), a partial re-verification
// printed as if it covered everything, or a sample of the oldest trajectories, which an engine
// serving the latest version skips (here: all of rc-0's).
TEST(Audit, AJournalPastTheBoundIsReverifiedInPartNotDamaged) {
  Executor x;
  x.Bootstrap();
  for (int i = 0; i < 3; ++i) JournalTrajectory(x, "old-" + std::to_string(i), "old prompt");
  ASSERT_TRUE(x.runner->Update(Update("u-1", "rc-1", 1)).ok());
  for (int i = 0; i < 4; ++i) JournalTrajectory(x, "new-" + std::to_string(i), "new prompt");
  Result<audit::JournalTrajectories> all = audit::SampleTrajectoriesFromJournal(*x.journal);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(all->total, 7u);
  EXPECT_FALSE(all->partial());
  Result<audit::JournalTrajectories> ts = audit::SampleTrajectoriesFromJournal(*x.journal, 3);
  ASSERT_TRUE(ts.ok()) << ts.status().ToString();
  EXPECT_EQ(ts->total, 7u);
  EXPECT_TRUE(ts->partial());
  ASSERT_EQ(ts->trajectories.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ts->trajectories[i].rollout_id, "new-" + std::to_string(i + 1));
    EXPECT_EQ(ts->trajectories[i].output, all->trajectories[i + 4].output);
    EXPECT_EQ(ts->trajectories[i].version.label, "rc-1");
  }
  EXPECT_EQ(audit::FormatJournalTrajectories(*ts),
            "trajectories in the journal: 7, the most recent 3 offered for re-verification");
  Result<std::vector<audit::Trajectory>> plain = audit::TrajectoriesFromJournal(*x.journal);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->size(), 7u);

  const audit::ReverifySummary s =
      audit::ReverifyFromJournal(*x.client, *ts, 1e-5, /*greedy=*/true);
  EXPECT_EQ(s.trajectories, 3u);
  EXPECT_EQ(s.available, 7u);
  EXPECT_EQ(s.checked, 3u);
  EXPECT_TRUE(s.partial());
  EXPECT_TRUE(s.verified());
  EXPECT_TRUE(audit::ReverifyFindings(s).empty()) << "a partial re-verification is no failure";
  const std::string line = audit::FormatReverifySummary(s, "E");
  EXPECT_NE(line.find(": OK; PARTIAL: 3 of 7 trajectories re-verified (only the most recent 3 "
                      "were offered; the 4 older ones were not)"),
            std::string::npos)
      << line;
  const nlohmann::json j = audit::ReverifyJson(s);
  EXPECT_EQ(j["available"], 7);
  EXPECT_EQ(j["partial"], true);

  auto report = audit::AuditJournal(*x.journal);
  ASSERT_TRUE(report.ok());
  audit::Verdict clean = audit::MakeVerdict(*report);
  for (std::string& f : audit::ReverifyFindings(s)) clean.engine_findings.push_back(f);
  const audit::AuditOutput out = audit::RenderAudit(*report, clean, x.dir);
  EXPECT_EQ(out.exit_code, audit::kExitOk) << out.text;
  EXPECT_NE(out.text.find("journal: INTACT"), std::string::npos) << out.text;

  audit::JournalTrajectories doctored = *ts;
  *doctored.trajectories[1].logprobs[4] -= 0.01;
  const audit::ReverifySummary bad = audit::ReverifyFromJournal(*x.client, doctored, 1e-3, true);
  EXPECT_EQ(bad.failed, 1u);
  EXPECT_NE(audit::FormatReverifySummary(bad, "E").find("1 failed: FAILED; PARTIAL: 3 of 7"),
            std::string::npos);
  audit::Verdict failed = audit::MakeVerdict(*report);
  for (std::string& f : audit::ReverifyFindings(bad)) failed.engine_findings.push_back(f);
  EXPECT_EQ(failed.exit_code(), audit::kExitEngineUnhealthy);
  EXPECT_TRUE(failed.journal_intact());
}

// Proves a trajectory that leaves the window while its rollout is still open is counted once,
// and its later parts neither rejoin the window nor start a trajectory of their own, while a
// trajectory kept whole gets every part; would catch the tail of a trajectory re-verified as a
// whole (a false failure), parts counted as trajectories, or a part joined to the wrong one.
TEST(Audit, TheTrajectoryWindowKeepsWholeTrajectoriesOnly) {
  Executor x;
  x.Bootstrap();
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(x.Admit(id).ok());
  SubmitPart(x, "a", 0, {10});
  SubmitPart(x, "b", 0, {20});
  SubmitPart(x, "c", 0, {30});  // with a bound of 2, "a" leaves the window here
  SubmitPart(x, "a", 1, {11});
  SubmitPart(x, "c", 1, {31});
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(x.Finish(id, nlohmann::json::object()).ok());
  Result<audit::JournalTrajectories> ts = audit::SampleTrajectoriesFromJournal(*x.journal, 2);
  ASSERT_TRUE(ts.ok()) << ts.status().ToString();
  EXPECT_EQ(ts->total, 3u);
  ASSERT_EQ(ts->trajectories.size(), 2u);
  EXPECT_EQ(ts->trajectories[0].rollout_id, "b");
  EXPECT_EQ(ts->trajectories[1].rollout_id, "c");
  EXPECT_EQ(ts->trajectories[1].prompt, (std::vector<std::int32_t>{1, 2}));
  EXPECT_EQ(ts->trajectories[1].output, (std::vector<std::int32_t>{30, 31}));
  EXPECT_EQ(ts->trajectories[1].logprobs.size(), 2u);
  Result<audit::JournalTrajectories> all = audit::SampleTrajectoriesFromJournal(*x.journal);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->trajectories.size(), 3u);
  EXPECT_EQ(all->trajectories[0].output, (std::vector<std::int32_t>{10, 11}));
}

// Proves a trajectories file past kTrajectoriesMax lines is refused as that file's limit, naming
// the file and the way out and nothing of damage, while a file of exactly the bound is read;
// would catch the file's bound worded as a damaged journal, or a bound off by one.
TEST(Audit, ATrajectoriesFilePastTheBoundIsRefusedPlainly) {
  Executor x;
  const std::string path = x.dir + "/many.trajectories.jsonl";
  std::ofstream(path) << std::string(audit::kTrajectoriesMax + 1, '\n');
  Result<std::vector<audit::Trajectory>> over = audit::LoadTrajectories(path);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), Code::kInvalidArgument);
  const std::string& m = over.status().message();
  EXPECT_NE(m.find("trajectories file " + path + " has more than 1048576 lines"), std::string::npos)
      << m;
  EXPECT_NE(m.find("split it"), std::string::npos) << m;
  for (const char* word : {"damage", "DAMAGED", "corrupt", "Corruption"}) {
    EXPECT_EQ(m.find(word), std::string::npos) << m;
  }
  std::ofstream(path, std::ios::trunc) << std::string(audit::kTrajectoriesMax, '\n');
  Result<std::vector<audit::Trajectory>> at = audit::LoadTrajectories(path);
  ASSERT_TRUE(at.ok()) << at.status().ToString();
  EXPECT_TRUE(at->empty());
}

}  // namespace
}  // namespace rc::itest
