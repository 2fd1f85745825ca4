// The fault schedule: names, the --faults syntax, the per-seed swarm, and shrinking.
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "sim/sim.h"

namespace rc::sim {
namespace {

constexpr const char* kNames[] = {"http_5xx",
                                  "http_timeout",
                                  "http_drop",
                                  "http_refused",
                                  "http_garbage",
                                  "success_false",
                                  "delay",
                                  "engine_death",
                                  "engine_restart_ready",
                                  "relabel",
                                  "external_pause",
                                  "wal_fault",
                                  "fsync_stall",
                                  "executor_crash",
                                  "clock_jump",
                                  "preflight_refuse",
                                  "transfer_fail",
                                  "disconnect",
                                  "lease_stop",
                                  "slow_rollout",
                                  "silent_loss",
                                  "external_update",
                                  "sleep_death",
                                  "external_wake",
                                  "instance_unread",
                                  "external_sleep",
                                  "restart_keeps_label",
                                  "digest_unread",
                                  "executor_restart_asleep"};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<int>(FaultKind::kCount));

// Each fsync stall costs real time (the journal's stall deadline is a real-time bound): rare.
bool ExpensiveKind(FaultKind k) { return k == FaultKind::kFsyncStall; }

}  // namespace

const char* FaultName(FaultKind k) { return kNames[static_cast<int>(k)]; }

std::string FormatPlan(const FaultPlan& plan) {
  std::string out;
  for (const Fault& f : plan) {
    if (!out.empty()) out += ",";
    out += std::string(FaultName(f.kind)) + "@" + std::to_string(f.cycle) + ":" +
           std::to_string(f.a) + ":" + std::to_string(f.b);
  }
  return out;
}

Result<FaultPlan> ParsePlan(const std::string& text) {
  FaultPlan plan;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(pos, end - pos);
    pos = end + 1;
    const std::size_t at = item.find('@');
    if (at == std::string::npos) return Status::InvalidArgument("fault without @: " + item);
    Fault f;
    int kind = -1;
    for (int k = 0; k < static_cast<int>(FaultKind::kCount); ++k) {
      if (item.compare(0, at, kNames[k]) == 0 && std::string(kNames[k]).size() == at) kind = k;
    }
    if (kind < 0) return Status::InvalidArgument("unknown fault: " + item.substr(0, at));
    f.kind = static_cast<FaultKind>(kind);
    unsigned c = 0, a = 0, b = 0;
    if (std::sscanf(item.c_str() + at + 1, "%u:%u:%u", &c, &a, &b) != 3) {
      return Status::InvalidArgument("fault needs @cycle:a:b: " + item);
    }
    f.cycle = c;
    f.a = a;
    f.b = b;
    plan.push_back(f);
  }
  return plan;
}

namespace {

constexpr double kIntensities[] = {0.005, 0.02, 0.06, 0.15};
using Enabled = std::vector<std::pair<FaultKind, double>>;

// The seed's subset of the kinds [from, to) and an intensity for each.
Enabled EnableKinds(std::mt19937_64& rng, int from, int to) {
  Enabled enabled;
  for (int k = from; k < to; ++k) {
    const FaultKind kind = static_cast<FaultKind>(k);
    if (rng() % 2 != 0) continue;
    if (ExpensiveKind(kind) && rng() % 16 != 0) continue;
    enabled.emplace_back(kind, ExpensiveKind(kind) ? 0.005 : kIntensities[rng() % 4]);
  }
  return enabled;
}

void DrawCycle(std::mt19937_64& rng, const Enabled& enabled, std::uint32_t cycle, FaultPlan& plan) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (const auto& [kind, p] : enabled) {
    if (u(rng) >= p) continue;
    plan.push_back(Fault{kind, cycle, static_cast<std::uint32_t>(rng() % 64),
                         static_cast<std::uint32_t>(rng() % 4096)});
  }
}

}  // namespace

// The colocated kinds come from a second stream: a seed's other faults are what they always were.
FaultPlan PlanForSeed(std::uint64_t seed, std::uint32_t cycles) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 1);
  std::mt19937_64 colocated_rng(seed * 0xC2B2AE3D27D4EB4Full + 7);
  std::mt19937_64 answer_rng(seed * 0x165667B19E3779F9ull + 11);
  std::mt19937_64 outside_sleep_rng(seed * 0x27D4EB2F165667C5ull + 13);
  std::mt19937_64 label_restart_rng(seed * 0x85EBCA77C2B2AE63ull + 17);
  std::mt19937_64 recheck_rng(seed * 0xD6E8FEB86659FD93ull + 19);
  const int first_colocated = static_cast<int>(kFirstColocatedFault);
  const int first_answer = static_cast<int>(kFirstAnswerFault);
  const int first_outside_sleep = static_cast<int>(kFirstOutsideSleepFault);
  const int first_label_restart = static_cast<int>(kFirstLabelRestartFault);
  const int first_recheck = static_cast<int>(kFirstRecheckFault);
  const Enabled enabled = EnableKinds(rng, 0, first_colocated);
  const Enabled colocated = EnableKinds(colocated_rng, first_colocated, first_answer);
  const Enabled answer = EnableKinds(answer_rng, first_answer, first_outside_sleep);
  const Enabled outside_sleep =
      EnableKinds(outside_sleep_rng, first_outside_sleep, first_label_restart);
  const Enabled label_restart = EnableKinds(label_restart_rng, first_label_restart, first_recheck);
  const Enabled recheck =
      EnableKinds(recheck_rng, first_recheck, static_cast<int>(FaultKind::kCount));
  FaultPlan plan;
  for (std::uint32_t c = 0; c < cycles; ++c) {
    DrawCycle(rng, enabled, c, plan);
    DrawCycle(colocated_rng, colocated, c, plan);
    DrawCycle(answer_rng, answer, c, plan);
    DrawCycle(outside_sleep_rng, outside_sleep, c, plan);
    DrawCycle(label_restart_rng, label_restart, c, plan);
    DrawCycle(recheck_rng, recheck, c, plan);
  }
  return plan;
}

void SimStats::Add(const SimStats& o) {
  cycles += o.cycles;
  worlds += o.worlds;
  committed += o.committed;
  refused += o.refused;
  tainted += o.tainted;
  update_errors += o.update_errors;
  restarts += o.restarts;
  stalled += o.stalled;
  admissions_acked += o.admissions_acked;
  events += o.events;
  full_checks += o.full_checks;
  faults += o.faults;
  restores += o.restores;
  restored += o.restored;
  for (const auto& [k, n] : o.taints) taints[k] += n;
  colocated.Add(o.colocated);
  recheck.Add(o.recheck);
}

void RecheckStats::Add(const RecheckStats& o) {
  digest_reads_failed += o.digest_reads_failed;
  validations_unread += o.validations_unread;
  monitor_looks_kept_pending += o.monitor_looks_kept_pending;
  journaled_clears += o.journaled_clears;
  journaled_unread_kept += o.journaled_unread_kept;
  rules0_unread_clears += o.rules0_unread_clears;
  admissions_refused_pending += o.admissions_refused_pending;
  rules0_worlds += o.rules0_worlds;
  rebootstrapped_worlds += o.rebootstrapped_worlds;
  rules_changes_refused += o.rules_changes_refused;
}

void ColocatedStats::Add(const ColocatedStats& o) {
  cycles += o.cycles;
  began_asleep += o.began_asleep;
  ended_asleep += o.ended_asleep;
  sleeps += o.sleeps;
  slept += o.slept;
  wakes += o.wakes;
  woken += o.woken;
  updates_from_sleep += o.updates_from_sleep;
  committed_from_sleep += o.committed_from_sleep;
  refused_from_sleep += o.refused_from_sleep;
  admissions_refused += o.admissions_refused;
  refusals_probed += o.refusals_probed;
  sleep_deaths += o.sleep_deaths;
  external_wakes += o.external_wakes;
  external_sleeps += o.external_sleeps;
  executor_restarts_asleep += o.executor_restarts_asleep;
  sleepers_checked_pending += o.sleepers_checked_pending;
  restores_published_unpaused += o.restores_published_unpaused;
  updates_published_unpaused += o.updates_published_unpaused;
  for (const auto& [k, n] : o.taints) taints[k] += n;
}

std::vector<std::string> ReplayArgs(const SimOptions& o, const FaultPlan& plan) {
  std::vector<std::string> args = {"--seed", std::to_string(o.seed)};
  if (o.cycles != SimOptions{}.cycles)
    args.insert(args.end(), {"--cycles", std::to_string(o.cycles)});
  if (!o.monitor_during_recovery) args.emplace_back("--no-monitor-during-recovery");
  if (o.colocated_one_in != SimOptions{}.colocated_one_in) {
    args.insert(args.end(), {"--colocated", std::to_string(o.colocated_one_in)});
  }
  if (o.fleet_engines > 0) args.insert(args.end(), {"--fleet", std::to_string(o.fleet_engines)});
  if (o.legacy_one_in != SimOptions{}.legacy_one_in) {
    args.insert(args.end(), {"--legacy", std::to_string(o.legacy_one_in)});
  }
  args.insert(args.end(), {"--faults", FormatPlan(plan)});
  return args;
}

std::string ReplayCommand(const SimOptions& o, const FaultPlan& plan) {
  std::string cmd = "rolloutcore-sim";
  const std::vector<std::string> args = ReplayArgs(o, plan);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const bool faults = i > 0 && args[i - 1] == "--faults";  // may be empty: quoted
    cmd += faults ? " '" + args[i] + "'" : " " + args[i];
  }
  return cmd;
}

namespace {

enum class Trial : std::uint8_t { kPasses, kFails, kUnknown };

// Runs the plan in a new process of the simulator (fork, then exec: RocksDB's background threads
// do not survive a bare fork, and a child that closed a journal would wait on them forever).
// Fails by a violation (exit 1) or an aborting assertion (a signal); 127 and up: no run.
Trial RunIsolated(const std::string& sim_path, const SimOptions& options, const FaultPlan& plan) {
  std::vector<std::string> args = ReplayArgs(options, plan);
  args.insert(args.begin(), sim_path);
  args.insert(args.end(), {"--no-shrink", "--quiet"});
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int null_fd = open("/dev/null", O_WRONLY);
    if (null_fd >= 0) {  // the child's report and assertion text are not the parent's
      dup2(null_fd, 1);
      dup2(null_fd, 2);
    }
    execv(sim_path.c_str(), argv.data());
    _exit(127);
  }
  if (pid < 0) return Trial::kUnknown;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return Trial::kUnknown;
  if (WIFSIGNALED(status)) return Trial::kFails;
  if (!WIFEXITED(status) || WEXITSTATUS(status) > 1) return Trial::kUnknown;
  return WEXITSTATUS(status) == 1 ? Trial::kFails : Trial::kPasses;
}

}  // namespace

FaultPlan Shrink(const std::string& sim_path, const SimOptions& options, const FaultPlan& plan,
                 std::uint32_t trials_max) {
  FaultPlan best = plan;
  std::uint32_t trials = 0;
  // Halves first (cheap big steps), then one fault at a time; keep any smaller plan that fails.
  for (std::size_t chunk = std::max<std::size_t>(1, best.size() / 2);
       !best.empty() && chunk >= 1 && trials < trials_max; chunk /= 2) {
    for (std::size_t start = 0; start < best.size() && trials < trials_max;) {
      FaultPlan candidate;
      for (std::size_t i = 0; i < best.size(); ++i) {
        if (i < start || i >= start + chunk) candidate.push_back(best[i]);
      }
      ++trials;
      const Trial t = RunIsolated(sim_path, options, candidate);
      if (t == Trial::kUnknown) return best;  // the simulator cannot be run: keep what failed
      if (t == Trial::kFails) {
        best = std::move(candidate);
      } else {
        start += chunk;
      }
    }
  }
  return best;
}

}  // namespace rc::sim
