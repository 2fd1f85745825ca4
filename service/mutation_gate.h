// MutationGate: once `serve` begins to shut down, no new mutation of an engine starts.
//
// Every call of a plan that may change an engine passes the gate first: a weight transfer, a
// sleep, a wake-up of the weights, a label write. Shutdown closes the gate. A mutation the gate
// refuses is reported to the runner as never sent (a transfer of MutationClass::kNone, an HTTP
// exchange that never reached the engine), which the fold already classifies as refused before
// any mutation: the plan ends refused, recorded so, and the engine resumes on its committed
// weights. The gate is checked at the moment the engine call would start, under its lock, so a
// mutation either passed before the close (Shutdown then knows it is in flight, with its own
// deadline, and waits for it rather than cutting it) or never starts.
//
// Preflights, cache resets, validation, pause and resume pass untouched: they change no weights,
// and the resets, validation and resume are what completes (or undoes) a plan safely.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "effects/engine.h"
#include "effects/transfer.h"

namespace rc::service {

// What the gate says in the evidence of a mutation it refused.
inline constexpr const char* kRefusedAtShutdown =
    "not started: serve is shutting down (nothing was sent to the engine)";

class MutationGate {
 public:
  using Clock = std::chrono::steady_clock;

  // A mutation that passed: in flight until destroyed. Movable, not copyable.
  class Pass {
   public:
    Pass() = default;
    Pass(Pass&& other) noexcept;
    Pass& operator=(Pass&& other) noexcept;
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;
    ~Pass();
    explicit operator bool() const { return gate_ != nullptr; }

   private:
    friend class MutationGate;
    Pass(MutationGate* gate, std::uint64_t ticket) : gate_(gate), ticket_(ticket) {}
    MutationGate* gate_ = nullptr;
    std::uint64_t ticket_ = 0;
  };

  MutationGate() = default;
  MutationGate(const MutationGate&) = delete;
  MutationGate& operator=(const MutationGate&) = delete;

  // A pass for a mutation bounded by `deadline_ms` from now; an empty one once closed.
  [[nodiscard]] Pass Enter(std::uint64_t deadline_ms);
  // A pass even once closed: for the next mutation of a plan that already mutated (refusing it
  // would leave the engine half changed), waited for by the shutdown like any other.
  [[nodiscard]] Pass Continue(std::uint64_t deadline_ms);
  // From now on every Enter is refused. Idempotent.
  void Close();
  bool closed() const;
  std::size_t in_flight() const;
  // Until when the mutations that passed still bind the plans that made them: the latest
  // deadline of those in flight, else when the last one in flight at the close ended; nullopt
  // when there is none.
  std::optional<Clock::time_point> BusyUntil() const;

 private:
  void Leave(std::uint64_t ticket);

  mutable std::mutex mu_;
  bool closed_ = false;
  std::uint64_t next_ticket_ = 1;
  // ticket -> deadline. One entry per runner performing an effect (each performs one at a time),
  // so at most one per engine: bounded by kFleetEnginesMax.
  std::map<std::uint64_t, Clock::time_point> in_flight_;
  std::optional<Clock::time_point> last_end_;  // set only once closed
};

// What one engine's plan already did to it, shared by that engine's gated control and transfer:
// a sleeper's update wakes its weights and then transfers, and the transfer after a wake that
// passed must pass a gate closed meanwhile (refused, the plan would end with the weights woken
// and nothing loaded: TAINTED).
struct EngineMutations {
  std::atomic<bool> weights_woken{false};  // since the last transfer or KV-cache wake-up
};

// `inner`'s transfer behind `gate` (its preflight passes untouched). Both must outlive it.
std::unique_ptr<effects::WeightTransfer> GateTransfer(effects::WeightTransfer& inner,
                                                      MutationGate& gate,
                                                      std::shared_ptr<EngineMutations> done);
// `inner`'s engine calls behind `gate`: Sleep, Wake of the weights and SetLabel (a label write is
// bounded by `call_timeout_ms`). Both must outlive it.
std::unique_ptr<effects::EngineControl> GateControl(effects::EngineControl& inner,
                                                    MutationGate& gate,
                                                    std::uint64_t call_timeout_ms,
                                                    std::shared_ptr<EngineMutations> done);

}  // namespace rc::service
