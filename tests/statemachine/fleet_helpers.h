// A driver for the fleet fold in tests: steps fleet events, asserts acceptance or rejection, and
// walks one engine's own update with calm (or chosen) observations.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "statemachine/fleet.h"
#include "statemachine/fleet_history.h"
#include "tests/statemachine/gen.h"

namespace rc::test {

inline FaultMix calm_mix() {
  FaultMix m;
  m.probe_fail = m.drain_fail = m.drain_timeout = m.preflight_bad = 0;
  m.transfer_refused = m.transfer_ambiguous = m.reset_fail = 0;
  m.validate_fail = m.validate_wrong = m.resume_fail = m.garbage = m.answer_partial = 0;
  return m;
}

inline std::string fleet_event_name(const FleetEvent& e) {
  return "[" + e.engine + "] " + event_name(e.event);
}

struct FleetDriver {
  FleetState f;
  std::vector<FleetEvent> accepted;        // every event the fold took, in order
  std::vector<FleetHistoryEntry> history;  // the same, as a journal records them
  int rollouts = 0;

  std::vector<FleetEvent> ok(const FleetEvent& input) {
    Result<std::vector<FleetEvent>> r = fleet_step(f, input);
    EXPECT_TRUE(r.ok()) << "rejected " << fleet_event_name(input) << ": " << r.status().ToString();
    if (!r.ok()) return {};
    EXPECT_EQ(check_fleet_invariants(f), "");
    accepted.push_back(input);
    accepted.insert(accepted.end(), r->begin(), r->end());
    record(history, input, *r);
    return *r;
  }
  // Appends one group (an input and what it caused) with journal seqs.
  static void record(std::vector<FleetHistoryEntry>& h, const FleetEvent& input,
                     const std::vector<FleetEvent>& caused) {
    const std::uint64_t in_seq = h.size() + 1;
    h.push_back({in_seq, 0, input.engine, input.event});
    for (const FleetEvent& c : caused) h.push_back({h.size() + 1, in_seq, c.engine, c.event});
  }
  std::vector<FleetEvent> ok(const std::string& engine, const Event& e) {
    return ok(FleetEvent{engine, e});
  }
  Status rejected(const FleetEvent& input) {
    const FleetState before = f;
    Result<std::vector<FleetEvent>> r = fleet_step(f, input);
    EXPECT_FALSE(r.ok()) << "accepted " << fleet_event_name(input);
    EXPECT_EQ(f, before) << "a rejected input changed the fleet";
    return r.ok() ? Status::OK() : r.status();
  }
  Status rejected(const std::string& engine, const Event& e) {
    return rejected(FleetEvent{engine, e});
  }

  const State& engine(const std::string& id) const { return f.engines.at(id); }

  void join(const std::string& id) { ok(FleetEvent{"", EngineJoined{id}}); }
  // `digest`: what the engine's probe reads (none by default: the journal then uses no digests);
  // `expected`: the digest the bootstrap is held to ("" none).
  void bootstrap(const std::string& id, const std::string& label = "rc-0", char ident = 'a',
                 const WeightDigest& digest = {}, const std::string& expected = "") {
    BootstrapRequested b{label, identity(ident)};
    b.expected_digest = expected;
    ok(id, b);
    ok(id, EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1000});
    EngineProbed probe{ok_http(), "0.25.1", label};
    probe.engine_instance = "i-" + id;
    probe.digest = digest;
    ok(id, probe);
  }
  std::string admit(const std::string& id) {
    std::string rollout = "r" + std::to_string(++rollouts);
    ok(make_fleet_admission(f, id, rollout));
    return rollout;
  }
  FleetUpdateRequested fleet_update(const std::string& id, FleetUpdateMode mode,
                                    const std::string& label, std::uint32_t batch_max = 1,
                                    std::uint32_t min_healthy = 1) const {
    return FleetUpdateRequested{
        id, mode, batch_max, min_healthy, label, identity('b'), "safetensors:/ckpt/x"};
  }
  UpdateRequested member_update(const FleetUpdateRequested& u) const {
    return UpdateRequested{u.update_id, u.target_label, u.identity, u.source_uri};
  }

  // Steps `id`'s own update until it ends or waits on rollouts; `ambiguous` breaks its transfer
  // after bytes may have landed.
  void run_update(const std::string& id, bool ambiguous = false) {
    Rng rng(7);
    const FaultMix calm = calm_mix();
    for (int guard = 0; guard < 64 && engine(id).update.has_value(); ++guard) {
      const State& s = engine(id);
      if (s.in_flight.has_value()) {
        if (ambiguous && s.in_flight->kind == EffectKind::kTransfer) {
          ok(id, TransferObserved{false, MutationClass::kPossible, 7, 1, 1, "", "broken"});
        } else {
          ok(id, observation(s, rng, calm));
        }
        continue;
      }
      const Effect due = next_effect(s);
      if (due.kind == EffectKind::kNone || due.kind == EffectKind::kAwaitRollouts) return;
      ok(id, EffectStarted{due.kind, due.cache, 1000});
    }
  }

  // A rolling update to `label` of which only `engine` runs before it is cancelled: the others
  // stay behind on their old label.
  void update_only(const std::string& engine, const std::string& update_id,
                   const std::string& label) {
    const FleetUpdateRequested u = fleet_update(update_id, FleetUpdateMode::kRolling, label);
    ok(FleetEvent{"", u});
    ok(engine, member_update(u));
    run_update(engine);
    ok(FleetEvent{"", FleetUpdateCancelled{update_id, "the others stay behind"}});
  }

  // Steps `id`'s own update as run_update does, but its engine never answers a resume (it died
  // paused): the plan stops in RESUMING once the resume ran out of attempts.
  void run_update_dead_at_resume(const std::string& id) {
    Rng rng(7);
    const FaultMix calm = calm_mix();
    for (int guard = 0; guard < 64 && engine(id).update.has_value(); ++guard) {
      const State& s = engine(id);
      if (s.in_flight.has_value()) {
        ok(id, s.in_flight->kind == EffectKind::kResume
                   ? Event{ResumeObserved{HttpEvidence{Transport::kConnectFailed, 0, false, 0,
                                                       "connection refused"}}}
                   : observation(s, rng, calm));
        continue;
      }
      const Effect due = next_effect(s);
      if (due.kind == EffectKind::kNone || due.kind == EffectKind::kAwaitRollouts) return;
      ok(id, EffectStarted{due.kind, due.cache, 1000});
    }
  }

  // Steps `id`'s own update as run_update does, its validation reading `seen` as the engine's
  // weight digest; with `dead_at_resume` its engine never answers a resume (the plan stalls in
  // RESUMING, validated).
  void run_update_reading(const std::string& id, const WeightDigest& seen,
                          bool dead_at_resume = false) {
    Rng rng(7);
    const FaultMix calm = calm_mix();
    const ResumeObserved dead{HttpEvidence{Transport::kConnectFailed, 0, false, 0, "refused"}};
    for (int guard = 0; guard < 64 && engine(id).update.has_value(); ++guard) {
      const State& s = engine(id);
      if (s.in_flight.has_value()) {
        Event seen_now = observation(s, rng, calm);
        if (auto* v = std::get_if<ValidationObserved>(&seen_now)) v->digest = seen;
        if (dead_at_resume && s.in_flight->kind == EffectKind::kResume) seen_now = dead;
        ok(id, seen_now);
        continue;
      }
      const Effect due = next_effect(s);
      if (due.kind == EffectKind::kNone || due.kind == EffectKind::kAwaitRollouts) return;
      ok(id, EffectStarted{due.kind, due.cache, 1000});
    }
  }

  // The fold of everything accepted, from nothing: what a journal replay would give.
  FleetState refold() const {
    FleetState again;
    for (const FleetEvent& e : accepted) {
      const Status st = fleet_apply(again, e);
      EXPECT_TRUE(st.ok()) << fleet_event_name(e) << ": " << st.ToString();
    }
    return again;
  }
};

}  // namespace rc::test
