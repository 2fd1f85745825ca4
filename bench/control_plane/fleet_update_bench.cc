// Control-plane overhead of an `all` fleet update over 8 vLLM doubles against one engine's, side
// by side in one run: the two fleets are updated in alternation, so both see the same machine
// load. Overhead is the fleet update's wall time minus its slowest member's transfer (members
// transfer at once; the transfer is the data plane, excluded as in control_plane_bench). Goal:
// the 8-engine overhead at most 2x the 1-engine one (p50). Journal fsync'd, as in production.
//
// Also reported: the process's CPU time per update (the doubles run in this process, so it holds
// their HTTP work too). Members run in parallel, so on C cores the 8-engine update cannot take
// less wall time than its CPU time / C: the ratio's floor on a small machine.
//
// A plain main rather than Google Benchmark: the two configurations must interleave cycle by
// cycle, which its one-benchmark-at-a-time model does not do.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "effects/fleet_runner.h"
#include "effects/http/engine_client.h"
#include "effects/http/engine_control.h"
#include "effects/http/sequence_transfer.h"
#include "fixtures/vllm_double.h"
#include "journal/journal.h"

namespace {

constexpr int kCycles = 100;

struct Engine {
  Engine() : engine(Options()) {
    RC_CHECK(engine.Start(0) > 0);
    client = std::make_unique<rc::effects::EngineClient>(engine.base_url());
    control = std::make_unique<rc::effects::HttpEngineControl>(*client);
    transfer = std::make_unique<rc::effects::HttpSequenceTransfer>(
        *client, rc::effects::detect_protocol("0.30.0"));
  }
  ~Engine() {
    transfer.reset();
    control.reset();
    client.reset();
    engine.Stop();
  }
  static rc::fixtures::VllmDoubleOptions Options() {
    rc::fixtures::VllmDoubleOptions o;
    o.version = "0.30.0";
    return o;
  }
  rc::fixtures::VllmDouble engine;
  std::unique_ptr<rc::effects::EngineClient> client;
  std::unique_ptr<rc::effects::HttpEngineControl> control;
  std::unique_ptr<rc::effects::HttpSequenceTransfer> transfer;
};

rc::WeightIdentity Identity(int step) {
  static const std::string digest = rc::effects::synthetic_manifest("synthetic:8x64")->digest();
  return {digest, "", "ckpt/" + std::to_string(step), "bench", step};
}

struct Fleet {
  explicit Fleet(int n) {
    std::random_device rd;
    dir = std::filesystem::temp_directory_path() / ("rc-fleet-bench-" + std::to_string(rd()));
    auto j = rc::journal::Journal::Open(dir.string(), rc::journal::Options{});
    RC_CHECK(j.ok());
    journal = std::move(j.value());
    runner = std::make_unique<rc::effects::FleetRunner>(*journal, rc::effects::system_clock(),
                                                        rc::effects::FleetRunnerOptions{});
    for (int i = 0; i < n; ++i) {
      engines.push_back(std::make_unique<Engine>());
      const std::string name = "e" + std::to_string(i);
      RC_CHECK(runner->Join(name, *engines.back()->control, *engines.back()->transfer).ok());
      RC_CHECK(runner->runner(name)->Bootstrap("rc-0", Identity(0)).ok());
    }
  }
  ~Fleet() {
    runner.reset();
    journal.reset();
    engines.clear();
    std::filesystem::remove_all(dir);
  }

  // One `all` update; returns its overhead in ms.
  double Update(int step) {
    const auto start = std::chrono::steady_clock::now();
    auto end = runner->Update({"u" + std::to_string(step), rc::FleetUpdateMode::kAll, 1, 1,
                               "rc-" + std::to_string(step), Identity(step),
                               "synthetic:8x64:" + std::to_string(step)});
    const double wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    RC_CHECK(end.ok() && end->outcome == rc::FleetOutcome::kCommitted);
    std::uint64_t transfer_us = 0;
    for (std::size_t i = 0; i < engines.size(); ++i) {
      const auto& t = runner->runner("e" + std::to_string(i))->last_timings();
      transfer_us = std::max(transfer_us, t.transfer_us);
    }
    return wall_ms - static_cast<double>(transfer_us) / 1000.0;
  }

  std::filesystem::path dir;
  std::unique_ptr<rc::journal::Journal> journal;
  std::vector<std::unique_ptr<Engine>> engines;
  std::unique_ptr<rc::effects::FleetRunner> runner;
};

double CpuMs() {
  rusage u{};
  RC_CHECK(getrusage(RUSAGE_SELF, &u) == 0);
  auto ms = [](const timeval& t) { return t.tv_sec * 1e3 + t.tv_usec / 1e3; };
  return ms(u.ru_utime) + ms(u.ru_stime);
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(p * static_cast<double>(v.size() - 1))];
}

}  // namespace

int main() {
  Fleet one(1), eight(8);
  std::vector<double> one_ms, eight_ms;
  double one_cpu_ms = 0, eight_cpu_ms = 0;
  for (int step = 1; step <= kCycles; ++step) {
    const double c0 = CpuMs();
    one_ms.push_back(one.Update(step));
    const double c1 = CpuMs();
    eight_ms.push_back(eight.Update(step));
    one_cpu_ms += c1 - c0;
    eight_cpu_ms += CpuMs() - c1;
  }
  const double ratio = Percentile(eight_ms, 0.5) / Percentile(one_ms, 0.5);
  std::printf("fleet `all` update overhead over %d alternating cycles (journal fsync'd):\n",
              kCycles);
  std::printf("  1 engine : p50 %.3f ms, p99 %.3f ms; CPU %.3f ms per update\n",
              Percentile(one_ms, 0.5), Percentile(one_ms, 0.99), one_cpu_ms / kCycles);
  std::printf("  8 engines: p50 %.3f ms, p99 %.3f ms; CPU %.3f ms per update\n",
              Percentile(eight_ms, 0.5), Percentile(eight_ms, 0.99), eight_cpu_ms / kCycles);
  std::printf("  ratio 8/1 at p50: %.2fx (goal <= 2x): %s\n", ratio,
              ratio <= 2.0 ? "met" : "NOT met");
  return 0;
}
