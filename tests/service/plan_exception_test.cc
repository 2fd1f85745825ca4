// A plan whose effects throw once its request is journaled, through `serve` over loopback HTTP: a
// fleet of vLLM doubles whose member threads the system refuses (std::thread throws
// std::system_error, as when a process is out of threads). The answer is the unknown outcome's,
// serve fail-stops, and the next start drives the plan to its end from the journal.
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "fixtures/vllm_double.h"
#include "service/service.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using nlohmann::json;

// Two doubles on loopback and a fleet `serve` in front of them, on one journal.
class PlanStack {
 public:
  PlanStack() {
    static int k = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("rc-plan-exception-" + std::to_string(::getpid()) + "-" + std::to_string(k++));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    for (int i = 0; i < 2; ++i) {
      fixtures::VllmDoubleOptions o;
      o.worker_extension_cls = effects::kWorkerExtensionClass;
      o.token_delay_ms = 1;
      engines_.push_back(std::make_unique<fixtures::VllmDouble>(o));
      RC_CHECK(engines_.back()->Start(0) > 0);
    }
  }
  ~PlanStack() {
    if (svc && !svc->failed()) (void)svc->Shutdown(5000);
    svc.reset();
    for (auto& e : engines_) e->Stop();
    std::filesystem::remove_all(dir_);
  }
  PlanStack(const PlanStack&) = delete;
  PlanStack& operator=(const PlanStack&) = delete;

  // Starts serve on the journal, as a restart does when one ran before (no Shutdown: the last
  // one fail-stopped).
  void Open() {
    svc.reset();
    ServeConfig c;
    for (std::size_t i = 0; i < engines_.size(); ++i) {
      c.engines.push_back({"e" + std::to_string(i), engines_[i]->base_url()});
    }
    c.journal_path = (dir_ / "journal").string();
    c.listen_port = 0;
    c.initial_source = stack::kStackSource;
    c.initial_checkpoint = "ckpt-0";
    c.initial_run = "run-a";
    c.initial_step = 0;
    c.engine_startup_timeout_ms = 10000;
    c.fleet_blocked_timeout_ms = 2000;
    auto opened = Service::Open(c);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    svc = std::move(opened.value());
    ASSERT_TRUE(svc->Start().ok());
  }

  httplib::Result FleetUpdate(const std::string& id, int step) const {
    httplib::Client c("127.0.0.1", svc->port());
    c.set_read_timeout(60, 0);
    json body = stack::UpdateBody(id, "rc-" + std::to_string(step), step, "run-a");
    body["mode"] = "all";
    return c.Post("/v1/fleet/updates", body.dump(), "application/json");
  }

  std::unique_ptr<Service> svc;

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<fixtures::VllmDouble>> engines_;
};

std::string ErrorType(const httplib::Result& r) {
  const json j = json::parse(r->body, nullptr, false);
  if (!j.is_object() || !j.contains("error") || !j["error"].is_object()) return "";
  return j["error"].value("type", "");
}

// Proves an exception out of a plan once its request is journaled (a member thread the system
// refuses) is answered 503 outcome_unknown, counted there, and fail-stops serve, and that the
// restart drives the plan to a recorded end. Catches the HTTP server's catch-all answering
// 500 internal while serve went on with the plan open and nothing driving it.
TEST(PlanException, AThreadRefusedMidPlanIsAnUnknownOutcomeAndAFailStop) {
  PlanStack f;
  ASSERT_NO_FATAL_FAILURE(f.Open());
  std::atomic<int> refused{0};
  f.svc->set_member_thread_start([&refused](std::function<void()>) -> std::thread {
    refused++;
    throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                            "the test refuses a member thread");
  });
  auto r = f.FleetUpdate("u1", 1);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_EQ(ErrorType(r), "outcome_unknown") << r->body;
  EXPECT_EQ(f.svc->metrics().updates_outcome_unknown.load(), 1u);
  EXPECT_EQ(refused.load(), 1);
  ASSERT_TRUE(f.svc->failed()) << "the plan was left open with nothing to drive it";
  EXPECT_NE(f.svc->failure().find("refuses a member thread"), std::string::npos)
      << f.svc->failure();
  // The request was journaled before the throw: the update is open in the fold.
  const FleetState open = f.svc->journal().fleet_state();
  ASSERT_TRUE(open.update.has_value());
  EXPECT_EQ(open.update->request.update_id, "u1");
  auto next = f.FleetUpdate("u2", 2);
  ASSERT_TRUE(next);
  EXPECT_EQ(next->status, 503) << "decided after the fail-stop: " << next->body;
  EXPECT_EQ(ErrorType(next), "failed") << next->body;

  // The process exits; the next start drives the update to its end, and a re-POST reads it.
  ASSERT_NO_FATAL_FAILURE(f.Open());
  EXPECT_FALSE(f.svc->failed()) << f.svc->failure();
  EXPECT_FALSE(f.svc->journal().fleet_state().update.has_value());
  auto again = f.FleetUpdate("u1", 1);
  ASSERT_TRUE(again);
  EXPECT_TRUE(again->status == 200 || again->status == 207 || again->status == 422)
      << again->status << " " << again->body;
  const json end = json::parse(again->body, nullptr, false);
  ASSERT_TRUE(end.is_object()) << again->body;
  EXPECT_EQ(end.value("update_id", ""), "u1") << again->body;
  EXPECT_EQ(f.svc->journal().fleet_state().fleet_updates_ended, 1u);
}

}  // namespace
}  // namespace rc::service
