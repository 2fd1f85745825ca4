// Threads the system refuses (std::thread's constructor throws std::system_error when a process is
// out of threads): every thread serve starts goes through effects::StartThread, and a refusal is
// a Status its caller returns. A test refuses chosen threads through a starter, since a process
// running as root is not held to RLIMIT_NPROC. Covered: the helper itself, the trajectories
// writer, the HTTP server's event loops and handler pool, serve's start (one engine and a fleet)
// against the vLLM double over loopback, and the GPU-free transfer's /update_weights thread.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <boost/asio/post.hpp>
#include <gtest/gtest.h>
#include <httplib.h>

#include "effects/http/engine_client.h"
#include "effects/http/protocol.h"
#include "effects/http/sequence_transfer.h"
#include "effects/thread_start.h"
#include "fixtures/vllm_double.h"
#include "service/http_server.h"
#include "service/service.h"
#include "service/trajectories.h"
#include "tests/service/raw_http.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

namespace fs = std::filesystem;

// A bound on waits for threads to be gone: reaching it is a leak, never a slow run.
constexpr int kGoneWaitMs = 5000;

std::system_error Refusal() {
  return std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                           "the test refuses this thread");
}

// The threads a starter was asked for, by name, in order.
struct Asked {
  std::mutex mu;
  std::vector<std::string> names;
  std::vector<std::string> Names() {
    std::lock_guard<std::mutex> g(mu);
    return names;
  }
};

// Starts every thread as std::thread does, except those whose name holds `refused` (never when
// empty): those throw as std::thread's constructor does when the system refuses one.
effects::ThreadStarter Refusing(std::string refused, std::shared_ptr<Asked> asked = nullptr) {
  return [refused, asked](std::string_view what, std::function<void()> body) -> std::thread {
    if (asked) {
      std::lock_guard<std::mutex> g(asked->mu);
      asked->names.emplace_back(what);
    }
    if (!refused.empty() && what.find(refused) != std::string_view::npos) throw Refusal();
    return std::thread(std::move(body));
  };
}

// The names of this process's threads that serve names (rc-monitor, rc-lease, rc-trajectory,
// rc-io-N, rc-api-N, rc-journal...): the other threads (RocksDB's pools, the double's) are not
// serve's to stop.
std::vector<std::string> ServeThreads() {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& task : fs::directory_iterator("/proc/self/task", ec)) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    if (std::getline(comm, name) && name.rfind("rc-", 0) == 0) out.push_back(name);
  }
  return out;
}

// True once no thread of serve's runs (a joined thread may linger in /proc for a moment).
bool ServeThreadsGone() {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(kGoneWaitMs);
  while (!ServeThreads().empty()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// A loopback port nothing listens on now (bound, read and closed).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  RC_CHECK(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  RC_CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  socklen_t len = sizeof(a);
  RC_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Whether something accepts TCP connections on the loopback port (a listener's backlog does).
bool Listening(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  RC_CHECK(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool connected = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return connected;
}

std::string Joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// ---- the helper

// Proves StartThread runs its body on a new, joinable thread with no starter given; catches a
// helper that runs the body on the caller's thread or hands back a thread that never ran it.
TEST(StartThread, RunsTheBodyOnAThreadOfItsOwn) {
  std::thread::id ran_on;
  Result<std::thread> t =
      effects::StartThread("a test thread", [&ran_on] { ran_on = std::this_thread::get_id(); });
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(t->joinable());
  t->join();
  EXPECT_NE(ran_on, std::thread::id());
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

// Proves a refused thread (std::system_error, or std::bad_alloc for its state) is an Unavailable
// Status naming the thread and the system's reason, with the body never run; catches the
// exception escaping the helper into code that promises a Status (what `rolloutcore` printed as
// "terminate called after throwing").
TEST(StartThread, ARefusalIsUnavailableNamingTheThreadAndTheReason) {
  bool ran = false;
  Result<std::thread> refused = effects::StartThread(
      "the test's worker", [&ran] { ran = true; }, Refusing("worker"));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kUnavailable);
  EXPECT_EQ(refused.status().message().rfind("cannot start the test's worker: ", 0), 0u)
      << refused.status().message();
  EXPECT_NE(refused.status().message().find("the test refuses this thread"), std::string::npos)
      << refused.status().message();
  const effects::ThreadStarter no_memory =
      [](std::string_view, std::function<void()>) -> std::thread { throw std::bad_alloc(); };
  Result<std::thread> starved = effects::StartThread(
      "the test's worker", [&ran] { ran = true; }, no_memory);
  ASSERT_FALSE(starved.ok());
  EXPECT_EQ(starved.status().code(), Code::kUnavailable);
  EXPECT_EQ(starved.status().message(), "cannot start the test's worker: out of memory");
  EXPECT_FALSE(ran);
}

// ---- the trajectories writer

// Proves a trajectories log whose writer is refused fails Open with Unavailable naming the writer
// and is left as never opened (Append drops, a later Open works and writes); catches Open
// throwing, and a log left half open that queues lines no thread ever writes.
TEST(ThreadRefusal, ARefusedTrajectoriesWriterLeavesTheLogUnopened) {
  const fs::path dir = fs::temp_directory_path() /
                       ("rc-thread-refusal-" + std::to_string(::getpid()) + "-trajectories");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "t.jsonl").string();
  TrajectoryLog log;
  const Status refused = log.Open(path, 1 << 20, {}, Refusing("trajectories writer"));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.code(), Code::kUnavailable);
  EXPECT_NE(refused.message().find("the trajectories writer thread"), std::string::npos)
      << refused.message();
  EXPECT_FALSE(log.Append("{\"lost\":1}")) << "queued on a log that has no writer";
  EXPECT_EQ(log.Close(), 0u);

  ASSERT_TRUE(log.Open(path, 1 << 20).ok());
  EXPECT_TRUE(log.Append("{\"kept\":1}"));
  EXPECT_EQ(log.Close(), 0u);
  std::ifstream in(path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_EQ(line, "{\"kept\":1}");
  fs::remove_all(dir);
}

// ---- the HTTP server

HttpRouter PingRoutes() {
  HttpRouter r;
  r.Async(bhttp::verb::get, "/ping",
          [](Exchange ex) { ex.Respond(MakeResponse(200, "pong", "text/plain")); });
  r.Blocking(bhttp::verb::get, "/blocking",
             [](const ApiRequest&, HttpResponse& res) { SetBody(res, 200, "done", "text/plain"); });
  return r;
}

HttpServerOptions ThreeLoopsFourHandlers(effects::ThreadStarter starter) {
  HttpServerOptions o;
  o.io_threads = 3;
  o.blocking_threads = 4;
  o.thread_starter = std::move(starter);
  return o;
}

// Proves every thread of the HTTP server (each event loop's, each blocking handler's) is started
// through its starter, and that the server so started serves both kinds of route; catches a
// thread started around the seam (one a refusal could still throw from, or hang on: Asio's own
// thread pool starts its threads in its constructor).
TEST(ThreadRefusal, EveryThreadOfTheHttpServerGoesThroughItsStarter) {
  auto asked = std::make_shared<Asked>();
  HttpServer http(ThreeLoopsFourHandlers(Refusing("", asked)), PingRoutes());
  const int port = raw_http::StartOrDie(http);
  EXPECT_EQ(asked->Names().size(), 7u) << Joined(asked->Names());
  const std::string ping =
      raw_http::raw_exchange(port, "GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(raw_http::body_of(ping), "pong") << ping;
  const std::string blocking = raw_http::raw_exchange(
      port, "GET /blocking HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(raw_http::body_of(blocking), "done") << blocking;
  EXPECT_TRUE(http.Stop(5000));
  EXPECT_TRUE(ServeThreadsGone()) << Joined(ServeThreads());
}

// Proves a thread refused part-way through the HTTP server's start (an event loop's, or a
// blocking handler's after some started) fails Start with Unavailable naming it, stops and joins
// the threads already started and closes the listener, and leaves a server that Stop and the
// destructor end at once; catches Start throwing, the started loops left running, and the hang of
// a pool whose later thread was refused (its first threads wait for work forever).
TEST(ThreadRefusal, AThreadRefusedDuringTheHttpServersStartFailsItCleanly) {
  for (const char* refused : {"HTTP event loop thread 2", "HTTP handler thread 2"}) {
    SCOPED_TRACE(refused);
    auto asked = std::make_shared<Asked>();
    HttpServerOptions o = ThreeLoopsFourHandlers(Refusing(refused, asked));
    o.port = FreePort();
    auto http = std::make_unique<HttpServer>(o, PingRoutes());
    const Result<int> port = http->Start();
    ASSERT_FALSE(port.ok());
    EXPECT_EQ(port.status().code(), Code::kUnavailable);
    EXPECT_NE(port.status().message().find(std::string("cannot start ") + refused),
              std::string::npos)
        << port.status().message();
    EXPECT_EQ(asked->Names().back(), refused) << "threads started after the refusal";
    EXPECT_TRUE(ServeThreadsGone()) << "left running: " << Joined(ServeThreads());
    EXPECT_FALSE(Listening(o.port)) << "the listener of a server that did not start is open";
    EXPECT_TRUE(http->Stop(0));
    http.reset();
  }
}

// Whether `done` holds within `ms`.
bool Within(int ms, const std::function<bool()>& done) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!done()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Proves the HTTP server starts every thread of its blocking pool before any event loop's, so a
// pool thread the system refuses finds no loop running: a blocking request already waiting in the
// listen backlog is never accepted (nothing is posted to a pool that will never run it), its
// client sees the connection end unanswered, and the server is destroyed cleanly. Catches the
// loops started first: a loop accepted the waiting request while the pool's thread was refused
// and posted its call, whose handler, dropped with the pool's queue after the loops were
// destroyed, released a connection whose socket was a destroyed loop's (a use-after-free).
TEST(ThreadRefusal, ARequestWaitingWhenAHandlerThreadIsRefusedIsNeverTaken) {
  for (const char* refused : {"HTTP handler thread 0", "HTTP handler thread 2"}) {
    SCOPED_TRACE(refused);
    auto asked = std::make_shared<Asked>();
    const effects::ThreadStarter refusing = Refusing(refused, asked);
    HttpServerOptions o = ThreeLoopsFourHandlers(nullptr);
    o.port = FreePort();
    int waiting = -1;
    o.thread_starter = [&](std::string_view what, std::function<void()> body) -> std::thread {
      if (what == refused) {
        // The listener is bound by now: the request waits in its backlog, where a loop already
        // running would take it within this pause.
        waiting = raw_http::connect_loopback(o.port);
        RC_CHECK(raw_http::send_all(
            waiting, "GET /blocking HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      return refusing(what, std::move(body));
    };
    auto http = std::make_unique<HttpServer>(o, PingRoutes());
    const Result<int> port = http->Start();
    ASSERT_FALSE(port.ok());
    EXPECT_EQ(port.status().code(), Code::kUnavailable) << port.status().ToString();
    for (const std::string& name : asked->Names()) {
      EXPECT_EQ(name.rfind("HTTP handler thread ", 0), 0u)
          << "started before the pool's threads: " << Joined(asked->Names());
    }
    EXPECT_EQ(http->counters().accepted.load(), 0u)
        << "a loop ran before the pool's threads and took the waiting request";
    http.reset();
    ASSERT_GE(waiting, 0);
    EXPECT_EQ(raw_http::read_to_close(waiting), "") << "answered by a server that did not start";
    ::close(waiting);
    EXPECT_TRUE(ServeThreadsGone()) << "left running: " << Joined(ServeThreads());
  }
}

// Proves a blocking call that a running loop queued before a later loop's thread was refused is
// dropped with the pool before any loop is destroyed: its connection (holding 1000 bytes of the
// body budget for its request's body) is gone by the time the first loop is destroyed. The pool
// runs one call at a time and queues two; while one runs, the loop queues a second and refuses a
// third (503), and the running call ends only after the start was abandoned, so the queued one is
// dropped, never run. Catches the destructor destroying the loops before the pool: the dropped
// call then released its connection, whose socket and timer belong to a destroyed loop, after
// the loops were gone (a use-after-free; here its body's hold is still taken as the first loop
// goes).
TEST(ThreadRefusal, ACallQueuedWhenALoopIsRefusedIsDroppedBeforeTheLoopsGo) {
  HttpServer* server = nullptr;
  std::atomic<bool> running{false};
  const BlockingHandler wait = [&](const ApiRequest&, HttpResponse& res) {
    running = true;
    // Until the abandoned start has stopped the loops, and well past it: the pool is stopped,
    // with the call behind this one still queued, before this one returns.
    (void)Within(10000, [&] { return server->io().stopped(); });
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    SetBody(res, 200, "done", "text/plain");
  };
  HttpRouter r;
  r.Blocking(bhttp::verb::get, "/wait", wait);
  r.Blocking(bhttp::verb::post, "/wait", wait);
  HttpServerOptions o;
  o.io_threads = 2;
  o.blocking_threads = 1;
  o.blocking_queue_max = 2;
  o.port = FreePort();
  const std::string post =
      "POST /wait HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
      "Content-Length: 1000\r\n\r\n" +
      std::string(1000, 'p');
  std::vector<int> clients;
  bool staged = false;
  o.thread_starter = [&](std::string_view what, std::function<void()> body) -> std::thread {
    if (what != "HTTP event loop thread 1") return std::thread(std::move(body));
    // Connections go to the loops in turn: the 1st, 3rd and 5th to loop 0, which runs; the 2nd
    // and 4th to loop 1, whose thread this refuses (they are never read).
    const auto connect = [&](const std::string& request) {
      clients.push_back(raw_http::connect_loopback(o.port));
      RC_CHECK(request.empty() || raw_http::send_all(clients.back(), request));
      const std::uint64_t n = clients.size();
      return Within(5000, [&] { return server->counters().accepted.load() >= n; });
    };
    staged = connect("GET /wait HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") &&
             Within(5000, [&] { return running.load(); }) && connect("") && connect(post) &&
             connect("") && connect(post) &&
             // One POST queued behind the running call, holding its body; the other refused,
             // its body given back once its 503 was written.
             Within(5000, [&] {
               return server->counters().blocking_refused.load() == 1 &&
                      server->body_budget().used() == 1000;
             });
    throw Refusal();
  };
  auto http = std::make_unique<HttpServer>(o, std::move(r));
  server = http.get();
  const Result<int> port = http->Start();
  ASSERT_FALSE(port.ok());
  EXPECT_NE(port.status().message().find("cannot start HTTP event loop thread 1"),
            std::string::npos)
      << port.status().message();
  EXPECT_TRUE(staged) << "no call was queued behind a running one when the loop was refused";
  std::optional<std::uint64_t> held_as_the_loop_went;
  boost::asio::post(http->io(), [at = std::make_shared<stack::AtDestruction>([&] {
                                   held_as_the_loop_went = server->body_budget().used();
                                 })] {});
  http.reset();
  ASSERT_TRUE(held_as_the_loop_went.has_value()) << "the first loop's queue was never destroyed";
  EXPECT_EQ(*held_as_the_loop_went, 0u)
      << "the call dropped with the pool still held its connection as the loops were destroyed";
  int refusals = 0;
  for (int fd : clients) {
    refusals += raw_http::status_of(raw_http::read_to_close(fd)) == 503 ? 1 : 0;
    ::close(fd);
  }
  EXPECT_EQ(refusals, 1);
  EXPECT_TRUE(ServeThreadsGone()) << "left running: " << Joined(ServeThreads());
}

// ---- serve's start against the vLLM double

// A fresh journal beside `engines` doubles on loopback, and serve's configuration for them (one
// engine, or a fleet of them).
class ServeWorld {
 public:
  explicit ServeWorld(int engines) {
    static int n = 0;
    dir_ = fs::temp_directory_path() /
           ("rc-thread-refusal-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (int i = 0; i < engines; ++i) {
      fixtures::VllmDoubleOptions o;
      o.worker_extension_cls = effects::kWorkerExtensionClass;
      o.token_delay_ms = 1;
      engines_.push_back(std::make_unique<fixtures::VllmDouble>(o));
      RC_CHECK(engines_.back()->Start(0) > 0);
    }
  }
  ~ServeWorld() {
    for (auto& e : engines_) e->Stop();
    fs::remove_all(dir_);
  }
  ServeWorld(const ServeWorld&) = delete;
  ServeWorld& operator=(const ServeWorld&) = delete;

  ServeConfig Config() const {
    ServeConfig c;
    if (engines_.size() == 1) {
      c.engine_url = engines_.front()->base_url();
    } else {
      for (std::size_t i = 0; i < engines_.size(); ++i) {
        c.engines.push_back({"e" + std::to_string(i), engines_[i]->base_url()});
      }
    }
    c.journal_path = (dir_ / "journal").string();
    c.listen_port = 0;
    c.initial_source = stack::kStackSource;
    c.initial_checkpoint = "ckpt-0";
    c.initial_run = "run-a";
    c.initial_step = 0;
    c.engine_startup_timeout_ms = 10000;
    c.io_threads = 2;
    c.http_threads = 4;  // the least the configuration allows
    return c;
  }

 private:
  fs::path dir_;
  std::vector<std::unique_ptr<fixtures::VllmDouble>> engines_;
};

// Serve's whole start (Open, then Start) with `refused` threads refused: its first error.
Status StartServe(const ServeWorld& world, const std::string& refused) {
  auto opened = Service::Open(world.Config(), nullptr, Refusing(refused));
  if (!opened.ok()) return opened.status();
  std::unique_ptr<Service> svc = std::move(opened.value());
  Status started = svc->Start();
  svc.reset();  // as `rolloutcore serve` does on a failed start: no Shutdown
  return started.ok() ? Status::Internal("serve started with '" + refused + "' refused") : started;
}

// After a failed start: the journal was closed (this process opens it again), and serve starts
// on it and answers.
void ExpectServeStartsAgain(const ServeWorld& world) {
  auto opened = Service::Open(world.Config());
  ASSERT_TRUE(opened.ok()) << "the failed start left the journal open: "
                           << opened.status().ToString();
  std::unique_ptr<Service> svc = std::move(opened.value());
  ASSERT_TRUE(svc->Start().ok());
  httplib::Client c("127.0.0.1", svc->port());
  c.set_read_timeout(30, 0);
  auto health = c.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200) << health->body;
  (void)svc->Shutdown(5000);
}

class ServeStartRefused : public ::testing::TestWithParam<const char*> {};

// serve's start refused with Unavailable naming `refused`, none of its threads left running,
// and the journal closed (serve starts on it again).
void ExpectRefusedAndReleased(ServeWorld& world, const Status& st, const std::string& refused) {
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("cannot start " + refused), std::string::npos) << st.ToString();
  EXPECT_TRUE(ServeThreadsGone()) << "left running: " << Joined(ServeThreads());
  ASSERT_NO_FATAL_FAILURE(ExpectServeStartsAgain(world));
}

// Proves that serve's start with one of its threads refused (the trajectories writer, the engine
// monitor, lease expiry at Open; an event loop or a blocking handler at Start) fails with
// Unavailable naming that thread, and that the destructor stops and joins every thread started
// before it and closes the journal (the next start opens it); catches the refusal escaping Open or
// Start as an exception, std::terminate from a joinable thread destroyed, and a thread or the
// journal left behind.
TEST_P(ServeStartRefused, FailsNamingTheThreadAndReleasesWhatStarted) {
  const std::string refused = GetParam();
  ServeWorld world(1);
  const Status st = StartServe(world, refused);
  ASSERT_NO_FATAL_FAILURE(ExpectRefusedAndReleased(world, st, refused));
}

INSTANTIATE_TEST_SUITE_P(EachThread, ServeStartRefused,
                         ::testing::Values("the trajectories writer thread",
                                           "the engine monitor thread", "the lease expiry thread",
                                           "HTTP event loop thread 1", "HTTP handler thread 2"));

// Proves a fleet's start with one member's monitor refused fails with Unavailable naming that
// engine's monitor, the monitor already started for the other member joined and the journal
// closed; catches the refusal escaping as an exception (InitFleet's loop started them with no
// guard) and a member's monitor left running.
TEST(ThreadRefusal, AFleetMembersMonitorRefusedFailsTheStart) {
  ServeWorld world(2);
  const std::string refused = "the engine monitor thread of engine 'e1'";
  const Status st = StartServe(world, refused);
  ASSERT_NO_FATAL_FAILURE(ExpectRefusedAndReleased(world, st, refused));
}

// ---- the GPU-free transfer

// Proves the GPU-free transfer whose /update_weights thread is refused fails that transfer (not
// acknowledged, kPossible: /start_weight_update reached the engine) naming the thread, with
// /update_weights never sent; catches the refusal thrown out of Transfer, which a plan's guard
// turns into a fail-stop of the whole executor.
TEST(ThreadRefusal, ARefusedUpdaterThreadFailsTheTransferNotTheProcess) {
  fixtures::VllmDoubleOptions o;
  o.version = "0.30.0";
  o.token_delay_ms = 1;
  fixtures::VllmDouble engine(o);
  ASSERT_GT(engine.Start(0), 0);
  effects::EngineDeadlines d;
  d.connect_timeout_ms = 1000;
  d.call_timeout_ms = 5000;
  d.update_timeout_ms = 10000;
  {
    effects::EngineClient client(engine.base_url(), d);
    effects::HttpSequenceTransfer transfer(client, effects::detect_protocol("0.30.0"));
    transfer.set_thread_starter(Refusing("/update_weights"));
    effects::TransferTarget target;
    target.update_id = "u-1";
    target.target = WeightVersion{1, "rc-1"};
    target.source_uri = "synthetic:4x64:1";
    TransferObserved t;
    ASSERT_NO_THROW(t = transfer.Transfer(target, 10000));
    EXPECT_FALSE(t.acknowledged);
    EXPECT_EQ(t.mutation, MutationClass::kPossible);
    EXPECT_NE(t.error.find("cannot start the /update_weights thread"), std::string::npos)
        << t.error;
    EXPECT_EQ(engine.RouteCount("/start_weight_update"), 1u);
    EXPECT_EQ(engine.RouteCount("/update_weights"), 0u);
  }
  engine.Stop();
}

}  // namespace
}  // namespace rc::service
