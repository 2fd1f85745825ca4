// Proves RolloutCore's Runner + NcclSender commit an update on a REAL vLLM server (and go TAINTED
// when it is killed mid-transfer); it would catch any route, body or rendezvous the double accepts
// but the engine does not.
// RolloutCore against a REAL vLLM server (tests/gpu/vllm/): effects::Runner with a real journal,
// HttpEngineControl + NcclSender over one EngineClient, the weights read from a safetensors file
// written by tests/gpu/vllm/make_model.py. One JSON object per line on stdout.
// One sender Init (one NCCL group), bootstrap --from, then one Runner::Update per --steps entry
// "FILE=LABEL" (comma separated): drain pause mode=wait, NCCL transfer with the protocol
// GET /version selects, cache resets, validation while paused, resume; phases and timings.
// --gate DIR: before step k >= 2 wait for DIR/go.K; after each step touch DIR/done.K.
//   --mode kill: during the LAST step the engine (--pid; negative = process group) is SIGKILLed
//   once the first broadcast has completed: the controller must journal TAINTED within 2 s.
// A step whose label is written "raw:LABEL" is NOT run through the Runner: NcclSender::Transfer
// alone (start/update/finish with the label, no pause, no cache reset) — the stale-cache negative
// control of E4, an update made outside RolloutCore's lifecycle.
// --resident 1: each checkpoint is first copied into GPU 0 memory (one allocation, tensors back to
// back) and sent from there, as from a trainer that holds its weights on the GPU (the article's
// setup); without it the sender stages the file through pinned host memory.
// Every checkpoint's identity carries the SHA-256 of the file's bytes (files up to 4 GiB), so two
// checkpoints with one manifest are told apart by content, not only by path (E5).
#include <signal.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>
#include <iostream>
#include <random>
#include <string>
#include <thread>

#include "effects/http/engine_client.h"
#include "effects/http/engine_control.h"
#include "effects/nccl/nccl_sender.h"
#include "effects/nccl/weight_source.h"
#include "effects/runner.h"
#include "encoding/sha256.h"
#include "journal/journal.h"
#include "replay/replay.h"
#include "statemachine/hex.h"
#include "tests/gpu/gpu_fixtures.h"

using namespace rc;
using namespace rc::effects;
using namespace rc::effects::nccl;
using namespace rc::gpu_test;

namespace {

// One log row. Rows carry status texts that may hold an engine's bytes: never throw on invalid
// UTF-8.
std::string Row(const json& row) {
  return row.dump(-1, ' ', false, json::error_handler_t::replace);
}

json Phases(const PhaseTimings& t) {
  return {{"total_us", t.total_us},           {"drain_us", t.drain_us},
          {"preflight_us", t.preflight_us},   {"transfer_us", t.transfer_us},
          {"invalidate_us", t.invalidate_us}, {"validate_us", t.validate_us},
          {"resume_us", t.resume_us},         {"journal_us", t.journal_us}};
}

// Lowercase hex SHA-256 of a file, "" when larger than max_bytes or unreadable.
std::string FileSha256(const std::string& path, std::uint64_t max_bytes) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec || size > max_bytes) return "";
  std::ifstream in(path, std::ios::binary);
  encoding::Sha256Hasher hasher;
  std::vector<char> buf(std::size_t{8} << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    if (in.gcount() > 0)
      hasher.Update(std::string_view(buf.data(), static_cast<std::size_t>(in.gcount())));
  }
  return hex::encode(hasher.Finish());
}

// Copies a host source into one device allocation on the current device (freed at exit).
std::shared_ptr<WeightSource> MakeResident(const WeightSource& host, std::vector<void*>* keep) {
  const Manifest& m = host.manifest();
  char* base = nullptr;
  RC_CHECK(cudaMalloc(reinterpret_cast<void**>(&base),
                      std::max<std::uint64_t>(m.total_bytes(), 1)) == cudaSuccess);
  keep->push_back(base);
  std::uint64_t max_bytes = 1;
  for (const auto& t : m.tensors) max_bytes = std::max(max_bytes, t.nbytes());
  std::vector<char> buf(max_bytes);
  std::vector<const void*> ptrs;
  std::uint64_t off = 0;
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    RC_CHECK(host.ReadHost(i, buf.data()).ok());
    RC_CHECK(cudaMemcpy(base + off, buf.data(), m.tensors[i].nbytes(), cudaMemcpyHostToDevice) ==
             cudaSuccess);
    ptrs.push_back(base + off);
    off += m.tensors[i].nbytes();
  }
  return std::make_shared<DevicePointerSource>(m, std::move(ptrs), 0);
}

json IdentityJson(const WeightIdentity& id) {
  return {{"manifest_digest", id.manifest_digest},
          {"content_digest", id.content_digest},
          {"checkpoint", id.checkpoint},
          {"run", id.run},
          {"step", id.step}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "update", url = "http://127.0.0.1:8000", steps_arg, gate, from = "rc-0";
  int pid = -1;
  bool resident = false;
  std::uint64_t drain_ms = 60000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--mode")
      mode = v;
    else if (k == "--url")
      url = v;
    else if (k == "--steps")
      steps_arg = v;
    else if (k == "--gate")
      gate = v;
    else if (k == "--from")
      from = v;
    else if (k == "--pid")
      pid = std::stoi(v);
    else if (k == "--drain-ms")
      drain_ms = std::stoull(v);
    else if (k == "--resident")
      resident = v == "1";
  }
  std::vector<std::pair<std::string, std::string>> steps;  // file, label
  {
    std::stringstream ss(steps_arg);
    std::string item;
    while (std::getline(ss, item, ',')) {
      const auto eq = item.find('=');
      if (eq != std::string::npos) steps.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    }
  }
  if (steps.empty()) {
    std::cerr << "--steps FILE=LABEL[,...] required\n";
    return 2;
  }
  std::vector<std::shared_ptr<WeightSource>> sources;
  for (const auto& [path, label] : steps) {
    auto src = SafetensorsSource::Open(path);
    if (!src.ok()) {
      std::cout << Row(json{{"check", "open " + path},
                            {"pass", false},
                            {"status", src.status().ToString()}})
                << std::endl;
      return 1;
    }
    sources.emplace_back(std::move(*src));
  }
  const Manifest m = sources[0]->manifest();
  EngineDeadlines d;
  d.connect_timeout_ms = 1000;
  d.call_timeout_ms = 10000;
  d.drain_timeout_ms = drain_ms;
  d.update_timeout_ms = 120000;
  EngineClient client(url, d);
  HttpEngineControl control(client);
  NcclSenderOptions so;  // world_size 0: 1 + GET /get_world_size; rendezvous from GET /version
  NcclSender sender(client, so);
  const auto t_init = SteadyNs();
  Status st = sender.Init(120000);
  std::cout << Row(json{{"check", "sender init (rendezvous with the engine)"},
                        {"pass", st.ok()},
                        {"status", st.ToString()},
                        {"init_ms", (SteadyNs() - t_init) / 1e6}})
            << std::endl;
  if (!st.ok()) return 1;
  std::vector<void*> device_copies;
  if (resident) {
    RC_CHECK(cudaSetDevice(0) == cudaSuccess);
    const auto t = SteadyNs();
    for (auto& src : sources) src = MakeResident(*src, &device_copies);
    std::cout << Row(json{{"resident", true}, {"upload_ms", (SteadyNs() - t) / 1e6}}) << std::endl;
  }
  for (std::size_t i = 0; i < steps.size(); ++i)
    sender.RegisterSource("file:" + steps[i].first + "#" + std::to_string(i), sources[i]);
  std::random_device rd;
  const auto dir =
      (std::filesystem::temp_directory_path() / ("rc-vllm-journal-" + std::to_string(rd())))
          .string();
  std::filesystem::create_directories(dir);
  auto j = journal::Journal::Open(dir, journal::Options{});
  if (!j.ok()) return 1;
  RunnerOptions o;
  o.drain_timeout_ms = drain_ms;
  o.transfer_timeout_ms = 120000;
  o.call_timeout_ms = 10000;
  Runner runner(**j, control, sender, system_clock(), o);
  Status boot = runner.Bootstrap(from, WeightIdentity{m.digest(), "", "dummy:", "vllm-real", 0});
  std::cout << Row(json{{"check", "bootstrap " + from},
                        {"pass", boot.ok()},
                        {"status", boot.ToString()}})
            << std::endl;
  if (!boot.ok()) return 1;
  std::atomic<std::int64_t> tainted_ns{0}, kill_ns{0};
  runner.set_observer([&](std::uint64_t, const Event& e) {
    if (const auto* ended = std::get_if<UpdateEnded>(&e);
        ended && ended->outcome == UpdateOutcome::kTainted)
      tainted_ns = SteadyNs();
  });
  int fails = 0;
  std::string prev = from;
  std::vector<std::string> contents;
  for (const auto& [path, label] : steps) {
    const auto t = SteadyNs();
    contents.push_back(FileSha256(path, std::uint64_t{4} << 30));
    std::cout << Row(json{{"content_sha256", path},
                          {"digest", contents.back()},
                          {"ms", (SteadyNs() - t) / 1e6}})
              << std::endl;
  }
  for (std::size_t i = 0; i < steps.size(); ++i) {
    std::string label = steps[i].second;
    const bool raw = label.rfind("raw:", 0) == 0;
    if (raw) label = label.substr(4);
    const std::string uri = "file:" + steps[i].first + "#" + std::to_string(i);
    const WeightIdentity identity{m.digest(), contents[i], uri, "vllm-real",
                                  static_cast<int>(i + 1)};
    if (i > 0 && !gate.empty()) {
      const auto go = gate + "/go." + std::to_string(i + 1);
      for (int w = 0; w < 2400 && !std::filesystem::exists(go); ++w)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (raw) {  // outside the lifecycle: no drain, no reset, no validation, nothing journaled
      const auto t0 = SteadyNs();
      TransferObserved tr = sender.Transfer(
          TransferTarget{"raw-" + label, WeightVersion{0, label}, identity, uri}, 120000);
      json row = {{"mode", "raw"},
                  {"step", i + 1},
                  {"file", steps[i].first},
                  {"label", label},
                  {"transfer_wall_ms", (SteadyNs() - t0) / 1e6},
                  {"acknowledged", tr.acknowledged},
                  {"mutation", mutation_name(tr.mutation)},
                  {"error", tr.error},
                  {"check", "raw transfer outside RolloutCore (E4 negative control: caches left)"},
                  {"pass", tr.acknowledged}};
      std::cout << Row(row) << std::endl;
      if (!tr.acknowledged) ++fails;
      if (!gate.empty()) std::ofstream(gate + "/done." + std::to_string(i + 1)) << 0;
      continue;
    }
    const bool kill_step = mode == "kill" && i + 1 == steps.size();
    std::atomic<bool> stop{false};
    std::thread killer;
    if (kill_step) {
      // The sender zeroes its progress counters when a transfer starts: wait for that reset (a
      // count below the previous step's), then for the first completed broadcast of this one.
      const auto base = sender.progress().ops_completed.load();
      killer = std::thread([&, base] {
        bool reset_seen = base == 0;
        for (;;) {
          if (stop) break;
          const auto done = sender.progress().ops_completed.load();
          if (done < base) reset_seen = true;
          if (reset_seen && done >= 1) break;
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        if (stop) return;
        kill_ns = SteadyNs();
        ::kill(pid, SIGKILL);
      });
    }
    const auto t0 = SteadyNs();
    auto r = runner.Update(UpdateRequested{"u-" + label, label, identity, uri});
    const double wall_ms = (SteadyNs() - t0) / 1e6;
    stop = true;
    if (killer.joinable()) killer.join();
    const PhaseTimings t = runner.last_timings();
    const TransferTiming tt = sender.last_timing();
    const State s = (*j)->state();
    json row = {{"mode", kill_step ? "kill" : "update"},
                {"resident", resident},
                {"step", i + 1},
                {"file", steps[i].first},
                {"label", label},
                {"bytes", m.total_bytes()},
                {"tensors", m.tensors.size()},
                {"update_wall_ms", wall_ms},
                {"outcome", r.ok() ? update_outcome_name(r->outcome) : r.status().ToString()},
                {"reason", r.ok() ? r->reason : ""},
                {"lifecycle", lifecycle_name(s.lifecycle)},
                {"committed_label", s.committed.label},
                {"phases_us", Phases(t)},
                {"committed_identity", IdentityJson(s.committed_identity)},
                {"sender_data_plane_us", tt.data_plane_us},
                {"sender_update_http_us", tt.update_http_us},
                {"sender_start_http_us", tt.start_http_us},
                {"sender_finish_http_us", tt.finish_http_us},
                {"direct_ops", tt.direct_ops},
                {"staged_ops", tt.staged_ops},
                {"ops_completed", sender.progress().ops_completed.load()},
                {"journal_dir", dir}};
    if (kill_step) {
      const double ms = tainted_ns > 0 && kill_ns > 0 ? (tainted_ns - kill_ns) / 1e6 : -1;
      row["kill_to_tainted_journaled_ms"] = ms;
      row["check"] = "engine SIGKILLed mid-transfer -> TAINTED within 2 s, target unpublished";
      row["pass"] = r.ok() && r->outcome == UpdateOutcome::kTainted && ms >= 0 && ms < 2000 &&
                    s.committed.label == prev;
      auto rep = replay::Replay(**j, {});
      if (rep.ok() && !rep->incidents.empty())
        row["replay_explanation"] = rep->incidents[0].explanation;
    } else {
      row["check"] = "Runner::Update against real vLLM commits";
      row["pass"] = r.ok() && r->outcome == UpdateOutcome::kCommitted && s.committed.label == label;
    }
    std::cout << Row(row) << std::endl;
    if (!row["pass"].get<bool>()) ++fails;
    if (!gate.empty()) std::ofstream(gate + "/done." + std::to_string(i + 1)) << wall_ms;
    prev = label;
    if (!r.ok() || r->outcome != UpdateOutcome::kCommitted) break;
  }
  return fails == 0 ? 0 : 1;
}
