// The mutation gate that serve's shutdown closes (service/mutation_gate.h), around the real HTTP
// engine control and GPU-free transfer, against the vLLM double on loopback: what a closed gate
// keeps from the engine (counted on the double's routes), what it lets through, and the one
// transfer it must still let pass, after a wake-up of a sleeper's weights.
#include "service/mutation_gate.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "effects/http/engine_client.h"
#include "effects/http/engine_control.h"
#include "effects/http/protocol.h"
#include "effects/http/sequence_transfer.h"
#include "fixtures/vllm_double.h"

namespace rc::service {
namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr const char* kVersion = "0.30.0";
constexpr const char* kSource = "synthetic:4x64:1";
constexpr std::uint64_t kCallMs = 5000;
constexpr std::uint64_t kTransferMs = 10000;

effects::TransferTarget Target(const std::string& label) {
  effects::TransferTarget t;
  t.update_id = "u-" + label;
  t.target = WeightVersion{1, label};
  t.source_uri = kSource;
  return t;
}

// One engine as serve wires it: the double behind an EngineClient, its HTTP control and sequence
// transfer, each behind the gate, the two wrappers sharing one EngineMutations.
struct GatedEngine {
  GatedEngine() : engine(Options()) {
    port = engine.Start(0);
    effects::EngineDeadlines d;
    d.connect_timeout_ms = 1000;
    d.call_timeout_ms = kCallMs;
    d.drain_timeout_ms = kCallMs;
    d.update_timeout_ms = kTransferMs;
    client = std::make_unique<effects::EngineClient>(engine.base_url(), d);
    control = std::make_unique<effects::HttpEngineControl>(*client);
    transfer = std::make_unique<effects::HttpSequenceTransfer>(*client,
                                                               effects::detect_protocol(kVersion));
    gated_control = GateControl(*control, gate, kCallMs, done);
    gated_transfer = GateTransfer(*transfer, gate, done);
  }
  ~GatedEngine() {
    gated_transfer.reset();
    gated_control.reset();
    transfer.reset();
    control.reset();
    client.reset();  // closes its keep-alive connections before the double stops
    engine.Stop();
  }

  static fixtures::VllmDoubleOptions Options() {
    fixtures::VllmDoubleOptions o;
    o.version = kVersion;
    o.token_delay_ms = 1;
    o.enable_sleep_mode = true;  // a sleeper's weights are unmapped until woken
    return o;
  }

  std::uint64_t Count(const char* route) const { return engine.RouteCount(route); }
  // Every route of the transfer that reaches the engine.
  std::uint64_t TransferCalls() const {
    return Count("/get_world_size") + Count("/init_weight_transfer_engine") +
           Count("/start_weight_update") + Count("/update_weights") +
           Count("/finish_weight_update");
  }

  fixtures::VllmDouble engine;
  int port = -1;
  std::unique_ptr<effects::EngineClient> client;
  std::unique_ptr<effects::HttpEngineControl> control;
  std::unique_ptr<effects::HttpSequenceTransfer> transfer;
  MutationGate gate;
  std::shared_ptr<EngineMutations> done = std::make_shared<EngineMutations>();
  std::unique_ptr<effects::EngineControl> gated_control;
  std::unique_ptr<effects::WeightTransfer> gated_transfer;
};

void ExpectRefused(const TransferObserved& t, const std::string& label) {
  EXPECT_FALSE(t.acknowledged);
  EXPECT_EQ(t.mutation, MutationClass::kNone);
  EXPECT_EQ(t.bytes_sent, 0u);
  EXPECT_EQ(t.finish_label, label);
  EXPECT_EQ(t.error, kRefusedAtShutdown);
}

void ExpectNotSent(const HttpEvidence& h) {
  EXPECT_TRUE(h.never_sent());
  EXPECT_EQ(h.error, kRefusedAtShutdown);
}

// Proves a closed gate keeps every mutation (transfer, sleep, wake-up of the weights, label
// write) from the engine and reports it never sent, while the preflight still answers and health,
// pause, resume and the KV-cache wake-up still reach the engine; would catch a mutation started
// after the shutdown began, or a gate that also blocks the calls that end a plan safely.
TEST(MutationGate, ClosedRefusesEveryMutationAndPassesTheRest) {
  GatedEngine e;
  ASSERT_GT(e.port, 0);
  e.gate.Close();
  ASSERT_TRUE(e.gate.closed());

  ExpectRefused(e.gated_transfer->Transfer(Target("rc-1"), kTransferMs), "rc-1");
  const SleepObserved s = e.gated_control->Sleep(1, kCallMs);
  ExpectNotSent(s.http);
  EXPECT_EQ(s.level, std::uint8_t{1});
  const WakeObserved w = e.gated_control->Wake(WakeTag::kWeights, kCallMs);
  ExpectNotSent(w.http);
  EXPECT_EQ(w.tag, WakeTag::kWeights);
  ExpectNotSent(e.gated_control->SetLabel("rc-9"));

  EXPECT_EQ(e.TransferCalls(), 0u);
  EXPECT_EQ(e.Count("/sleep"), 0u);
  EXPECT_EQ(e.Count("/wake_up"), 0u);
  EXPECT_EQ(e.Count("/update_weight_version"), 0u);
  EXPECT_EQ(e.engine.weight_label(), "default");
  EXPECT_EQ(e.gate.in_flight(), 0u);
  EXPECT_FALSE(e.gate.BusyUntil().has_value());

  const PreflightObserved p = e.gated_transfer->Preflight(Target("rc-1"));
  EXPECT_EQ(p.source_manifest_digest, effects::synthetic_manifest(kSource)->digest());
  const HttpEvidence health = e.gated_control->Health();
  EXPECT_TRUE(health.ok_2xx()) << health.error;
  EXPECT_EQ(e.Count("/health"), 1u);
  const DrainObserved drained = e.gated_control->PauseWait(kCallMs);
  EXPECT_TRUE(drained.http.ok_2xx()) << drained.http.error;
  EXPECT_TRUE(drained.paused);
  EXPECT_EQ(e.Count("/pause"), 1u);
  const ResumeObserved resumed = e.gated_control->Resume();
  EXPECT_TRUE(resumed.http.ok_2xx()) << resumed.http.error;
  EXPECT_EQ(e.Count("/resume"), 1u);
  const WakeObserved kv = e.gated_control->Wake(WakeTag::kKvCache, kCallMs);
  EXPECT_TRUE(kv.http.ok_2xx()) << kv.http.error;
  EXPECT_EQ(e.Count("/wake_up"), 1u);
  EXPECT_EQ(e.gate.in_flight(), 0u);
}

// Proves that after a wake-up of a sleeper's weights that passed before the close, the next
// transfer passes the closed gate, reaches the engine and is waited for (in flight, its deadline
// in BusyUntil), and that it consumes the wake-up (a second transfer is refused); would catch a
// shutdown that leaves the weights woken with nothing loaded (TAINTED), or one that lets every
// later transfer through.
TEST(MutationGate, ATransferAfterAPassedWakeOfTheWeightsPassesAClosedGate) {
  GatedEngine e;
  ASSERT_GT(e.port, 0);
  const SleepObserved slept = e.gated_control->Sleep(1, kCallMs);
  ASSERT_TRUE(slept.http.ok_2xx()) << slept.http.error;
  const WakeObserved woken = e.gated_control->Wake(WakeTag::kWeights, kCallMs);
  ASSERT_TRUE(woken.http.ok_2xx()) << woken.http.error;
  ASSERT_EQ(e.Count("/wake_up"), 1u);
  EXPECT_TRUE(e.done->weights_woken.load());
  e.gate.Close();
  EXPECT_EQ(e.gate.in_flight(), 0u);
  EXPECT_FALSE(e.gate.BusyUntil().has_value());  // nothing was in flight at the close

  // /update_weights held a while, so the transfer can be seen in flight.
  fixtures::RouteFault slow;
  slow.delay_ms = 1000;
  slow.times = 1;
  e.engine.SetRouteFault("/update_weights", slow);
  TransferObserved t;
  std::thread runner([&] { t = e.gated_transfer->Transfer(Target("rc-1"), kTransferMs); });
  const SteadyClock::time_point give_up = SteadyClock::now() + std::chrono::seconds(5);
  while (e.gate.in_flight() == 0 && SteadyClock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const SteadyClock::time_point seen_at = SteadyClock::now();
  const std::size_t in_flight = e.gate.in_flight();
  const std::optional<SteadyClock::time_point> busy = e.gate.BusyUntil();
  runner.join();

  EXPECT_EQ(in_flight, 1u);
  ASSERT_TRUE(busy.has_value());
  // Bound by the transfer's own deadline (kTransferMs from its start), not by its end.
  EXPECT_GT(*busy, seen_at + std::chrono::milliseconds(kTransferMs / 2));
  EXPECT_TRUE(t.acknowledged) << t.error;
  EXPECT_EQ(t.mutation, MutationClass::kComplete);
  EXPECT_EQ(t.tensors_sent, 4u);
  EXPECT_EQ(t.finish_label, "rc-1");
  EXPECT_EQ(e.Count("/start_weight_update"), 1u);
  EXPECT_EQ(e.Count("/update_weights"), 1u);
  EXPECT_EQ(e.Count("/finish_weight_update"), 1u);
  EXPECT_EQ(e.engine.weight_label(), "rc-1");
  EXPECT_FALSE(e.done->weights_woken.load());
  EXPECT_EQ(e.gate.in_flight(), 0u);
  const std::optional<SteadyClock::time_point> ended = e.gate.BusyUntil();
  ASSERT_TRUE(ended.has_value());
  EXPECT_LE(*ended, SteadyClock::now());  // when it ended: the shutdown waits no longer

  // The wake-up was consumed: another transfer would be a new mutation.
  const std::uint64_t calls = e.TransferCalls();
  ExpectRefused(e.gated_transfer->Transfer(Target("rc-2"), kTransferMs), "rc-2");
  EXPECT_EQ(e.TransferCalls(), calls);
  EXPECT_EQ(e.engine.weight_label(), "rc-1");

  // The plan still ends: the KV-cache wake-up passes the closed gate.
  const WakeObserved kv = e.gated_control->Wake(WakeTag::kKvCache, kCallMs);
  EXPECT_TRUE(kv.http.ok_2xx()) << kv.http.error;
  EXPECT_EQ(e.Count("/wake_up"), 2u);
}

// Proves a KV-cache wake-up clears a passed wake-up of the weights, so a transfer after the
// close is refused again; would catch a stale wake-up letting a new transfer through a closed
// gate after its plan had already ended.
TEST(MutationGate, AKvCacheWakeClearsTheWokenWeights) {
  GatedEngine e;
  ASSERT_GT(e.port, 0);
  const SleepObserved slept = e.gated_control->Sleep(1, kCallMs);
  ASSERT_TRUE(slept.http.ok_2xx()) << slept.http.error;
  const WakeObserved weights = e.gated_control->Wake(WakeTag::kWeights, kCallMs);
  ASSERT_TRUE(weights.http.ok_2xx()) << weights.http.error;
  const WakeObserved kv = e.gated_control->Wake(WakeTag::kKvCache, kCallMs);
  ASSERT_TRUE(kv.http.ok_2xx()) << kv.http.error;
  ASSERT_EQ(e.Count("/wake_up"), 2u);
  EXPECT_FALSE(e.done->weights_woken.load());
  e.gate.Close();

  ExpectRefused(e.gated_transfer->Transfer(Target("rc-1"), kTransferMs), "rc-1");
  EXPECT_EQ(e.TransferCalls(), 0u);
  EXPECT_EQ(e.engine.weight_label(), "default");
  EXPECT_EQ(e.gate.in_flight(), 0u);
  EXPECT_FALSE(e.gate.BusyUntil().has_value());
}

}  // namespace
}  // namespace rc::service
