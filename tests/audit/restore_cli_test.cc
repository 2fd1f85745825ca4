// `rolloutcore restore` as a child process against a loopback server that stands in for `serve`
// and answers POST /v1/restores with a scripted body: every answer is outside input, so any shape
// is printed (escaped) and exits with a code, never aborts the command.
#include <gtest/gtest.h>
#include <httplib.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "statemachine/text.h"
#include "tests/audit/run_cli.h"

namespace rc {
namespace {

using cli_testing::CliRun;
using cli_testing::RunCli;

// Answers every POST /v1/restores with `body` (HTTP 200, application/json).
class ScriptedExecutor {
 public:
  ScriptedExecutor() {
    server_.Post("/v1/restores", [this](const httplib::Request&, httplib::Response& res) {
      std::lock_guard<std::mutex> l(mu_);
      res.set_content(body_, "application/json");
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

  void Answer(const std::string& body) {
    std::lock_guard<std::mutex> l(mu_);
    body_ = body;
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  httplib::Server server_;
  std::mutex mu_;
  std::string body_;
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

}  // namespace
}  // namespace rc
