// A fleet behind one `serve`: its members (each an engine client, control, weight transfer and
// upstream pool), the fleet executor that updates them (effects/fleet_runner.h), and admission
// across them. The trainer API of a fleet is in fleet_api.cc.
//
// Startup, under update_mu_: every configured engine must answer GET /version; the journal's
// policy is configured when it differs; every engine joins (a restart finds them joined); every
// runner journals its RecoveryStarted; a member still UNINITIALIZED bootstraps at the fleet's
// newest label (the fold refuses any other), or at initial_label on a new fleet, held to the
// digest its weight layout holds for that label (join_digest), or waits for one. Whatever each
// runner's recovery found interrupted, and a fleet update found open after it, is driven to its
// end once the proxy listens (StartFleet), as one engine's interrupted update is: on a thread of
// its own when a plan was interrupted, so that one member's hung plan keeps no other from serving.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "effects/clock.h"
#include "effects/http/weight_digest.h"
#include "service/balancer.h"
#include "service/engine_startup.h"
#include "service/nccl_transfer.h"
#include "service/service.h"
#include "service/service_internal.h"

namespace rc::service {
namespace {

using namespace internal;  // NOLINT: the service's own helpers

constexpr int kJoinDigestAttempts = 3;
constexpr int kJoinDigestRetryMs = 1000;

// The label a joining member bootstraps at: the fleet's newest, with its identity.
struct NewestLabel {
  std::string label;
  WeightIdentity identity;
};

// The newest generation an untainted engine holds, as the fold's bootstrap rule reads it; nullopt
// when none holds one (a new fleet, or every holder TAINTED): the configured initial label then.
std::optional<NewestLabel> FleetNewestLabel(const FleetState& f) {
  const std::optional<std::uint64_t> newest = newest_held_generation(f);
  if (!newest) return std::nullopt;
  for (const auto& [label, generation] : f.label_generation) {
    if (generation != *newest) continue;
    RC_CHECK(f.labels.count(label) == 1);  // one identity per label served
    return NewestLabel{label, f.labels.at(label)};
  }
  RC_CHECK(false);  // a held generation names a label
  return std::nullopt;
}

// Why no member admits now, each engine's reason, bounded (a 503's message and a log line).
std::string FleetBlockReason(const FleetState& f,
                             const std::map<std::string, std::unique_ptr<FleetMember>>& members) {
  constexpr std::size_t kReasonBytesMax = 1024;
  std::string why = "no engine of the fleet admits now:";
  for (const auto& [name, m] : members) {
    if (why.size() > kReasonBytesMax) return why + " ...";
    const std::string r = fleet_admission_block_reason(f, name);
    why += " " + name + ": " + (r.empty() ? "admits" : r) + ";";
  }
  return why;
}

// True when no configured member can admit again without an operator: each is TAINTED, leaving
// or gone.
bool FleetQuarantined(const FleetState& f,
                      const std::map<std::string, std::unique_ptr<FleetMember>>& members) {
  return std::all_of(members.begin(), members.end(), [&f](const auto& m) {
    const auto it = f.engines.find(m.first);
    return m.second->retire || it == f.engines.end() || f.leaving.count(m.first) != 0 ||
           it->second.lifecycle == Lifecycle::kTainted;
  });
}

// Whether a joining engine's digest can decide anything at `label`: an engine of the fleet has a
// weight layout (a committed digest) or holds a digest for the label. A fleet none of whose
// engines computes a digest checks a joiner by its label only, without asking it.
bool JoinReadsDigest(const FleetState& f, const std::string& label) {
  if (!join_digest(f, label, WeightDigest{}).ok()) return true;
  return std::any_of(f.engines.begin(), f.engines.end(),
                     [](const auto& e) { return e.second.committed_digest.present(); });
}

// The engine's weight digest; a busy engine may time out or fail a read, so it is asked again
// (kJoinDigestAttempts in all) before it is judged to compute none.
WeightDigest ReadJoinerDigest(effects::EngineClient& client) {
  WeightDigest d = effects::ReadWeightDigest(client);
  for (int attempt = 1; !d.present() && attempt < kJoinDigestAttempts; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kJoinDigestRetryMs));
    d = effects::ReadWeightDigest(client);
  }
  return d;
}

// What a joining engine is held to at a label: `digest` ("" none: its label is the only check),
// or, while `waits` is not OK, nothing yet (join_digest's retryable refusal: an engine of its
// layout updates to the label and has read no digest yet).
struct JoinHold {
  std::string digest;
  Status waits;
};

// The joining engine's digest is read (outside the journal's lock), then the fleet says what its
// layout holds for `label` (join_digest: the rule that holds a fleet update's members, counting
// TAINTED engines' records and the digests of plans still open). A refusal other than the wait
// (it computes no digest while the fleet holds one for the label) refuses the join.
Result<JoinHold> JoinDigest(const journal::Journal& journal, effects::EngineClient& client,
                            const std::string& engine, const std::string& label) {
  bool read = false;
  journal.ReadFleetState([&](const FleetState& f) { read = JoinReadsDigest(f, label); });
  const WeightDigest d = read ? ReadJoinerDigest(client) : WeightDigest{};
  Result<std::string> held = std::string();
  journal.ReadFleetState([&](const FleetState& f) { held = join_digest(f, label, d); });
  if (!held.ok() && d.present()) return JoinHold{"", held.status()};
  if (!held.ok()) {
    return Status::Rejected("engine '" + engine + "' gave no weight digest in " +
                            std::to_string(kJoinDigestAttempts) +
                            " attempts (last: " + Esc(d.error) + "): " + held.status().message() +
                            "; if it computes none, load the weight-digest extension on it");
  }
  if (held->empty() && d.present()) {
    spdlog::warn(
        "serve: engine {} digests {} tensors ({} bytes), a layout no engine holds a digest of at "
        "'{}': it is verified by its label only",
        Esc(engine), d.tensors.size(), d.bytes, Esc(label));
  } else if (!held->empty()) {
    spdlog::info("serve: engine {} must hold the weights its layout holds at '{}' (digest {})",
                 Esc(engine), Esc(label), Esc(*held));
  }
  return JoinHold{*held, Status::OK()};
}

using FleetMembers = std::map<std::string, std::unique_ptr<FleetMember>>;

// The staying members `f` holds READY.
std::set<std::string> ReadyMembers(const FleetState& f, const FleetMembers& members) {
  std::set<std::string> ready;
  for (const auto& [name, m] : members) {
    if (!m->retire && engine_state(f, name).lifecycle == Lifecycle::kReady) ready.insert(name);
  }
  return ready;
}

// Each of `names`' weight-transfer engine is told the rendezvous (transfer http only).
void InitHttpTransfersOf(const ServeConfig& config, const FleetMembers& members,
                         const std::set<std::string>& names) {
  if (config.transfer != "http") return;
  for (const std::string& name : names) {
    const FleetMember& m = *members.at(name);
    InitHttpWeightTransfer(*m.client, effects::detect_protocol(m.version), config);
  }
}

// Whether the plans a restart found interrupted are members' own only (a member that stalled
// mid-plan: no fleet update is open to go on with after them). Driving one may take as long as
// its deadlines.
bool OnlyMemberPlansInterrupted(const FleetState& f) {
  return !f.update.has_value() &&
         std::any_of(f.engines.begin(), f.engines.end(),
                     [](const auto& e) { return e.second.update.has_value(); });
}

// The plan slot (update_mu_) handed from Start to the thread that drives the fleet's recovery:
// the thread holds it before the proxy listens, so no trainer call reaches a runner whose
// interrupted plan is still to be driven, and drives only once Start says the proxy listens.
class SlotHandover {
 public:
  // On the recovery's thread, holding the slot: tells Start, then waits for its word (whether
  // the proxy listens).
  bool TakenThenAwaitListening() {
    std::unique_lock<std::mutex> l(mu_);
    taken_ = true;
    cv_.notify_all();
    cv_.wait(l, [this] { return listening_.has_value(); });
    return *listening_;
  }
  // On Start: true once the thread holds the slot; false once `gave_up` (the thread ended without
  // taking it, fail-stopping the executor).
  bool AwaitTaken(const std::function<bool()>& gave_up) {
    std::unique_lock<std::mutex> l(mu_);
    while (!cv_.wait_for(l, kLookMs, [this] { return taken_; })) {
      if (gave_up()) return false;
    }
    return true;
  }
  // The first word counts: a Start that failed or threw before it spoke says no.
  void Listening(bool listening) {
    std::lock_guard<std::mutex> l(mu_);
    if (!listening_) listening_ = listening;
    cv_.notify_all();
  }

 private:
  static constexpr std::chrono::milliseconds kLookMs{10};
  std::mutex mu_;
  std::condition_variable cv_;
  bool taken_ = false;
  std::optional<bool> listening_;
};

}  // namespace

Status Service::InitFleet() {
  RC_CHECK(is_fleet() && journal_ != nullptr && fleet_runner_ == nullptr);
  RC_RETURN_IF_ERROR(OpenFleetMembers());
  RC_RETURN_IF_ERROR(CheckMembersAreDistinctEngines());
  MakeFleetRunner();
  std::lock_guard<std::timed_mutex> lock(update_mu_);
  RC_RETURN_IF_ERROR(JoinFleet());
  // Only what must be durable first: each member's RecoveryStarted, recording what the journal's
  // open found (service.cc RecoverJournal). No engine is called: what a member's recovery found
  // interrupted is driven once the proxy listens (FinishInterruptedFleetUpdate).
  if (Status begun = fleet_runner_->BeginRecovery(journal_->recovery()); !begun.ok()) {
    return RecoveryFailed(begun);
  }
  RC_RETURN_IF_ERROR(BootstrapFleetMembers());
  if (failed()) return Status::Internal("a fleet member's bootstrap failed");
  InitHttpTransfers();
  RC_RETURN_IF_ERROR(InitNcclTransfers());
  journal_->ReadFleetState([this](const FleetState& f) {
    if (f.update) interrupted_fleet_update_ = f.update->request;
  });
  // The runners waited for every record they wrote: all of the journal is durable.
  durable_.fleet = journal_->fleet_state();
  durable_.head = DurableHead{journal_->head_seq(), journal_->head_hash()};
  durable_.decision_seq = journal_->head_seq();
  LogFleetStart();
  RC_RETURN_IF_ERROR(StartFleetMonitors());
  RC_CHECK(fleet_members_.size() == config_.engines.size() && !rollout_prefix_.empty());
  return Status::OK();
}

// The monitor watches every member, each on its own thread (a restart, a relabel, drifted
// weights, unreachable); a fleet has no explicit rollouts, so no lease thread. A thread refused
// fails the start (the destructor joins those that started).
Status Service::StartFleetMonitors() {
  for (auto& [name, m] : fleet_members_) {
    if (m->retire) continue;
    // The slot is made before its thread starts: a running thread is never lost to an allocation.
    std::thread& slot = fleet_monitor_threads_.emplace_back();
    RC_RETURN_IF_ERROR(StartBackgroundThread(
        "the engine monitor thread of engine '" + name + "'",
        [this, target = MonitorTarget{name, *m->client, m->watch}] {
          RunGuarded("engine monitor", [this, &target] { MonitorLoop(target); });
        },
        slot));
  }
  return Status::OK();
}

// Two members that reach one engine process (URLs that differ only in spelling, or two names of
// one host) would have two runners pause, load and resume it under each other's rollouts. The
// worker extension's nonces name a process; a process start time ("start:...") does not (two
// engines launched together share one), so only the former are compared.
Status Service::CheckMembersAreDistinctEngines() {
  std::map<std::string, std::string> member_of_instance;
  for (auto& [name, m] : fleet_members_) {
    if (m->retire) continue;
    const std::string instance = m->client->Instance();
    if (instance.empty() || instance.rfind("start:", 0) == 0) continue;
    auto [it, fresh] = member_of_instance.emplace(instance, name);
    if (!fresh) {
      return Status::InvalidArgument(
          "engines '" + it->second + "' and '" + name + "' reach one engine process (instance '" +
          text::escape_line(instance) + "'): two runners would drive one engine");
    }
  }
  return Status::OK();
}

Status Service::OpenFleetMembers() {
  for (std::size_t i = 0; i < config_.engines.size(); ++i) {
    RC_RETURN_IF_ERROR(OpenFleetMember(config_.engines[i], i));
  }
  return Status::OK();
}

// Nothing is decided before the engine answers GET /version: it may still be loading. A retiring
// engine is not waited for.
Status Service::OpenFleetMember(const FleetEngineConfig& e, std::size_t index) {
  auto m = std::make_unique<FleetMember>();
  m->name = e.name;
  m->url = e.engine_url;
  m->retire = e.retire;
  Result<UpstreamTarget> target = ParseEngineUrl(e.engine_url);
  if (!target.ok()) return target.status();
  m->target = std::move(target.value());
  m->client = std::make_unique<effects::EngineClient>(e.engine_url, ControlDeadlines(config_));
  m->control = std::make_unique<effects::HttpEngineControl>(*m->client);
  if (m->retire) {
    RC_RETURN_IF_ERROR(OpenRetiringMember(*m));
    fleet_members_.emplace(e.name, std::move(m));
    return Status::OK();
  }
  const EngineVersionWait waited =
      WaitForEngineVersion(*m->client, e.engine_url, config_.engine_startup_timeout_ms);
  if (!waited.status.ok()) {
    return Status(waited.status.code(),
                  "engine '" + e.name + "': " + waited.status.message() +
                      " (to drop an engine that died, mark it \"retire\": true)");
  }
  m->version = waited.version;
  RC_RETURN_IF_ERROR(MakeMemberTransfer(*m, index));
  RC_CHECK(fleet_members_.count(e.name) == 0);  // ValidateConfig: names are unique
  fleet_members_.emplace(e.name, std::move(m));
  return Status::OK();
}

// With transfer nccl, each member has a communicator of its own (docs/fleet.md: isolation, at
// the cost of sending the weights once per member); set up by InitNcclTransfers.
Status Service::MakeMemberTransfer(FleetMember& m, std::size_t index) {
  if (config_.transfer == "nccl") {
    NcclTransfer nccl = MakeNcclTransfer(*m.client, config_,
                                         {m.name, m.url, FleetMemberRendezvous(config_, index)});
    m.transfer = std::move(nccl.transfer);
    m.transfer_init = std::move(nccl.init);
    return Status::OK();
  }
  auto transfer = MakeGpuFreeTransfer(config_, *m.client, m.version);
  if (!transfer.ok()) return transfer.status();
  m.transfer = std::move(transfer.value());
  return Status::OK();
}

// Every staying member's communicator, one after another once the journal is recovered: a
// member that cannot rendezvous is a startup error naming it (retire it, or bring it back).
Status Service::InitNcclTransfers() {
  for (auto& [name, m] : fleet_members_) {
    if (m->transfer_init) RC_RETURN_IF_ERROR(m->transfer_init());
  }
  return Status::OK();
}

// A retiring engine is asked once: one that answers gets its real transfer (an interrupted plan
// may still need it; under nccl, whose communicator a retiring engine never gets, none); one
// that does not gets a transfer that refuses before sending anything, so no plan can claim to
// have moved weights into it.
Status Service::OpenRetiringMember(FleetMember& m) {
  const std::optional<std::string> version = VersionOf(m.client->Version());
  if (!version) {
    spdlog::warn("serve: engine {} ({}) retires and does not answer GET /version", Esc(m.name),
                 Esc(m.url));
    m.transfer =
        MakeRefusingTransfer("engine '" + m.name + "' retires and did not answer at start");
    return Status::OK();
  }
  m.version = *version;
  if (config_.transfer == "nccl") {
    m.transfer = MakeRefusingTransfer("engine '" + m.name + "' retires: it has no communicator");
    return Status::OK();
  }
  auto transfer = MakeGpuFreeTransfer(config_, *m.client, m.version);
  m.transfer = transfer.ok() ? std::move(transfer.value())
                             : MakeRefusingTransfer(transfer.status().message());
  return Status::OK();
}

void Service::MakeFleetRunner() {
  effects::FleetRunnerOptions o;
  o.runner = RunnerOptionsOf(config_);
  o.blocked_timeout_ms = config_.fleet_blocked_timeout_ms;
  o.update_timeout_ms = config_.fleet_update_timeout_ms;
  member_threads_ = effects::OsMemberThreads(
      [this](std::function<void()> drive) { return StartMemberThread(std::move(drive)); });
  o.threads = member_threads_.get();
  fleet_runner_ =
      std::make_unique<effects::FleetRunner>(*journal_, effects::system_clock(), std::move(o));
}

void Service::set_member_thread_start(ThreadStart start) {
  std::lock_guard<std::mutex> g(member_thread_start_mu_);
  member_thread_start_ = std::move(start);
}

// A member's drive (its own update, or its runner's recovery) on a thread of its own; an
// exception out of it fail-stops the executor. The member's `done` then never comes, but the
// fleet runner stops at its next look at the failed journal, and joins the thread, which ended.
std::thread Service::StartMemberThread(std::function<void()> drive) {
  std::function<void()> guarded = [this, drive = std::move(drive)] {
    RunGuarded("fleet member", drive);
  };
  ThreadStart start;
  {
    std::lock_guard<std::mutex> g(member_thread_start_mu_);
    start = member_thread_start_;
  }
  if (start) return start(std::move(guarded));
  // Throws when refused, as MemberThreads::Start's callers expect (effects/fleet_runner.h).
  return thread_starter_ ? thread_starter_("a fleet member's drive thread", std::move(guarded))
                         : std::thread(std::move(guarded));
}

// Refuses a journal whose fleet holds an engine this configuration leaves out: without a runner
// its rollouts would never be recovered, and the fleet's rules would still count it (members,
// min_serving, staleness). Configures the policy when the journal's differs, and joins every
// configured engine (a restart finds them joined; one that left joins again: the configuration
// decides membership at start).
Status Service::JoinFleet() {
  const FleetConfigured policy{config_.fleet_staleness_max, config_.fleet_min_serving};
  FleetConfigured held;
  std::string unconfigured;
  std::set<std::string> held_engines;
  journal_->ReadFleetState([&](const FleetState& f) {
    held = f.policy;
    for (const auto& [name, s] : f.engines) held_engines.insert(name);
    for (const auto& [name, s] : f.engines) {
      if (fleet_members_.count(name) == 0)
        unconfigured += (unconfigured.empty() ? "" : ", ") + name;
    }
  });
  if (!unconfigured.empty()) {
    return Status::InvalidArgument(
        "the journal's fleet holds engine(s) " + Esc(unconfigured) +
        " that `engines` does not configure: configure them (they recover and serve), or remove "
        "one for good: configure it with \"retire\": true (it leaves at start, answering or "
        "not), or DELETE /v1/fleet/engines/NAME while it serves; drop it from the "
        "configuration once it has left");
  }
  if (journal_->head_seq() == 0 || held != policy) {
    if (Status st = fleet_runner_->Configure(policy); !st.ok()) {
      return Status(st.code(), "configuring the fleet's policy: " + st.message());
    }
  }
  for (auto& [name, m] : fleet_members_) {
    if (m->retire && held_engines.count(name) == 0) continue;  // gone already: nothing to join
    auto done = std::make_shared<EngineMutations>();
    m->gated_control = GateControl(*m->control, mutation_gate_, config_.call_timeout_ms, done);
    m->gated_transfer = GateTransfer(*m->transfer, mutation_gate_, done);
    Status joined = fleet_runner_->Join(name, *m->gated_control, *m->gated_transfer);
    if (!joined.ok()) {
      return Status(joined.code(), "engine '" + name + "' could not join: " + joined.message());
    }
    fleet_runner_->runner(name)->set_observer(
        [this, engine = name](std::uint64_t seq, const Event& e) {
          if (!IsDecision(e)) return;
          LogDecision(engine, seq, e);
          NotifyLifecycle(seq);
        });
    fleet_runner_->runner(name)->set_stop_waiting([this] { return mutation_gate_.closed(); });
    fleet_runner_->runner(name)->set_digest_schedule(DigestScheduleOf(m->watch));
  }
  return Status::OK();
}

// Members bootstrap one at a time, each at the fleet's newest label as it stands then: on a new
// fleet the first sets the label (and its digest) that the others are held to. A member whose
// layout has a plan to that label open that has read no digest yet (one this start found
// interrupted) waits, UNINITIALIZED: those plans are driven only once the proxy listens, so it is
// asked again after them (FinishInterruptedFleetUpdate), and held to the digest they read.
Status Service::BootstrapFleetMembers() {
  for (const std::string& name : UninitializedMembers()) {
    std::optional<NewestLabel> newest;
    journal_->ReadFleetState([&](const FleetState& f) { newest = FleetNewestLabel(f); });
    if (!newest) {
      Result<WeightIdentity> id = BootstrapIdentity(*Member(name).transfer);
      if (!id.ok()) return id.status();
      newest = NewestLabel{config_.initial_label, *id};
    }
    Result<JoinHold> hold = JoinDigest(*journal_, *Member(name).client, name, newest->label);
    if (!hold.ok()) return hold.status();
    if (!hold->waits.ok()) {
      spdlog::warn(
          "serve: engine {} does not join yet: {}; it is asked again once the plans this start "
          "found open have been driven, else at the next start",
          Esc(name), Esc(hold->waits.message()));
      continue;
    }
    RC_RETURN_IF_ERROR(BootstrapFleetMember(name, newest->label, newest->identity, hold->digest));
  }
  return Status::OK();
}

// The configured members still UNINITIALIZED in the fleet (one whose removal the recovery
// completed has left, and bootstraps at the next start).
std::vector<std::string> Service::UninitializedMembers() const {
  std::vector<std::string> out;
  journal_->ReadFleetState([&](const FleetState& f) {
    for (const auto& [name, m] : fleet_members_) {
      const auto it = f.engines.find(name);
      if (!m->retire && it != f.engines.end() && f.leaving.count(name) == 0 &&
          it->second.lifecycle == Lifecycle::kUninitialized) {
        out.push_back(name);
      }
    }
  });
  return out;
}

Status Service::BootstrapFleetMember(const std::string& engine, const std::string& label,
                                     const WeightIdentity& identity,
                                     const std::string& expected_digest) {
  FleetMember& m = Member(engine);
  spdlog::info("serve: bootstrapping engine {} ({}) as '{}'{}", Esc(engine), Esc(m.url), Esc(label),
               config_.adopt_engine ? " (adopt)" : "");
  effects::Runner* runner = fleet_runner_->runner(engine);
  RC_CHECK(runner != nullptr);  // joined by JoinFleet
  effects::BootstrapOptions options = BootstrapOptionsOf();
  options.expected_digest = expected_digest;
  Status booted = runner->Bootstrap(label, identity, options);
  if (!booted.ok()) {
    return Status(booted.code(), "bootstrap of engine '" + engine + "' (" + m.url + ") as '" +
                                     label + "' failed: " + booted.message());
  }
  return Status::OK();
}

// Every READY member's weight-transfer engine is told the rendezvous on each start, as one
// engine's is: a start that stopped between a bootstrap and this would otherwise leave it unset.
// One whose interrupted plan ends READY is told after that plan (FinishInterruptedFleetUpdate).
void Service::InitHttpTransfers() {
  std::set<std::string> ready;
  journal_->ReadFleetState([&](const FleetState& f) { ready = ReadyMembers(f, fleet_members_); });
  InitHttpTransfersOf(config_, fleet_members_, ready);
}

void Service::LogFleetStart() {
  const FleetState& f = durable_.fleet;
  spdlog::info("serve: fleet journal {} at seq {}: {} engine(s), staleness_max {}, min_serving {}",
               Esc(config_.journal_path), durable_.head.seq, f.engines.size(),
               f.policy.staleness_max, f.policy.min_serving);
  for (const auto& [name, m] : fleet_members_) {
    if (f.engines.count(name) == 0) {
      spdlog::warn(
          "serve: engine {} left the fleet during recovery (its removal completed); it gets "
          "nothing now, and joins again at the next start while configured",
          Esc(name));
    }
  }
  for (const auto& [name, s] : f.engines) {
    spdlog::info("serve: engine {}: {}, committed '{}' (fleet generation {}){}", Esc(name),
                 lifecycle_name(s.lifecycle), Esc(s.committed.label),
                 fleet_generation(f, name).value_or(0), f.leaving.count(name) ? ", leaving" : "");
    if (s.lifecycle == Lifecycle::kTainted) LogTaint(s.taint, ("engine " + name).c_str());
  }
}

// The recovery's second half (FinishInterruptedFleetUpdate, then the retiring members asked to
// leave again) runs under the plan slot once the proxy listens, each member's drive on a thread of
// its own, so a member whose plan waits on its engine keeps none of the others from admitting.
// Start returns once it ended, as the one engine's Start does with its interrupted update, when a
// fleet update is open (it goes on only after its members' own plans ended) or nothing waits on
// an engine beyond a look at it. When only members' own plans were interrupted, it runs on a
// thread of its own, as long as their deadlines: Start returns once the proxy listens. That
// thread is joined with the background threads (StopBackground); a Shutdown waits for the plan
// slot it holds, as for any plan, and the gate it closes ends the drives' waits.
Status Service::StartFleet() {
  for (auto& [name, m] : fleet_members_) {
    auto pool = MakeUpstream(m->target);
    if (!pool.ok())
      return Status(pool.status().code(), "engine '" + name + "': " + pool.status().message());
    m->upstream = std::move(pool.value());
  }
  {
    std::lock_guard<std::timed_mutex> lock(update_mu_);
    RC_RETURN_IF_ERROR(RetireMembers(false));
  }
  auto finish = [this]() -> Status {
    RC_RETURN_IF_ERROR(FinishInterruptedFleetUpdate());
    return RetireMembers(true);
  };
  bool members_only = false;
  journal_->ReadFleetState(
      [&members_only](const FleetState& f) { members_only = OnlyMemberPlansInterrupted(f); });
  if (!members_only) {
    std::lock_guard<std::timed_mutex> lock(update_mu_);
    RC_RETURN_IF_ERROR(Listen());
    return finish();
  }
  auto handover = std::make_shared<SlotHandover>();
  // Refused, nothing waits on the handover: the start fails, and the restart recovers again.
  std::thread& recovery = fleet_monitor_threads_.emplace_back();
  RC_RETURN_IF_ERROR(StartBackgroundThread(
      "the fleet's recovery thread",
      [this, handover, finish] {
        RunGuarded("fleet recovery", [this, &handover, &finish] {
          std::unique_lock<std::timed_mutex> slot(update_mu_);
          if (!handover->TakenThenAwaitListening()) return;
          const Status finished = finish();
          if (!finished.ok()) FailStop("the fleet's recovery failed: " + finished.ToString());
        });
      },
      recovery));
  // Whatever Start does now, even throw, the thread is told whether the proxy listens.
  struct Verdict {
    SlotHandover& handover;
    bool listening = false;
    ~Verdict() { handover.Listening(listening); }
  } verdict{*handover};
  if (!handover->AwaitTaken([this] { return failed(); })) {
    return RecoveryFailed(Status::Internal("the fleet's recovery thread ended: " + failure()));
  }
  RC_RETURN_IF_ERROR(Listen());
  verdict.listening = true;
  return Status::OK();
}

// Each retiring engine the fleet still holds is asked to leave before the proxy listens: a member
// of a fleet update the restart found open is skipped by it if it had not started. One the fold
// cannot let leave yet (its own plan can still move, or it belongs to that fleet update) is asked
// again once its plan and that update ended; if it still cannot, serve runs without it (never
// picked, no monitor) and the log says why. The fold removes a leaving engine once it holds no
// rollouts (the recovery abandoned those of the last run). Only the journal failing stops the
// start. The caller holds update_mu_.
Status Service::RetireMembers(bool last_try) {
  std::vector<std::string> held;
  journal_->ReadFleetState([&](const FleetState& f) {
    for (const auto& [name, m] : fleet_members_) {
      if (m->retire && f.engines.count(name) != 0 && f.leaving.count(name) == 0) {
        held.push_back(name);
      }
    }
  });
  for (const std::string& name : held) {
    const Status st = fleet_runner_->Remove(name);
    if (IsJournalFailure(st)) {
      return Status(st.code(), "retiring engine '" + name + "': " + st.message());
    }
    if (st.ok()) {
      spdlog::warn(
          "serve: engine {} retires: it is leaving the fleet; drop it from `engines` once it left",
          Esc(name));
    } else if (last_try) {
      spdlog::error(
          "serve: engine {} retires but cannot leave yet: {}; it gets no traffic, and a later "
          "start retires it once its plan ended",
          Esc(name), Esc(st.message()));
    }
  }
  return Status::OK();
}

// The recovery's second half, once the proxy listens, under update_mu_ (the caller's): each
// member's interrupted plan is driven to its end on a thread of its own (its drain may wait for
// rollouts whose clients must be able to finish them), a member whose join waited for one of
// those plans bootstraps, each member left READY is told the transfer's rendezvous, and then a
// fleet update the last run left open goes on: its members not started yet drain and update, each
// with the request the executor builds for a first start (member_update_request: held to its
// layout's digest, which an interrupted member's plan, now ended, may have recorded).
Status Service::FinishInterruptedFleetUpdate() {
  const std::optional<FleetUpdateRequested> open = std::exchange(interrupted_fleet_update_, {});
  std::set<std::string> ready_before;
  journal_->ReadFleetState(
      [&](const FleetState& f) { ready_before = ReadyMembers(f, fleet_members_); });
  const Status driven = DrivePlan("recovery of the fleet's members", open ? open->update_id : "",
                                  [this] { return fleet_runner_->DriveRecoveries(); });
  // A member's drive that threw fail-stopped the executor and left its own result OK.
  if (!driven.ok() || failed()) {
    const Status why = driven.ok() ? Status::Internal("a fleet member's recovery failed") : driven;
    FailStop("recovery of the fleet's members failed: " + why.ToString());
    return RecoveryFailed(why);
  }
  // A member that waited to join joins now. One refused now leaves the others serving (at start,
  // a refused join stops serve instead): it stays UNINITIALIZED, admits nothing, and is asked
  // again at the next start.
  if (const Status joined = BootstrapFleetMembers(); !joined.ok()) {
    if (IsJournalFailure(joined) || failed()) {
      FailStop("a fleet member's late join failed: " + joined.ToString());
      return RecoveryFailed(joined);
    }
    spdlog::error("serve: {}; it gets nothing, and joins again at the next start",
                  Esc(joined.message()));
  }
  std::set<std::string> ready_now;
  journal_->ReadFleetState(
      [&](const FleetState& f) { ready_now = ReadyMembers(f, fleet_members_); });
  for (const std::string& name : ready_before) ready_now.erase(name);
  InitHttpTransfersOf(config_, fleet_members_, ready_now);
  if (!open) return Status::OK();
  const FleetUpdateRequested& request = *open;
  spdlog::info("serve: going on with the interrupted fleet update '{}'", Esc(request.update_id));
  Result<FleetUpdateEnded> ended = DrivePlan("interrupted fleet update", request.update_id,
                                             [&] { return fleet_runner_->Update(request); });
  if (!ended.ok()) {
    FailStop("recovery of the interrupted fleet update failed: " + ended.status().ToString());
    return RecoveryFailed(ended.status());
  }
  spdlog::warn("serve: this restart ended the interrupted fleet update '{}': {} ({}); {}",
               Esc(request.update_id), fleet_outcome_name(ended->outcome), Esc(ended->reason),
               ReplayHint(config_.journal_path));
  return Status::OK();
}

// ---- admission across the fleet ----

// Decided under the journal's lock without copying the fleet: the balancer's pick among the
// configured engines that admit now, and its binding. The journal decides again on submit, so a
// race with an update costs a retry (kAgain), never an admission past a drain.
Service::AdmitStep Service::TryAdmitFleet(const std::string& rollout_id, const AdmitTries& tries,
                                          std::optional<std::uint64_t> affinity_key) {
  std::optional<FleetEvent> admission;
  std::string blocked;
  bool quarantined = false;
  std::size_t active = 0;
  std::uint64_t generation = 0;
  journal_->ReadFleetState([&](const FleetState& f) {
    if (std::optional<std::string> engine = PickFleetEngine(f, affinity_key)) {
      admission = make_fleet_admission(f, *engine, rollout_id);
      active = engine_state(f, *engine).active.size();
      generation = fleet_generation(f, *engine).value_or(0);
      return;
    }
    quarantined = FleetQuarantined(f, fleet_members_);
    blocked = FleetBlockReason(f, fleet_members_);
  });
  if (quarantined) {
    metrics_.admission_rejected_tainted++;
    return Refused({503, "tainted",
                    "every engine of the fleet is TAINTED or leaving; no rollouts are admitted (" +
                        blocked + ")",
                    0});
  }
  AdmitStep step;
  if (!admission) {
    step.kind = AdmitStep::kWait;
    step.waiting_on = blocked;
    return step;
  }
  FleetMember& m = Member(admission->engine);
  m.outstanding++;  // counted at the pick, so concurrent picks spread
  auto submitted = journal_->SubmitFleet(*admission, effects::wall_now_ms());
  if (!submitted.ok()) {
    EngineCallEnded(m.name);
    return SubmitRefused(submitted.status(), rollout_id, tries, active);
  }
  step.kind = AdmitStep::kSubmitted;
  step.ticket = submitted->ticket;
  step.engine = admission->engine;
  step.fleet_generation = generation;
  step.binding = std::get<RolloutAdmitted>(admission->event);
  return step;
}

// Among the configured engines that admit now (admitting_engines holds the staleness bound and
// quarantine): the affine one, or the least busy (balancer.h); an engine of the journal that is
// not configured gets nothing.
std::optional<std::string> Service::PickFleetEngine(const FleetState& fleet,
                                                    std::optional<std::uint64_t> affinity_key) {
  std::vector<EngineLoad> loads;
  for (const std::string& name : admitting_engines(fleet)) {
    const auto it = fleet_members_.find(name);
    if (it == fleet_members_.end() || it->second->retire) continue;
    loads.push_back({name, fleet_generation(fleet, name).value_or(0),
                     it->second->outstanding.load(std::memory_order_relaxed)});
  }
  return PickEngine(loads, affinity_key, config_.fleet_affinity_slack);
}

void Service::EngineCallEnded(const std::string& engine) {
  const std::uint32_t before = Member(engine).outstanding.fetch_sub(1);
  RC_CHECK(before > 0);  // each counted pick ends exactly once
}

FleetMember& Service::Member(const std::string& engine) {
  const auto it = fleet_members_.find(engine);
  RC_CHECK(it != fleet_members_.end());  // only configured engines are picked
  return *it->second;
}

const UpstreamTarget& Service::TargetOf(const std::string& engine) const {
  if (engine.empty()) return engine_target_;
  const auto it = fleet_members_.find(engine);
  RC_CHECK(it != fleet_members_.end());
  return it->second->target;
}

UpstreamPool& Service::UpstreamOf(const std::string& engine) {
  UpstreamPool* pool = engine.empty() ? upstream_.get() : Member(engine).upstream.get();
  RC_CHECK(pool != nullptr);  // made by Start before it listens
  return *pool;
}

std::string Service::PassThroughEngine() {
  if (!is_fleet()) return "";
  std::optional<std::string> engine;
  journal_->ReadFleetState([&](const FleetState& f) { engine = PickFleetEngine(f, std::nullopt); });
  return engine ? *engine : StayingMember().name;
}

FleetMember& Service::StayingMember() {
  for (auto& [name, m] : fleet_members_) {
    if (!m->retire) return *m;
  }
  RC_CHECK(false);  // ValidateConfig: at least one engine stays
  return *fleet_members_.begin()->second;
}

std::string Service::FleetNotReadyReason() const {
  if (failed()) return "fail-stopped: " + failure();
  if (shutting_down_.load()) return "shutting down";
  std::string why;
  journal_->ReadFleetState([&](const FleetState& f) {
    const bool any = std::any_of(fleet_members_.begin(), fleet_members_.end(), [&f](const auto& m) {
      return !m.second->retire && fleet_admits(f, m.first);
    });
    if (!any) why = FleetBlockReason(f, fleet_members_);
  });
  return why;
}

}  // namespace rc::service
