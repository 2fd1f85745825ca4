// `rolloutcore restore` as a child process against a loopback server that stands in for `serve`
// and answers POST /v1/restores with a scripted body: every answer is outside input, so any shape
// is printed (escaped) and exits with a code, never aborts the command.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "statemachine/text.h"
#include "tests/audit/quoting.h"
#include "tests/audit/run_cli.h"

namespace rc {
namespace {

using cli_testing::CliRun;
using cli_testing::RunCli;

// Answers every POST /v1/restores with `body` (HTTP 200, application/json).
class ScriptedExecutor {
 public:
  ScriptedExecutor() {
    server_.Post("/v1/restores", [this](const httplib::Request& req, httplib::Response& res) {
      std::chrono::milliseconds delay{0};
      {
        std::lock_guard<std::mutex> l(mu_);
        ++requests_;
        last_body_ = req.body;
        delay = delay_;
        res.status = status_;
        res.set_content(body_, "application/json");
      }
      std::this_thread::sleep_for(delay);
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });  // bound: connects queue
  }
  ~ScriptedExecutor() {
    server_.stop();
    thread_.join();
  }
  ScriptedExecutor(const ScriptedExecutor&) = delete;
  ScriptedExecutor& operator=(const ScriptedExecutor&) = delete;

  void Answer(const std::string& body, int status = 200) {
    std::lock_guard<std::mutex> l(mu_);
    body_ = body;
    status_ = status;
  }
  // Each answer leaves only after `delay`.
  void Delay(std::chrono::milliseconds delay) {
    std::lock_guard<std::mutex> l(mu_);
    delay_ = delay;
  }
  int requests() {
    std::lock_guard<std::mutex> l(mu_);
    return requests_;
  }
  // The body of the last request answered ("" before the first).
  std::string last_body() {
    std::lock_guard<std::mutex> l(mu_);
    return last_body_;
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  httplib::Server server_;
  std::mutex mu_;
  std::string body_;
  int status_ = 200;
  std::chrono::milliseconds delay_{0};
  int requests_ = 0;
  std::string last_body_;
  int port_ = 0;
  std::thread thread_;
};

CliRun Restore(const ScriptedExecutor& executor) {
  return RunCli({"restore", "--url", executor.url(), "--label", "rc-0", "--adopt"},
                /*with_stderr=*/true);
}

// Proves an answer of an unexpected shape (a null reason, a numeric outcome, a state that is not
// an object, a lifecycle that is not a string) prints the raw body, escaped, and exits 2, while
// the shape `serve` sends prints its facts escaped and exits 1 for a refusal; catches the json
// type_error thrown by value() on a field of another type, which aborted the command.
TEST(RestoreCli, AnswersOfAnUnexpectedShapeExit2WithTheRawBody) {
  ScriptedExecutor executor;
  const std::vector<std::string> odd = {R"({"outcome":"refused","reason":null})",
                                        R"({"outcome":1})", R"({"outcome":"x","state":"y"})",
                                        R"({"outcome":"x","state":{"lifecycle":7}})",
                                        "{\"outcome\":[\"x\"],\"reason\":\"line\\nforged\"}"};
  for (const std::string& body : odd) {
    executor.Answer(body);
    const CliRun run = Restore(executor);
    EXPECT_EQ(run.exit_code, 2) << body << ": " << run.out;
    EXPECT_EQ(run.out, "restore: HTTP 200: " + text::escape_line(body) + "\n") << body;
  }
  executor.Answer(
      R"({"restore_id":"restore-rc-0","outcome":"refused","reason":"digest differs\nforged: yes",)"
      R"("state":{"lifecycle":"TAINTED"}})");
  const CliRun refused = Restore(executor);
  EXPECT_EQ(refused.exit_code, 1) << refused.out;
  EXPECT_EQ(refused.out, "restore restore-rc-0: refused\nreason: " +
                             text::escape_line("digest differs\nforged: yes") +
                             "\nlifecycle: TAINTED\n");
}

// Proves an answer of another shape too large for one line prints its first 4096 bytes, escaped,
// and its size; catches a 1 MiB body printed whole on one line.
TEST(RestoreCli, AnOddAnswerIsShownByItsFirstBytes) {
  ScriptedExecutor executor;
  const std::string body = "{\"outcome\":1,\"pad\":\"" + std::string(1 << 20, 'x') + "\"}";
  executor.Answer(body);
  const CliRun run = Restore(executor);
  EXPECT_EQ(run.exit_code, 2) << run.out.substr(0, 200);
  EXPECT_LT(run.out.size(), 4200u);
  EXPECT_NE(run.out.find(" ... (" + std::to_string(body.size()) + " bytes)\n"), std::string::npos)
      << run.out.substr(run.out.size() > 200 ? run.out.size() - 200 : 0);
}

// Proves a label whose default restore id ("restore-<label>") would pass the id bound is refused
// before anything is sent, naming --restore-id, and is sent once an id is given; catches the
// request the executor refused with a 400 the command could not explain.
TEST(RestoreCli, ALabelTooLongForTheDefaultIdAsksForOne) {
  ScriptedExecutor executor;
  executor.Answer(R"({"restore_id":"r","outcome":"committed","reason":"",)"
                  R"("state":{"lifecycle":"READY"}})");
  const std::string label(125, 'l');
  const CliRun refused =
      RunCli({"restore", "--url", executor.url(), "--label", label, "--adopt"}, true);
  EXPECT_EQ(refused.exit_code, 2) << refused.out;
  EXPECT_NE(refused.out.find("give --restore-id"), std::string::npos) << refused.out;
  EXPECT_EQ(executor.requests(), 0);
  const CliRun sent = RunCli(
      {"restore", "--url", executor.url(), "--label", label, "--adopt", "--restore-id", "r"}, true);
  EXPECT_EQ(sent.exit_code, 0) << sent.out;
  EXPECT_EQ(executor.requests(), 1);
}

// Proves a request sent but never answered within --timeout-s exits 3 and says the restore may
// have run, naming the id to rerun with, while one that could not connect exits 2 (nothing sent);
// catches the timeout reported as "no answer" with the exit code of a request never sent.
TEST(RestoreCli, ANoAnswerAfterSendingSaysToRerunWithTheSameId) {
  ScriptedExecutor executor;
  executor.Answer(R"({"outcome":"committed"})");
  executor.Delay(std::chrono::milliseconds(2500));
  const CliRun late = RunCli(
      {"restore", "--url", executor.url(), "--label", "rc-0", "--adopt", "--timeout-s", "1"}, true);
  EXPECT_EQ(late.exit_code, 3) << late.out;
  EXPECT_NE(late.out.find("the restore may have run; rerun with --restore-id=restore-rc-0"),
            std::string::npos)
      << late.out;
  const CliRun nobody =
      RunCli({"restore", "--url", "http://127.0.0.1:1", "--label", "rc-0", "--adopt"}, true);
  EXPECT_EQ(nobody.exit_code, 2) << nobody.out;
  EXPECT_NE(nobody.out.find("nothing was sent"), std::string::npos) << nobody.out;
}

// Proves serve's error answers exit by what they mean for the restore: outcome_unknown (the
// executor fail-stopped after journaling it) exits 3 naming the id to rerun with, a refusal of the
// request (409: not TAINTED) exits 1, an authorization failure exits 2; catches all three read as
// an answer of another shape (exit 2), which told a user whose restore may have run nothing.
TEST(RestoreCli, ServesErrorAnswersExitByWhatTheyMean) {
  ScriptedExecutor executor;
  const auto error = [](const std::string& type, int code) {
    return R"({"error":{"message":"because\nof this","type":")" + type + R"(","code":)" +
           std::to_string(code) + "}}";
  };
  executor.Answer(error("outcome_unknown", 503), 503);
  const CliRun unknown = Restore(executor);
  EXPECT_EQ(unknown.exit_code, 3) << unknown.out;
  EXPECT_NE(unknown.out.find("outcome unknown: " + text::escape_line("because\nof this") +
                             "; rerun with --restore-id=restore-rc-0"),
            std::string::npos)
      << unknown.out;
  executor.Answer(error("conflict", 409), 409);
  const CliRun refused = Restore(executor);
  EXPECT_EQ(refused.exit_code, 1) << refused.out;
  EXPECT_NE(refused.out.find("HTTP 409 conflict"), std::string::npos) << refused.out;
  executor.Answer(error("unauthorized", 401), 401);
  EXPECT_EQ(Restore(executor).exit_code, 2);
}

// The option a "rerun with --restore-id=ID to read it" line of `out` gives ("" when none).
std::string RerunOption(const std::string& out) {
  const std::string open = "; rerun with ";
  const std::string close = " to read it\n";
  const std::size_t from = out.find(open);
  const std::size_t to = out.rfind(close);
  if (from == std::string::npos || to == std::string::npos || from + open.size() >= to) return "";
  return out.substr(from + open.size(), to - from - open.size());
}

// Proves the "rerun with --restore-id" hint hands the shell the default id ("restore-<label>") as
// exactly one argument when the label holds a quote, `;`, `|` and `$(...)`; catches the id
// printed bare, where the operator's rerun ran the commands the trainer's label held.
TEST(RestoreCli, TheRerunHintTakesTheIdAsOneShellArgument) {
  ScriptedExecutor executor;
  executor.Answer(R"({"error":{"message":"journal failed","type":"outcome_unknown","code":503}})",
                  503);
  const std::string label = "rc-7'; echo INJECTED $(echo sub) | cat; echo '";
  const CliRun run =
      RunCli({"restore", "--url", executor.url(), "--label", label, "--adopt"}, true);
  EXPECT_EQ(run.exit_code, 3) << run.out;
  EXPECT_EQ(quoting_testing::ShellWords(RerunOption(run.out)),
            std::vector<std::string>{"--restore-id=restore-" + label})
      << run.out;
}

// Proves the "rerun with --restore-id=ID" hint, pasted into the rerun's command line, names the
// same restore when the id begins with `-` (`-x`, `--adopt`, `--url=...`): through /bin/sh and
// the CLI's own parser the rerun sends that id. Catches a hint that does not read back as exactly
// that id (a word the shell splits or the parser takes for another option or its value).
TEST(RestoreCli, TheRerunHintNamesAnIdBeginningWithADash) {
  ScriptedExecutor executor;
  executor.Answer(R"({"error":{"message":"journal failed","type":"outcome_unknown","code":503}})",
                  503);
  const std::vector<std::string> restore = {"restore", "--url", executor.url(),
                                            "--label", "rc-0",  "--adopt"};
  for (const std::string id : {"-x", "--adopt", "--url=http://127.0.0.1:1"}) {
    std::vector<std::string> first = restore;
    first.push_back("--restore-id=" + id);
    const CliRun run = RunCli(first, true);
    EXPECT_EQ(run.exit_code, 3) << run.out;
    std::vector<std::string> rerun = restore;
    for (const std::string& word : quoting_testing::ShellWords(RerunOption(run.out))) {
      rerun.push_back(word);
    }
    const CliRun again = RunCli(rerun, true);
    EXPECT_EQ(again.exit_code, 3) << id << ": " << again.out;
    const nlohmann::json body = nlohmann::json::parse(executor.last_body(), nullptr, false);
    ASSERT_TRUE(body.is_object()) << executor.last_body();
    EXPECT_EQ(body.value("restore_id", ""), id) << run.out;
    EXPECT_EQ(body.value("label", ""), "rc-0") << run.out;
    EXPECT_EQ(body.value("adopt", false), true) << run.out;
  }
}

}  // namespace
}  // namespace rc
