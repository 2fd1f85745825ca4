// rolloutcore-sim: runs seeds of the deterministic simulator; a failing seed prints the one
// command that replays it, then shrinks its fault schedule and prints the minimal one.
//
//   rolloutcore-sim --seed N [--faults SPEC] [--cycles C]    one seed (SPEC replaces its swarm)
//   rolloutcore-sim --seeds A:B [--cycles C]                 seeds A..B-1, stops at the first
//   failure
//   --colocated N: one cycle in N (that starts READY) sleeps first; 0: no colocated cycles
//   --fleet N: a fleet of N engines (1..16), one fleet update per cycle
//   --legacy N: one world in N starts from a journal without fold rules (rules 0); 0: none
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unistd.h>

#include "sim/sim.h"

namespace {

// Written before each seed runs: an assertion in the fold aborts the process, and the operator
// still gets the command that replays it.
char g_replay[8192];

void OnAbort(int) {
  const char* head = "\nSIM FAILURE (aborted): replay with:\n  ";
  (void)!write(2, head, std::strlen(head));
  (void)!write(2, g_replay, std::strlen(g_replay));
  (void)!write(2, "\n", 1);
  std::signal(SIGABRT, SIG_DFL);
  std::abort();
}

struct Args {
  std::uint64_t seed_from = 1, seed_to = 2;
  bool explicit_faults = false;
  std::string faults;
  std::uint32_t cycles = rc::sim::SimOptions{}.cycles;
  bool shrink = true;
  bool quiet = false;
  bool verbose = false;
  bool monitor_during_recovery = true;
  std::uint32_t colocated_one_in = rc::sim::SimOptions{}.colocated_one_in;
  std::uint32_t fleet_engines = 0;
  std::uint32_t legacy_one_in = rc::sim::SimOptions{}.legacy_one_in;
};

bool Parse(int argc, char** argv, Args& a) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const char* next = i + 1 < argc ? argv[i + 1] : nullptr;
    if (arg == "--seed" && next) {
      a.seed_from = std::strtoull(next, nullptr, 10);
      a.seed_to = a.seed_from + 1;
      ++i;
    } else if (arg == "--seeds" && next) {
      if (std::sscanf(next, "%lu:%lu", &a.seed_from, &a.seed_to) != 2) return false;
      ++i;
    } else if (arg == "--faults" && next) {
      a.explicit_faults = true;
      a.faults = next;
      ++i;
    } else if (arg == "--cycles" && next) {
      a.cycles = static_cast<std::uint32_t>(std::strtoul(next, nullptr, 10));
      ++i;
    } else if (arg == "--colocated" && next) {
      a.colocated_one_in = static_cast<std::uint32_t>(std::strtoul(next, nullptr, 10));
      ++i;
    } else if (arg == "--fleet" && next) {
      a.fleet_engines = static_cast<std::uint32_t>(std::strtoul(next, nullptr, 10));
      if (a.fleet_engines < 1 || a.fleet_engines > 16) return false;
      ++i;
    } else if (arg == "--legacy" && next) {
      a.legacy_one_in = static_cast<std::uint32_t>(std::strtoul(next, nullptr, 10));
      ++i;
    } else if (arg == "--monitor-during-recovery") {
      a.monitor_during_recovery = true;
    } else if (arg == "--no-monitor-during-recovery") {
      a.monitor_during_recovery = false;
    } else if (arg == "--no-shrink") {
      a.shrink = false;
    } else if (arg == "--quiet") {
      a.quiet = true;
    } else if (arg == "--verbose") {
      a.verbose = true;
    } else {
      return false;
    }
  }
  return a.seed_from < a.seed_to && a.cycles > 0;
}

void Report(const rc::sim::SimStats& s, std::uint64_t seeds) {
  std::string taints;
  for (const auto& [k, n] : s.taints) taints += " " + k + "=" + std::to_string(n);
  std::printf(
      "sim: %lu seeds, %lu cycles, %lu worlds, %lu events; updates committed %lu refused "
      "%lu tainted %lu stalled %lu errors %lu; restores %lu proven %lu; restarts %lu; admissions "
      "acknowledged %lu; faults %lu; full checks %lu; taints:%s\n",
      seeds, s.cycles, s.worlds, s.events, s.committed, s.refused, s.tainted, s.stalled,
      s.update_errors, s.restores, s.restored, s.restarts, s.admissions_acked, s.faults,
      s.full_checks, taints.c_str());
  const rc::sim::ColocatedStats& c = s.colocated;
  std::string colocated_taints;
  for (const auto& [k, n] : c.taints) colocated_taints += " " + k + "=" + std::to_string(n);
  std::printf(
      "colocated: %lu cycles (%lu began asleep, %lu ended asleep); sleeps %lu slept %lu; wakes %lu "
      "woken %lu; updates from sleep %lu committed %lu refused %lu; admissions refused while "
      "asleep %lu; refusals probed %lu; deaths asleep %lu; external wakes %lu; external sleeps "
      "%lu; published on an "
      "unpaused validation: restores %lu, updates %lu; taints:%s\n",
      c.cycles, c.began_asleep, c.ended_asleep, c.sleeps, c.slept, c.wakes, c.woken,
      c.updates_from_sleep, c.committed_from_sleep, c.refused_from_sleep, c.admissions_refused,
      c.refusals_probed, c.sleep_deaths, c.external_wakes, c.external_sleeps,
      c.restores_published_unpaused, c.updates_published_unpaused, colocated_taints.c_str());
  const rc::sim::RecheckStats& r = s.recheck;
  std::printf(
      "re-verification: digest reads failed %lu (validations %lu); monitor looks kept pending "
      "%lu; journaled looks: cleared %lu, no digest kept pending %lu, rules 0 cleared without "
      "digest %lu; admissions refused while pending %lu; legacy worlds: rules 0 %lu, bootstrapped "
      "again %lu; rule changes refused %lu; restarts asleep %lu, sleepers checked pending %lu\n",
      r.digest_reads_failed, r.validations_unread, r.monitor_looks_kept_pending, r.journaled_clears,
      r.journaled_unread_kept, r.rules0_unread_clears, r.admissions_refused_pending,
      r.rules0_worlds, r.rebootstrapped_worlds, r.rules_changes_refused, c.executor_restarts_asleep,
      c.sleepers_checked_pending);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!Parse(argc, argv, args)) {
    std::fprintf(stderr,
                 "usage: rolloutcore-sim (--seed N [--faults SPEC] | --seeds A:B) "
                 "[--cycles C] [--colocated N] [--fleet N] [--legacy N] [--no-shrink] [--quiet] "
                 "[--verbose] [--no-monitor-during-recovery]\n");
    return 2;
  }
  std::signal(SIGABRT, OnAbort);
  rc::sim::SimStats total;
  for (std::uint64_t seed = args.seed_from; seed < args.seed_to; ++seed) {
    rc::sim::SimOptions o;
    o.seed = seed;
    o.cycles = args.cycles;
    o.monitor_during_recovery = args.monitor_during_recovery;
    o.colocated_one_in = args.colocated_one_in;
    o.verbose = args.verbose;
    o.fleet_engines = args.fleet_engines;
    o.legacy_one_in = args.legacy_one_in;
    rc::sim::FaultPlan plan = rc::sim::PlanForSeed(seed, o.cycles);
    if (args.explicit_faults) {
      auto parsed = rc::sim::ParsePlan(args.faults);
      if (!parsed.ok()) {
        std::fprintf(stderr, "%s\n", parsed.status().ToString().c_str());
        return 2;
      }
      plan = *parsed;
    }
    std::snprintf(g_replay, sizeof(g_replay), "%s", rc::sim::ReplayCommand(o, plan).c_str());
    rc::sim::SimResult r = o.fleet_engines > 0 ? rc::sim::RunFleet(o, plan) : rc::sim::Run(o, plan);
    total.Add(r.stats);
    if (!args.quiet)
      std::printf("seed %lu: %s head %s\n", seed, r.violations.empty() ? "ok" : "FAILED",
                  r.head.c_str());
    if (r.violations.empty()) continue;
    std::printf("SIM FAILURE seed %lu:\n", seed);
    for (const std::string& v : r.violations) std::printf("  %s\n", v.c_str());
    std::printf("replay with:\n  %s\n", rc::sim::ReplayCommand(o, plan).c_str());
    if (args.shrink) {
      std::fflush(stdout);
      const rc::sim::FaultPlan minimal = rc::sim::Shrink("/proc/self/exe", o, plan);
      std::printf("minimal fault schedule (%zu of %zu faults):\n  %s\n", minimal.size(),
                  plan.size(), rc::sim::ReplayCommand(o, minimal).c_str());
    }
    Report(total, seed - args.seed_from + 1);
    return 1;
  }
  Report(total, args.seed_to - args.seed_from);
  return 0;
}
