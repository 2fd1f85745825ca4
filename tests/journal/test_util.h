// Helpers shared by the journal tests: temp dirs and sample events covering every alternative.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "journal/journal.h"
#include "statemachine/events.h"

namespace rc::journal::testing {

// A fresh directory under $TMPDIR, removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "rc-journal-test-XXXXXX").string();
    RC_CHECK(mkdtemp(tmpl.data()) != nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline WeightIdentity SampleIdentity() {
  return WeightIdentity{"abc123", "def456", "/ckpt/step-7", "run-1", 7};
}

// One event of every rc::Event alternative, each with non-default field values.
inline std::vector<Event> SampleEvents() {
  const HttpEvidence http{Transport::kTimeout, 504, true, 1234, "deadline"};
  return {
      BootstrapRequested{"rc-0", SampleIdentity(), /*adopt=*/true},
      UpdateRequested{"u1", "rc-1", SampleIdentity(), "safetensors:/ckpt/m.safetensors"},
      RecoveryStarted{"exec-9", JournalEnding::kTornTail, 4096, "torn WAL tail in /j: 000012.log"},
      EffectStarted{EffectKind::kResetCache, CacheKind::kMultimodal, 1500},
      EngineProbed{http, "0.25.1", "rc-0", true, true, "nonce-0,nonce-1", "default", true},
      DrainObserved{http, true},
      DrainTimedOut{30000, 3},
      PreflightObserved{"abc123", true, false, "not enough memory"},
      TransferObserved{true, MutationClass::kPossible, 1 << 20, 17, 99999, "rc-1", "eof", true},
      CacheResetObserved{CacheKind::kEncoder, http, true},
      ValidationObserved{http, "rc-1", false, "canary drift", "start:1.7e9", {}, true, false},
      ResumeObserved{http, true, false, "i-9", true, true},
      RolloutAdmitted{"r-1", WeightVersion{3, "rc-3"}, SampleIdentity(), 30000},
      RolloutFinished{"r-1", RolloutOutcome::kExpired, 100, 200},
      StateChanged{Lifecycle::kUpdating, Lifecycle::kTainted, Cause::kTransferAmbiguous, "x"},
      VersionPublished{"u1", WeightVersion{4, "rc-4"}, SampleIdentity()},
      UpdateEnded{"u1", UpdateOutcome::kRefused, "preflight refused"},
      TrajectoryRecorded{"r-1", 2, {1, 2, 3}, {97, 98}, {-0.5f, std::nanf("")}},
      EngineMonitored{http, "rc-2", true, false, "nonce-9", 1700000000123, 7},
      RestoreRequested{"restore-1", "rc-2", "safetensors:/ckpt/rc-2", false},
      RestoreRequested{"restore-2", "rc-2", "", true},
      SleepRequested{"sleep-1", 2},
      WakeRequested{"wake-1"},
      SleepObserved{http, 1, true, true, DeviceMemory{true, 1 << 30, 70ull << 30, 80ull << 30}},
      WakeObserved{http, WakeTag::kKvCache, true, false, DeviceMemory{true, 9, 8, 10}},
      EffectStarted{EffectKind::kWake, CacheKind::kPrefix, 2500, WakeTag::kKvCache},
      FleetConfigured{2, 3},
      EngineJoined{"engine-a"},
      EngineRemovalRequested{"engine-a"},
      EngineRemoved{"engine-a"},
      FleetUpdateRequested{"fu-1", FleetUpdateMode::kRolling, 2, 3, "rc-5", SampleIdentity(),
                           "safetensors:/ckpt/rc-5", std::string(64, 'e')},
      FleetUpdateEnded{"fu-1", FleetOutcome::kPartial, 2, 1, 1, 1, "one engine tainted"},
      FleetUpdateCancelled{"fu-1", "operator"},
  };
}

// A random event of a random alternative with random field values (strings of arbitrary bytes).
inline Event RandomEvent(std::mt19937_64& rng) {
  auto str = [&] {
    std::string s(rng() % 40, '\0');
    for (char& c : s) c = static_cast<char>(rng() % 256);
    return s;
  };
  auto u64 = [&] { return static_cast<std::uint64_t>(rng()); };
  auto u32 = [&] { return static_cast<std::uint32_t>(rng()); };
  auto b = [&] { return (rng() & 1) != 0; };
  auto id = [&] {
    return WeightIdentity{str(), str(), str(), str(), static_cast<std::int64_t>(u64())};
  };
  auto ver = [&] { return WeightVersion{u64(), str()}; };
  auto http = [&] {
    return HttpEvidence{static_cast<Transport>(rng() % 4), static_cast<std::int32_t>(u32()), b(),
                        u64(), str()};
  };
  auto ints = [&] {
    std::vector<std::int32_t> v(rng() % 20);
    for (auto& x : v) x = static_cast<std::int32_t>(u32());
    return v;
  };
  auto memory = [&] {
    const std::uint64_t total = u64() >> 1;
    return b() ? DeviceMemory{true, total / 3, total / 2, total} : DeviceMemory{};
  };
  switch (rng() % 31) {
    case 24:
      return FleetConfigured{u32(), u32()};
    case 25:
      return EngineJoined{str()};
    case 26:
      return EngineRemovalRequested{str()};
    case 27:
      return EngineRemoved{str()};
    case 28:
      return FleetUpdateRequested{
          str(), static_cast<FleetUpdateMode>(rng() % (kFleetUpdateModeMax + 1)),
          u32(), u32(),
          str(), id(),
          str(), str()};
    case 29:
      return FleetUpdateEnded{str(), static_cast<FleetOutcome>(rng() % (kFleetOutcomeMax + 1)),
                              u32(), u32(),
                              u32(), u32(),
                              str()};
    case 30:
      return FleetUpdateCancelled{str(), str()};
    case 0:
      return BootstrapRequested{str(), id()};
    case 1:
      return UpdateRequested{str(), str(), id(), str()};
    case 2:
      return RecoveryStarted{str()};
    case 3:
      return EffectStarted{static_cast<EffectKind>(rng() % (kEffectKindMax + 1)),
                           static_cast<CacheKind>(rng() % 3), u64(),
                           static_cast<WakeTag>(rng() % (kWakeTagMax + 1))};
    case 4:
      return EngineProbed{http(), str(), str(), b(), b(), str(), str(), b()};
    case 19:
      return RestoreRequested{str(), str(), str(), b()};
    case 20:
      return SleepRequested{str(), static_cast<std::uint8_t>(rng())};
    case 21:
      return WakeRequested{str()};
    case 22:
      return SleepObserved{http(), static_cast<std::uint8_t>(rng()), b(), b(), memory()};
    case 23:
      return WakeObserved{http(), static_cast<WakeTag>(rng() % (kWakeTagMax + 1)), b(), b(),
                          memory()};
    case 18:
      return EngineMonitored{http(), str(), b(), b(), str(), static_cast<std::int64_t>(u64()),
                             u64()};
    case 5:
      return DrainObserved{http(), b()};
    case 6:
      return DrainTimedOut{u64(), u32()};
    case 7:
      return PreflightObserved{str(), b(), b(), str()};
    case 8:
      return TransferObserved{
          b(), static_cast<MutationClass>(rng() % 3), u64(), u32(), u64(), str(), str(), b()};
    case 9:
      return CacheResetObserved{static_cast<CacheKind>(rng() % 3), http(), b(), b()};
    case 10:
      return ValidationObserved{http(), str(), b(), str(), str(), {}, b(), b()};
    case 11:
      return ResumeObserved{http(), b(), b(), "", b(), b()};
    case 12:
      return RolloutAdmitted{str(), ver(), id(), u32()};
    case 13:
      return RolloutFinished{str(), static_cast<RolloutOutcome>(rng() % 4), u32(), u32()};
    case 14:
      return StateChanged{static_cast<Lifecycle>(rng() % (kLifecycleMax + 1)),
                          static_cast<Lifecycle>(rng() % (kLifecycleMax + 1)),
                          static_cast<Cause>(rng() % (kCauseMax + 1)), str()};
    case 15:
      return VersionPublished{str(), ver(), id()};
    case 16:
      return UpdateEnded{str(), static_cast<UpdateOutcome>(rng() % 3), str()};
    default: {
      TrajectoryRecorded t{str(), u32(), ints(), ints(), {}};
      if (b()) {
        for (std::size_t i = 0; i < t.output_token_ids.size(); ++i) {
          t.output_logprobs.push_back(static_cast<float>(static_cast<std::int32_t>(u32())) / 1e6f);
        }
      }
      return t;
    }
  }
}

// The groups that take an empty journal to READY (bootstrap, probe intent, probe + decision).
inline std::vector<std::vector<Event>> BootstrapGroups() {
  return {
      {BootstrapRequested{"rc-0", SampleIdentity()}},
      {EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1000}},
      {EngineProbed{HttpEvidence{Transport::kOk, 200, true, 10, ""}, "0.25.1", "rc-0", false, false,
                    "i-0"},
       StateChanged{Lifecycle::kUninitialized, Lifecycle::kReady, Cause::kBootstrapped,
                    "engine 0.25.1 reports 'rc-0', instance 'i-0'"}},
  };
}

inline AppendRequest Group(std::vector<Event> events, std::string key = "") {
  AppendRequest r;
  r.events = std::move(events);
  r.client_event_id = std::move(key);
  r.wall_time_ms = 1700000000000;
  return r;
}

}  // namespace rc::journal::testing
