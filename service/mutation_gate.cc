#include "service/mutation_gate.h"

#include <algorithm>
#include <string>
#include <utility>

#include "statemachine/events.h"
#include "statemachine/status.h"

namespace rc::service {

MutationGate::Pass::Pass(Pass&& other) noexcept
    : gate_(std::exchange(other.gate_, nullptr)), ticket_(other.ticket_) {}

MutationGate::Pass& MutationGate::Pass::operator=(Pass&& other) noexcept {
  if (this == &other) return *this;
  if (gate_ != nullptr) gate_->Leave(ticket_);
  gate_ = std::exchange(other.gate_, nullptr);
  ticket_ = other.ticket_;
  return *this;
}

MutationGate::Pass::~Pass() {
  if (gate_ != nullptr) gate_->Leave(ticket_);
}

MutationGate::Pass MutationGate::Enter(std::uint64_t deadline_ms) {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) return Pass();
  RC_CHECK(in_flight_.size() < kFleetEnginesMax);  // one effect at a time per engine's runner
  const std::uint64_t ticket = next_ticket_++;
  in_flight_.emplace(ticket, Clock::now() + std::chrono::milliseconds(deadline_ms));
  return Pass(this, ticket);
}

MutationGate::Pass MutationGate::Continue(std::uint64_t deadline_ms) {
  std::lock_guard<std::mutex> g(mu_);
  RC_CHECK(in_flight_.size() < kFleetEnginesMax);  // one effect at a time per engine's runner
  const std::uint64_t ticket = next_ticket_++;
  in_flight_.emplace(ticket, Clock::now() + std::chrono::milliseconds(deadline_ms));
  return Pass(this, ticket);
}

void MutationGate::Leave(std::uint64_t ticket) {
  std::lock_guard<std::mutex> g(mu_);
  const std::size_t erased = in_flight_.erase(ticket);
  RC_CHECK(erased == 1);  // each pass leaves exactly once
  // Only a mutation in flight when the gate closed binds a plan the shutdown waits for.
  if (closed_) last_end_ = Clock::now();
}

void MutationGate::Close() {
  std::lock_guard<std::mutex> g(mu_);
  closed_ = true;
}

bool MutationGate::closed() const {
  std::lock_guard<std::mutex> g(mu_);
  return closed_;
}

std::size_t MutationGate::in_flight() const {
  std::lock_guard<std::mutex> g(mu_);
  return in_flight_.size();
}

std::optional<MutationGate::Clock::time_point> MutationGate::BusyUntil() const {
  std::lock_guard<std::mutex> g(mu_);
  if (in_flight_.empty()) return last_end_;
  Clock::time_point latest = in_flight_.begin()->second;
  for (const auto& [ticket, deadline] : in_flight_) latest = std::max(latest, deadline);
  return latest;
}

namespace {

// An HTTP exchange the gate kept from the engine: provably never sent.
HttpEvidence NotSent() {
  HttpEvidence h;
  h.transport = Transport::kConnectFailed;
  h.error = kRefusedAtShutdown;
  RC_CHECK(h.never_sent());
  return h;
}

class GatedTransfer final : public effects::WeightTransfer {
 public:
  GatedTransfer(effects::WeightTransfer& inner, MutationGate& gate,
                std::shared_ptr<EngineMutations> done)
      : inner_(inner), gate_(gate), done_(std::move(done)) {
    RC_CHECK(done_ != nullptr);
  }

  PreflightObserved Preflight(const effects::TransferTarget& target) override {
    return inner_.Preflight(target);
  }

  TransferObserved Transfer(const effects::TransferTarget& target,
                            std::uint64_t deadline_ms) override {
    const bool woken = done_->weights_woken.exchange(false);
    const MutationGate::Pass pass = woken ? gate_.Continue(deadline_ms) : gate_.Enter(deadline_ms);
    if (pass) return inner_.Transfer(target, deadline_ms);
    TransferObserved t;
    t.acknowledged = false;
    t.mutation = MutationClass::kNone;
    t.finish_label = target.target.label;
    t.error = kRefusedAtShutdown;
    return t;
  }

 private:
  effects::WeightTransfer& inner_;
  MutationGate& gate_;
  const std::shared_ptr<EngineMutations> done_;
};

class GatedControl final : public effects::EngineControl {
 public:
  GatedControl(effects::EngineControl& inner, MutationGate& gate, std::uint64_t call_timeout_ms,
               std::shared_ptr<EngineMutations> done)
      : inner_(inner), gate_(gate), call_timeout_ms_(call_timeout_ms), done_(std::move(done)) {
    RC_CHECK(done_ != nullptr);
  }

  HttpEvidence Health() override { return inner_.Health(); }
  EngineProbed Probe() override { return inner_.Probe(); }
  EngineMonitored Observe(bool with_digest, std::uint64_t timeout_ms) override {
    return inner_.Observe(with_digest, timeout_ms);
  }
  HttpEvidence SetLabel(const std::string& label) override {
    const MutationGate::Pass pass = gate_.Enter(call_timeout_ms_);
    return pass ? inner_.SetLabel(label) : NotSent();
  }
  // Behind the gate: on vLLM 0.25.x a finish commits whatever the session loaded.
  HttpEvidence EndOpenWeightSession() override {
    const MutationGate::Pass pass = gate_.Enter(call_timeout_ms_);
    return pass ? inner_.EndOpenWeightSession() : NotSent();
  }
  DrainObserved PauseWait(std::uint64_t timeout_ms) override {
    return inner_.PauseWait(timeout_ms);
  }
  CacheResetObserved ResetCache(CacheKind cache) override { return inner_.ResetCache(cache); }
  ValidationObserved WeightInfo() override { return inner_.WeightInfo(); }
  ResumeObserved Resume() override { return inner_.Resume(); }
  SleepObserved Sleep(std::uint8_t level, std::uint64_t timeout_ms) override {
    const MutationGate::Pass pass = gate_.Enter(timeout_ms);
    if (pass) return inner_.Sleep(level, timeout_ms);
    SleepObserved s;
    s.http = NotSent();
    s.level = level;
    return s;
  }
  // Waking the KV cache is how a sleeper resumes (its plan's end, or its undoing): it passes.
  WakeObserved Wake(WakeTag tag, std::uint64_t timeout_ms) override {
    if (tag != WakeTag::kWeights) {
      done_->weights_woken.store(false);  // the plan's end (or a wake-up that loads nothing)
      return inner_.Wake(tag, timeout_ms);
    }
    const MutationGate::Pass pass = gate_.Enter(timeout_ms);
    if (pass) {
      done_->weights_woken.store(true);  // before the call: it may wake them and then fail
      return inner_.Wake(tag, timeout_ms);
    }
    WakeObserved w;
    w.http = NotSent();
    w.tag = tag;
    return w;
  }

 private:
  effects::EngineControl& inner_;
  MutationGate& gate_;
  const std::uint64_t call_timeout_ms_;
  const std::shared_ptr<EngineMutations> done_;
};

}  // namespace

std::unique_ptr<effects::WeightTransfer> GateTransfer(effects::WeightTransfer& inner,
                                                      MutationGate& gate,
                                                      std::shared_ptr<EngineMutations> done) {
  return std::make_unique<GatedTransfer>(inner, gate, std::move(done));
}

std::unique_ptr<effects::EngineControl> GateControl(effects::EngineControl& inner,
                                                    MutationGate& gate,
                                                    std::uint64_t call_timeout_ms,
                                                    std::shared_ptr<EngineMutations> done) {
  return std::make_unique<GatedControl>(inner, gate, call_timeout_ms, std::move(done));
}

}  // namespace rc::service
