#include "effects/fleet_runner.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <utility>

#include "encoding/sha256.h"
#include "statemachine/text.h"

namespace rc::effects {

std::string FleetUpdateIdempotencyKey(const std::string& update_id) {
  return "fleet-update:" + encoding::Sha256Hex(update_id);
}

namespace {

// One OS thread per drive.
class OsThreads final : public MemberThreads {
 public:
  explicit OsThreads(ThreadStart start) : start_(std::move(start)) {}
  ~OsThreads() override { RC_CHECK(threads_.empty()); }
  std::uint64_t Start(std::function<void()> drive) override {
    std::thread t = start_ ? start_(std::move(drive)) : std::thread(std::move(drive));
    RC_CHECK(t.joinable());
    std::lock_guard<std::mutex> l(mu_);
    const std::uint64_t id = ++last_id_;
    // A map node that cannot be made would destroy a running std::thread (terminate): it is
    // joined first, and the allocation failure goes on to the caller.
    try {
      threads_.emplace(id, std::move(t));
    } catch (...) {
      if (t.joinable()) t.join();
      throw;
    }
    return id;
  }
  void Join(std::uint64_t id) override {
    std::thread t;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = threads_.find(id);
      RC_CHECK(it != threads_.end());
      t = std::move(it->second);
      threads_.erase(it);
    }
    t.join();
  }

 private:
  const ThreadStart start_;
  std::mutex mu_;
  std::map<std::uint64_t, std::thread> threads_;
  std::uint64_t last_id_ = 0;
};

}  // namespace

std::unique_ptr<MemberThreads> OsMemberThreads(ThreadStart start) {
  return std::make_unique<OsThreads>(std::move(start));
}

// A member's own update, driven to its end by the executor's MemberThreads.
struct FleetRunner::Member {
  explicit Member(MemberThreads& t) : threads(t) {}
  Member(const Member&) = delete;
  Member& operator=(const Member&) = delete;
  ~Member() { Join(); }
  void Join() {
    if (started) threads.Join(id);
    started = false;
  }
  MemberThreads& threads;
  std::atomic<bool> done{false};
  Status finished;       // FinishUpdate's error, if it failed (read once `done`)
  bool stopped = false;  // its runner gave the plan up to its stop (read once joined)
  bool started = false;
  std::uint64_t id = 0;
};

FleetRunner::FleetRunner(journal::Journal& journal, Clock& clock, FleetRunnerOptions options)
    : journal_(journal),
      clock_(clock),
      options_(std::move(options)),
      own_threads_(options_.threads == nullptr ? OsMemberThreads() : nullptr),
      threads_(options_.threads != nullptr ? *options_.threads : *own_threads_) {
  RC_CHECK(options_.poll_ms > 0);
  RC_CHECK(options_.update_timeout_ms > 0);
  RC_CHECK(options_.runner.engine.empty());  // set per engine by Join
}

Status FleetRunner::SubmitFleetEvent(const Event& event, const std::string& key) {
  RC_CHECK(is_fleet_event(event));
  auto submitted = journal_.SubmitFleet(FleetEvent{"", event}, clock_.wall_ms(), key);
  if (!submitted.ok()) return submitted.status();
  NoteEnds(submitted->decisions);
  return journal_.Wait(submitted->ticket);
}

void FleetRunner::NoteEnds(const std::vector<FleetEvent>& decisions) {
  for (const FleetEvent& d : decisions) NoteEnd(d.event);
}

void FleetRunner::NoteEnd(const Event& decision) {
  const auto* end = std::get_if<FleetUpdateEnded>(&decision);
  if (end == nullptr) return;
  std::lock_guard<std::mutex> l(ends_mu_);
  if (ends_.size() >= kFleetEndsKept) ends_.erase(ends_.begin());
  ends_[end->update_id] = *end;
}

std::optional<FleetUpdateEnded> FleetRunner::NotedEnd(const std::string& update_id) {
  std::lock_guard<std::mutex> l(ends_mu_);
  auto it = ends_.find(update_id);
  if (it == ends_.end()) return std::nullopt;
  return it->second;
}

void FleetRunner::NoteMembersStopped(const std::string& update_id, const Members& members) {
  const bool stopped =
      std::any_of(members.begin(), members.end(), [](const auto& m) { return m.second->stopped; });
  if (!stopped) return;
  std::lock_guard<std::mutex> l(ends_mu_);
  if (std::find(stopped_.begin(), stopped_.end(), update_id) != stopped_.end()) return;
  stopped_.push_back(update_id);
  if (stopped_.size() > kFleetEndsKept) stopped_.pop_front();
}

bool FleetRunner::MemberPlanStopped(const std::string& update_id) {
  std::lock_guard<std::mutex> l(ends_mu_);
  return std::find(stopped_.begin(), stopped_.end(), update_id) != stopped_.end();
}

Status FleetRunner::Configure(const FleetConfigured& policy) { return SubmitFleetEvent(policy); }

Status FleetRunner::Join(const std::string& engine, EngineControl& control,
                         WeightTransfer& transfer) {
  if (runners_.count(engine) != 0) {
    return Status::Conflict("engine '" + engine + "' already has a runner");
  }
  bool member = false;
  journal_.ReadFleetState([&](const FleetState& f) { member = f.engines.count(engine) != 0; });
  if (!member || engine.empty()) RC_RETURN_IF_ERROR(SubmitFleetEvent(EngineJoined{engine}));
  RunnerOptions o = options_.runner;
  o.engine = engine;
  auto r = std::make_unique<Runner>(journal_, control, transfer, clock_, std::move(o));
  r->set_fleet_decisions([this](const Event& decision) { NoteEnd(decision); });
  runners_.emplace(engine, std::move(r));
  return Status::OK();
}

Runner* FleetRunner::runner(const std::string& engine) {
  auto it = runners_.find(engine);
  return it == runners_.end() ? nullptr : it->second.get();
}

// Starts `recover` of each runner on a thread of its own, writing its result into `recovered`. A
// thread that cannot start (Start throws) ends the starts with that error, naming its engine; the
// recoveries already started are in `ids`, for the caller to join.
Status FleetRunner::StartRecoveries(const std::function<Status(Runner&)>& recover,
                                    std::vector<Status>& recovered,
                                    std::vector<std::uint64_t>& ids) {
  RC_CHECK(recovered.size() == runners_.size() && ids.capacity() >= runners_.size());
  std::size_t i = 0;
  for (auto& [engine, r] : runners_) {
    try {
      ids.push_back(
          threads_.Start([&recovered, &recover, i, r = r.get()] { recovered[i] = recover(*r); }));
    } catch (const std::exception& e) {
      return Status::Unavailable("engine '" + engine +
                                 "': its recovery did not start: " + e.what());
    }
    ++i;
  }
  return Status::OK();
}

Status FleetRunner::RecoverEach(const std::function<Status(Runner&)>& recover) {
  std::vector<Status> recovered(runners_.size());
  std::vector<std::uint64_t> ids;
  ids.reserve(runners_.size());  // no allocation between a thread's start and its id kept
  const Status started = StartRecoveries(recover, recovered, ids);
  // Every started recovery writes into `recovered`: joined before it goes, whatever happened.
  for (std::uint64_t id : ids) threads_.Join(id);
  RC_RETURN_IF_ERROR(started);
  std::size_t i = 0;
  for (const auto& [engine, r] : runners_) {
    if (!recovered[i].ok()) {
      return Status(recovered[i].code(), "engine '" + engine + "': " + recovered[i].message());
    }
    ++i;
  }
  return Status::OK();
}

Status FleetRunner::Recover(const journal::Recovery& opened) {
  return RecoverEach([&opened](Runner& r) { return r.Recover(opened); });
}

Status FleetRunner::BeginRecovery(const journal::Recovery& opened) {
  for (auto& [engine, r] : runners_) {
    const Status begun = r->BeginRecovery(opened);
    if (!begun.ok()) return Status(begun.code(), "engine '" + engine + "': " + begun.message());
  }
  return Status::OK();
}

Status FleetRunner::DriveRecoveries() {
  return RecoverEach([](Runner& r) { return r.Drive(); });
}

Status FleetRunner::Remove(const std::string& engine) {
  return SubmitFleetEvent(EngineRemovalRequested{engine});
}

Status FleetRunner::Cancel(const std::string& update_id, const std::string& reason) {
  return SubmitFleetEvent(FleetUpdateCancelled{update_id, reason});
}

// Who may start is computed on a copy of the fleet (fleet_next_members), so only when a member's
// status changed since `last`, or every kReplanPolls looks (other engines may have changed what
// min_serving allows); otherwise `last`'s answer stands.
FleetRunner::Plan FleetRunner::Look(const std::string& update_id, const Plan* last) const {
  Plan plan;
  journal_.ReadFleetState([&](const FleetState& f) {
    plan.open = f.update.has_value() && f.update->request.update_id == update_id;
    if (!plan.open) return;
    plan.members = f.update->members;
    for (const auto& [engine, status] : plan.members) {
      plan.pending += status == MemberStatus::kPending ? 1 : 0;
    }
    if (last != nullptr && last->members == plan.members && last->looks < kReplanPolls) {
      plan.next = last->next;
      plan.blocked = last->blocked;
      plan.member_requests = last->member_requests;
      plan.looks = last->looks + 1;
      return;
    }
    plan.next = fleet_next_members(f);
    plan.blocked = fleet_update_blocked_reason(f);
    for (const std::string& engine : plan.next) {
      plan.member_requests.emplace(engine, member_update_request(f, engine));
    }
  });
  return plan;
}

// The look before a plan of each proposed member not started yet (an engine changed behind the
// fleet is TAINTED by it, and the fold skips the member); a member whose look refused is not
// started, its refusal kept.
std::map<std::string, EngineLooked> FleetRunner::LookAtMembers(
    const Plan& plan, const Members& members, std::map<std::string, Status>& refused) {
  std::map<std::string, EngineLooked> looked;
  for (const std::string& engine : plan.next) {
    if (members.count(engine) != 0) continue;
    Runner* r = runner(engine);
    if (r == nullptr) {
      refused[engine] = Status::NotFound("no runner drives engine '" + engine + "'");
      continue;
    }
    Result<EngineLooked> look = r->LookBeforePlan(plan.member_requests.at(engine));
    if (!look.ok()) {
      refused[engine] = look.status();
      continue;
    }
    looked.emplace(engine, look.value());
  }
  return looked;
}

// Journals the request of each proposed member found as committed, in the fold's order, then
// drives it on its thread. Every member is looked at first, so the members an `all` update
// proposes together all start before any ends. A refused look or start (the engine unread, the
// fleet moved since the look, the journal's queue was full, the digest it was to carry no longer
// held) is tried again at the next look while the fold still proposes the member, with the
// request computed then; the last refusal is kept for the stuck reason.
void FleetRunner::StartMembers(const Plan& plan, Members& members,
                               std::map<std::string, Status>& refused) {
  const std::map<std::string, EngineLooked> looked = LookAtMembers(plan, members, refused);
  for (const std::string& engine : plan.next) {
    auto l = looked.find(engine);
    if (l == looked.end()) continue;
    Runner* r = runner(engine);
    RC_CHECK(r != nullptr);  // looked at through it above
    const UpdateRequested& request = plan.member_requests.at(engine);
    const Status started = r->StartUpdate(request, l->second);
    if (!started.ok()) {
      refused[engine] = started;
      continue;
    }
    refused.erase(engine);
    auto member = std::make_unique<Member>(threads_);
    Member* m = member.get();
    const std::string id = request.update_id;
    m->id = threads_.Start([m, r, id] {
      Result<UpdateEnded> ended = r->FinishUpdate(id);
      if (!ended.ok()) m->finished = ended.status();
      m->stopped = r->plan_stopped();
      m->done.store(true);
    });
    m->started = true;
    members.emplace(engine, std::move(member));
  }
}

namespace {

using Members = std::map<std::string, std::unique_ptr<FleetRunner::Member>>;

bool AnyRunning(const Members& members) {
  for (const auto& [engine, m] : members) {
    if (!m->done.load()) return true;
  }
  return false;
}

void JoinAll(Members& members) {
  for (auto& [engine, m] : members) m->Join();
}

// Why nothing progresses: the fold's reason, the members refused at their start, and those
// whose runner stopped without an end.
std::string StuckReason(const std::string& blocked, const Members& members,
                        const std::map<std::string, Status>& refused) {
  std::string why = blocked;
  auto add = [&why](const std::string& engine, const Status& failed) {
    if (!failed.ok())
      why += (why.empty() ? "" : "; ") + ("engine '" + engine + "': ") + failed.ToString();
  };
  for (const auto& [engine, failed] : refused) add(engine, failed);
  for (const auto& [engine, m] : members) add(engine, m->finished);
  return why.empty() ? std::string("no member may start") : why;
}

}  // namespace

// The update progresses while a member runs. Otherwise it is blocked (the fold lets none start,
// or the runners of those it proposes stopped): after blocked_timeout_ms it is cancelled, which
// skips its pending members; blocked as long again, it cannot end (a member's own update stopped
// without ending, e.g. retries exhausted), and Update returns why.
Status FleetRunner::CancelIfBlocked(const std::string& update_id, const Plan& plan,
                                    const Members& members, Progress& progress) {
  RC_CHECK(progress.refused != nullptr);
  if (AnyRunning(members)) {
    progress.blocked_since_ms = -1;
    return Status::OK();
  }
  const std::int64_t now = clock_.now_ms();
  if (progress.blocked_since_ms < 0) progress.blocked_since_ms = now;
  const std::int64_t blocked_ms = now - progress.blocked_since_ms;
  if (blocked_ms < static_cast<std::int64_t>(options_.blocked_timeout_ms)) return Status::OK();
  const std::string why = StuckReason(plan.blocked, members, *progress.refused);
  if (progress.cancelled) {
    return Status::Unavailable("fleet update '" + update_id + "' cannot end: " + why);
  }
  return CancelOnce(update_id, "blocked for " + std::to_string(blocked_ms) + " ms: " + why,
                    progress);
}

Status FleetRunner::CancelIfPastDeadline(const std::string& update_id, Progress& progress) {
  const std::int64_t open_ms = clock_.now_ms() - progress.requested_ms;
  if (open_ms < static_cast<std::int64_t>(options_.update_timeout_ms)) return Status::OK();
  progress.past_deadline = true;
  if (progress.cancelled) return Status::OK();
  return CancelOnce(update_id,
                    "deadline: open for " + std::to_string(open_ms) + " ms (update_timeout_ms " +
                        std::to_string(options_.update_timeout_ms) + ")",
                    progress);
}

Status FleetRunner::CancelOnce(const std::string& update_id, const std::string& reason,
                               Progress& progress) {
  RC_CHECK(!progress.cancelled);
  const Status cancelled = Cancel(update_id, text::utf8_prefix(reason, kFleetCancelReasonBytesMax));
  // A full queue refused it (not a failure of the journal): tried again at the next look.
  if (cancelled.code() == Code::kBusy) return Status::OK();
  progress.cancelled = true;
  progress.blocked_since_ms = clock_.now_ms();  // "cannot end" counts from the cancel
  if (cancelled.code() == Code::kConflict || cancelled.code() == Code::kNotFound) {
    return Status::OK();
  }
  return cancelled;
}

// When the request was journaled, on this process's monotonic clock. A request asked again after
// a restart is the one the earlier process journaled (same id, same bytes: its seq), and its
// deadline still counts from then, by the wall clocks of the two records.
std::int64_t FleetRunner::RequestedAtMs(std::uint64_t request_seq) {
  const std::int64_t now_ms = clock_.now_ms();
  Result<journal::Record> record = journal_.Read(request_seq);
  if (!record.ok() || !std::holds_alternative<FleetUpdateRequested>(record->event)) {
    return now_ms;
  }
  const std::int64_t age_ms = clock_.wall_ms() - record->wall_time_ms;
  return now_ms - std::max<std::int64_t>(0, age_ms);
}

Result<FleetUpdateEnded> FleetRunner::Update(const FleetUpdateRequested& request) {
  const std::string& id = request.update_id;
  {
    std::lock_guard<std::mutex> l(ends_mu_);
    ends_.erase(id);  // an end or a stop noted under this id belongs to an earlier update
    stopped_.erase(std::remove(stopped_.begin(), stopped_.end(), id), stopped_.end());
  }
  auto submitted = journal_.SubmitFleet(FleetEvent{"", request}, clock_.wall_ms(),
                                        FleetUpdateIdempotencyKey(id));
  if (!submitted.ok()) return submitted.status();
  NoteEnds(submitted->decisions);
  RC_RETURN_IF_ERROR(journal_.Wait(submitted->ticket));
  Members members;
  std::map<std::string, Status> refused;
  Status stopped = Status::OK();
  Progress progress;
  progress.refused = &refused;
  progress.requested_ms = RequestedAtMs(submitted->ticket.result.first_seq);
  for (Plan plan = Look(id, nullptr); plan.open && stopped.ok(); plan = Look(id, &plan)) {
    if (journal_.failed()) {
      stopped = journal_.failure();
      break;
    }
    stopped = CancelIfPastDeadline(id, progress);
    const std::size_t started_before = members.size();
    // Once cancelled, the fold skips the pending members: none is started from an older look.
    if (!progress.cancelled && !progress.past_deadline) StartMembers(plan, members, refused);
    // A member started this look is progress, even one that already ended.
    if (members.size() > started_before) progress.blocked_since_ms = -1;
    // Every member started (an `all` update at once): nothing is left to start, so the members'
    // ends are awaited rather than polled for.
    const bool all_started = plan.pending == plan.next.size() && AnyRunning(members);
    if (all_started) JoinAll(members);
    if (stopped.ok()) stopped = CancelIfBlocked(id, plan, members, progress);
    if (!all_started) clock_.sleep_ms(options_.poll_ms);
  }
  JoinAll(members);  // each member's own update ends by its own deadlines
  NoteMembersStopped(id, members);
  members.clear();
  RC_RETURN_IF_ERROR(stopped);
  // The fold closed the update in some group that may still be committing (a member's, the
  // monitor's, a cancel's): the end is reported only once it is durable.
  RC_RETURN_IF_ERROR(journal_.WaitForHead());
  return FindEnd(submitted->ticket.result.first_seq, id);
}

// The fold decided the end in some member's group (or in the request's own, when refused as a
// whole, or in a cancel's, or in the monitor's): as a submit returned it, or else read back from
// the journal, where it is the truth. Everything up to the head is durable by now.
Result<FleetUpdateEnded> FleetRunner::FindEnd(std::uint64_t from_seq,
                                              const std::string& update_id) {
  std::optional<FleetUpdateEnded> end = NotedEnd(update_id);
  if (end) return *end;
  RC_RETURN_IF_ERROR(journal_.Scan(from_seq, 0, [&](const journal::Record& r) {
    const auto* e = std::get_if<FleetUpdateEnded>(&r.event);
    if (e != nullptr && e->update_id == update_id) end = *e;
    return Status::OK();
  }));
  if (!end) return Status::Internal("fleet update '" + update_id + "' closed without its end");
  return *end;
}

}  // namespace rc::effects
