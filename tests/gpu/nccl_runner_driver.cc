// Full update cycles driven by effects::Runner with the real NCCL path: a real journal
// (journal::Journal::Open, fsync on), HttpEngineControl + NcclSender over one EngineClient, and
// tests/gpu/receiver_double.py as the engine (rank 1 on GPU 1). One JSON object per line.
//   cycle  bootstrap rc-0, then --reps Runner::Update cycles (plus one warm-up, reported but left
//          out of the medians) per weight set (Qwen3-8B-shaped 16 GB bf16, OPT-125M-shaped), each
//          with total time and the PhaseTimings split; then one cycle verified byte for byte.
//   kill   the receiver is SIGKILLed mid-broadcast (8B set) during Runner::Update: the controller
//          must journal TAINTED within 2 s of the kill with the target unpublished, and
//          replay::Replay of that journal must explain the incident.
#include <cuda_runtime.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "effects/http/engine_client.h"
#include "effects/http/engine_control.h"
#include "effects/nccl/nccl_sender.h"
#include "effects/runner.h"
#include "journal/journal.h"
#include "replay/replay.h"
#include "tests/gpu/gpu_fixtures.h"

using namespace rc;
using namespace rc::effects;
using namespace rc::effects::nccl;
using namespace rc::gpu_test;

namespace {

int g_failures = 0;
void Emit(json j) {
  std::cout << j.dump() << std::endl;
  if (j.contains("pass") && j["pass"] == false) ++g_failures;
}

std::string TempJournalDir(const std::string& tag) {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() /
             ("rc-gpu-journal-" + tag + "-" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

json Phases(const PhaseTimings& t) {
  return {{"total_us", t.total_us},           {"drain_us", t.drain_us},
          {"preflight_us", t.preflight_us},   {"transfer_us", t.transfer_us},
          {"invalidate_us", t.invalidate_us}, {"validate_us", t.validate_us},
          {"resume_us", t.resume_us},         {"journal_us", t.journal_us}};
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

RunnerOptions Options() {
  RunnerOptions o;
  o.drain_timeout_ms = 20000;
  o.transfer_timeout_ms = 60000;
  o.call_timeout_ms = 5000;
  return o;
}

EngineDeadlines Deadlines() {
  EngineDeadlines d;
  d.connect_timeout_ms = 1000;
  d.call_timeout_ms = 5000;
  d.drain_timeout_ms = 20000;
  d.update_timeout_ms = 60000;
  return d;
}

WeightIdentity Identity(const Manifest& m, const std::string& uri, int step) {
  return WeightIdentity{m.digest(), "", uri, "gpu-runner", step};
}

struct Wiring {
  EngineClient client;
  HttpEngineControl control;
  NcclSender sender;
  explicit Wiring(const std::string& url, NcclSenderOptions o)
      : client(url, Deadlines()), control(client), sender(client, std::move(o)) {}
};

// Proves a whole update cycle (drain, preflight, NCCL transfer, cache resets, validation, resume,
// durable journal) commits through the Runner with the real data plane, and times it; it would
// catch a control route the double/EngineClient disagree on, or bytes the receiver did not get.
int Cycle(Ctx& c, int reps) {
  c.Config("0.30.0", nullptr);
  NcclSenderOptions so;
  so.world_size = 2;
  Wiring w("http://127.0.0.1:" + std::to_string(c.port), so);
  Status st = w.sender.Init(60000);
  Emit({{"check", "runner cycle: sender init"}, {"pass", st.ok()}, {"status", st.ToString()}});
  if (!st.ok()) return 1;
  const std::uint64_t seed = 7;
  for (const auto& [name, m] : std::vector<std::pair<std::string, Manifest>>{
           {"qwen3-8b", Qwen3_8B()}, {"opt-125m", Opt125M()}}) {
    auto dev = Upload(m, seed, /*contiguous=*/true);
    const std::string uri = "device:" + name;
    w.sender.RegisterSource(uri, std::make_shared<DevicePointerSource>(m, dev->ptrs, 0));
    const std::string dir = TempJournalDir(name);
    auto j = journal::Journal::Open(dir, journal::Options{});
    if (!j.ok()) {
      Emit({{"check", "journal open " + name}, {"pass", false}, {"status", j.status().ToString()}});
      return 1;
    }
    Runner runner(**j, w.control, w.sender, system_clock(), Options());
    Status boot = runner.Bootstrap("rc-0", Identity(m, uri, 0));
    Emit({{"check", "bootstrap rc-0 " + name},
          {"pass", boot.ok() && c.Label() == "rc-0"},
          {"status", boot.ToString()}});
    if (!boot.ok()) return 1;
    std::vector<double> total_us, transfer_us, data_plane_us;
    std::vector<PhaseTimings> phases;
    bool all_committed = true;
    for (int k = 1; k <= reps + 2; ++k) {  // k = 1: warm-up; k = reps + 2: verified
      const bool verified = k == reps + 2;
      if (verified) c.Config("0.30.0", seed);
      const std::string label = "rc-" + std::to_string(k);
      auto r = runner.Update(
          UpdateRequested{"u-" + name + "-" + std::to_string(k), label, Identity(m, uri, k), uri});
      const PhaseTimings t = runner.last_timings();
      const TransferTiming tt = w.sender.last_timing();
      const bool committed = r.ok() && r->outcome == UpdateOutcome::kCommitted &&
                             (*j)->state().committed.label == label && c.Label() == label;
      all_committed = all_committed && committed;
      json row = {{"cycle", name},
                  {"k", k},
                  {"warmup", k == 1},
                  {"verified", verified},
                  {"committed", committed},
                  {"outcome", r.ok() ? update_outcome_name(r->outcome) : r.status().ToString()},
                  {"phases_us", Phases(t)},
                  {"sender_data_plane_us", tt.data_plane_us},
                  {"sender_update_http_us", tt.update_http_us},
                  {"sender_start_http_us", tt.start_http_us},
                  {"sender_finish_http_us", tt.finish_http_us},
                  {"direct_ops", tt.direct_ops},
                  {"staged_ops", tt.staged_ops}};
      if (verified) {
        json rep = c.Report();
        row["check"] = "runner cycle verified byte for byte " + name;
        row["pass"] = committed && rep.value("verified", false) &&
                      rep.value("verified_ok", -1) == static_cast<int>(m.tensors.size()) &&
                      rep["verified_bad"].empty();
        row["receiver"] = rep;
        c.Config("0.30.0", nullptr);
      } else if (k > 1) {
        total_us.push_back(static_cast<double>(t.total_us));
        transfer_us.push_back(static_cast<double>(t.transfer_us));
        data_plane_us.push_back(static_cast<double>(tt.data_plane_us));
        phases.push_back(t);
      }
      Emit(row);
    }
    auto med = [&](std::uint64_t PhaseTimings::*f) {
      std::vector<double> v;
      for (const auto& p : phases) v.push_back(static_cast<double>(p.*f));
      return Median(v);
    };
    const double total_med_s = Median(total_us) / 1e6;
    Emit({{"check", "runner cycle " + name + ": all committed"},
          {"pass", all_committed},
          {"bytes", m.total_bytes()},
          {"tensors", m.tensors.size()},
          {"reps", reps},
          {"total_us", total_us},
          {"total_s_median", total_med_s},
          {"goal_total_s", 0.10},
          {"goal_met", total_med_s <= 0.10},
          {"phases_us_median",
           {{"drain_us", med(&PhaseTimings::drain_us)},
            {"preflight_us", med(&PhaseTimings::preflight_us)},
            {"transfer_us", med(&PhaseTimings::transfer_us)},
            {"invalidate_us", med(&PhaseTimings::invalidate_us)},
            {"validate_us", med(&PhaseTimings::validate_us)},
            {"resume_us", med(&PhaseTimings::resume_us)},
            {"journal_us", med(&PhaseTimings::journal_us)}}},
          {"transfer_share_median", Median(transfer_us) / std::max(1.0, Median(total_us))},
          {"sender_data_plane_us_median", Median(data_plane_us)},
          {"data_plane_GBps_median",
           static_cast<double>(m.total_bytes()) / 1e9 / (Median(data_plane_us) / 1e6)},
          {"journal_dir", dir}});
  }
  return g_failures;
}

// Proves a receiver killed mid-broadcast leaves the controller TAINTED (journaled within 2 s of
// the kill) with the target unpublished and an incident replay explains; it would catch a hang on
// the dead peer, a failure classified as a clean refusal, or a published half-written version.
int Kill(Ctx& c, int pid) {
  c.Config("0.30.0", nullptr,
           30.0);  // the receiver holds back after chunk 1: the kill lands mid-broadcast
  NcclSenderOptions so;
  so.world_size = 2;
  Wiring w("http://127.0.0.1:" + std::to_string(c.port), so);
  Status st = w.sender.Init(60000);
  if (!st.ok()) {
    Emit({{"check", "runner kill: sender init"}, {"pass", false}, {"status", st.ToString()}});
    return 1;
  }
  const Manifest m = Qwen3_8B();
  auto dev = Upload(m, 5, true);
  const std::string uri = "device:qwen3-8b";
  w.sender.RegisterSource(uri, std::make_shared<DevicePointerSource>(m, dev->ptrs, 0));
  const std::string dir = TempJournalDir("kill");
  auto j = journal::Journal::Open(dir, journal::Options{});
  if (!j.ok()) {
    Emit({{"check", "runner kill: journal open"},
          {"pass", false},
          {"status", j.status().ToString()}});
    return 1;
  }
  Runner runner(**j, w.control, w.sender, system_clock(), Options());
  Status boot = runner.Bootstrap("rc-0", Identity(m, uri, 0));
  if (!boot.ok()) {
    Emit({{"check", "runner kill: bootstrap"}, {"pass", false}, {"status", boot.ToString()}});
    return 1;
  }
  // The observer runs after each group is durable: the TAINTED decision's time is its journaling.
  std::atomic<std::int64_t> tainted_ns{0};
  std::uint64_t tainted_seq = 0;
  runner.set_observer([&](std::uint64_t seq, const Event& e) {
    if (const auto* ended = std::get_if<UpdateEnded>(&e);
        ended && ended->outcome == UpdateOutcome::kTainted) {
      tainted_seq = seq;
      tainted_ns = SteadyNs();
    }
  });
  std::atomic<bool> stop{false};
  std::atomic<std::int64_t> kill_ns{0};
  std::thread killer([&] {
    while (!stop && w.sender.progress().ops_completed.load() < 1)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (stop) return;
    std::this_thread::sleep_for(
        std::chrono::milliseconds(200));  // the sender now waits on chunk 2+
    kill_ns = SteadyNs();
    ::kill(pid, SIGKILL);
  });
  auto r = runner.Update(UpdateRequested{"u-kill", "rc-kill", Identity(m, uri, 1), uri});
  stop = true;
  killer.join();
  const PhaseTimings t = runner.last_timings();
  const TransferTiming tt = w.sender.last_timing();
  const State s = (*j)->state();
  const double kill_to_tainted_ms = tainted_ns.load() > 0 && kill_ns.load() > 0
                                        ? static_cast<double>(tainted_ns - kill_ns) / 1e6
                                        : -1;
  auto report = replay::Replay(**j, {});
  json replayed = nullptr;
  bool replay_ok = false, published = false;
  std::string explanation;
  if (report.ok()) {
    replayed = json::parse(replay::ReportJson(*report), nullptr, false);
    replay_ok =
        report->ok && report->incidents.size() == 1 && report->incidents[0].update_id == "u-kill";
    if (!report->incidents.empty()) {
      explanation = report->incidents[0].explanation;
      for (const auto& rec : report->incidents[0].timeline) {
        if (const auto* p = std::get_if<VersionPublished>(&rec.event))
          published = published || p->version.label == "rc-kill";
      }
    }
    std::cerr << replay::FormatReport(*report) << std::endl;
  }
  Emit({{"check",
         "runner kill receiver mid-broadcast -> TAINTED within 2 s, target unpublished, replay "
         "explains"},
        {"pass", r.ok() && r->outcome == UpdateOutcome::kTainted &&
                     s.lifecycle == Lifecycle::kTainted && s.committed.label == "rc-0" &&
                     !published && kill_ns.load() > 0 && kill_to_tainted_ms >= 0 &&
                     kill_to_tainted_ms < 2000 && replay_ok},
        {"outcome", r.ok() ? update_outcome_name(r->outcome) : r.status().ToString()},
        {"reason", r.ok() ? r->reason : ""},
        {"lifecycle", lifecycle_name(s.lifecycle)},
        {"committed_label", s.committed.label},
        {"kill_to_tainted_journaled_ms", kill_to_tainted_ms},
        {"tainted_seq", tainted_seq},
        {"phases_us", Phases(t)},
        {"sender_abort_us", tt.abort_us},
        {"sender_abort_reserve_ms", tt.abort_reserve_ms},
        {"ops_enqueued", w.sender.progress().ops_enqueued.load()},
        {"ops_completed", w.sender.progress().ops_completed.load()},
        {"replay_ok", replay_ok},
        {"replay_explanation", explanation},
        {"replay", replayed},
        {"journal_dir", dir}});
  return g_failures;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "cycle";
  std::uint16_t port = 18000;
  int pid = -1, reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--mode")
      mode = v;
    else if (k == "--port")
      port = static_cast<std::uint16_t>(std::stoi(v));
    else if (k == "--pid")
      pid = std::stoi(v);
    else if (k == "--reps")
      reps = std::stoi(v);
  }
  cudaSetDevice(0);  // the runner calls Transfer on this thread: the communicator's device
  Ctx c(port);
  int fails = 0;
  if (mode == "cycle")
    fails = Cycle(c, reps);
  else if (mode == "kill")
    fails = Kill(c, pid);
  else {
    std::cerr << "unknown mode\n";
    return 2;
  }
  Emit({{"mode", mode}, {"failures", fails}});
  return fails == 0 ? 0 : 1;
}
