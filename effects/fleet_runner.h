// The fleet executor: one Runner per engine, driven by the fleet fold's plan (statemachine/
// fleet.h).
//
// A fleet update is journaled as FleetUpdateRequested. Its members' own updates are journaled in
// the order fleet_next_members proposes them (all at once in `all` mode; in `rolling` mode at most
// batch_max at a time while min_serving engines keep serving; in either, when the fleet update
// names no expected digest, the members of one weight layout wait for the first of them to read
// the target's digest, and then carry it), each then driven to its end by its engine's Runner on
// a thread of its own, with the Runner's deadlines. The executor decides nothing: the fold says
// which member may start and with which request (member_update_request), and the fleet update's
// end (FleetUpdateEnded) is the fold's decision, read back from the journal.
//
// Nothing waits forever: a fleet update that cannot progress (no member updating and none may
// start: too few engines serve, or every pending member is quarantined) is cancelled after
// blocked_timeout_ms, naming why; one still open update_timeout_ms after it was requested is
// cancelled too. Either way the members already updating finish by their own deadlines, so
// Update() returns within update_timeout_ms plus one member's deadlines.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "effects/clock.h"
#include "effects/engine.h"
#include "effects/runner.h"
#include "effects/transfer.h"
#include "journal/journal.h"
#include "statemachine/fleet.h"

namespace rc::effects {

// Runs the members of a fleet update (and the runners' recoveries) side by side. The default gives
// each a thread of its own; the simulator's interleaves them one at a time at its scheduling
// points, so that a seed replays the same interleaving.
class MemberThreads {
 public:
  virtual ~MemberThreads() = default;
  // Starts `drive`; the returned id names it for Join.
  [[nodiscard]] virtual std::uint64_t Start(std::function<void()> drive) = 0;
  // Returns once that drive has returned. Each id is joined exactly once.
  virtual void Join(std::uint64_t id) = 0;
};

// One OS thread per drive, each got from `start` (std::thread's constructor when empty). A thread
// that cannot start throws from Start, with nothing recorded.
using ThreadStart = std::function<std::thread(std::function<void()>)>;
std::unique_ptr<MemberThreads> OsMemberThreads(ThreadStart start = {});

struct FleetRunnerOptions {
  RunnerOptions runner;                      // every engine's runner; `engine` is set per engine
  std::uint64_t blocked_timeout_ms = 30000;  // a fleet update that cannot progress is cancelled
  // A fleet update still open this long after its request is durable is cancelled: no member
  // starts after it. A rolling update over many engines needs batches x a member's duration.
  std::uint64_t update_timeout_ms = 3600000;
  // Between looks at the fleet while a rolling update's members run. A look computes which
  // members may start on a copy of the fleet (O(its rollouts)) under the journal's lock, so it
  // is not a busy poll: a rolling batch starts within this of the previous one's end.
  std::uint32_t poll_ms = 20;
  // Where members run; nullptr: a thread of their own each. Not owned; outlives the runner.
  MemberThreads* threads = nullptr;
};

// The journal idempotency key of a fleet update request.
std::string FleetUpdateIdempotencyKey(const std::string& update_id);

class FleetRunner {
 public:
  struct Member;  // a member's update in flight (fleet_runner.cc)

  FleetRunner(journal::Journal& journal, Clock& clock, FleetRunnerOptions options);

  // Journals the fleet's policy.
  [[nodiscard]] Status Configure(const FleetConfigured& policy);
  // Journals EngineJoined unless the fleet already holds `engine` (an executor restart), and
  // makes its runner. `control` and `transfer` must outlive this FleetRunner.
  [[nodiscard]] Status Join(const std::string& engine, EngineControl& control,
                            WeightTransfer& transfer);
  // The runner of an engine joined through this executor (bootstrap, restore, recovery, sleep
  // go through it); nullptr for any other name. A Runner is not thread-safe: never use it while
  // Update(), Recover() or DriveRecoveries() runs (they drive it on threads of their own).
  Runner* runner(const std::string& engine);
  // After an executor restart, with every engine joined again: each runner recovers at once on
  // its own thread (journals RecoveryStarted with what the journal's open found, `opened`, and
  // drives whatever plan was interrupted to its end).
  // Then Update() with the same request (its idempotency key answers with the original) goes on
  // with the members still pending. Returns the first runner's error, naming its engine; a
  // runner whose thread cannot start is that error, once the recoveries started have ended.
  [[nodiscard]] Status Recover(const journal::Recovery& opened);
  // Recover() in two halves, for an executor that must listen before an interrupted plan goes on
  // (a drain waits for rollouts whose clients must reach it, and one engine that hangs must not
  // keep the others from serving). BeginRecovery journals each runner's RecoveryStarted (with
  // `opened`), one runner after another, calling no engine; the first error names its engine.
  [[nodiscard]] Status BeginRecovery(const journal::Recovery& opened);
  // Then DriveRecoveries drives whatever each runner's recovery found interrupted to its end, each
  // runner on its own thread with its own deadlines, and returns once every one has ended: the
  // first runner's error, naming its engine (a thread that cannot start is that error, as in
  // Recover).
  [[nodiscard]] Status DriveRecoveries();
  // Journals the request and drives every member to its end. Returns the fleet update's end as
  // the fold decided it (committed, partial or refused, with each member's count).
  [[nodiscard]] Result<FleetUpdateEnded> Update(const FleetUpdateRequested& request);
  // Journals a cancel of the open fleet update (from any thread): members not started are
  // skipped; Update() returns once the members in flight have ended.
  [[nodiscard]] Status Cancel(const std::string& update_id, const std::string& reason);
  // Journals the engine's removal: it admits nothing more and leaves once its last rollout ends.
  [[nodiscard]] Status Remove(const std::string& engine);
  // Whether a member whose own update Update(`update_id`) drove gave its plan up to its runner's
  // stop (Runner::plan_stopped: a drain cut short, a mutation never sent while stopping): that
  // member's refusal was the stop's, not its own. Known for the newest kFleetEndsKept updates.
  bool MemberPlanStopped(const std::string& update_id);

 private:
  // One look at the open fleet update: whether `update_id` is still open, who may start, why
  // none can.
  struct Plan {
    bool open = false;
    std::vector<std::string> next;
    std::string blocked;
    std::size_t pending = 0;  // members not started yet
    // Each proposed member's own request: the target, held to the digest of its layout.
    std::map<std::string, UpdateRequested> member_requests;
    std::map<std::string, MemberStatus> members;
    std::uint32_t looks = 0;  // looks since `next` was computed
  };
  static constexpr std::uint32_t kReplanPolls = 10;
  using Members = std::map<std::string, std::unique_ptr<Member>>;
  struct Progress {
    std::int64_t blocked_since_ms = -1;  // -1: a member runs
    bool cancelled = false;              // by this executor (blocked, or past the deadline)
    bool past_deadline = false;          // no member starts, even before the cancel is journaled
    std::int64_t requested_ms = 0;       // when the request was durable
    const std::map<std::string, Status>* refused = nullptr;  // members whose start was refused
  };
  Plan Look(const std::string& update_id, const Plan* last) const;
  [[nodiscard]] Status SubmitFleetEvent(const Event& event, const std::string& key = "");
  // Runs `recover` on every runner, each on a thread of its own, and joins them all.
  [[nodiscard]] Status RecoverEach(const std::function<Status(Runner&)>& recover);
  [[nodiscard]] Status StartRecoveries(const std::function<Status(Runner&)>& recover,
                                       std::vector<Status>& recovered,
                                       std::vector<std::uint64_t>& ids);
  std::map<std::string, EngineLooked> LookAtMembers(const Plan& plan, const Members& members,
                                                    std::map<std::string, Status>& refused);
  void StartMembers(const Plan& plan, Members& members, std::map<std::string, Status>& refused);
  [[nodiscard]] Status CancelIfBlocked(const std::string& update_id, const Plan& plan,
                                       const Members& members, Progress& progress);
  std::int64_t RequestedAtMs(std::uint64_t request_seq);
  [[nodiscard]] Status CancelIfPastDeadline(const std::string& update_id, Progress& progress);
  // Journals this executor's cancel; one that came second (another cancel, or the update ended
  // meanwhile) is no error: the next look sees the update as it is.
  [[nodiscard]] Status CancelOnce(const std::string& update_id, const std::string& reason,
                                  Progress& progress);
  [[nodiscard]] Result<FleetUpdateEnded> FindEnd(std::uint64_t from_seq,
                                                 const std::string& update_id);

  // Keeps the FleetUpdateEnded decisions any submit returned (the request's own, a cancel's, a
  // member's), so that Update() rarely reads the journal back.
  void NoteEnds(const std::vector<FleetEvent>& decisions);
  void NoteEnd(const Event& decision);
  std::optional<FleetUpdateEnded> NotedEnd(const std::string& update_id);
  // Notes, once its members are joined, whether one of them gave its plan up to its stop.
  void NoteMembersStopped(const std::string& update_id, const Members& members);

  journal::Journal& journal_;
  Clock& clock_;
  const FleetRunnerOptions options_;
  std::unique_ptr<MemberThreads> own_threads_;  // used when options_.threads is nullptr
  MemberThreads& threads_;
  std::map<std::string, std::unique_ptr<Runner>> runners_;
  std::mutex ends_mu_;                            // member threads note ends
  std::map<std::string, FleetUpdateEnded> ends_;  // by update id, the last kFleetEndsKept
  // The updates a member of which gave its plan up to its stop, oldest first; at most
  // kFleetEndsKept (under ends_mu_).
  std::deque<std::string> stopped_;
  static constexpr std::size_t kFleetEndsKept = 64;
};

}  // namespace rc::effects
