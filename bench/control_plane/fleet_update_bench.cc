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
// Beside the totals, each phase of the runner's split (PhaseTimings) at p50: one engine's, and
// for the fleet the slowest member's in each update, so a phase that grows with the fleet shows.
// Flags: --cycles N, --commit-window-us N (the journal's group-commit window), --no-sync.
//
// A plain main rather than Google Benchmark: the two configurations must interleave cycle by
// cycle, which its one-benchmark-at-a-time model does not do.
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <functional>
#include <cstdlib>
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

struct BenchOptions {
  int cycles = 100;
  rc::journal::Options journal;
};

// The phases reported, by name.
struct Phase {
  const char* name;
  std::uint64_t rc::effects::PhaseTimings::*field;
};
constexpr Phase kPhases[] = {
    {"drain", &rc::effects::PhaseTimings::drain_us},
    {"preflight", &rc::effects::PhaseTimings::preflight_us},
    {"transfer", &rc::effects::PhaseTimings::transfer_us},
    {"invalidate", &rc::effects::PhaseTimings::invalidate_us},
    {"validate", &rc::effects::PhaseTimings::validate_us},
    {"resume", &rc::effects::PhaseTimings::resume_us},
    {"journal", &rc::effects::PhaseTimings::journal_us},
    {"total", &rc::effects::PhaseTimings::total_us},
};
constexpr std::size_t kPhaseCount = sizeof(kPhases) / sizeof(kPhases[0]);

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

// The journal, timed: where a member's durable appends wait (the submit under the journal's lock,
// or the wait for a group commit), and how many group commits the waits shared.
class TimedJournal final : public rc::journal::Journal {
 public:
  explicit TimedJournal(std::unique_ptr<Journal> j) : j_(std::move(j)) {}
  struct Counts {
    std::uint64_t submits = 0, submit_ns = 0, waits = 0, wait_ns = 0, batches = 0;
  };
  Counts Take() {
    Counts c{submits_.exchange(0), submit_ns_.exchange(0), waits_.exchange(0), wait_ns_.exchange(0),
             batches_.exchange(0)};
    return c;
  }

  rc::Result<rc::journal::Ticket> Enqueue(const rc::journal::AppendRequest& r) override {
    return j_->Enqueue(r);
  }
  rc::Result<Submitted> Submit(const rc::Event& input, std::int64_t wall_ms,
                               const std::string& key) override {
    return j_->Submit(input, wall_ms, key);
  }
  rc::Result<FleetSubmitted> SubmitFleet(const rc::FleetEvent& input, std::int64_t wall_ms,
                                         const std::string& key) override {
    const auto t0 = std::chrono::steady_clock::now();
    auto out = j_->SubmitFleet(input, wall_ms, key);
    submit_ns_ += Ns(t0);
    submits_++;
    return out;
  }
  rc::Result<FleetSubmitted> SubmitFleetIf(const rc::FleetEvent& input, std::int64_t wall_ms,
                                           const Precondition& holds) override {
    return j_->SubmitFleetIf(input, wall_ms, holds);
  }
  rc::Result<bool> KeyHeld(const std::string& key) override { return j_->KeyHeld(key); }
  rc::State state() const override { return j_->state(); }
  void ReadState(const std::function<void(const rc::State&)>& read) const override {
    j_->ReadState(read);
  }
  rc::FleetState fleet_state() const override { return j_->fleet_state(); }
  void ReadFleetState(const std::function<void(const rc::FleetState&)>& read) const override {
    j_->ReadFleetState(read);
  }
  bool is_fleet() const override { return j_->is_fleet(); }
  rc::Status Wait(const rc::journal::Ticket& ticket) override {
    const auto t0 = std::chrono::steady_clock::now();
    rc::Status st = j_->Wait(ticket);
    wait_ns_ += Ns(t0);
    waits_++;
    std::uint64_t seen = last_batch_.load();
    while (ticket.batch_id > seen && !last_batch_.compare_exchange_weak(seen, ticket.batch_id)) {
    }
    if (ticket.batch_id > seen) batches_++;
    return st;
  }
  rc::Status WaitForHead() override { return j_->WaitForHead(); }
  void WaitAsync(const rc::journal::Ticket& t, DurableFn done) override {
    j_->WaitAsync(t, std::move(done));
  }
  bool failed() const override { return j_->failed(); }
  rc::Status failure() const override { return j_->failure(); }
  void Stop(const rc::Status& why) override { j_->Stop(why); }
  rc::journal::Recovery recovery() const override { return j_->recovery(); }
  rc::Status ForgetRecordedTornTail() override { return j_->ForgetRecordedTornTail(); }
  rc::Result<rc::journal::AppendResult> Append(const rc::journal::AppendRequest& r) override {
    return j_->Append(r);
  }
  std::uint64_t head_seq() const override { return j_->head_seq(); }
  std::uint64_t durable_seq() const override { return j_->durable_seq(); }
  rc::journal::Hash head_hash() const override { return j_->head_hash(); }
  rc::Result<rc::journal::Record> Read(std::uint64_t seq) override { return j_->Read(seq); }
  rc::Status Scan(std::uint64_t from, std::uint64_t to,
                  const std::function<rc::Status(const rc::journal::Record&)>& visit) override {
    return j_->Scan(from, to, visit);
  }
  rc::Result<std::vector<std::uint64_t>> RolloutSeqs(const std::string& id) override {
    return j_->RolloutSeqs(id);
  }
  rc::Result<rc::FleetState> LoadFleetState() override { return j_->LoadFleetState(); }
  rc::Result<rc::FleetState> RefoldFleet(std::uint64_t until) override {
    return j_->RefoldFleet(until);
  }
  rc::Result<rc::State> LoadState() override { return j_->LoadState(); }
  rc::Result<rc::State> Refold(std::uint64_t until) override { return j_->Refold(until); }
  rc::Status WriteSnapshot(std::uint64_t seq, const rc::FleetState& f) override {
    return j_->WriteSnapshot(seq, f);
  }
  rc::Status CatchUp() override { return j_->CatchUp(); }
  rc::Status Checkpoint(const std::string& dir) override { return j_->Checkpoint(dir); }
  rc::Status VerifyChecksum() override { return j_->VerifyChecksum(); }
  rc::Status Flush() override { return j_->Flush(); }
  rc::Status Compact() override { return j_->Compact(); }
  rc::Status Close() override { return j_->Close(); }

 private:
  static std::uint64_t Ns(std::chrono::steady_clock::time_point t0) {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
  }
  std::unique_ptr<Journal> j_;
  std::atomic<std::uint64_t> submits_{0}, submit_ns_{0}, waits_{0}, wait_ns_{0}, batches_{0};
  std::atomic<std::uint64_t> last_batch_{0};
};

struct Fleet {
  Fleet(int n, const rc::journal::Options& options) {
    std::random_device rd;
    dir = std::filesystem::temp_directory_path() / ("rc-fleet-bench-" + std::to_string(rd()));
    auto j = rc::journal::Journal::Open(dir.string(), options);
    RC_CHECK(j.ok());
    journal = std::make_unique<TimedJournal>(std::move(j.value()));
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
    const TimedJournal::Counts c = journal->Take();
    submits += c.submits;
    submit_ns += c.submit_ns;
    waits += c.waits;
    wait_ns += c.wait_ns;
    batches += c.batches;
    std::array<std::uint64_t, kPhaseCount> slowest{};
    for (std::size_t i = 0; i < engines.size(); ++i) {
      const auto& t = runner->runner("e" + std::to_string(i))->last_timings();
      for (std::size_t k = 0; k < kPhaseCount; ++k) {
        slowest[k] = std::max(slowest[k], t.*kPhases[k].field);
      }
    }
    for (std::size_t k = 0; k < kPhaseCount; ++k) {
      phases_ms[k].push_back(static_cast<double>(slowest[k]) / 1000.0);
    }
    return wall_ms - static_cast<double>(slowest[2]) / 1000.0;  // less the slowest transfer
  }

  std::array<std::vector<double>, kPhaseCount> phases_ms;  // per update, the slowest member's
  std::uint64_t submits = 0, submit_ns = 0, waits = 0, wait_ns = 0, batches = 0;  // all updates

  std::filesystem::path dir;
  std::unique_ptr<TimedJournal> journal;
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

BenchOptions ParseArgs(int argc, char** argv) {
  BenchOptions o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--cycles" && has_value) {
      o.cycles = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--commit-window-us" && has_value) {
      o.journal.commit_window_us = static_cast<std::uint32_t>(std::atoi(argv[++i]));
    } else if (a == "--no-sync") {
      o.journal.sync = false;
    } else {
      std::fprintf(stderr,
                   "usage: fleet_update_bench [--cycles N] [--commit-window-us N] "
                   "[--no-sync]\n");
      std::exit(2);
    }
  }
  return o;
}

void PrintJournal(const char* what, const Fleet& f, int cycles) {
  const double n = cycles;
  std::printf(
      "  journal, %s: per update %.1f submits (%.1f us each), %.1f waits (%.1f us each), "
      "%.1f group commits waited for\n",
      what, static_cast<double>(f.submits) / n,
      static_cast<double>(f.submit_ns) / 1e3 / std::max<double>(1, f.submits),
      static_cast<double>(f.waits) / n,
      static_cast<double>(f.wait_ns) / 1e3 / std::max<double>(1, f.waits),
      static_cast<double>(f.batches) / n);
}

void PrintPhases(const Fleet& one, const Fleet& eight) {
  std::printf("  phase p50 (ms)  1 engine   8 engines (slowest member)\n");
  for (std::size_t k = 0; k < kPhaseCount; ++k) {
    std::printf("  %-14s %9.3f  %9.3f\n", kPhases[k].name, Percentile(one.phases_ms[k], 0.5),
                Percentile(eight.phases_ms[k], 0.5));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const BenchOptions options = ParseArgs(argc, argv);
  const int kCycles = options.cycles;
  Fleet one(1, options.journal), eight(8, options.journal);
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
  std::printf(
      "fleet `all` update overhead over %d alternating cycles (journal %s, commit "
      "window %u us):\n",
      kCycles, options.journal.sync ? "fsync'd" : "not synced", options.journal.commit_window_us);
  std::printf("  1 engine : p50 %.3f ms, p99 %.3f ms; CPU %.3f ms per update\n",
              Percentile(one_ms, 0.5), Percentile(one_ms, 0.99), one_cpu_ms / kCycles);
  std::printf("  8 engines: p50 %.3f ms, p99 %.3f ms; CPU %.3f ms per update\n",
              Percentile(eight_ms, 0.5), Percentile(eight_ms, 0.99), eight_cpu_ms / kCycles);
  std::printf("  ratio 8/1 at p50: %.2fx (goal <= 2x): %s\n", ratio,
              ratio <= 2.0 ? "met" : "NOT met");
  PrintPhases(one, eight);
  PrintJournal("1 engine ", one, kCycles);
  PrintJournal("8 engines", eight, kCycles);
  return 0;
}
