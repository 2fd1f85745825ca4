// Simulated parts: a discrete-event scheduler and virtual clock, a vLLM engine with its own
// truth (weights, label, pause, prefix cache, process instance), the EngineControl and
// WeightTransfer the real runner calls, with per-cycle faults. Single-threaded and seeded.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <queue>
#include <random>
#include <string>
#include <vector>

#include "effects/engine.h"
#include "effects/transfer.h"
#include "sim/sim.h"

namespace rc::sim {

// Discrete events in virtual time. Events never advance time themselves (no nesting).
class Scheduler {
 public:
  static constexpr std::size_t kEventsMax = 1 << 16;  // a runaway producer is a bug
  // A thread's place in virtual time. Several threads may run simulator code (SimThreads), but
  // one at a time: a thread gives the simulator up only inside RunUntil, to whichever thread's
  // time comes first, and waits there until its own comes.
  struct Turn {
    bool go = false;  // under the scheduler's turn mutex
    std::condition_variable cv;
  };
  std::int64_t now_us() const { return now_us_; }
  void At(std::int64_t t_us, std::function<void()> fn);
  void After(std::int64_t delay_us, std::function<void()> fn) {
    At(now_us_ + delay_us, std::move(fn));
  }
  // Runs every event due up to t_us in time order (and lets the other threads run up to their
  // own times meanwhile), then sets the time to t_us. Events due at t_us run before it returns.
  void RunUntil(std::int64_t t_us);
  // A new thread's first turn: `turn` comes up now, after the events already due; the thread
  // waits for it in Await.
  void Enter(Turn& turn);
  void Await(Turn& turn);
  // The calling thread ends: the next thread due takes the simulator.
  void Leave();

 private:
  struct Item {
    std::int64_t t;
    bool is_turn;  // at one time, events run before turns
    std::uint64_t seq;
    std::function<void()> fn;
    Turn* turn;
    bool operator>(const Item& o) const {
      if (t != o.t) return t > o.t;
      if (is_turn != o.is_turn) return is_turn;
      return seq > o.seq;
    }
  };
  void Dispatch(Turn* me);
  void HandOver(Turn* next, Turn* me);
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> queue_;
  std::int64_t now_us_ = 1'000'000;
  std::uint64_t seq_ = 0;
  bool running_ = false;
  std::mutex turns_mu_;
};

// The runner's clock: sleep_ms is the scheduling point where clients, the monitor and the
// engine's requests act. The wall clock may jump; the monotonic one never goes back.
class SimClock final : public effects::Clock {
 public:
  explicit SimClock(Scheduler& s) : s_(s) {}
  std::int64_t now_ms() override { return s_.now_us() / 1000; }
  std::int64_t now_us() override { return s_.now_us(); }
  std::int64_t wall_ms() override { return 1'700'000'000'000 + wall_offset_ms_ + now_ms(); }
  void sleep_ms(std::uint32_t ms) override { s_.RunUntil(s_.now_us() + std::int64_t{ms} * 1000); }
  void Jump(std::int64_t ms) { wall_offset_ms_ += ms; }

 private:
  Scheduler& s_;
  std::int64_t wall_offset_ms_ = 0;
};

enum class Line : std::uint8_t { k025, kNewer };  // vLLM 0.25.x vs the newer route behaviour

inline constexpr const char* kInitialWeights = "ckpt/initial";
// What a level-2 sleeper's weights hold once mapped again (followed by the op number).
inline constexpr const char* kDiscardedWeights = "discarded#";

// The engine's own truth, which the checks compare the journal against.
struct EngineTruth {
  bool alive = true;
  std::uint64_t instance = 1;  // changes on restart
  std::string label = kFreshEngineLabel;
  std::string weights = kInitialWeights;  // a checkpoint, "meta" or "mixed:<...>"
  bool paused = false;
  std::uint64_t op = 0;                // every state-changing operation, in order
  std::uint64_t last_mutation_op = 0;  // weights changed by a transfer or a restart
  std::array<std::uint64_t, kCacheKinds> last_reset_op{};
  std::uint64_t transfer_epoch = 0;  // transfers that touched the weights
  std::uint64_t restarts = 0;
  std::int64_t up_since_us = 0;                     // when this instance came up (virtual time)
  std::map<std::string, std::string> prefix_cache;  // key -> weights that computed the blocks
  // Colocated mode: what /sleep released, as vLLM keeps it (a second sleep keeps the first level).
  std::uint8_t sleep_level = 0;
  bool weights_asleep = false;
  bool kv_asleep = false;
  std::string weights_backup;  // level 1: the host copy a wake-up of the weights restores
};

class SimEngine {
 public:
  using Done = std::function<void(bool ok)>;
  SimEngine(Scheduler& s, Line line, std::vector<std::string>& violations);

  EngineTruth& truth() { return t_; }
  const EngineTruth& truth() const { return t_; }
  Line line() const { return line_; }
  std::string instance_name() const { return "sim-" + std::to_string(t_.instance); }
  bool CachesResetSinceMutation() const;

  // What a restarted process comes back with besides a new instance, unpaused, empty caches.
  enum class Comeback : std::uint8_t {
    kFresh,             // initial weights, label "default"
    kLabelKept,         // initial weights under the label it had: a launcher that sets it
    kLabelWeightsKept,  // the label and the weights it had: a launcher that reloads them
  };
  // The process dies now (requests fail) and is back `down_ms` later, as `comeback` says.
  void Die(std::uint32_t down_ms, Comeback comeback = Comeback::kFresh);
  // A generate request. Runs `duration_ms` once the engine is unpaused; `done(false)` if the
  // engine dies or it is aborted. Returns 0 when the engine is down (connection refused).
  std::uint64_t Start(const std::string& rollout_id, const std::string& cache_key,
                      std::uint32_t duration_ms, Done done);
  void Abort(std::uint64_t request_id);
  std::size_t running() const;
  std::size_t requests() const { return requests_.size(); }  // running and queued

  // Route semantics (the fault-free effect of each call).
  void Pause() { t_.paused = true; }
  void Resume();
  void SetLabel(const std::string& l) { t_.label = l; }
  // false: {"success": false} (blocks held); the 0.25.x line never reports.
  bool ResetCache(CacheKind c);
  void Mutate(const std::string& weights);  // a transfer step that changes the weights
  // /sleep?level=L: a pause that resets the caches, then (unless asleep) releases both pools.
  void Sleep(std::uint8_t level);
  // /wake_up?tags=T: an asleep tag is mapped again (level-1 weights from the host copy, level-2
  // weights as garbage); the scheduler resumes once nothing sleeps. An awake tag is a no-op.
  void Wake(WakeTag tag);
  // /wake_up without tags: every pool mapped again, then the scheduler resumes.
  void WakeAll();
  bool asleep() const { return t_.weights_asleep || t_.kv_asleep; }

 private:
  struct Request {
    std::string rollout_id;
    std::string cache_key;
    std::uint32_t duration_ms = 0;
    bool started = false;
    std::uint64_t token = 0;
    Done done;
  };
  void Begin(std::uint64_t id);
  void Finish(std::uint64_t id, std::uint64_t token);

  Scheduler& s_;
  Line line_;
  std::vector<std::string>& violations_;
  EngineTruth t_;
  std::map<std::uint64_t, Request> requests_;
  std::uint64_t next_id_ = 1;
  std::uint64_t next_token_ = 1;
};

// The faults armed for one cycle, consumed by the engine calls of that cycle (in call order).
struct CycleFaults {
  std::map<std::uint32_t, Fault> by_call;  // engine call index -> fault
  std::uint32_t delay_ms = 0;
  std::uint32_t success_false_left = 0;
  std::optional<Fault> death;  // at call a%16
  std::optional<Fault> preflight;
  std::optional<Fault> transfer;
  bool silent_loss = false;
  std::uint32_t unnamed_left = 0;  // answers still to name no process (kInstanceUnread)
  std::uint32_t calls = 0;
};

// Arms, for this cycle, a fault that acts through the engine's calls: an HTTP fault, {"success":
// false}, a delay, a death, a refused preflight, a failed transfer, a silent loss. False for any
// other kind, which its world arms itself.
bool ArmCallFault(const Fault& f, CycleFaults& cf);

// The weight digest the engine's worker extension would compute over `weights` (and what a
// trainer digesting the same checkpoint in the engine's layout computes).
WeightDigest SimDigest(const std::string& weights);

// Who reads the engine's weight digest.
enum class DigestRead : std::uint8_t { kValidation, kProbe, kMonitor };

// kDigestUnread for one cycle: each weight-digest read of the kinds it targets fails with
// probability per_mille / 1000.
struct DigestFaults {
  std::uint32_t per_mille = 0;  // 0: every read succeeds (and no draw is made)
  std::uint32_t mode = 0;       // 0 timeout, 1 HTTP 5xx, 2 malformed body
  std::uint32_t reads = 0;      // 0 every read, 1 validations, 2 probes, 3 monitor looks
  bool targets(DigestRead r) const {
    return reads == 0 || reads == 1 + static_cast<std::uint32_t>(r);
  }
};

// The EngineControl and WeightTransfer the real runner drives.
class SimControl final : public effects::EngineControl, public effects::WeightTransfer {
 public:
  SimControl(SimEngine& e, Scheduler& s) : e_(e), s_(s) {}
  CycleFaults& faults() { return f_; }
  // kDigestUnread: armed until the next call of either (a cycle's start disarms it). Its draws come
  // from a stream of the fault's own, so a read's fate depends on nothing else the seed does.
  void ArmDigestFaults(const Fault& f);
  void DisarmDigestFaults() { digest_ = DigestFaults{}; }
  std::uint64_t digest_reads_failed() const { return digest_reads_failed_; }
  std::uint64_t validations_unread() const { return validations_unread_; }
  std::int64_t last_digest_failure_us() const { return last_digest_failure_us_; }
  // The engine's op count when a probe or a monitor look last read its digest: a weight change
  // after it (a larger last_mutation_op) has not been seen by any digest read yet.
  std::uint64_t last_digest_read_op() const { return last_digest_read_op_; }

  HttpEvidence Health() override;
  EngineProbed Probe() override;
  HttpEvidence SetLabel(const std::string& label) override;
  // The simulated engine has no weight sessions: nothing to end, nothing sent.
  HttpEvidence EndOpenWeightSession() override {
    HttpEvidence h;
    h.transport = Transport::kConnectFailed;
    return h;
  }
  DrainObserved PauseWait(std::uint64_t timeout_ms) override;
  CacheResetObserved ResetCache(CacheKind cache) override;
  ValidationObserved WeightInfo() override;
  ResumeObserved Resume() override;
  SleepObserved Sleep(std::uint8_t level, std::uint64_t timeout_ms) override;
  WakeObserved Wake(WakeTag tag, std::uint64_t timeout_ms) override;
  PreflightObserved Preflight(const effects::TransferTarget& target) override;
  TransferObserved Transfer(const effects::TransferTarget& target,
                            std::uint64_t deadline_ms) override;

  // The engine as the executor's monitor sees it (no HTTP faults, only kDigestUnread; a dead
  // engine is unreachable), its weight digest read when `with_digest` and the weights are mapped.
  EngineMonitored Monitor(bool with_digest = true);
  // The engine's truth when the last WeightInfo answered (what validation vouched for).
  struct Validated {
    std::uint64_t instance = 0;
    std::string weights, label;
    bool caches_reset = false;
    std::uint64_t mutation_op = 0;
    bool paused = false;      // nothing could be served while it answered
    bool digest_read = true;  // false: its weight-digest read failed (kDigestUnread)
  };
  const std::optional<Validated>& validated() const { return validated_; }
  // The weights' last mutation when the last resume (or KV wake-up, a sleeper's resume) answered:
  // the point the fold publishes at. An outsider may change the engine after it, before the
  // publish is durable and observed; that is the monitor's to taint.
  std::uint64_t mutation_op_at_resume() const { return mutation_op_at_resume_; }

 private:
  // One call: latency, the death fault, then the injected fault. `applied` says whether the
  // route's effect happened (the caller performs it when true).
  HttpEvidence Call(bool* applied);
  // The process an answer names: none while a kInstanceUnread fault has answers left.
  std::string AnsweringInstance();
  // The digest a read returns: the engine's weights', or none with the failed read's error.
  WeightDigest ReadDigest(DigestRead read);

  SimEngine& e_;
  Scheduler& s_;
  CycleFaults f_;
  std::optional<Validated> validated_;
  std::uint64_t mutation_op_at_resume_ = 0;
  DigestFaults digest_;
  std::mt19937_64 digest_rng_;
  std::uint64_t digest_reads_failed_ = 0, validations_unread_ = 0, last_digest_read_op_ = 0;
  std::int64_t last_digest_failure_us_ = 0;
};

// kRestartKeepsLabel's comeback: b odd reloads the weights the process had.
inline SimEngine::Comeback LabelKeepingComeback(const Fault& f) {
  return f.b % 2 ? SimEngine::Comeback::kLabelWeightsKept : SimEngine::Comeback::kLabelKept;
}

}  // namespace rc::sim
