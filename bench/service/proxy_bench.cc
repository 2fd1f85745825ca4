// Proxy overhead benchmark: the same load against the vLLM double directly and through the
// service's enforcing proxy (durable admission + finish in the journal, fsync on), interleaved
// in rounds in one process so both sides see the same machine.
//
//   service_proxy_bench [--concurrency 256] [--requests 8] [--rounds 3] [--max-tokens 4]
//                       [--token-delay-ms 0] [--stream 0|1] [--sync 1]
//
// Prints per-request latency p50/p99 for each side, the difference (added latency at that
// percentile; requests are not paired), requests/s, and CPU time per request (getrusage of this
// one process: load generator + double on the direct side, load generator + proxy + double on
// the proxy side; the difference is what the proxy costs). On a box with C cores, a side that
// costs X us of CPU per request cannot exceed C * 1e6 / X requests/s.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "fixtures/vllm_double.h"
#include "service/service.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  int concurrency = 256, requests = 8, rounds = 3, max_tokens = 4, token_delay_ms = 0;
  bool stream = false, sync = true;
};

struct Side {
  std::vector<double> latencies_us;
  double seconds = 0;
  double cpu_seconds = 0;  // user + system of the whole process while this side ran
  int errors = 0;
};

double process_cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

Side run_load(int port, const Args& a) {
  Side side;
  std::vector<std::vector<double>> per(a.concurrency);
  std::atomic<int> errors{0};
  const std::string body = nlohmann::json{
      {"prompt", "benchmark prompt"},
      {"max_tokens", a.max_tokens},
      {"stream", a.stream}}.dump();
  const auto t0 = Clock::now();
  const double cpu0 = process_cpu_seconds();
  std::vector<std::thread> threads;
  for (int c = 0; c < a.concurrency; ++c) {
    threads.emplace_back([&, c] {
      httplib::Client cli("127.0.0.1", port);
      cli.set_keep_alive(true);
      cli.set_tcp_nodelay(true);
      cli.set_read_timeout(120, 0);
      for (int i = 0; i < a.requests; ++i) {
        const auto s = Clock::now();
        auto r = cli.Post("/v1/completions", body, "application/json");
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - s).count();
        if (!r || r->status != 200) {
          errors++;
          continue;
        }
        per[c].push_back(us);
      }
    });
  }
  for (auto& t : threads) t.join();
  side.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  side.cpu_seconds = process_cpu_seconds() - cpu0;
  for (auto& v : per) side.latencies_us.insert(side.latencies_us.end(), v.begin(), v.end());
  side.errors = errors;
  return side;
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--concurrency")
      a.concurrency = v;
    else if (k == "--requests")
      a.requests = v;
    else if (k == "--rounds")
      a.rounds = v;
    else if (k == "--max-tokens")
      a.max_tokens = v;
    else if (k == "--token-delay-ms")
      a.token_delay_ms = v;
    else if (k == "--stream")
      a.stream = v != 0;
    else if (k == "--sync")
      a.sync = v != 0;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("rc-proxy-bench-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);

  rc::fixtures::VllmDoubleOptions eo;
  eo.worker_extension_cls = rc::effects::kWorkerExtensionClass;  // vLLM 0.25.1 (the default)
  eo.token_delay_ms = a.token_delay_ms;
  // The double serves a thread per connection: the load generator's connections and the
  // proxy's pooled keep-alive connections to it both hold one.
  eo.http_threads = 2 * a.concurrency + 64;
  rc::fixtures::VllmDouble engine(eo);
  if (engine.Start(0) <= 0) return 1;  // raises its own listen backlog

  rc::service::ServeConfig c;
  c.engine_url = engine.base_url();
  c.journal_path = (dir / "journal").string();
  c.listen_port = 0;
  c.initial_source = "synthetic:4x64";
  c.http_threads = a.concurrency + 64;
  c.journal_sync = a.sync;
  auto svc = rc::service::Service::Open(c);
  if (!svc.ok()) {
    std::fprintf(stderr, "%s\n", svc.status().ToString().c_str());
    return 1;
  }
  if (!(*svc)->Start().ok()) return 1;

  Side direct, proxy;
  for (int r = 0; r < a.rounds; ++r) {
    for (bool via_proxy : {false, true}) {
      Side s = run_load(via_proxy ? (*svc)->port() : engine.port(), a);
      Side& into = via_proxy ? proxy : direct;
      into.latencies_us.insert(into.latencies_us.end(), s.latencies_us.begin(),
                               s.latencies_us.end());
      into.seconds += s.seconds;
      into.cpu_seconds += s.cpu_seconds;
      into.errors += s.errors;
    }
  }
  auto cpu_us_per_req = [](const Side& s) {
    return s.latencies_us.empty()
               ? 0.0
               : s.cpu_seconds * 1e6 / static_cast<double>(s.latencies_us.size());
  };
  auto report = [&](const char* name, const Side& s) {
    std::printf(
        "%-7s n=%zu errors=%d p50=%.0f us p99=%.0f us  %.0f req/s  cpu=%.0f us/req "
        "(cores busy %.2f)\n",
        name, s.latencies_us.size(), s.errors, pct(s.latencies_us, 0.50), pct(s.latencies_us, 0.99),
        static_cast<double>(s.latencies_us.size()) / s.seconds, cpu_us_per_req(s),
        s.cpu_seconds / s.seconds);
  };
  std::printf(
      "concurrency=%d requests/client=%d rounds=%d max_tokens=%d token_delay_ms=%d "
      "stream=%d journal_sync=%d cores=%u\n",
      a.concurrency, a.requests, a.rounds, a.max_tokens, a.token_delay_ms, a.stream, a.sync,
      std::thread::hardware_concurrency());
  report("direct", direct);
  report("proxy", proxy);
  std::printf("added   p50=%.0f us p99=%.0f us  throughput ratio proxy/direct=%.2f\n",
              pct(proxy.latencies_us, 0.50) - pct(direct.latencies_us, 0.50),
              pct(proxy.latencies_us, 0.99) - pct(direct.latencies_us, 0.99),
              (static_cast<double>(proxy.latencies_us.size()) / proxy.seconds) /
                  (static_cast<double>(direct.latencies_us.size()) / direct.seconds));
  std::printf(
      "proxy cpu per request: +%.0f us (%.3f of a core per request/s; the proxy alone "
      "caps at %.0f req/s per core)\n",
      cpu_us_per_req(proxy) - cpu_us_per_req(direct),
      (cpu_us_per_req(proxy) - cpu_us_per_req(direct)) / 1e6,
      1e6 / std::max(1.0, cpu_us_per_req(proxy) - cpu_us_per_req(direct)));
  // Where a proxied request's time went, from the service's own histograms (means).
  {
    const std::string m = (*svc)->RenderMetrics();
    auto value = [&](const std::string& name) {
      const auto at = m.find("\n" + name + " ");
      return at == std::string::npos ? 0.0 : std::atof(m.c_str() + at + name.size() + 2);
    };
    for (const char* h :
         {"rolloutcore_journal_append_seconds", "rolloutcore_proxy_upstream_seconds",
          "rolloutcore_proxy_added_seconds", "rolloutcore_proxy_request_seconds"}) {
      const double n = value(std::string(h) + "_count");
      std::printf("service %-36s mean=%.0f us (n=%.0f)\n", h,
                  n > 0 ? value(std::string(h) + "_sum") / n * 1e6 : 0.0, n);
    }
  }
  (void)(*svc)->Shutdown(5000);
  engine.Stop();
  fs::remove_all(dir);
  return direct.errors + proxy.errors == 0 ? 0 : 1;
}
