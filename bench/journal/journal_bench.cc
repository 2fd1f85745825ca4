// Journal benchmarks; every figure that matters is printed as a ratio measured in the same run.
//   BM_Fold                 rc::apply over a pre-generated legal history (goal >= 5M events/s)
//   BM_Replay               Refold of a 1M-event RocksDB journal: read, decode, verify, hash
//                           chain, fold (goal >= 1M events/s)
//   BM_DurableAppend/T/mode T concurrent appenders, sync=true; mode 0 = group commit,
//                           mode 1 = one fsync per event (callers serialised) (goal >= 50k/s at 16)
// Usage: journal_bench [--replay_events=N] [google benchmark flags]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "journal/journal.h"
#include "journal/testing/random_history.h"

namespace rc::journal {
namespace {

std::size_t g_replay_events = 1000000;
std::map<std::string, double> g_results;  // name -> events/s (printed as ratios at the end)
std::map<std::string, double> g_p50_us, g_p99_us;  // durable-append latencies by the same name

const std::vector<Event>& History() {
  static const std::vector<Event> events = [] {
    std::vector<Event> out;
    for (auto& g : testing::RandomHistory(7, g_replay_events, nullptr, /*allow_taint=*/false)) {
      for (auto& e : g) out.push_back(std::move(e));
    }
    return out;
  }();
  return events;
}

std::string TempPath(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("rc-journal-bench-" + name);
  std::filesystem::remove_all(p);
  return p.string();
}

void BM_Fold(benchmark::State& st) {
  const auto& events = History();
  for (auto _ : st) {
    State s;
    for (const Event& e : events) {
      if (!apply(s, e).ok()) st.SkipWithError("history does not fold");
    }
    benchmark::DoNotOptimize(s);
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations() * events.size()));
}

void BM_Replay(benchmark::State& st) {
  static const std::string path = [] {
    const std::string p = TempPath("replay");
    Options o;
    o.sync = false;
    o.snapshot_every = 0;
    auto j = Journal::Open(p, o);
    RC_CHECK(j.ok());
    const auto groups = testing::RandomHistory(7, g_replay_events, nullptr, false);
    std::vector<Ticket> tickets;
    for (const auto& g : groups) {
      AppendRequest r;
      r.events = g;
      Result<Ticket> t = (*j)->Enqueue(r);
      RC_CHECK(t.ok());
      if (t->result.last_seq % 2048 < g.size()) RC_CHECK((*j)->Wait(*t).ok());
      tickets.push_back(*t);
    }
    RC_CHECK((*j)->Wait(tickets.back()).ok());
    RC_CHECK((*j)->Flush().ok());
    return p;
  }();
  Options o;
  o.snapshot_every = 0;
  auto j = Journal::Open(path, o);  // open also refolds: measure the explicit Refold below
  RC_CHECK(j.ok());
  std::uint64_t events = 0;
  for (auto _ : st) {
    Result<State> s = (*j)->Refold();
    if (!s.ok()) st.SkipWithError(s.status().ToString().c_str());
    events = s->counters.events;
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations() * events));
  st.counters["journal_events"] = static_cast<double>(events);
}

// Runs `threads` appenders of `total` events; returns events/s and fills latencies (us).
// finish_each: every admission is followed by its RolloutFinished (active set <= threads);
// otherwise `total` admissions that never finish (the active set grows to `total`).
double RunAppends(Journal& j, int threads, int total, bool serialise, bool finish_each,
                  std::vector<double>& lat_us) {
  std::mutex one_at_a_time;
  std::mutex lat_mu;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      // The committed version does not change during the run: take the State once per appender.
      // (Copying it per event took the journal's lock and copied every active rollout: with
      // 4000 admissions that alone was 35% of the run's CPU and serialised all appenders.)
      const State at_start = j.state();
      std::vector<double> mine;
      for (int i = t; i < total; i += threads) {
        const auto t0 = std::chrono::steady_clock::now();
        std::unique_lock<std::mutex> l(one_at_a_time, std::defer_lock);
        if (serialise) l.lock();
        const bool finish = finish_each && ((i - t) / threads) % 2 == 1;  // this appender's 2nd, 4th...
        const std::string id = "r" + std::to_string(finish ? i - threads : i);
        Result<Journal::Submitted> s =
            finish ? j.Submit(RolloutFinished{id, RolloutOutcome::kCompleted, 10, 20}, i)
                   : j.Submit(make_admission(at_start, id), i);
        RC_CHECK(s.ok());
        RC_CHECK(j.Wait(s->ticket).ok());
        if (serialise) l.unlock();
        mine.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      std::lock_guard<std::mutex> g(lat_mu);
      lat_us.insert(lat_us.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : ts) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return total / secs;
}

void BM_DurableAppend(benchmark::State& st) {
  const int threads = static_cast<int>(st.range(0));
  const bool per_event_fsync = st.range(1) == 1;
  // workload 0: 4000 admissions that never finish (the active set grows to 4000);
  // workload 1: admit then finish (active set <= appenders), 20000 events (2000 per-event-fsync).
  const bool bounded = st.range(2) == 1;
  const int total = !bounded ? 4000 : per_event_fsync ? 2000 : 20000;
  double rate = 0;
  std::vector<double> lat;
  for (auto _ : st) {
    const std::string path = TempPath("append");
    {
      Options o;
      o.sync = true;
      auto j = Journal::Open(path, o);
      RC_CHECK(j.ok());
      RC_CHECK((*j)->Append(AppendRequest{{}, "", 0, {BootstrapRequested{"rc-0", WeightIdentity{"ab", "", "", "", -1}}}}).ok());
      RC_CHECK((*j)->Append(AppendRequest{{}, "", 0, {EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1}}}).ok());
      RC_CHECK((*j)->Submit(EngineProbed{HttpEvidence{Transport::kOk, 200, true, 1, ""}, "v", "rc-0"}, 0).ok());
      lat.clear();
      rate = RunAppends(**j, threads, total, per_event_fsync, bounded, lat);
    }
    std::filesystem::remove_all(path);
  }
  std::sort(lat.begin(), lat.end());
  st.counters["events_per_s"] = rate;
  st.counters["p50_us"] = lat[lat.size() / 2];
  st.counters["p99_us"] = lat[lat.size() * 99 / 100];
  const std::string key = std::string(per_event_fsync ? "fsync_each_" : "group_") +
                          std::to_string(threads) + (bounded ? "_bounded" : "");
  g_results[key] = rate;
  g_p50_us[key] = lat[lat.size() / 2];
  g_p99_us[key] = lat[lat.size() * 99 / 100];
}

BENCHMARK(BM_Fold)->Unit(benchmark::kMillisecond)->MinTime(2.0);
// Wall time: the goal is "a 1M-event journal in <= 1 s", and a long scan uses two threads.
BENCHMARK(BM_Replay)->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_DurableAppend)
    ->Args({1, 0, 0})->Args({1, 1, 0})->Args({16, 0, 0})->Args({16, 1, 0})
    ->Args({1, 0, 1})->Args({1, 1, 1})->Args({16, 0, 1})->Args({16, 1, 1})
    ->Iterations(1)->UseRealTime()->Unit(benchmark::kMillisecond);

// Google Benchmark reports items/s per run; the fold and replay rates are read back from it.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      auto it = r.counters.find("items_per_second");
      if (it != r.counters.end()) g_results[r.benchmark_name().substr(0, r.benchmark_name().find('/'))] = it->second;
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

}  // namespace
}  // namespace rc::journal

int main(int argc, char** argv) {
  using rc::journal::g_results;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--replay_events=", 16) == 0) {
      rc::journal::g_replay_events = std::stoull(argv[i] + 16);
      for (int k = i; k + 1 < argc; ++k) argv[k] = argv[k + 1];
      --argc;
      --i;
    }
  }
  benchmark::Initialize(&argc, argv);
  rc::journal::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  auto get = [&](const char* k) { return g_results.count(k) ? g_results[k] : 0.0; };
  const double fold = get("BM_Fold"), replay = get("BM_Replay");
  std::printf("\n== ratios (same run) ==\n");
  std::printf("fold: %.2fM events/s (goal 5M: %.2fx)\n", fold / 1e6, fold / 5e6);
  std::printf("replay (decode+verify+chain+fold): %.2fM events/s (goal 1M: %.2fx); %zu events in %.2f s\n",
              replay / 1e6, replay / 1e6, rc::journal::g_replay_events,
              replay > 0 ? rc::journal::g_replay_events / replay : 0.0);
  std::printf("fold / replay: %.2fx\n", replay > 0 ? fold / replay : 0.0);
  for (const char* w : {"", "_bounded"}) {
    std::printf("durable appends, %s:\n", *w ? "admit+finish (active set <= appenders)"
                                              : "4000 admissions (active set grows to 4000)");
    for (int t : {1, 16}) {
      const std::string g = "group_" + std::to_string(t) + w, f = "fsync_each_" + std::to_string(t) + w;
      std::printf("  %2d appenders: group commit %.0f events/s (p50 %.0f us, p99 %.0f us), one fsync per "
                  "event %.0f events/s (p50 %.0f us, p99 %.0f us), ratio %.1fx\n",
                  t, get(g.c_str()), rc::journal::g_p50_us[g], rc::journal::g_p99_us[g], get(f.c_str()),
                  rc::journal::g_p50_us[f], rc::journal::g_p99_us[f],
                  get(f.c_str()) > 0 ? get(g.c_str()) / get(f.c_str()) : 0.0);
    }
  }
  std::printf("group commit at 16 vs goal 50k events/s: %.2fx (4000 admissions), %.2fx (admit+finish)\n",
              get("group_16") / 5e4, get("group_16_bounded") / 5e4);
  benchmark::Shutdown();
  return 0;
}
