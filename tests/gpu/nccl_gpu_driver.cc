// GPU driver for the NCCL sender against tests/gpu/receiver_double.py (rank 1 on GPU 1).
// Modes (each prints one JSON object per check/measurement, one per line, and exits non-zero if a
// check failed):
//   e2e      both rendezvous modes, three protocol lines, packed + unpacked, safetensors and device
//            sources, byte-for-byte verification by the double; wrong-device and identity refusals
//   bench    RolloutCore Transfer vs raw ncclBroadcast of the same bytes, same run, Qwen3-8B-shaped
//            (16 GB bf16) and OPT-125M-shaped sets; contiguous (zero-copy) and scattered (packed
//            copy)
//   deadline the double stalls after one chunk: Transfer must abort at its deadline (kPossible)
//   kill     the double is SIGKILLed mid-broadcast: Transfer must return kPossible within 2 s
//   ipc      the OPT-125M set exported by another process (ipc_export.py) through CUDA IPC
#include <cuda_runtime.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "effects/nccl/nccl_sender.h"
#include "effects/nccl/rendezvous.h"
#include "tests/gpu/gpu_fixtures.h"

using namespace rc;
using namespace rc::effects;
using namespace rc::effects::nccl;
using namespace rc::gpu_test;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

// The files a run writes go to one private directory (--workdir DIR, else a fresh mkdtemp under
// $TMPDIR or /tmp), so that two runs on one host never share a path.
std::string g_workdir;
const std::string& WorkDir() {
  if (g_workdir.empty()) {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl =
        std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/rc_gpu_XXXXXX";
    RC_CHECK(::mkdtemp(tmpl.data()) != nullptr);
    g_workdir = tmpl;
  }
  return g_workdir;
}
std::string WorkFile(const std::string& name) { return WorkDir() + "/" + name; }

int g_failures = 0;
void Emit(json j) {
  std::cout << j.dump() << std::endl;
  if (j.contains("pass") && j["pass"] == false) ++g_failures;
}
double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

TransferTarget Target(const std::string& uri, const std::string& label,
                      const std::string& digest = "") {
  TransferTarget t;
  t.update_id = "u-" + label;
  t.target.label = label;
  t.identity.manifest_digest = digest;
  t.source_uri = uri;
  return t;
}

json Obs(const TransferObserved& o) {
  return {{"acknowledged", o.acknowledged}, {"mutation", mutation_name(o.mutation)},
          {"bytes_sent", o.bytes_sent},     {"tensors_sent", o.tensors_sent},
          {"duration_us", o.duration_us},   {"error", o.error}};
}

// One verified transfer; checks ack, the double's byte-for-byte report and the label.
void VerifiedTransfer(Ctx& c, NcclSender& s, const std::string& name, const std::string& uri,
                      const Manifest& m, const std::string& label) {
  auto o = s.Transfer(Target(uri, label, m.digest()), 120000);
  json rep = c.Report();
  const bool pass =
      o.acknowledged && o.mutation == MutationClass::kComplete && rep.value("verified", false) &&
      rep.value("verified_ok", -1) == static_cast<int>(m.tensors.size()) &&
      rep["verified_bad"].empty() && c.Label() == label && o.bytes_sent == m.total_bytes();
  Emit({{"check", name},
        {"pass", pass},
        {"observed", Obs(o)},
        {"receiver", rep},
        {"rendezvous", rendezvous_name(s.rendezvous())},
        {"line", protocol_line_name(s.protocol().line)}});
}

int E2E(Ctx& c) {
  const Manifest opt = Opt125M();
  const std::uint64_t seed = 1234567;
  auto dev = Upload(opt, seed, /*contiguous=*/false);
  auto src = std::make_shared<DevicePointerSource>(opt, dev->ptrs, 0);
  const std::string weights = WorkFile("opt125m.safetensors");
  WriteSafetensors(opt, seed, weights);
  struct Case {
    std::string version;
    Rendezvous mode;
    bool packed;
  };
  const std::vector<Case> cases = {
      {"0.30.0", Rendezvous::kUniqueId, true}, {"0.30.0", Rendezvous::kUniqueId, false},
      {"0.30.0", Rendezvous::kTcpStore, true}, {"0.28.0", Rendezvous::kAuto, true},
      {"0.25.1", Rendezvous::kAuto, true},     {"0.25.1", Rendezvous::kAuto, false}};
  int n = 0;
  for (const auto& k : cases) {
    c.Config(k.version, seed);
    NcclSenderOptions o;
    o.world_size = 0;  // ask /get_world_size
    o.rendezvous = k.mode;
    o.packing.packed = k.packed;
    o.packing.packed_buffer_size_bytes = 64ull << 20;  // several chunks for a 250 MB set
    NcclSender s(c.api, o);
    Status st = s.Init(60000);
    json rep = c.Report();
    const std::string tag =
        k.version + "/" + rendezvous_name(k.mode) + "/" + (k.packed ? "packed" : "unpacked");
    Emit({{"check", "init " + tag},
          {"pass", st.ok() && rep.value("init", "") ==
                                  (s.rendezvous() == Rendezvous::kUniqueId ? "uid" : "tcpstore")},
          {"status", st.ToString()},
          {"receiver", rep}});
    if (!st.ok()) continue;
    s.RegisterSource("device:opt", src);
    VerifiedTransfer(c, s, "transfer device " + tag, "device:opt", opt,
                     "rc-" + std::to_string(++n));
    VerifiedTransfer(c, s, "transfer safetensors " + tag, "safetensors:" + weights, opt,
                     "rc-" + std::to_string(++n));
    if (k.version == "0.30.0" && k.mode == Rendezvous::kUniqueId && k.packed) {
      // Wrong current device: refused in preflight and in Transfer, nothing sent.
      cudaSetDevice(1);
      auto p = s.Preflight(Target("device:opt", "x"));
      auto t = s.Transfer(Target("device:opt", "rc-wrong-device"), 10000);
      cudaSetDevice(0);
      Emit({{"check", "wrong current device refused"},
            {"pass", !p.device_ok && !t.acknowledged && t.mutation == MutationClass::kNone &&
                         c.Label() != "rc-wrong-device"},
            {"preflight_detail", p.detail},
            {"observed", Obs(t)}});
      auto ok = s.Preflight(Target("device:opt", "x", opt.digest()));
      Emit({{"check", "preflight ok"},
            {"pass", ok.device_ok && ok.memory_ok && ok.source_manifest_digest == opt.digest()},
            {"detail", ok.detail}});
      // Identity mismatch: the declared manifest is Qwen3-8B's, the source is OPT-125M.
      const std::string declared = Qwen3_8B().digest();
      auto pm = s.Preflight(Target("device:opt", "x", declared));
      auto tm = s.Transfer(Target("device:opt", "rc-mismatch", declared), 10000);
      Emit({{"check", "identity mismatch: digest differs, transfer refused"},
            {"pass", pm.source_manifest_digest == opt.digest() &&
                         pm.source_manifest_digest != declared && !tm.acknowledged &&
                         tm.mutation == MutationClass::kNone},
            {"declared", declared},
            {"source", pm.source_manifest_digest},
            {"observed", Obs(tm)}});
      // Re-init: a fresh communicator, transfers still verify.
      Status re = s.Init(60000);
      Emit({{"check", "re-init fresh communicator"}, {"pass", re.ok()}, {"status", re.ToString()}});
      if (re.ok())
        VerifiedTransfer(c, s, "transfer after re-init", "device:opt", opt,
                         "rc-" + std::to_string(++n));
    }
  }
  return g_failures;
}

int Bench(Ctx& c, int reps) {
  c.Config("0.30.0", nullptr);
  NcclSenderOptions o;
  o.world_size = 2;
  NcclSender s(c.api, o);
  Status st = s.Init(60000);
  Emit({{"check", "bench init"}, {"pass", st.ok()}, {"status", st.ToString()}});
  if (!st.ok()) return 1;
  const std::uint64_t chunk = 1ull << 30;
  for (const auto& [name, m] : std::vector<std::pair<std::string, Manifest>>{
           {"opt-125m", Opt125M()}, {"qwen3-8b", Qwen3_8B()}}) {
    const std::uint64_t seed = 99;
    auto contig = Upload(m, seed, true);
    auto scattered = Upload(m, seed, false);
    s.RegisterSource("bench:" + name + ":contiguous",
                     std::make_shared<DevicePointerSource>(m, contig->ptrs, 0));
    s.RegisterSource("bench:" + name + ":scattered",
                     std::make_shared<DevicePointerSource>(m, scattered->ptrs, 0));
    std::vector<double> raw_us, contig_us, scat_us, contig_total_us;
    // Receiver lag: the receiver's first posted broadcast (time.monotonic_ns, CLOCK_MONOTONIC)
    // minus the sender's first enqueue (steady_clock, the same clock on Linux). The data-plane
    // clock starts at the sender's enqueue, so this lag is inside every data-plane figure.
    std::vector<double> raw_lag_us, contig_lag_us, scat_lag_us;
    auto lag_us = [&](std::int64_t sender_ns) {
      json rep = c.Report();
      return static_cast<double>(rep.value("first_post_mono_ns", std::int64_t{0}) - sender_ns) /
             1e3;
    };
    int label = 0;
    for (int r = 0; r < reps + 1; ++r) {  // rep 0 warms caches and allocators on both sides
      std::thread rx([&] {
        c.Call(EngineClient::Method::kPost, "/test/raw_recv",
               json{{"bytes", m.total_bytes()}, {"chunk_bytes", chunk}}, 120000);
      });
      const std::int64_t raw_t0_ns = SteadyNs();
      auto raw = s.RawBroadcast(contig->ptrs[0], m.total_bytes(), chunk, 120000);
      rx.join();
      const double raw_lag = lag_us(raw_t0_ns);
      auto a = s.Transfer(Target("bench:" + name + ":contiguous", "b" + std::to_string(++label)),
                          120000);
      const auto ta = s.last_timing();
      const double a_lag = lag_us(ta.first_enqueue_steady_ns);
      auto b =
          s.Transfer(Target("bench:" + name + ":scattered", "b" + std::to_string(++label)), 120000);
      const auto tb = s.last_timing();
      const double b_lag = lag_us(tb.first_enqueue_steady_ns);
      if (!raw.ok() || !a.acknowledged || !b.acknowledged) {
        Emit({{"check", "bench " + name},
              {"pass", false},
              {"raw", raw.status().ToString()},
              {"a", Obs(a)},
              {"b", Obs(b)}});
        return 1;
      }
      if (r == 0) continue;
      raw_lag_us.push_back(raw_lag);
      contig_lag_us.push_back(a_lag);
      scat_lag_us.push_back(b_lag);
      raw_us.push_back(static_cast<double>(*raw));
      contig_us.push_back(static_cast<double>(ta.data_plane_us));
      contig_total_us.push_back(static_cast<double>(a.duration_us));
      scat_us.push_back(static_cast<double>(tb.data_plane_us));
    }
    auto best = [](std::vector<double> v) { return *std::min_element(v.begin(), v.end()); };
    auto med = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double gb = static_cast<double>(m.total_bytes()) / 1e9;
    Emit({{"bench", name},
          {"bytes", m.total_bytes()},
          {"tensors", m.tensors.size()},
          {"reps", reps},
          {"raw_us", raw_us},
          {"rc_contiguous_data_plane_us", contig_us},
          {"rc_scattered_data_plane_us", scat_us},
          {"rc_contiguous_transfer_total_us", contig_total_us},
          {"raw_receiver_lag_us", raw_lag_us},
          {"rc_contiguous_receiver_lag_us", contig_lag_us},
          {"rc_scattered_receiver_lag_us", scat_lag_us},
          {"raw_GBps_median", gb / (med(raw_us) / 1e6)},
          {"rc_contiguous_GBps_median", gb / (med(contig_us) / 1e6)},
          {"rc_scattered_GBps_median", gb / (med(scat_us) / 1e6)},
          {"ratio_contiguous_vs_raw_median", med(raw_us) / med(contig_us)},
          {"ratio_scattered_vs_raw_median", med(raw_us) / med(scat_us)},
          {"ratio_contiguous_vs_raw_best", best(raw_us) / best(contig_us)},
          {"ratio_scattered_vs_raw_best", best(raw_us) / best(scat_us)}});
    // One verified pass of the scattered (packing) path at full size.
    c.Config("0.30.0", seed);
    VerifiedTransfer(c, s, "bench verified " + name + " scattered", "bench:" + name + ":scattered",
                     m, "v-" + name);
    c.Config("0.30.0", nullptr);
  }
  return g_failures;
}

// ipc: proves the sender can broadcast tensors another process exported through CUDA IPC
// (ipc_export.py on GPU 0, opened as ipc:<file>), verified byte for byte by the receiver; it would
// catch a handle/offset misread (wrong bytes) or a handle that cannot be opened.
int Ipc(Ctx& c, const std::string& script) {
  const Manifest opt = Opt125M();
  const std::uint64_t seed = 4242;
  const std::string manifest_path = WorkFile("ipc_manifest.json"), out = WorkFile("ipc.json"),
                    pidf = WorkFile("ipc.pid");
  std::remove(out.c_str());
  std::remove(pidf.c_str());
  json list = json::array();
  for (const auto& t : opt.tensors)
    list.push_back({{"name", t.name}, {"dtype", dtype_torch_name(t.dtype)}, {"shape", t.shape}});
  std::ofstream(manifest_path) << list.dump();
  const std::string cmd = "python3 " + script + " --manifest " + manifest_path + " --out " + out +
                          " --seed " + std::to_string(seed) + " --device 0 --pid-file " + pidf +
                          " &";
  RC_CHECK(std::system(cmd.c_str()) == 0);
  const auto t0 = Clock::now();
  while (!std::filesystem::exists(out) && MsSince(t0) < 120000)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  int exporter = -1;
  std::ifstream(pidf) >> exporter;
  c.Config("0.30.0", seed);
  NcclSenderOptions o;
  o.world_size = 2;
  NcclSender s(c.api, o);
  Status st = s.Init(60000);
  Emit({{"check", "ipc init"},
        {"pass", st.ok() && std::filesystem::exists(out)},
        {"status", st.ToString()},
        {"exporter_pid", exporter},
        {"export_ms", MsSince(t0)}});
  if (st.ok()) {
    auto p = s.Preflight(Target("ipc:" + out, "x", opt.digest()));
    Emit({{"check", "ipc preflight"},
          {"pass", p.device_ok && p.source_manifest_digest == opt.digest()},
          {"detail", p.detail}});
    VerifiedTransfer(c, s, "ipc source verified byte for byte", "ipc:" + out, opt, "rc-ipc");
  }
  if (exporter > 0) ::kill(exporter, SIGTERM);
  return g_failures;
}

// deadline: proves Transfer returns by its deadline, abort included, when the double stalls after
// the first chunk (would catch an overshoot by the ncclCommAbort time); kill: proves a SIGKILLed
// receiver ends Transfer within 2 s as kPossible (would catch a hang on the dead peer).
int Liveness(Ctx& c, bool kill, int pid, std::uint64_t deadline_ms) {
  c.Config("0.30.0", nullptr, kill ? 30.0 : 60.0);
  NcclSenderOptions o;
  o.world_size = 2;
  NcclSender s(c.api, o);
  Status st = s.Init(60000);
  if (!st.ok()) {
    Emit({{"check", "liveness init"}, {"pass", false}, {"status", st.ToString()}});
    return 1;
  }
  const Manifest m = Qwen3_8B();
  auto dev = Upload(m, 5, true);
  s.RegisterSource("q", std::make_shared<DevicePointerSource>(m, dev->ptrs, 0));
  std::atomic<bool> stop{false};
  Clock::time_point t_kill{};
  std::thread killer;
  if (kill) {
    killer = std::thread([&] {
      while (!stop && s.progress().ops_completed.load() < 1)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (stop) return;
      std::this_thread::sleep_for(
          std::chrono::milliseconds(200));  // the sender is now waiting on chunk 2+
      t_kill = Clock::now();
      ::kill(pid, SIGKILL);
    });
  }
  const auto t0 = Clock::now();
  auto obs = s.Transfer(Target("q", "never"), deadline_ms);
  const auto t_ret = Clock::now();
  stop = true;
  if (killer.joinable()) killer.join();
  const auto timing = s.last_timing();
  const double transfer_ms = std::chrono::duration<double, std::milli>(t_ret - t0).count();
  json j = {{"observed", Obs(obs)},
            {"abort_us", timing.abort_us},
            {"abort_reserve_ms", timing.abort_reserve_ms},
            {"transfer_ms", transfer_ms},
            {"ops_enqueued", s.progress().ops_enqueued.load()},
            {"ops_completed", s.progress().ops_completed.load()},
            {"ready_after", s.ready()}};
  if (kill) {
    const double since_kill_ms = std::chrono::duration<double, std::milli>(t_ret - t_kill).count();
    j["check"] = "kill receiver mid-broadcast";
    j["return_after_kill_ms"] = since_kill_ms;
    j["pass"] = t_kill != Clock::time_point{} && !obs.acknowledged &&
                obs.mutation == MutationClass::kPossible && since_kill_ms < 2000 && !s.ready();
  } else {
    j["check"] = "deadline with a stalled receiver";
    // The abort is inside the deadline: Transfer returns by it (no slack).
    j["deadline_ms"] = deadline_ms;
    j["overshoot_ms"] = transfer_ms - static_cast<double>(deadline_ms);
    j["pass"] = !obs.acknowledged && obs.mutation == MutationClass::kPossible &&
                transfer_ms <= static_cast<double>(deadline_ms) && timing.abort_us > 0 &&
                !s.ready();
  }
  Emit(j);
  // A communicator-less sender refuses without sending anything.
  auto again = s.Transfer(Target("q", "never2"), 5000);
  Emit({{"check", "after abort: refused until re-init"},
        {"pass", again.mutation == MutationClass::kNone && !again.acknowledged},
        {"observed", Obs(again)}});
  return g_failures;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "e2e";
  std::uint16_t port = 18000;
  int pid = -1, reps = 3;
  std::uint64_t deadline_ms = 3000;
  std::string ipc_script = "tests/gpu/ipc_export.py";
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
    else if (k == "--deadline-ms")
      deadline_ms = std::stoull(v);
    else if (k == "--ipc-script")
      ipc_script = v;
    else if (k == "--workdir")
      g_workdir = v;
  }
  if (!g_workdir.empty()) std::filesystem::create_directories(g_workdir);
  std::cerr << "nccl_gpu_driver: files in " << WorkDir() << "\n";
  cudaSetDevice(0);
  Ctx c(port);
  int fails = 0;
  if (mode == "e2e")
    fails = E2E(c);
  else if (mode == "bench")
    fails = Bench(c, reps);
  else if (mode == "deadline")
    fails = Liveness(c, false, pid, deadline_ms);
  else if (mode == "kill")
    fails = Liveness(c, true, pid, 60000);
  else if (mode == "ipc")
    fails = Ipc(c, ipc_script);
  else {
    std::cerr << "unknown mode\n";
    return 2;
  }
  Emit({{"mode", mode}, {"failures", fails}});
  return fails == 0 ? 0 : 1;
}
