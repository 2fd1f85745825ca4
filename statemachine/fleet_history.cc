// The fleet's history checker (see fleet_history.h).
#include "statemachine/fleet_history.h"

#include <optional>
#include <set>

#include "statemachine/describe.h"

namespace rc {
namespace {

std::string describe_all(const std::vector<FleetEvent>& events) {
  if (events.empty()) return "(none)";
  std::string out;
  for (const FleetEvent& e : events) {
    if (!out.empty()) out += "; ";
    out += (e.engine.empty() ? "" : "[" + e.engine + "] ") + describe(e.event);
  }
  return out;
}

struct Failure {
  std::uint64_t seq = 0;
  std::string message;  // complete, naming the seq
};

Failure at(std::uint64_t seq, const std::string& why) {
  return Failure{seq, "seq " + std::to_string(seq) + ": " + why};
}

// Pass 1: the fleet fold over every group. Returns the failure, if any.
std::optional<Failure> check_groups(const std::vector<FleetHistoryEntry>& history,
                                    FleetHistoryReport& report) {
  std::set<std::string> admitted;  // rollout ids are unique for the journal's life, fleet-wide
  std::uint64_t last_seq = 0;
  std::size_t i = 0;
  while (i < history.size()) {
    const FleetHistoryEntry& in = history[i];
    if (in.seq <= last_seq) return at(in.seq, "seq not increasing");
    if (in.cause_seq != 0) {
      return at(in.seq, std::string("derived ") + event_name(in.event) + " without its input");
    }
    std::vector<FleetEvent> recorded;
    std::size_t end = i + 1;
    last_seq = in.seq;
    for (; end < history.size() && history[end].cause_seq == in.seq; ++end) {
      if (history[end].seq <= last_seq) return at(history[end].seq, "seq not increasing");
      last_seq = history[end].seq;
      recorded.push_back(FleetEvent{history[end].engine, history[end].event});
    }
    if (const auto* a = std::get_if<RolloutAdmitted>(&in.event);
        a != nullptr && !admitted.insert(a->rollout_id).second) {
      return at(in.seq, "rollout id '" + a->rollout_id + "' admitted again");
    }
    const FleetEvent input{in.engine, in.event};
    Result<std::vector<FleetEvent>> decided = fleet_decide(report.state, input);
    if (!decided.ok()) {
      return at(in.seq, std::string("illegal ") + event_name(in.event) + ": " +
                            decided.status().ToString());
    }
    if (*decided != recorded) {
      return at(in.seq, std::string("decisions for ") + event_name(in.event) +
                            " differ from fleet_decide(): recorded [" + describe_all(recorded) +
                            "], fleet_decide() gives [" + describe_all(*decided) + "]");
    }
    for (std::size_t k = i; k < end; ++k) {
      const FleetHistoryEntry& h = history[k];
      if (Status st = fleet_apply(report.state, FleetEvent{h.engine, h.event}); !st.ok()) {
        return at(h.seq, std::string("illegal ") + event_name(h.event) + ": " + st.ToString());
      }
      if (const auto* end_event = std::get_if<FleetUpdateEnded>(&h.event)) {
        report.fleet_updates[end_event->outcome]++;
      }
    }
    if (std::string bad = check_fleet_invariants(report.state); !bad.empty()) {
      return at(in.seq, "fleet invariant broken: " + bad);
    }
    i = end;
  }
  return std::nullopt;
}

// Pass 2: each engine life's own events, as the single-engine history they must be.
using EngineLife = std::pair<std::string, std::uint32_t>;
std::map<EngineLife, std::vector<HistoryEntry>> project(
    const std::vector<FleetHistoryEntry>& history) {
  std::map<std::string, std::uint32_t> removed;  // lives ended so far, per name
  std::map<EngineLife, std::vector<HistoryEntry>> out;
  for (const FleetHistoryEntry& h : history) {
    if (const auto* r = std::get_if<EngineRemoved>(&h.event)) {
      removed[r->engine]++;
      continue;
    }
    if (is_fleet_event(h.event)) continue;
    const EngineLife life{h.engine, removed[h.engine] + 1};
    out[life].push_back(HistoryEntry{h.seq, h.cause_seq, h.event});
  }
  return out;
}

}  // namespace

FleetHistoryReport check_fleet_history(const std::vector<FleetHistoryEntry>& history) {
  FleetHistoryReport report;
  auto fail = [&](const Failure& f) {
    report.ok = false;
    report.first_bad_seq = f.seq;
    report.message = f.message;
    return report;
  };
  if (std::optional<Failure> f = check_groups(history, report)) return fail(*f);
  std::optional<Failure> first;
  for (auto& [life, entries] : project(history)) {
    HistoryReport r = check_history(entries);
    report.engines[life] = r.summary;
    if (r.ok || (first && first->seq <= r.first_bad_seq)) continue;
    first = Failure{r.first_bad_seq, "engine '" + life.first + "' (life " +
                                         std::to_string(life.second) + "): " + r.message};
  }
  if (first) return fail(*first);
  return report;
}

}  // namespace rc
