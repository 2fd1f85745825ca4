// Proves that a trainer-API body (update, explicit admission, finish, lease renewal) goes through
// the service's own parser and validation to an InvalidArgument Status or to an input the fold's
// decide() handles against a READY state without throwing, and that an accepted input applies
// cleanly with the invariants intact; catches a parser that lets an out-of-range field or a
// malformed identity reach decide(), or a decide() that accepts what apply() then refuses.
//
// Input: one selector byte (0 update, 1 admit, 2 finish, 3 lease), then for finish/lease the
// rollout id of the URL up to the first '\n', then the request body.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "service/api_parse.h"
#include "service/config.h"
#include "statemachine/state.h"
#include "statemachine/text.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

constexpr std::uint64_t kAdmitWaitMs = 30000;
constexpr std::uint32_t kLeaseMs = 30000;
const char* const kActive = "r1";  // the rollout active in the READY state

rc::WeightIdentity identity(char c) {
  return rc::WeightIdentity{std::string(64, c), std::string(64, 'e'), "/ckpt/a", "run-1", 1};
}

// READY at rc-0 with one explicit rollout (kActive) admitted: built with the fold itself.
const rc::State& ready() {
  static const rc::State s = [] {
    rc::State st;
    auto ok = [&](const rc::Event& e) { FUZZ_CHECK(rc::step(st, e).ok()); };
    ok(rc::BootstrapRequested{"rc-0", identity('a')});
    ok(rc::EffectStarted{rc::EffectKind::kProbeEngine, rc::CacheKind::kPrefix, 1000});
    rc::EngineProbed p;
    p.http = rc::HttpEvidence{rc::Transport::kOk, 200, true, 10, ""};
    p.engine_version = "0.25.1";
    p.reported_label = "rc-0";
    p.engine_instance = "i-0";  // the process the bootstrap verifies
    ok(p);
    ok(rc::make_admission(st, kActive, kLeaseMs));
    FUZZ_CHECK(st.lifecycle == rc::Lifecycle::kReady && st.active.count(kActive) == 1);
    return st;
  }();
  return s;
}

// decide() on READY: a refusal is a Status with a message; an acceptance applies cleanly.
bool decide_and_apply(const rc::Event& input) {
  const rc::State& s = ready();
  rc::Result<std::vector<rc::Event>> d = rc::decide(s, input);
  if (!d.ok()) {
    const rc::Code c = d.status().code();
    FUZZ_CHECK(c == rc::Code::kInvalidArgument || c == rc::Code::kRejected ||
               c == rc::Code::kConflict || c == rc::Code::kNotFound);
    FUZZ_CHECK(!d.status().message().empty());
    return false;
  }
  rc::State copy = s;
  FUZZ_CHECK(rc::apply(copy, input).ok());
  for (const rc::Event& e : *d) FUZZ_CHECK(rc::apply(copy, e).ok());
  FUZZ_CHECK(rc::check_invariants(copy).empty());
  return true;
}

void check_refusal(const rc::Status& st) {
  FUZZ_CHECK(st.code() == rc::Code::kInvalidArgument);
  FUZZ_CHECK(!st.message().empty());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t route = data[0] % 4;
  std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);
  std::string id;  // the URL's rollout id (finish, lease)
  if (route >= 2) {
    const std::size_t nl = rest.find('\n');
    id = rest.substr(0, nl);
    rest = nl == std::string::npos ? std::string() : rest.substr(nl + 1);
  }
  switch (route) {
    case 0: {  // POST /v1/updates
      rc::Result<rc::UpdateRequested> u = rc::service::ParseUpdateBody(rest);
      if (!u.ok()) {
        check_refusal(u.status());
        return 0;
      }
      FUZZ_CHECK(rc::text::printable_utf8(u->source_uri) && !u->source_uri.empty());
      FUZZ_CHECK(u->identity.step >= -1);
      const bool accepted = decide_and_apply(*u);
      // READY with no update in flight: a well-formed request for a fresh label starts DRAINING.
      (void)accepted;
      return 0;
    }
    case 1: {  // POST /v1/rollouts
      rc::Result<rc::service::AdmitBody> a =
          rc::service::ParseAdmitBody(rest, kAdmitWaitMs, kLeaseMs);
      if (!a.ok()) {
        check_refusal(a.status());
        return 0;
      }
      FUZZ_CHECK(a->wait_ms >= 0 && a->wait_ms <= static_cast<std::int64_t>(kAdmitWaitMs));
      FUZZ_CHECK(a->lease_ms >= rc::service::kRolloutLeaseMsMin &&
                 a->lease_ms <= rc::service::kRolloutLeaseMsMax);
      FUZZ_CHECK(a->rollout_id.size() <= rc::kIdBytesMax);
      FUZZ_CHECK(rc::text::printable_utf8(a->rollout_id));
      const std::string rid = a->rollout_id.empty() ? std::string("auto-1") : a->rollout_id;
      const bool accepted = decide_and_apply(
          rc::make_admission(ready(), rid, static_cast<std::uint32_t>(a->lease_ms)));
      // READY admits every id that is not already active, and never one that is.
      FUZZ_CHECK(accepted == (rid != kActive));
      return 0;
    }
    case 2: {  // DELETE /v1/rollouts/{id}
      rc::Result<rc::service::FinishBody> f = rc::service::ParseFinishBody(rest);
      if (!f.ok()) {
        check_refusal(f.status());
        return 0;
      }
      FUZZ_CHECK(f->prompt_tokens >= 0 && f->prompt_tokens <= UINT32_MAX);
      FUZZ_CHECK(f->completion_tokens >= 0 && f->completion_tokens <= UINT32_MAX);
      const bool accepted = decide_and_apply(
          rc::RolloutFinished{id, f->outcome, static_cast<std::uint32_t>(f->prompt_tokens),
                              static_cast<std::uint32_t>(f->completion_tokens)});
      if (id == kActive) FUZZ_CHECK(accepted);  // the active rollout always finishes
      if (ready().active.count(id) == 0) FUZZ_CHECK(!accepted);
      return 0;
    }
    default: {  // POST /v1/rollouts/{id}/lease
      const rc::Status st = rc::service::ParseLeaseBody(rest);
      if (!st.ok()) check_refusal(st);
      return 0;
    }
  }
}
