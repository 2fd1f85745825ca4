// Shared builders for the statemachine tests: valid payloads, evidence, and a driver that steps
// the fold and records the journal-shaped history it produced.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "statemachine/describe.h"
#include "statemachine/history.h"
#include "statemachine/state.h"

namespace rc::test {

inline std::string hex(char c) { return std::string(64, c); }

// One manifest and one content digest per `c` (steps of one `c` share both): a content digest
// names one set of bytes, so two manifests never share one (the fold refuses such an identity).
inline WeightIdentity identity(char c, std::int64_t step = 1) {
  return WeightIdentity{hex(c), std::string(63, 'e') + c, "/ckpt/" + std::string(1, c), "run-1",
                        step};
}

inline HttpEvidence ok_http() { return HttpEvidence{Transport::kOk, 200, true, 10, ""}; }
inline HttpEvidence http(Transport t, std::int32_t status = 0, bool parsed = false) {
  return HttpEvidence{t, status, parsed, 10, t == Transport::kOk ? "" : "boom"};
}

inline EffectStarted intent(EffectKind k, CacheKind c = CacheKind::kPrefix) {
  return EffectStarted{k, c, 1000};
}

// A digest over tensors "a", "b", "c" whose values are named by `v` (one hex digit per tensor).
inline WeightDigest digest_of(const std::string& v) {
  WeightDigest d;
  d.algorithm = "rcd1";
  d.bytes = 3 * 1024;
  const char* names[] = {"a", "b", "c"};
  for (int i = 0; i < 3; ++i) d.tensors.push_back({names[i], std::string(32, v[i])});
  d.combined = std::string(61, '0') + v;
  return d;
}

// Steps a State through inputs, asserting acceptance, and records the history like the journal.
struct Driver {
  State s;
  std::vector<HistoryEntry> history;
  std::uint64_t next_seq = 1;
  int rollout_counter = 0;

  // Steps `input`; returns the derived events (fails the test if the input is rejected).
  std::vector<Event> ok(const Event& input) {
    Result<std::vector<Event>> r = step(s, input);
    EXPECT_TRUE(r.ok()) << "rejected " << describe(input) << ": " << r.status().ToString() << " in "
                        << describe(s);
    if (!r.ok()) return {};
    record(input, r.value());
    return r.value();
  }
  // Steps `input` expecting a rejection; checks that the state is unchanged. Returns the code.
  Code rejected(const Event& input) {
    const State before = s;
    Result<std::vector<Event>> r = step(s, input);
    EXPECT_FALSE(r.ok()) << "accepted " << describe(input) << " in " << describe(before);
    EXPECT_EQ(s, before) << "a rejected input changed the state";
    return r.status().code();
  }
  void record(const Event& input, const std::vector<Event>& derived) {
    const std::uint64_t in_seq = next_seq++;
    history.push_back({in_seq, 0, input});
    for (const Event& d : derived) history.push_back({next_seq++, in_seq, d});
  }

  void effect(EffectKind k, CacheKind c = CacheKind::kPrefix) { ok(intent(k, c)); }

  // ---- walks to each state of the happy path ----
  void to_ready(const std::string& label = "rc-0") {
    ok(BootstrapRequested{label, identity('a')});
    effect(EffectKind::kProbeEngine);
    ok(EngineProbed{ok_http(), "0.25.1", label, false, false, "i-0"});
  }
  // The probe a restarted executor makes in READY, showing the same engine as before.
  void reverify() {
    effect(EffectKind::kProbeEngine);
    EngineProbed p{ok_http(), "0.25.1", s.committed.label};
    p.is_paused_known = true;
    p.engine_instance = s.engine_instance;
    ok(p);
  }
  std::string admit() {
    std::string id = "r" + std::to_string(++rollout_counter);
    ok(make_admission(s, id));
    return id;
  }
  UpdateRequested update_request(const std::string& label, char ident = 'b') const {
    return UpdateRequested{"u-" + label, label, identity(ident), "safetensors:/ckpt/x"};
  }
  void to_draining(const std::string& label = "rc-1") { ok(update_request(label)); }
  void to_quiesced(const std::string& label = "rc-1") {
    to_draining(label);
    effect(EffectKind::kDrain);
    ok(DrainObserved{ok_http(), true});
  }
  PreflightObserved good_preflight() const {
    return PreflightObserved{s.update->identity.manifest_digest, true, true, "fits"};
  }
  void to_updating(const std::string& label = "rc-1") {
    to_quiesced(label);
    effect(EffectKind::kPreflight);
    ok(good_preflight());
  }
  TransferObserved good_transfer() const {
    return TransferObserved{true, MutationClass::kComplete, 1 << 20, 10,
                            5000, s.update->target.label,   ""};
  }
  void to_invalidating(const std::string& label = "rc-1") {
    to_updating(label);
    effect(EffectKind::kTransfer);
    ok(good_transfer());
  }
  void reset_cache(CacheKind c) {
    effect(EffectKind::kResetCache, c);
    ok(CacheResetObserved{c, ok_http(), true});
  }
  void to_validating(const std::string& label = "rc-1") {
    to_invalidating(label);
    reset_cache(CacheKind::kPrefix);
    reset_cache(CacheKind::kEncoder);
    reset_cache(CacheKind::kMultimodal);
  }
  void to_resuming_validated(const std::string& label = "rc-1") {
    to_validating(label);
    effect(EffectKind::kValidate);
    ok(ValidationObserved{ok_http(),
                          label,
                          true,
                          "",
                          s.engine_instance.empty() ? "i-0" : s.engine_instance,
                          {},
                          true,
                          true});
  }
  // Answered unpaused by the process the fold knows (none known: names none).
  ResumeObserved good_resume() const {
    return ResumeObserved{ok_http(), true, false, s.engine_instance};
  }
  void resume() {
    effect(EffectKind::kResume);
    ok(good_resume());
  }
};

// Counts derived events of type T in `events`.
template <class T>
int count_of(const std::vector<Event>& events) {
  int n = 0;
  for (const Event& e : events) n += std::holds_alternative<T>(e) ? 1 : 0;
  return n;
}

// The last StateChanged in `events` (or a default one whose `to` is UNINITIALIZED).
inline StateChanged last_change(const std::vector<Event>& events) {
  StateChanged out;
  for (const Event& e : events) {
    if (const auto* c = std::get_if<StateChanged>(&e)) out = *c;
  }
  return out;
}

}  // namespace rc::test

namespace rc {
// gtest prints a State as its one-line description instead of raw bytes.
inline void PrintTo(const State& s, std::ostream* os) { *os << describe(s); }
}  // namespace rc
