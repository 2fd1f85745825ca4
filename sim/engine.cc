#include "sim/engine.h"

#include <algorithm>

#include "encoding/sha256.h"

namespace rc::sim {

namespace {
// The calling thread's turn: a SimThreads thread sets its own in Await; any other thread (the
// simulator's) has this one.
thread_local Scheduler::Turn tl_default_turn;
thread_local Scheduler::Turn* tl_turn = nullptr;
Scheduler::Turn& CurrentTurn() { return tl_turn != nullptr ? *tl_turn : tl_default_turn; }
}  // namespace

void Scheduler::At(std::int64_t t_us, std::function<void()> fn) {
  RC_CHECK(queue_.size() < kEventsMax);
  queue_.push(Item{std::max(t_us, now_us_), false, ++seq_, std::move(fn), nullptr});
}

void Scheduler::RunUntil(std::int64_t t_us) {
  RC_CHECK(!running_);  // an event that advanced time would reorder the world
  Turn& me = CurrentTurn();
  queue_.push(Item{std::max(t_us, now_us_), true, ++seq_, {}, &me});
  Dispatch(&me);
  RC_CHECK(now_us_ >= t_us);
}

void Scheduler::Enter(Turn& turn) {
  RC_CHECK(queue_.size() < kEventsMax);
  queue_.push(Item{now_us_, true, ++seq_, {}, &turn});
}

void Scheduler::Await(Turn& turn) {
  tl_turn = &turn;
  std::unique_lock<std::mutex> l(turns_mu_);
  turn.cv.wait(l, [&turn] { return turn.go; });
  turn.go = false;
}

void Scheduler::Leave() {
  RC_CHECK(!running_);
  Dispatch(nullptr);
}

// Runs the events due before the next turn; that turn's thread then takes over. `me` returns
// when its own turn comes, handed back by whichever thread reached it; nullptr never does.
void Scheduler::Dispatch(Turn* me) {
  while (true) {
    RC_CHECK(!queue_.empty());  // the waiting threads' turns at least
    Item item = queue_.top();
    queue_.pop();
    now_us_ = item.t;
    if (item.turn == nullptr) {
      running_ = true;
      item.fn();
      running_ = false;
      continue;
    }
    if (item.turn != me) HandOver(item.turn, me);
    return;
  }
}

// The mutex orders everything `me` did before everything `next` does.
void Scheduler::HandOver(Turn* next, Turn* me) {
  std::unique_lock<std::mutex> l(turns_mu_);
  next->go = true;
  next->cv.notify_one();
  if (me == nullptr) return;
  me->cv.wait(l, [me] { return me->go; });
  me->go = false;
}

SimEngine::SimEngine(Scheduler& s, Line line, std::vector<std::string>& violations)
    : s_(s), line_(line), violations_(violations) {}

bool SimEngine::CachesResetSinceMutation() const {
  return std::all_of(t_.last_reset_op.begin(), t_.last_reset_op.end(),
                     [&](std::uint64_t r) { return r > t_.last_mutation_op; });
}

void SimEngine::Die(std::uint32_t down_ms, Comeback comeback) {
  if (!t_.alive) return;
  t_.alive = false;
  std::vector<Done> failed;
  for (auto& [id, r] : requests_) failed.push_back(std::move(r.done));
  requests_.clear();
  for (Done& d : failed) d(false);
  const std::string label = t_.label;
  const std::string weights = t_.weights;
  s_.After(std::int64_t{down_ms} * 1000 + 1000, [this, comeback, label, weights] {
    // A new process with empty caches: a restart is a mutation even when the weights come back.
    t_.alive = true;
    t_.instance++;
    t_.restarts++;
    t_.up_since_us = s_.now_us();
    t_.label = comeback == Comeback::kFresh ? std::string(kFreshEngineLabel) : label;
    t_.weights = comeback == Comeback::kLabelWeightsKept ? weights : std::string(kInitialWeights);
    t_.paused = false;
    t_.prefix_cache.clear();
    t_.sleep_level = 0;
    t_.weights_asleep = t_.kv_asleep = false;
    t_.last_mutation_op = ++t_.op;
    ++t_.op;
    t_.last_reset_op.fill(t_.op);
  });
}

std::uint64_t SimEngine::Start(const std::string& rollout_id, const std::string& cache_key,
                               std::uint32_t duration_ms, Done done) {
  if (!t_.alive) return 0;
  const std::uint64_t id = next_id_++;
  requests_[id] = Request{rollout_id, cache_key, duration_ms, false, 0, std::move(done)};
  if (!t_.paused) Begin(id);  // a paused engine queues it (pause leaves queued requests queued)
  return id;
}

void SimEngine::Begin(std::uint64_t id) {
  Request& r = requests_.at(id);
  if (asleep() && violations_.size() < 32) {
    violations_.push_back("rollout '" + r.rollout_id + "' served by a sleeping engine");
  }
  // A level-2 sleep discards the weights: mapped again they hold garbage until a transfer.
  if (t_.weights.rfind(kDiscardedWeights, 0) == 0 && violations_.size() < 32) {
    violations_.push_back("rollout '" + r.rollout_id + "' served by discarded weights '" +
                          t_.weights + "'");
  }
  r.started = true;
  r.token = next_token_++;
  // Prefix caching: blocks computed by other weights must never serve this request.
  auto hit = t_.prefix_cache.find(r.cache_key);
  if (hit != t_.prefix_cache.end() && hit->second != t_.weights && violations_.size() < 32) {
    violations_.push_back("stale KV: rollout '" + r.rollout_id +
                          "' hit prefix blocks computed by '" + hit->second +
                          "' while the engine holds '" + t_.weights + "'");
  }
  t_.prefix_cache[r.cache_key] = t_.weights;
  const std::uint64_t token = r.token;
  s_.After(std::int64_t{r.duration_ms} * 1000, [this, id, token] { Finish(id, token); });
}

void SimEngine::Finish(std::uint64_t id, std::uint64_t token) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second.token != token) return;
  Done done = std::move(it->second.done);
  requests_.erase(it);
  done(true);
}

void SimEngine::Abort(std::uint64_t request_id) { requests_.erase(request_id); }

std::size_t SimEngine::running() const {
  return static_cast<std::size_t>(std::count_if(requests_.begin(), requests_.end(),
                                                [](const auto& kv) { return kv.second.started; }));
}

void SimEngine::Resume() {
  t_.paused = false;
  std::vector<std::uint64_t> queued;
  for (const auto& [id, r] : requests_) {
    if (!r.started) queued.push_back(id);
  }
  for (std::uint64_t id : queued) Begin(id);
}

bool SimEngine::ResetCache(CacheKind c) {
  // Blocks held by running requests: the newer line answers {"success": false}; 0.25.x answers
  // an empty 200 either way (nothing reported).
  if (running() > 0) return false;
  if (c == CacheKind::kPrefix) t_.prefix_cache.clear();
  t_.last_reset_op[static_cast<int>(c)] = ++t_.op;
  return true;
}

void SimEngine::Sleep(std::uint8_t level) {
  t_.paused = true;
  for (std::uint8_t c = 0; c < kCacheKinds; ++c) ResetCache(static_cast<CacheKind>(c));
  if (asleep()) return;
  t_.sleep_level = level;
  t_.weights_asleep = t_.kv_asleep = true;
  t_.weights_backup = t_.weights;
}

void SimEngine::Wake(WakeTag tag) {
#ifdef RC_MUTANT_WAKE_KV_UNMAPPED
  // Simulator mutant (off in every normal build): waking the KV cache resumes the scheduler but
  // maps nothing, as vLLM does when its executor never marked itself sleeping (docs/
  // vllm-protocol.md 8.2): the engine answers 200, reports not paused, and serves from memory it
  // released.
  if (tag == WakeTag::kKvCache && t_.kv_asleep) {
    t_.paused = false;
    return;
  }
#endif
  bool& tag_asleep = tag == WakeTag::kWeights ? t_.weights_asleep : t_.kv_asleep;
  if (!tag_asleep) {
    if (!asleep()) Resume();
    return;
  }
  tag_asleep = false;
  if (tag == WakeTag::kWeights && t_.sleep_level >= 2) {
    Mutate(kDiscardedWeights + std::to_string(t_.op));  // mapped again, contents undefined
  }
  if (!asleep()) Resume();
}

void SimEngine::WakeAll() {
  Wake(WakeTag::kWeights);
  Wake(WakeTag::kKvCache);
}

void SimEngine::Mutate(const std::string& weights) {
  if (t_.weights_asleep && violations_.size() < 32) {
    violations_.push_back("weights '" + weights + "' written while the weights sleep");
  }
  t_.weights = weights;
  t_.last_mutation_op = ++t_.op;
  t_.transfer_epoch++;
}

// ---- SimControl ----

namespace {
HttpEvidence Ok() { return HttpEvidence{Transport::kOk, 200, true, 1000, ""}; }
HttpEvidence Failed(Transport t, std::int32_t status, const char* error) {
  return HttpEvidence{t, status, false, 1000, error};
}
}  // namespace

HttpEvidence SimControl::Call(bool* applied) {
  const std::uint32_t index = f_.calls++;
  s_.RunUntil(s_.now_us() + 1000 + std::int64_t{f_.delay_ms} * 1000);  // latency: others act
  if (f_.death && index == f_.death->a % 16) e_.Die(f_.death->b % 200);
  *applied = false;
  if (!e_.truth().alive) return Failed(Transport::kConnectFailed, 0, "connection refused");
  auto it = f_.by_call.find(index);
  if (it == f_.by_call.end()) {
    *applied = true;
    return Ok();
  }
  const Fault& f = it->second;
  const bool done_anyway = (f.b % 2) == 1;
  switch (f.kind) {
    case FaultKind::kHttp5xx:
      return Failed(Transport::kOk, 500, "HTTP 500");
    case FaultKind::kHttpTimeout:
      *applied = done_anyway;
      return Failed(Transport::kTimeout, 0, "timed out");
    case FaultKind::kHttpDrop:
      *applied = done_anyway;
      return Failed(Transport::kBroken, 0, "connection dropped");
    case FaultKind::kHttpRefused:
      return Failed(Transport::kConnectFailed, 0, "connection refused");
    case FaultKind::kHttpGarbage:
      *applied = done_anyway;
      return Failed(Transport::kOk, 200, "unparsable body");
    default:
      break;
  }
  *applied = true;
  return Ok();
}

HttpEvidence SimControl::Health() {
  return e_.truth().alive ? Ok() : Failed(Transport::kConnectFailed, 0, "connection refused");
}

bool ArmCallFault(const Fault& f, CycleFaults& cf) {
  switch (f.kind) {
    case FaultKind::kHttp5xx:
    case FaultKind::kHttpTimeout:
    case FaultKind::kHttpDrop:
    case FaultKind::kHttpRefused:
    case FaultKind::kHttpGarbage:
      cf.by_call[f.a % 14] = f;
      return true;
    case FaultKind::kSuccessFalse:
      cf.success_false_left = 1 + f.b % 3;
      return true;
    case FaultKind::kDelay:
      cf.delay_ms = f.b % 40;
      return true;
    case FaultKind::kEngineDeath:
      cf.death = f;
      return true;
    case FaultKind::kPreflightRefuse:
      cf.preflight = f;
      return true;
    case FaultKind::kTransferFail:
      cf.transfer = f;
      return true;
    case FaultKind::kSilentLoss:
      cf.silent_loss = true;
      return true;
    case FaultKind::kInstanceUnread:
      cf.unnamed_left = 1 + f.b % 2;
      return true;
    default:
      return false;
  }
}

WeightDigest SimDigest(const std::string& weights) {
  WeightDigest d;
  d.algorithm = "sim";
  d.combined = encoding::Sha256Hex(weights).substr(0, 32);
  d.tensors.push_back({"model.weight", d.combined});
  d.bytes = 4096;
  return d;
}

void SimControl::ArmDigestFaults(const Fault& f) {
  digest_.per_mille = 250 * (1 + f.b % 4);
  digest_.mode = f.a % 3;
  digest_.reads = (f.a / 3) % 4;
  digest_rng_.seed((std::uint64_t{f.cycle} << 32) ^ (std::uint64_t{f.a} << 16) ^ f.b ^
                   0x5851F42D4C957F2Dull);
}

// What the real client records when the worker extension's digest RPC fails: an absent digest
// whose error says why (effects/http/weight_digest.h); the label, pause and process still answer.
WeightDigest SimControl::ReadDigest(DigestRead read) {
  static constexpr const char* kFailures[] = {
      "the weight digest read failed: /collective_rpc rc_weight_digest: timed out",
      "the weight digest read failed: /collective_rpc rc_weight_digest: HTTP 500",
      "2xx body is not what rc_weight_digest returns: results[0] has no combined digest",
  };
  if (digest_.per_mille == 0 || !digest_.targets(read) ||
      digest_rng_() % 1000 >= digest_.per_mille) {
    return SimDigest(e_.truth().weights);
  }
  ++digest_reads_failed_;
  last_digest_failure_us_ = s_.now_us();
  WeightDigest failed;
  failed.error = kFailures[digest_.mode % 3];
  return failed;
}

std::string SimControl::AnsweringInstance() {
  if (f_.unnamed_left == 0) return e_.instance_name();
  --f_.unnamed_left;
  return {};
}

EngineProbed SimControl::Probe() {
  bool applied = false;
  EngineProbed p;
  p.http = Call(&applied);
  if (!applied || !p.http.ok_2xx()) return p;
  const EngineTruth& t = e_.truth();
  p.engine_version = e_.line() == Line::k025 ? "0.25.1" : "0.30.0";
  p.reported_label = t.label;
  p.is_paused_known = true;
  p.is_paused = t.paused;
  p.engine_instance = AnsweringInstance();
  p.digest = ReadDigest(DigestRead::kProbe);
  if (p.digest.present() && !e_.asleep()) last_digest_read_op_ = t.op;
  return p;
}

HttpEvidence SimControl::SetLabel(const std::string& label) {
  bool applied = false;
  HttpEvidence h = Call(&applied);
  if (applied) e_.SetLabel(label);
  return h;
}

DrainObserved SimControl::PauseWait(std::uint64_t timeout_ms) {
  bool applied = false;
  DrainObserved d;
  d.http = Call(&applied);
  if (!applied) return d;
  e_.Pause();
  // mode=wait: running requests finish first; the clients act meanwhile.
  const std::int64_t deadline = s_.now_us() + static_cast<std::int64_t>(timeout_ms) * 1000;
  while (e_.truth().alive && e_.running() > 0 && s_.now_us() < deadline) {
    s_.RunUntil(s_.now_us() + 1000);
  }
  if (!e_.truth().alive) {
    d.http = Failed(Transport::kBroken, 0, "connection dropped");
  } else if (e_.running() > 0) {
    d.http = Failed(Transport::kTimeout, 0, "pause timed out");
  } else {
    d.paused = d.http.ok_2xx();
  }
  return d;
}

CacheResetObserved SimControl::ResetCache(CacheKind cache) {
  bool applied = false;
  CacheResetObserved r;
  r.cache = cache;
  r.http = Call(&applied);
  if (!applied) return r;
  const bool newer = e_.line() == Line::kNewer;
  if (newer && cache == CacheKind::kPrefix && f_.success_false_left > 0) {
    f_.success_false_left--;  // blocks held by something: {"success": false}, nothing reset
    r.reported_success = false;
    return r;
  }
  const bool done = e_.ResetCache(cache);
  if (!r.http.ok_2xx()) return r;
  if (newer && cache == CacheKind::kPrefix) {
    r.reported_success = done;
  } else {
    r.reported_success = true;  // an empty 200 (0.25.x, mm/encoder routes): nothing reported
    r.success_unreported = true;
  }
  return r;
}

ValidationObserved SimControl::WeightInfo() {
  bool applied = false;
  ValidationObserved v;
  v.http = Call(&applied);
  if (!applied || !v.http.ok_2xx()) return v;
  v.reported_label = e_.truth().label;
  v.engine_instance = AnsweringInstance();
  const EngineTruth& t = e_.truth();
  v.digest = ReadDigest(DigestRead::kValidation);
  validations_unread_ += v.digest.present() ? 0 : 1;
  v.is_paused_known = true;
  v.is_paused = t.paused;
  validated_ =
      Validated{t.instance,         t.weights, t.label,           e_.CachesResetSinceMutation(),
                t.last_mutation_op, t.paused,  v.digest.present()};
  return v;
}

ResumeObserved SimControl::Resume() {
  bool applied = false;
  ResumeObserved r;
  r.http = Call(&applied);
  mutation_op_at_resume_ = e_.truth().last_mutation_op;
  if (!applied) return r;
  e_.Resume();
  if (!r.http.ok_2xx()) return r;
  r.is_paused_known = true;
  r.is_paused = e_.truth().paused;
  if (!r.is_paused) {  // as vLLM reports it: a paused engine reads as sleeping too
    r.is_sleeping_known = true;
    r.is_sleeping = e_.asleep();
  }
  r.engine_instance = AnsweringInstance();
  return r;
}

PreflightObserved SimControl::Preflight(const effects::TransferTarget& target) {
  PreflightObserved p;
  p.source_manifest_digest = target.identity.manifest_digest;
  p.device_ok = true;
  p.memory_ok = true;
  if (f_.preflight) {
    if (f_.preflight->b % 2 == 0) {
      p.source_manifest_digest = std::string(64, '0');
    } else {
      p.device_ok = false;
    }
    f_.preflight.reset();
  }
  return p;
}

// The weights a source names: "synthetic:<checkpoint>" (what the world sends), else the declared
// checkpoint. A restore from the wrong source loads what the source holds, not what was declared.
std::string SourceWeights(const effects::TransferTarget& target) {
  const std::string scheme = "synthetic:";
  if (target.source_uri.rfind(scheme, 0) == 0) return target.source_uri.substr(scheme.size());
  return target.identity.checkpoint;
}

TransferObserved SimControl::Transfer(const effects::TransferTarget& target,
                                      std::uint64_t deadline_ms) {
  const std::int64_t start_us = s_.now_us();
  const std::uint32_t mode = f_.transfer ? f_.transfer->b % 4 : 4;
  f_.transfer.reset();
  TransferObserved t;
  t.finish_label = target.target.label;
  auto ambiguous = [&](const std::string& why) {
    t.acknowledged = false;
    t.mutation = MutationClass::kPossible;
    t.error = why;
    t.duration_us = static_cast<std::uint64_t>(s_.now_us() - start_us);
    return t;
  };
  // /start_weight_update: on 0.25.x it moves every layer to meta before it can fail.
  bool applied = false;
  const HttpEvidence start = Call(&applied);
  if (mode == 0 || start.never_sent()) {
    t.mutation = MutationClass::kNone;
    t.error = "start_weight_update: connection refused";
    return t;
  }
  if (e_.line() == Line::k025 && e_.truth().alive) e_.Mutate("meta");
  if (!applied || !start.ok_2xx() || mode == 1) return ambiguous("start_weight_update failed");
  // /update_weights + the data plane: chunks land one by one.
  const HttpEvidence update = Call(&applied);
  if (!e_.truth().alive) return ambiguous("engine gone mid-transfer");
  const std::string weights = SourceWeights(target);
  e_.Mutate("mixed:" + weights);
  if (!applied || !update.ok_2xx() || mode == 2) return ambiguous("update_weights failed");
  s_.RunUntil(s_.now_us() + 5000);  // the data plane runs; others act
  if (!e_.truth().alive) return ambiguous("engine gone mid-transfer");
  // A silent loss leaves the mix in place and nothing reports it: only the digest can tell.
  if (!f_.silent_loss) e_.Mutate(weights);
  f_.silent_loss = false;
  // /finish_weight_update {"weight_version": label}
  const HttpEvidence finish = Call(&applied);
  if (applied) e_.SetLabel(target.target.label);
  if (!applied || !finish.ok_2xx() || mode == 3) return ambiguous("finish_weight_update failed");
  if (s_.now_us() - start_us > static_cast<std::int64_t>(deadline_ms) * 1000) {
    return ambiguous("transfer deadline passed");
  }
  t.acknowledged = true;
  t.mutation = MutationClass::kComplete;
  t.bytes_sent = 4096;
  t.tensors_sent = 4;
  t.duration_us = static_cast<std::uint64_t>(s_.now_us() - start_us);
  return t;
}

SleepObserved SimControl::Sleep(std::uint8_t level, std::uint64_t timeout_ms) {
  (void)timeout_ms;
  bool applied = false;
  SleepObserved o;
  o.level = level;
  o.http = Call(&applied);
  if (applied) e_.Sleep(level);
  if (!o.http.ok_2xx()) return o;
  o.is_sleeping_known = true;
  o.is_sleeping = e_.truth().paused;
  return o;
}

WakeObserved SimControl::Wake(WakeTag tag, std::uint64_t timeout_ms) {
  (void)timeout_ms;
  bool applied = false;
  WakeObserved o;
  o.tag = tag;
  o.http = Call(&applied);
  if (applied) e_.Wake(tag);
  if (tag == WakeTag::kKvCache) mutation_op_at_resume_ = e_.truth().last_mutation_op;
  if (!o.http.ok_2xx() || tag != WakeTag::kKvCache) return o;
  o.is_paused_known = true;
  o.is_paused = e_.truth().paused;
  o.engine_instance = AnsweringInstance();
  return o;
}

EngineMonitored SimControl::Monitor(bool with_digest) {
  EngineMonitored m;
  if (!e_.truth().alive) {
    m.http = Failed(Transport::kConnectFailed, 0, "connection refused");
    return m;
  }
  m.http = Ok();
  m.reported_label = e_.truth().label;
  m.is_paused_known = true;
  m.is_paused = e_.truth().paused;
  m.engine_instance = e_.instance_name();
  if (!with_digest || e_.asleep()) return m;  // asleep: the weights are not mapped
  m.digest = ReadDigest(DigestRead::kMonitor);
  if (m.digest.present()) last_digest_read_op_ = e_.truth().op;
  return m;
}

}  // namespace rc::sim
