#include "effects/runner.h"

#include "encoding/sha256.h"
#include "statemachine/describe.h"
#include "statemachine/text.h"

#include <algorithm>
#include <utility>

namespace rc::effects {

// A torn tail is named first (its WAL shows it only until the journal is written on); an empty
// journal that was never closed held nothing a crash could have lost. A reader beside a live
// writer checks no tail, and records nothing.
RecoveryStarted RecoveryStartedAfter(const std::string& executor_id,
                                     const journal::Recovery& opened) {
  RecoveryStarted e{executor_id};
  if (opened.live_writer) return e;
  if (!opened.torn_tail.empty()) {
    e.journal_ending = JournalEnding::kTornTail;
    e.journal_bytes_unread = opened.wal_bytes_unread;
    e.journal_torn_tail = text::utf8_prefix(text::sanitize_utf8(opened.torn_tail), kTextBytesMax);
  } else if (opened.clean_close) {
    e.journal_ending = JournalEnding::kCleanClose;
  } else {
    e.journal_ending = opened.head_seq == 0 ? JournalEnding::kNewJournal : JournalEnding::kCrash;
  }
  return e;
}

// A fixed-size key, so the one limit on update ids (kIdBytesMax) is the only one: a prefix on the
// id itself pushed ids near the limit over the journal's key bound.
std::string UpdateIdempotencyKey(const std::string& update_id) {
  return "update:" + encoding::Sha256Hex(update_id);
}

std::string RestoreIdempotencyKey(const std::string& restore_id) {
  return "restore:" + encoding::Sha256Hex(restore_id);
}

std::string SleepIdempotencyKey(const std::string& sleep_id) {
  return "sleep:" + encoding::Sha256Hex(sleep_id);
}

std::string WakeIdempotencyKey(const std::string& wake_id) {
  return "wake:" + encoding::Sha256Hex(wake_id);
}

Runner::Runner(journal::Journal& journal, EngineControl& engine, WeightTransfer& transfer,
               Clock& clock, RunnerOptions options)
    : journal_(journal),
      engine_(engine),
      transfer_(transfer),
      clock_(clock),
      options_(std::move(options)) {
  RC_CHECK(options_.backoff_ms_min <= options_.backoff_ms_max);
  RC_CHECK(options_.effects_per_drive_max > 0);
}

std::uint64_t Runner::elapsed_us(std::int64_t since_us) const {
  const std::int64_t now = clock_.now_us();
  return now > since_us ? static_cast<std::uint64_t>(now - since_us) : 0;
}

Result<std::vector<Event>> Runner::submit(const Event& input, const std::string& client_event_id,
                                          Durability durability) {
  const std::int64_t start_us = clock_.now_us();
  auto submitted =
      journal_.SubmitFleet(FleetEvent{options_.engine, input}, clock_.wall_ms(), client_event_id);
  if (!submitted.ok()) return submitted.status();
  unsynced_ = submitted->ticket;
  // This engine's decisions; the fleet's (named "") are the fleet executor's to read.
  std::vector<Event> own;
  std::uint64_t seq = submitted->ticket.result.first_seq;
  const bool observe = observer_ && !submitted->ticket.result.duplicate;
  if (observe) unobserved_.emplace_back(seq, input);
  for (FleetEvent& d : submitted->decisions) {
    ++seq;
    if (is_fleet_event(d.event) && fleet_decisions_) fleet_decisions_(d.event);
    if (d.engine != options_.engine || is_fleet_event(d.event)) continue;
    if (observe) unobserved_.emplace_back(seq, d.event);
    own.push_back(std::move(d.event));
  }
  if (durability == Durability::kNow) RC_RETURN_IF_ERROR(sync());
  timings_.journal_us += elapsed_us(start_us);
  for (const Event& d : own) {
    if (const auto* ended = std::get_if<UpdateEnded>(&d)) ended_.push_back(*ended);
  }
  return own;
}

void Runner::read_state(const std::function<void(const State&)>& read) const {
  journal_.ReadFleetState(
      [&](const FleetState& fleet) { read(engine_state(fleet, options_.engine)); });
}

State Runner::current_state() const {
  State s;
  read_state([&s](const State& state) { s = state; });
  return s;
}

std::string Runner::engine_key(const std::string& key) const {
  if (options_.engine.empty()) return key;
  return key + ":" + encoding::Sha256Hex(options_.engine).substr(0, 16);
}

Status Runner::sync() {
  if (!unsynced_.has_value()) return Status::OK();
  // Groups commit in order: waiting for the last ticket makes every earlier one durable too.
  Status st = journal_.Wait(*unsynced_);
  if (!st.ok()) return st;
  unsynced_.reset();
  std::vector<std::pair<std::uint64_t, Event>> durable;
  durable.swap(unobserved_);
  for (const auto& [seq, event] : durable) observer_(seq, event);
  return Status::OK();
}

// The bound journaled with an effect's intent: what the effect can take at most. An effect of
// several engine calls, each bounded by call_timeout_ms, can take their sum: a probe (health,
// version, label, is_paused, the instance's /metrics, the digest), a validation (label, instance,
// digest, is_paused), a resume (resume, is_paused, is_sleeping, the instance: one bound for its
// two reads).
std::uint64_t Runner::deadline_for(EffectKind kind) const {
  constexpr std::uint64_t kProbeCalls = 6, kValidateCalls = 4, kResumeCalls = 4;
  switch (kind) {
    case EffectKind::kDrain:
      return options_.drain_timeout_ms;
    case EffectKind::kTransfer:
      return options_.transfer_timeout_ms;
    case EffectKind::kSleep:
    case EffectKind::kWake:
      return options_.sleep_timeout_ms;
    case EffectKind::kProbeEngine:
      return kProbeCalls * options_.call_timeout_ms;
    case EffectKind::kValidate:
      return kValidateCalls * options_.call_timeout_ms;
    case EffectKind::kResume:
      return kResumeCalls * options_.call_timeout_ms;
    default:
      return options_.call_timeout_ms;
  }
}

// Drains locally before pausing the engine. The fold is DRAINING, so nothing new is admitted;
// waiting for the admitted rollouts first means no admitted-but-not-yet-forwarded request can
// reach a paused engine and sit in its queue (pause(mode=wait) leaves queued requests queued).
// Rollouts still active at the deadline are the fold's to judge after the pause.
// Read under the journal's lock: no copy of the state (O(active rollouts)) per poll.
std::size_t Runner::active_rollouts() const {
  std::size_t n = 0;
  read_state([&n](const State& s) { n = s.active.size(); });
  return n;
}

Effect Runner::due_effect() const {
  Effect e;
  read_state([&e](const State& s) { e = next_effect(s); });
  return e;
}

// The pause's own share of the drain deadline: the local wait stops this long before it, so a
// pause sent after rollouts outlived the drain has time to be sent and answered (a pause given
// 1 ms would fail unsent and the whole drain be tried again).
std::int64_t Runner::pause_reserve_ms() const {
  return static_cast<std::int64_t>(
      std::min(options_.call_timeout_ms, options_.drain_timeout_ms / 2));
}

DrainObserved Runner::drain() {
  const std::int64_t deadline_ms =
      clock_.now_ms() + static_cast<std::int64_t>(options_.drain_timeout_ms);
  const std::int64_t local_deadline_ms = deadline_ms - pause_reserve_ms();
  // A failed journal stops every effect at once (fail-stop): nothing waits out its deadline. At
  // shutdown the wait gives up too: the pause is not sent, and the plan ends refused.
  bool stop = false;
  while (active_rollouts() > 0 && clock_.now_ms() < local_deadline_ms && !journal_.failed() &&
         !(stop = stop_waiting_ && stop_waiting_())) {
    clock_.sleep_ms(options_.await_poll_ms);
  }
  if (journal_.failed() || (stop && active_rollouts() > 0)) {
    if (!journal_.failed()) plan_stopped_ = true;
    DrainObserved refused;
    refused.http.transport = Transport::kConnectFailed;
    refused.http.error = journal_.failed() ? "not sent: the journal failed"
                                           : "not sent: the executor is shutting down";
    return refused;
  }
  const std::int64_t left_ms = std::max<std::int64_t>(1, deadline_ms - clock_.now_ms());
  return engine_.PauseWait(static_cast<std::uint64_t>(left_ms));
}

namespace {

// The plan's fields an effect sends (next_step).
UpdatePlan SentFieldsOf(const UpdatePlan& u) {
  UpdatePlan sent;
  sent.update_id = u.update_id;
  sent.target = u.target;
  sent.identity = u.identity;
  sent.source_uri = u.source_uri;
  sent.restore = u.restore;
  sent.adopt = u.adopt;
  sent.sleep_level = u.sleep_level;
  return sent;
}

}  // namespace

Runner::Step Runner::next_step() const {
  Step step;
  read_state([&step](const State& s) {
    step.effect = next_effect(s);
    step.attempts = s.attempts;
    step.lifecycle = s.lifecycle;
    const EffectKind k = step.effect.kind;
    if (k == EffectKind::kProbeEngine) step.bootstrap = s.bootstrap;
    const bool sends_plan =
        k == EffectKind::kPreflight || k == EffectKind::kTransfer || k == EffectKind::kSleep;
    if (sends_plan && s.update) step.plan = SentFieldsOf(*s.update);
  });
  return step;
}

Event Runner::observe(const Step& step) {
  const Effect& effect = step.effect;
  switch (effect.kind) {
    case EffectKind::kProbeEngine:
      // In READY this re-verifies the engine after a restart: what it is, nothing changed.
      if (step.lifecycle != Lifecycle::kUninitialized) return engine_.Probe();
      RC_CHECK(step.bootstrap.has_value());  // UNINITIALIZED probes only for a bootstrap
      return probe_for_bootstrap(*step.bootstrap);
    case EffectKind::kDrain:
      return drain();
    case EffectKind::kPreflight:
    case EffectKind::kTransfer: {
      RC_CHECK(step.plan.has_value());  // a plan's effects
      const UpdatePlan& u = *step.plan;
      if (u.adopt && effect.kind == EffectKind::kPreflight) return adopt_preflight();
      if (u.adopt) return label_only(u);
      TransferTarget target{u.update_id, u.target, u.identity, u.source_uri, u.restore};
      if (effect.kind == EffectKind::kPreflight) return transfer_.Preflight(target);
      return transfer_.Transfer(target, options_.transfer_timeout_ms);
    }
    case EffectKind::kResetCache:
      return engine_.ResetCache(effect.cache);
    case EffectKind::kValidate:
      return engine_.WeightInfo();
    case EffectKind::kResume:
      return engine_.Resume();
    case EffectKind::kSleep:
      RC_CHECK(step.plan.has_value());
      return engine_.Sleep(step.plan->sleep_level, options_.sleep_timeout_ms);
    case EffectKind::kWake:
      return engine_.Wake(effect.wake, options_.sleep_timeout_ms);
    case EffectKind::kNone:
    case EffectKind::kAwaitRollouts:
      break;
  }
  RC_CHECK(false && "observe() called for an effect without I/O");
  return DrainTimedOut{};
}

// A restore that adopts sends no weights, so there is no source to check: the validation's
// digest, compared with the one recorded for the version, is the whole proof.
PreflightObserved Runner::adopt_preflight() {
  return PreflightObserved{"", true, true, "adopt: nothing is sent; the weight digest decides"};
}

// Adopt's transfer only labels the engine, after ending any weight session left open (the failed
// transfer that tainted it may have left its own). A failed label is a refusal when nothing else
// reached the engine, a possible mutation after the finish did (the engine stays TAINTED either
// way); whatever ending the session changed, the validation's digest judges.
TransferObserved Runner::label_only(const UpdatePlan& plan) {
  RC_CHECK(plan.restore && plan.adopt);
  const std::int64_t start_us = clock_.now_us();
  const HttpEvidence ended = engine_.EndOpenWeightSession();
  const HttpEvidence set = engine_.SetLabel(plan.target.label);
  TransferObserved t;
  t.acknowledged = set.ok_2xx();
  // A finish that reached the engine may have committed a session's load: a failed label after
  // it is no proof that nothing changed.
  const MutationClass failed = ended.never_sent() ? MutationClass::kNone : MutationClass::kPossible;
  t.mutation = t.acknowledged ? MutationClass::kComplete : failed;
  t.finish_label = plan.target.label;
  t.duration_us = elapsed_us(start_us);
  if (!t.acknowledged) {
    t.error =
        "labelling the adopted engine failed: " + describe(set) +
        (ended.never_sent() ? "" : "; the open weight session was ended first: " + describe(ended));
  }
  return t;
}

// Bootstrap names the initial weights. A fresh engine (kFreshEngineLabel) is labelled once; with
// adopt, so is an engine with another label, and a paused one is resumed first. The evidence is
// what the engine reports afterwards, with what was found before (the fold judges both).
EngineProbed Runner::probe_for_bootstrap(const BootstrapRequested& bootstrap) {
  EngineProbed probed = engine_.Probe();
  if (!probed.http.ok_2xx()) return probed;
  bool resumed = false;
  if (bootstrap.adopt && probed.is_paused_known && probed.is_paused) {
    if (!engine_.Resume().http.ok_2xx()) return probed;
    resumed = true;
    probed = engine_.Probe();
  }
  const std::string found = probed.reported_label;
  const bool relabel = probed.http.ok_2xx() && found != bootstrap.label &&
                       (found == kFreshEngineLabel || bootstrap.adopt);
  if (relabel && engine_.SetLabel(bootstrap.label).ok_2xx()) probed = engine_.Probe();
  if (relabel) probed.label_before = found;
  probed.resumed_before = resumed;
  return probed;
}

std::uint64_t* phase_slot(PhaseTimings& t, const Effect& effect) {
  switch (effect.kind) {
    case EffectKind::kDrain:
    case EffectKind::kAwaitRollouts:
      return &t.drain_us;
    case EffectKind::kPreflight:
      return &t.preflight_us;
    case EffectKind::kTransfer:
      return &t.transfer_us;
    case EffectKind::kResetCache:
      return &t.invalidate_us;
    case EffectKind::kValidate:
      return &t.validate_us;
    case EffectKind::kResume:
      return &t.resume_us;
    case EffectKind::kSleep:
      return &t.sleep_us;
    case EffectKind::kWake:
      return effect.wake == WakeTag::kWeights ? &t.wake_weights_us : &t.wake_kv_us;
    default:
      return nullptr;
  }
}

// Which intents must be durable before their effect starts. Write-ahead matters where a crash
// between the effect and its record would leave the journal unable to classify or reconcile:
//  * kTransfer is not idempotent: its durable intent is what makes a crash in UPDATING TAINTED
//    rather than a silent "nothing happened";
//  * kDrain pauses the engine: without a durable UpdateRequested + intent, a crash right after
//    the pause would restart in READY with the engine paused and nothing to resume it.
// The other effects are idempotent reads or resets (probe, preflight, cache resets, validate,
// resume): after a crash the journal shows them not done and recovery simply redoes them. Their
// intents ride with the next durable write, and Drive() syncs before it returns, so nothing is
// acknowledged (update result, admission) before everything it depends on is durable.
//  * kSleep and kWake release or map the engine's memory: the journal says so before they may
//    have happened, so an incident's replay shows what was attempted.
bool intent_must_be_durable(EffectKind kind) {
  return kind == EffectKind::kDrain || kind == EffectKind::kTransfer ||
         kind == EffectKind::kSleep || kind == EffectKind::kWake;
}

namespace {

// A mutation the engine never received: a transfer (or an adopted engine's label) that changed
// nothing and was not acknowledged, a sleep or a wake-up of the weights never sent.
bool mutation_not_sent(const Event& observation) {
  if (const auto* t = std::get_if<TransferObserved>(&observation)) {
    return !t->acknowledged && t->mutation == MutationClass::kNone;
  }
  if (const auto* s = std::get_if<SleepObserved>(&observation)) return s->http.never_sent();
  if (const auto* w = std::get_if<WakeObserved>(&observation)) {
    return w->tag == WakeTag::kWeights && w->http.never_sent();
  }
  return false;
}

}  // namespace

// Once stop_waiting says true the executor lets no new mutation reach the engine: one not sent
// then was kept back by the stop.
void Runner::note_stopped_mutation(const Event& observation) {
  if (mutation_not_sent(observation) && stop_waiting_ && stop_waiting_()) plan_stopped_ = true;
}

Status Runner::perform(const Step& step) {
  const Effect& effect = step.effect;
  auto intent =
      submit(EffectStarted{effect.kind, effect.cache, deadline_for(effect.kind), effect.wake}, "",
             intent_must_be_durable(effect.kind) ? Durability::kNow : Durability::kWithNext);
  if (!intent.ok()) return intent.status();
  const std::int64_t start_us = clock_.now_us();
  // Cut to what the fold accepts: a refused observation would stop the executor, and stop it
  // again at every recovery that re-runs the effect.
  Event observation = observe(step);
  note_stopped_mutation(observation);
  bound_texts(observation);
  if (const auto* probed = std::get_if<EngineProbed>(&observation)) last_probe_ = *probed;
  if (const auto* slept = std::get_if<SleepObserved>(&observation)) {
    last_sleep_memory_ = slept->memory;
  }
  if (std::uint64_t* slot = phase_slot(timings_, effect)) *slot += elapsed_us(start_us);
  // The observation becomes durable together with the next intent (one fsync for both): nothing
  // acts on its decisions before that intent's Wait, and Drive() syncs before it returns.
  auto decided = submit(observation, "", Durability::kWithNext);
  return decided.status();
}

// Gives up on the bindings still active. The last of them may end between the look that saw them
// and this submit (another thread journals its RolloutFinished): the fold then awaits nothing and
// refuses the timeout, which ends the wait as the bindings' end does, so it is no error.
Status Runner::time_out_rollouts(std::int64_t waited_ms) {
  auto r = submit(DrainTimedOut{static_cast<std::uint64_t>(waited_ms),
                                static_cast<std::uint32_t>(active_rollouts())});
  if (r.ok()) return Status::OK();
  const bool moved_on = due_effect().kind != EffectKind::kAwaitRollouts;
  if (r.status().code() == Code::kRejected && moved_on) return Status::OK();
  return r.status();
}

Status Runner::await_rollouts() {
  const std::int64_t start_ms = clock_.now_ms();
  const std::int64_t start_us = clock_.now_us();
  while (true) {
    if (journal_.failed()) return journal_.failure();
    if (due_effect().kind != EffectKind::kAwaitRollouts) break;
    const std::int64_t waited_ms = clock_.now_ms() - start_ms;
    const bool stop = stop_waiting_ && stop_waiting_();
    if (stop || waited_ms >= static_cast<std::int64_t>(options_.await_rollouts_timeout_ms)) {
      if (stop) plan_stopped_ = true;
      RC_RETURN_IF_ERROR(time_out_rollouts(waited_ms));
      break;
    }
    clock_.sleep_ms(options_.await_poll_ms);
  }
  timings_.drain_us += elapsed_us(start_us);
  return Status::OK();
}

Status Runner::Drive() {
  std::uint32_t backoff_ms = options_.backoff_ms_min;
  Effect previous{};
  for (std::uint32_t i = 0; i < options_.effects_per_drive_max; ++i) {
    const Step step = next_step();
    const Effect& effect = step.effect;
    if (effect.kind == EffectKind::kNone) return sync();
    if (effect.kind == EffectKind::kAwaitRollouts) {
      RC_RETURN_IF_ERROR(await_rollouts());
      continue;
    }
    // The same effect due again means the last attempt failed: back off (bounded).
    if (i > 0 && effect == previous && step.attempts > 0) {
      clock_.sleep_ms(backoff_ms);
      backoff_ms = std::min(options_.backoff_ms_max, backoff_ms * 2);
      // Other inputs (the engine monitor, bindings) may have moved the state while we slept.
      if (!(due_effect() == effect)) continue;
    } else {
      backoff_ms = options_.backoff_ms_min;
    }
    previous = effect;
    Status performed = perform(step);
    // An intent refused because another input made it no longer due: look again.
    if (performed.code() == Code::kRejected && !(due_effect() == effect)) continue;
    RC_RETURN_IF_ERROR(performed);
  }
  RC_RETURN_IF_ERROR(sync());
  return Status::Internal("Drive() performed " + std::to_string(options_.effects_per_drive_max) +
                          " effects without settling");
}

// The journal keeps a torn tail its open found until an executor's record of it is durable: a
// start that fails before this (the engine never comes up) must not let the next read as clean.
Status Runner::BeginRecovery(const journal::Recovery& opened) {
  auto r = submit(RecoveryStartedAfter(options_.executor_id, opened));
  if (!r.ok() || opened.torn_tail.empty()) return r.status();
  return journal_.ForgetRecordedTornTail();
}

Status Runner::Recover(const journal::Recovery& opened) {
  RC_RETURN_IF_ERROR(BeginRecovery(opened));
  return Drive();
}

Status Runner::RetryStalledPlan() {
  const std::string id =
      text::utf8_prefix(std::string(kStalledPlanRetryPrefix) + options_.executor_id, kIdBytesMax);
  RC_RETURN_IF_ERROR(submit(RecoveryStarted{id}).status());
  return Drive();
}

// Waits (unjournaled) until the engine answers /health: an engine still loading its weights is
// not a failed bootstrap. Bounded by options.startup_timeout_ms.
Status Runner::wait_for_engine(const BootstrapOptions& options) {
  const std::int64_t start_ms = clock_.now_ms();
  std::int64_t reported_ms = start_ms;
  for (;;) {
    const HttpEvidence health = engine_.Health();
    if (health.ok_2xx() || (health.transport == Transport::kOk && health.http_status < 500)) {
      return Status::OK();  // it answers; the journaled probe judges what it says
    }
    const std::int64_t waited_ms = clock_.now_ms() - start_ms;
    const std::string last = describe(health);
    if (waited_ms >= static_cast<std::int64_t>(options.startup_timeout_ms)) {
      return Status::Unavailable("the engine did not come up within " +
                                 std::to_string(options.startup_timeout_ms) +
                                 " ms (engine_startup_timeout_ms); last /health: " + last);
    }
    if (options.progress && clock_.now_ms() - reported_ms >= options_.startup_report_ms) {
      reported_ms = clock_.now_ms();
      options.progress("waiting for the engine to start (" + std::to_string(waited_ms / 1000) +
                       " s of " + std::to_string(options.startup_timeout_ms / 1000) +
                       " s): /health " + last);
    }
    clock_.sleep_ms(options_.startup_poll_ms);
  }
}

Status Runner::Bootstrap(const std::string& label, const WeightIdentity& identity,
                         const BootstrapOptions& options) {
  if (options.startup_timeout_ms > 0) RC_RETURN_IF_ERROR(wait_for_engine(options));
  const BootstrapRequested request{label, identity, options.adopt, options.require_digest,
                                   options.expected_digest};
  auto r = submit(request);
  if (!r.ok()) return r.status();
  last_probe_.reset();
  RC_RETURN_IF_ERROR(Drive());
  const State s = current_state();
  if (s.lifecycle == Lifecycle::kReady) return Status::OK();
  std::string why = last_probe_ ? explain_bootstrap_refusal(request, *last_probe_)
                                : std::string("no probe was made");
  if (last_probe_ && last_probe_->http.ok_2xx() && last_probe_->engine_instance.empty()) {
    why +=
        " (the engine must expose its process: /metrics with process_start_time_seconds, or "
        "the worker extension)";
  } else if (last_probe_ && last_probe_->is_paused_known && last_probe_->is_paused) {
    why += " (resume it, or restart it from the declared weights; --adopt-engine resumes it)";
  } else if (last_probe_ && last_probe_->http.ok_2xx() && !options.adopt) {
    why +=
        " (restart the engine from the declared weights, or start with --adopt-engine to "
        "journal it as found)";
  }
  return Status::Unavailable("bootstrap did not reach READY after " + std::to_string(s.attempts) +
                             " probe(s): " + why);
}

Result<UpdateEnded> Runner::Update(const UpdateRequested& request) {
  return run_to_end(request, request.update_id,
                    engine_key(UpdateIdempotencyKey(request.update_id)));
}

Result<UpdateEnded> Runner::Restore(const RestoreRequested& request) {
  return run_to_end(request, request.restore_id,
                    engine_key(RestoreIdempotencyKey(request.restore_id)));
}

Result<UpdateEnded> Runner::Sleep(const SleepRequested& request) {
  return run_to_end(request, request.sleep_id, engine_key(SleepIdempotencyKey(request.sleep_id)));
}

Result<UpdateEnded> Runner::Wake(const WakeRequested& request) {
  return run_to_end(request, request.wake_id, engine_key(WakeIdempotencyKey(request.wake_id)));
}

Status Runner::StartUpdate(const UpdateRequested& request) {
  return start_plan(request, engine_key(UpdateIdempotencyKey(request.update_id)));
}

Result<EngineLooked> Runner::LookBeforePlan(const UpdateRequested& request) {
  if (look_due(request)) RC_RETURN_IF_ERROR(check_engine_before_plan());
  return looked_now();
}

Status Runner::StartUpdate(const UpdateRequested& request, const EngineLooked& looked) {
  return start_plan(request, engine_key(UpdateIdempotencyKey(request.update_id)), &looked);
}

// A restore starts from TAINTED: its validation proves the engine. A request refused for what it
// is (malformed, a level-2 wake-up, another plan in flight) is refused before the engine is
// looked at, as it was before any look: judged as if a look had found the engine answering and
// re-verified, which is all a look can change.
bool Runner::look_due(const Event& request) const {
  if (std::holds_alternative<RestoreRequested>(request)) return false;
  State s = current_state();
  s.engine_reachable = true;
  s.engine_recheck = false;
  return decide(s, request).ok();
}

// A request the journal holds already is answered from the journal (its recorded end, or a
// conflict for another body): an idempotent retry is never refused by a look at the engine, and
// touches nothing there.
Status Runner::look_unless_held(const Event& request, const std::string& key) {
  if (!look_due(request)) return Status::OK();
  if (key.empty()) return check_engine_before_plan();
  Result<bool> held = journal_.KeyHeld(key);
  if (!held.ok()) return held.status();
  return *held ? Status::OK() : check_engine_before_plan();
}

EngineLooked Runner::looked_now() const {
  EngineLooked now;
  read_state([&now](const State& s) {
    now.epoch = monitor_epoch(s);
    now.lifecycle = s.lifecycle;
    now.committed_label = s.committed.label;
  });
  return now;
}

Result<UpdateEnded> Runner::FinishUpdate(const std::string& update_id) {
  return finish_plan(update_id);
}

Result<UpdateEnded> Runner::run_to_end(const Event& request, const std::string& id,
                                       const std::string& key) {
  RC_RETURN_IF_ERROR(start_plan(request, key));
  return finish_plan(id);
}

Status Runner::start_plan(const Event& request, const std::string& key,
                          const EngineLooked* looked) {
  timings_.clear();
  ended_.clear();
  resubmitted_seq_ = 0;
  plan_stopped_ = false;
  plan_start_us_ = clock_.now_us();
  const bool looked_still = looked != nullptr && *looked == looked_now();
  if (!looked_still) RC_RETURN_IF_ERROR(look_unless_held(request, key));
  // Durable with the drain's intent, before the engine is touched.
  const Status submitted = submit(request, key, Durability::kWithNext).status();
  const bool resubmitted = submitted.ok() && unsynced_ && unsynced_->result.duplicate;
  resubmitted_seq_ = resubmitted ? unsynced_->result.first_seq : 0;
  return submitted;
}

namespace {

// What a look at the engine left unread of what the fold compares ("" when nothing): a look that
// names no process (once one was verified), no pause state or no digest (when the committed
// version has one) cannot tell the committed engine from another.
std::string unread_in(const State& before, const EngineMonitored& seen, bool with_digest) {
  if (!seen.http.ok_2xx()) return "the engine did not answer (" + describe(seen.http) + ")";
  if (!seen.is_paused_known) return "its /is_paused was not read";
  if (seen.engine_instance.empty() && !before.engine_instance.empty()) {
    return "it named no process instance";
  }
  if (with_digest && !seen.digest.present()) return "no weight digest (" + seen.digest.error + ")";
  return {};
}

// The fold's own rules (engine_matches, weights_match): the look shows an engine other than the
// one the committed version was verified on.
bool shows_other_engine(const State& before, const EngineMonitored& seen) {
  if (!seen.http.ok_2xx()) return false;
  return !engine_matches(before, seen.reported_label, seen.is_paused_known, seen.is_paused,
                         seen.engine_instance) ||
         !weights_match(before, seen.digest);
}

// Whether the monitor would journal this look (service/service.cc, MonitorOnce): it changes
// reachability, shows another engine, or vouches for an engine awaiting re-verification (or not
// yet verified by its instance).
bool changes_the_fold(const State& before, const EngineMonitored& seen) {
  const bool ok = seen.http.ok_2xx();
  const bool vouched = ok && engine_vouched(before, seen.reported_label, seen.is_paused_known,
                                            seen.is_paused, seen.engine_instance);
  const bool adopts = vouched && before.engine_instance.empty() && !seen.engine_instance.empty();
  return look_changes_reachability(before, seen) || shows_other_engine(before, seen) ||
         look_clears_recheck(before, seen) || adopts;
}

}  // namespace

State Runner::watched_state() const {
  State view;
  read_state([&view](const State& s) {
    view.lifecycle = s.lifecycle;
    view.committed = s.committed;
    view.committed_identity = s.committed_identity;
    view.committed_digest = s.committed_digest;
    view.update = s.update;
    view.taint = s.taint;
    view.engine_instance = s.engine_instance;
    view.engine_reachable = s.engine_reachable;
    view.engine_recheck = s.engine_recheck;
    view.fold_rules = s.fold_rules;
    view.sleep_level = s.sleep_level;
    view.counters = s.counters;
  });
  return view;
}

// The monitor's schedule of weight digests (weight_digest_check_interval_ms; 0: never) decides,
// so a look never reads, nor journals, a digest the monitor would not.
bool Runner::digest_due() const { return !digest_schedule_.due || digest_schedule_.due(); }

void Runner::digest_looked(const WeightDigest& digest) const {
  if (digest_schedule_.looked) digest_schedule_.looked(digest);
}

// A read that failed proves nothing and the next may succeed; a look that shows another engine
// is final. Every look ends by the one deadline.
EngineMonitored Runner::look_at_engine(const State& before, bool with_digest) {
  const std::int64_t deadline_ms =
      clock_.now_ms() + static_cast<std::int64_t>(deadline_for(EffectKind::kProbeEngine));
  std::uint32_t backoff_ms = options_.backoff_ms_min;
  EngineMonitored seen;
  for (std::uint32_t look = 0; look < kEffectAttemptsMax; ++look) {
    if (look > 0) {
      clock_.sleep_ms(backoff_ms);
      backoff_ms = std::min(options_.backoff_ms_max, backoff_ms * 2);
    }
    const std::int64_t left_ms = deadline_ms - clock_.now_ms();
    if (look > 0 && left_ms <= 0) break;
    seen = engine_.Observe(with_digest,
                           static_cast<std::uint64_t>(std::max<std::int64_t>(1, left_ms)));
    if (shows_other_engine(before, seen) || unread_in(before, seen, with_digest).empty()) break;
  }
  RC_CHECK(with_digest || !seen.digest.present());  // a sleeper's look holds no digest
  return seen;
}

Status Runner::journal_engine_look(const State& before, EngineMonitored seen, std::string* taint) {
  RC_CHECK(taint != nullptr && !before.update.has_value());
  RC_CHECK(before.lifecycle == Lifecycle::kReady || before.lifecycle == Lifecycle::kSleeping);
  // When the verified engine was last seen is the monitor's to know, not the runner's: 0 opens
  // the audit's window of suspect rollouts at the engine's verification (READY), the widest.
  seen.last_ok_wall_ms = 0;
  seen.updates_seen = monitor_epoch(before);
  Event look = std::move(seen);
  bound_texts(look);
  // Durable now: a plan refused on it is answered only once the record is.
  auto decided = submit(look);
  if (!decided.ok() && decided.status().code() == Code::kRejected) {
    return Status::Rejected("the look at the engine before the plan was refused: " +
                            decided.status().message());
  }
  if (!decided.ok()) return decided.status();
  for (const Event& d : decided.value()) {
    const auto* c = std::get_if<StateChanged>(&d);
    if (c != nullptr && c->to == Lifecycle::kTainted) *taint = c->detail;
  }
  return Status::OK();
}

Status Runner::check_engine_before_plan() {
  const State before = watched_state();
  const bool asleep = before.lifecycle == Lifecycle::kSleeping;
  // Only a watched engine has a committed one to compare with; a plan in flight owns the engine
  // already (its request is being submitted again).
  if ((before.lifecycle != Lifecycle::kReady && !asleep) || before.update.has_value()) {
    return Status::OK();
  }
  const bool with_digest = !asleep && before.committed_digest.present() && digest_due();
  const EngineMonitored seen = look_at_engine(before, with_digest);
  if (with_digest) digest_looked(seen.digest);
  const bool other = shows_other_engine(before, seen);
  std::string taint;
  if (changes_the_fold(before, seen)) {
    RC_RETURN_IF_ERROR(journal_engine_look(before, seen, &taint));
  }
  if (other) {
    return Status::Rejected("the engine is not the one '" + before.committed.label +
                            "' was verified on; it was recorded TAINTED and nothing was sent: " +
                            (taint.empty() ? describe(Event{seen}) : taint));
  }
  const std::string unread = unread_in(before, seen, with_digest);
  if (unread.empty()) return Status::OK();
  return Status::Rejected("the engine could not be verified before the plan (" + unread +
                          "); nothing was sent: ask again");
}

// A request the journal held already, whose plan is not the one in flight: it ended before, in
// some group this runner did not see. Its end is the journal's to tell, and nothing is driven.
Status Runner::RefuseEndedResubmission(const std::string& id) const {
  if (resubmitted_seq_ == 0) return Status::OK();
  for (const UpdateEnded& e : ended_) {
    if (e.update_id == id) return Status::OK();  // it ended in its own group: that end answers
  }
  const State s = current_state();
  if (s.update && s.update->update_id == id) return Status::OK();
  return Status::Conflict("'" + id + "' was requested at seq " + std::to_string(resubmitted_seq_) +
                          " and has ended (rolloutcore replay shows how); a new request needs a "
                          "new id");
}

Result<UpdateEnded> Runner::finish_plan(const std::string& id) {
  RC_RETURN_IF_ERROR(RefuseEndedResubmission(id));
  Status driven = Drive();
  timings_.total_us = elapsed_us(plan_start_us_);
  if (!driven.ok()) return driven;
  for (const UpdateEnded& e : ended_) {
    if (e.update_id == id) return e;
  }
  const State s = current_state();
  return Status::Unavailable("'" + id + "' did not end: state " + lifecycle_name(s.lifecycle) +
                             ", next effect " + effect_name(next_effect(s).kind) +
                             " (retries exhausted)");
}

}  // namespace rc::effects
