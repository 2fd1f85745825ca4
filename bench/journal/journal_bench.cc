// Journal benchmarks; every figure that matters is printed as a ratio measured in the same run.
//   BM_Fold                  rc::apply over a pre-generated legal history (goal >= 5M events/s)
//   BM_Replay/C/P            Refold of a 1M-event RocksDB journal: read, decode, verify, hash
//                            chain, fold; wall time (goal >= 1M events/s, 1M events in <= 1 s).
//                            C=0: as written and flushed (background compaction may run during
//                            the scan), C=1: compacted first; P=0: one thread, P=1: two-stage scan
//   BM_ScanStage/V           where replay time goes, on the compacted journal: V=0 RocksDB
//                            iteration alone (raw DB, the journal's ReadOptions), V=1 iteration +
//                            copy into batches (the reader stage), V=2 the same with
//                            allow_mmap_reads (measured only; the journal reads with pread),
//                            V=3 decode + verify + chain over values in memory (no RocksDB, no
//                            fold)
//   BM_DurableAppend/T/M/W/D T concurrent appenders, sync=true; M=0 group commit, M=1 one fsync per
//                            event (callers serialised); W=0 4000 admissions, W=1 admit+finish;
//                            D = submissions each appender keeps outstanding (1 = closed loop:
//                            submit, wait; D>1 = pipelined: submit up to D before waiting for the
//                            oldest) (goal >= 50k/s at 16)
// Usage: journal_bench [--replay_events=N] [google benchmark flags]
#include <benchmark/benchmark.h>
#include <rocksdb/db.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "journal/codec.h"
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

// The replay journal as written (sync off, flushed at the end) and a compacted copy of it.
const std::string& ReplayPath(bool compacted) {
  static const std::string flushed = [] {
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
  static const std::string compact = [] {
    const std::string p = TempPath("replay-compacted");
    std::filesystem::copy(flushed, p, std::filesystem::copy_options::recursive);
    Options o;
    o.snapshot_every = 0;
    auto j = Journal::Open(p, o);
    RC_CHECK(j.ok());
    RC_CHECK((*j)->Compact().ok());
    return p;
  }();
  return compacted ? compact : flushed;
}

void BM_Replay(benchmark::State& st) {
  const bool compacted = st.range(0) == 1;
  Options o;
  o.snapshot_every = 0;
  o.scan_pipelined = st.range(1) == 1;
  auto j = Journal::Open(ReplayPath(compacted), o);  // open also refolds: time the Refold below
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

// Stages of a replay measured apart, on the compacted journal (see the header comment).
void BM_ScanStage(benchmark::State& st) {
  const int variant = static_cast<int>(st.range(0));
  const std::string& path = ReplayPath(true);
  std::vector<rocksdb::ColumnFamilyDescriptor> descs;
  for (const char* name : {"default", "events", "rollouts", "idempotency", "snapshots", "meta"}) {
    descs.emplace_back(name, rocksdb::ColumnFamilyOptions());
  }
  std::vector<rocksdb::ColumnFamilyHandle*> cfs;
  rocksdb::DB* raw = nullptr;
  rocksdb::DBOptions db_options;
  db_options.allow_mmap_reads = variant == 2;
  RC_CHECK(rocksdb::DB::OpenForReadOnly(db_options, path, descs, &cfs, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  // Values in memory for the decode stage, 8-byte aligned as the two-stage scan hands them over.
  std::vector<std::string> values;
  std::uint64_t records = 0;
  for (auto _ : st) {
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    ro.readahead_size = 2 * 1024 * 1024;
    if (variant <= 2) {
      std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(ro, cfs[1]));
      std::string batch;
      batch.reserve(512 * 1024);
      std::size_t n = 0, bytes = 0;
      for (it->SeekToFirst(); it->Valid(); it->Next()) {
        ++n;
        if (variant == 0) {
          bytes += it->value().size();
          continue;
        }
        batch.append(it->key().data(), it->key().size());
        batch.resize((batch.size() + 7) / 8 * 8);
        batch.append(it->value().data(), it->value().size());
        if (batch.size() >= 256 * 1024) batch.clear();
      }
      RC_CHECK(it->status().ok());
      benchmark::DoNotOptimize(bytes);
      records = n;
    } else {
      st.PauseTiming();
      if (values.empty()) {
        std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(ro, cfs[1]));
        for (it->SeekToFirst(); it->Valid(); it->Next()) values.push_back(it->value().ToString());
      }
      st.ResumeTiming();
      Hash prev{};
      for (const std::string& v : values) {
        Result<Record> r = DecodeRecord(v);
        RC_CHECK(r.ok() && r->prev_hash == prev);
        prev = r->hash;
      }
      records = values.size();
    }
  }
  for (auto* h : cfs) RC_CHECK(db->DestroyColumnFamilyHandle(h).ok());
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations() * records));
}

// Runs `threads` appenders of `total` submissions; returns submissions/s and fills latencies (us,
// submission to durable acknowledgement). finish_each: every admission is followed by its
// RolloutFinished (active set <= threads x depth); otherwise `total` admissions that never finish.
// depth: submissions an appender keeps outstanding before waiting for its oldest (1 = closed loop).
double RunAppends(Journal& j, int threads, int total, bool serialise, bool finish_each, int depth,
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
      struct Outstanding {
        Ticket ticket;
        std::chrono::steady_clock::time_point t0;
      };
      std::deque<Outstanding> outstanding;
      auto wait_oldest = [&] {
        RC_CHECK(j.Wait(outstanding.front().ticket).ok());
        const auto now = std::chrono::steady_clock::now();
        mine.push_back(
            std::chrono::duration<double, std::micro>(now - outstanding.front().t0).count());
        outstanding.pop_front();
      };
      // With depth D, this appender's k-th admission is finished D submissions later.
      const int step = threads * depth;
      for (int i = t, k = 0; i < total; i += threads, ++k) {
        const auto t0 = std::chrono::steady_clock::now();
        std::unique_lock<std::mutex> l(one_at_a_time, std::defer_lock);
        if (serialise) l.lock();
        const bool finish = finish_each && (k / depth) % 2 == 1;
        const std::string id = "r" + std::to_string(finish ? i - step : i);
        Result<Journal::Submitted> s =
            finish ? j.Submit(RolloutFinished{id, RolloutOutcome::kCompleted, 10, 20}, i)
                   : j.Submit(make_admission(at_start, id), i);
        RC_CHECK(s.ok());
        outstanding.push_back({s->ticket, t0});
        if (static_cast<int>(outstanding.size()) >= depth) wait_oldest();
        if (serialise) l.unlock();
      }
      while (!outstanding.empty()) wait_oldest();
      std::lock_guard<std::mutex> g(lat_mu);
      lat_us.insert(lat_us.end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : ts) t.join();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return total / secs;
}

void BM_DurableAppend(benchmark::State& st) {
  const int threads = static_cast<int>(st.range(0));
  const bool per_event_fsync = st.range(1) == 1;
  // workload 0: 4000 admissions that never finish (the active set grows to 4000);
  // workload 1: admit then finish (active set <= appenders x depth), 20000 submissions (2000 with
  // one fsync per event); pipelined runs submit 4x as many (they finish 4x sooner).
  const bool bounded = st.range(2) == 1;
  const int depth = static_cast<int>(st.range(3));
  const int total = !bounded ? 4000 : per_event_fsync ? 2000 : depth > 1 ? 80000 : 20000;
  double rate = 0, journal_rate = 0;
  std::vector<double> lat;
  for (auto _ : st) {
    const std::string path = TempPath("append");
    {
      Options o;
      o.sync = true;
      auto j = Journal::Open(path, o);
      RC_CHECK(j.ok());
      RC_CHECK(
          (*j)
              ->Append(AppendRequest{
                  {}, "", 0, {BootstrapRequested{"rc-0", WeightIdentity{"ab", "", "", "", -1}}}})
              .ok());
      RC_CHECK((*j)
                   ->Append(AppendRequest{
                       {}, "", 0, {EffectStarted{EffectKind::kProbeEngine, CacheKind::kPrefix, 1}}})
                   .ok());
      RC_CHECK(
          (*j)->Submit(EngineProbed{HttpEvidence{Transport::kOk, 200, true, 1, ""}, "v", "rc-0"}, 0)
              .ok());
      lat.clear();
      const std::uint64_t seq_before = (*j)->head_seq();
      const auto t0 = std::chrono::steady_clock::now();
      rate = RunAppends(**j, threads, total, per_event_fsync, bounded, depth, lat);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      journal_rate = static_cast<double>((*j)->head_seq() - seq_before) / secs;
    }
    std::filesystem::remove_all(path);
  }
  std::sort(lat.begin(), lat.end());
  st.counters["events_per_s"] = rate;
  st.counters["records_per_s"] = journal_rate;  // journal records (an input + its decisions)
  st.counters["p50_us"] = lat[lat.size() / 2];
  st.counters["p99_us"] = lat[lat.size() * 99 / 100];
  const std::string key = std::string(per_event_fsync ? "fsync_each_" : "group_") +
                          std::to_string(threads) + (bounded ? "_bounded" : "") +
                          (depth > 1 ? "_depth" + std::to_string(depth) : "");
  g_results[key] = rate;
  g_p50_us[key] = lat[lat.size() / 2];
  g_p99_us[key] = lat[lat.size() * 99 / 100];
}

BENCHMARK(BM_Fold)->Unit(benchmark::kMillisecond)->MinTime(2.0);
// Wall time: the goal is "a 1M-event journal in <= 1 s", and a long scan uses two threads.
BENCHMARK(BM_Replay)
    ->Args({0, 0})
    ->Args({0, 1})
    ->Args({1, 0})
    ->Args({1, 1})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3)
    ->UseRealTime();
BENCHMARK(BM_ScanStage)
    ->DenseRange(0, 3)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3)
    ->UseRealTime();
BENCHMARK(BM_DurableAppend)
    ->Args({1, 0, 0, 1})
    ->Args({1, 1, 0, 1})
    ->Args({16, 0, 0, 1})
    ->Args({16, 1, 0, 1})
    ->Args({1, 0, 1, 1})
    ->Args({1, 1, 1, 1})
    ->Args({16, 0, 1, 1})
    ->Args({16, 1, 1, 1})
    ->Args({16, 0, 1, 4})
    ->Args({16, 0, 1, 16})
    ->Iterations(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// "BM_Replay/1/0/iterations:3/real_time" -> "BM_Replay/1/0": the name and its arguments.
std::string BaseName(const std::string& name) {
  std::string out;
  std::size_t at = 0;
  while (at <= name.size()) {
    const std::size_t slash = std::min(name.find('/', at), name.size());
    const std::string part = name.substr(at, slash - at);
    if (part.find(':') == std::string::npos && part != "real_time")
      out += (out.empty() ? "" : "/") + part;
    at = slash + 1;
  }
  return out;
}

// Google Benchmark reports items/s per run; the fold and replay rates are read back from it.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      auto it = r.counters.find("items_per_second");
      if (it != r.counters.end()) g_results[BaseName(r.benchmark_name())] = it->second;
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
  auto get = [&](const std::string& k) { return g_results.count(k) ? g_results[k] : 0.0; };
  const double fold = get("BM_Fold");
  const double n = static_cast<double>(rc::journal::g_replay_events);
  std::printf("\n== ratios (same run) ==\n");
  std::printf("fold: %.2fM events/s (goal 5M: %.2fx)\n", fold / 1e6, fold / 5e6);
  std::printf("replay (decode+verify+chain+fold, wall), goal 1M events/s:\n");
  for (const char* c : {"0", "1"}) {
    for (const char* p : {"0", "1"}) {
      const double r = get(std::string("BM_Replay/") + c + "/" + p);
      std::printf("  %-28s %-10s %.2fM events/s (%.2fx goal), %.0f events in %.2f s\n",
                  *c == '1' ? "compacted first" : "as written (flushed)",
                  *p == '1' ? "two-stage" : "one thread", r / 1e6, r / 1e6, n, r > 0 ? n / r : 0.0);
    }
  }
  const double serial = get("BM_Replay/1/0"), piped = get("BM_Replay/1/1");
  std::printf(
      "  compacted: two-stage / one thread %.2fx; compacted / as written (one thread) %.2fx\n",
      serial > 0 ? piped / serial : 0.0,
      get("BM_Replay/0/0") > 0 ? serial / get("BM_Replay/0/0") : 0.0);
  const char* stages[] = {"RocksDB iteration", "iteration + copy (reader stage)",
                          "  same, allow_mmap_reads", "decode+verify+chain (in memory)"};
  for (int v = 0; v < 4; ++v) {
    const double r = get("BM_ScanStage/" + std::to_string(v));
    std::printf("  stage %-34s %.2fM records/s, %.0f ns/record\n", stages[v], r / 1e6,
                r > 0 ? 1e9 / r : 0.0);
  }
  std::printf("  fold alone: %.0f ns/event\n", fold > 0 ? 1e9 / fold : 0.0);
  for (const char* w : {"", "_bounded"}) {
    std::printf("durable appends, %s:\n", *w ? "admit+finish (active set <= appenders)"
                                             : "4000 admissions (active set grows to 4000)");
    for (int t : {1, 16}) {
      const std::string g = "group_" + std::to_string(t) + w,
                        f = "fsync_each_" + std::to_string(t) + w;
      std::printf(
          "  %2d appenders: group commit %.0f events/s (p50 %.0f us, p99 %.0f us), one fsync per "
          "event %.0f events/s (p50 %.0f us, p99 %.0f us), ratio %.1fx\n",
          t, get(g), rc::journal::g_p50_us[g], rc::journal::g_p99_us[g], get(f),
          rc::journal::g_p50_us[f], rc::journal::g_p99_us[f], get(f) > 0 ? get(g) / get(f) : 0.0);
    }
  }
  const double closed = get("group_16_bounded");
  std::printf("16 appenders, admit+finish, group commit: closed loop %.0f/s (p50 %.0f us)", closed,
              rc::journal::g_p50_us["group_16_bounded"]);
  for (int d : {4, 16}) {
    const std::string k = "group_16_bounded_depth" + std::to_string(d);
    std::printf(", pipelined depth %d %.0f/s (p50 %.0f us, %.1fx)", d, get(k),
                rc::journal::g_p50_us[k], closed > 0 ? get(k) / closed : 0.0);
  }
  std::printf(
      "\ngroup commit at 16 vs goal 50k events/s: %.2fx (4000 admissions), %.2fx (admit+finish, "
      "closed loop), %.2fx (pipelined depth 4)\n",
      get("group_16") / 5e4, closed / 5e4, get("group_16_bounded_depth4") / 5e4);
  benchmark::Shutdown();
  return 0;
}
