// Trust-under-faults tests of serve's HTTP front and proxy: a real Service (RocksDB journal in a
// temp dir) behind the connection gate, in front of the in-process vLLM double, over loopback.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "effects/http/sequence_transfer.h"
#include "fixtures/vllm_double.h"
#include "effects/http/engine_client.h"
#include "service/http_server.h"
#include "service/http_util.h"
#include "service/proxy_stream.h"
#include "service/service.h"
#include "tests/service/scripted_engine.h"
#include "tests/service/raw_http.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using raw_http::body_of;
using raw_http::connect_loopback;
using raw_http::OneLoop;
using raw_http::raw_exchange;
using raw_http::StartOrDie;
using raw_http::status_of;

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

std::int64_t ms_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

struct Stack : stack::ServiceStack {
  explicit Stack(std::function<void(ServeConfig&)> tweak = nullptr)
      : ServiceStack(Options(std::move(tweak))) {}
  static stack::StackOptions Options(std::function<void(ServeConfig&)> tweak) {
    stack::StackOptions o;
    o.dir_prefix = "rc-proxyfault";
    o.tweak = [tweak = std::move(tweak)](ServeConfig& c) {
      c.admit_wait_ms = 5000;
      if (tweak) tweak(c);
    };
    return o;
  }
  httplib::Client client() const { return ServiceStack::client(30); }
};

std::string post_bytes(const std::string& path, const std::string& body,
                       const std::string& extra_headers = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
         extra_headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string completion_body(bool stream) {
  return json{{"model", "rc-double-model"}, {"prompt", "hi"}, {"max_tokens", 4}, {"stream", stream}}
      .dump();
}

// Proves that clients trickling their request heads cannot starve the server: with 8 workers and
// 64 tricklers, proxied rollouts and trainer calls keep completing, and every trickler is closed
// at the header deadline. Catches: a worker (or any blocking wait) per connection still in its
// head, and a missing header deadline (tricklers held forever).
TEST(ConnectionGate, TricklersDoNotStarveWorkersAndAreClosedAtTheHeaderDeadline) {
  constexpr std::uint64_t kHeaderTimeoutMs = 2000;
  Stack s([](ServeConfig& c) {
    c.http_threads = 8;
    c.header_timeout_ms = kHeaderTimeoutMs;
    c.idle_timeout_ms = 1000;
  });
  constexpr int kTricklers = 64;
  struct Trickler {
    int fd = -1;
    Clock::time_point opened;
    std::int64_t closed_after_ms = -1;
  };
  std::vector<Trickler> tricklers(kTricklers);
  for (auto& t : tricklers) {
    t.fd = connect_loopback(s.svc->port());
    t.opened = Clock::now();
  }
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: ";
    for (std::size_t i = 0; !stop.load(); ++i) {
      for (auto& t : tricklers) {
        if (t.closed_after_ms >= 0) continue;
        const char c = head[std::min(i, head.size() - 1)];
        pollfd p{t.fd, POLLIN, 0};
        const bool readable = ::poll(&p, 1, 0) > 0;  // an answer (408) or EOF: closed by us
        if (readable || ::send(t.fd, &c, 1, MSG_NOSIGNAL) != 1) {
          t.closed_after_ms = ms_since(t.opened);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  // Meanwhile, rollouts through the proxy and trainer calls answer promptly.
  for (int i = 0; i < 12; ++i) {
    const auto t0 = Clock::now();
    auto c = s.client();
    auto r = c.Post("/v1/completions", completion_body(i % 2 == 1), "application/json");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200);
    auto st = c.Get("/v1/state");
    ASSERT_TRUE(st);
    EXPECT_EQ(st->status, 200);
    EXPECT_LT(ms_since(t0), 1500) << "request " << i << " waited behind tricklers";
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(kHeaderTimeoutMs + 1500));
  stop.store(true);
  trickle.join();
  for (const auto& t : tricklers) {
    EXPECT_GE(t.closed_after_ms, static_cast<std::int64_t>(kHeaderTimeoutMs) - 100);
    EXPECT_LE(t.closed_after_ms, static_cast<std::int64_t>(kHeaderTimeoutMs) + 1000);
    ::close(t.fd);
  }
  EXPECT_GE(s.svc->metrics().finishes_completed.load(), 12u);
}

// Proves that a connection that never sends a byte is closed at the idle deadline and that
// connections beyond the gate's budget are refused at once. Catches: silent connections held
// until the (longer) header deadline, and an unbounded gate.
TEST(ConnectionGate, IdleConnectionsCloseAndTheBudgetRefusesBeyondIt) {
  Stack s([](ServeConfig& c) {
    c.http_threads = 4;
    c.http_connections_max = 8;
    c.header_timeout_ms = 10000;
    c.idle_timeout_ms = 500;
  });
  std::vector<int> fds;
  for (int i = 0; i < 8; ++i) fds.push_back(connect_loopback(s.svc->port()));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // The ninth is over budget: 503 without waiting.
  const std::string refused = raw_exchange(s.svc->port(), post_bytes("/v1/state", ""));
  EXPECT_EQ(status_of(refused), 503) << refused;
  const auto t0 = Clock::now();
  for (int fd : fds) {
    char buf[512];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);  // the 408, then EOF
    EXPECT_GT(n, 0);
    if (n > 0) {
      EXPECT_EQ(status_of(std::string(buf, static_cast<std::size_t>(n))), 408);
    }
    ::close(fd);
  }
  EXPECT_LT(ms_since(t0), 3000);
  // Budget released: served again.
  auto c = s.client();
  auto r = c.Get("/v1/state");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

// Proves that invalid UTF-8 from the engine (an error body cut inside a character: vLLM echoes a
// long non-ASCII model name in its 404) and from clients never crashes serve, on every proxy
// route, streamed or not. Catches: a throwing json::dump() inside httplib's content provider
// (std::terminate), and client bytes that reach a throwing serialiser.
TEST(ProxyText, InvalidUtf8FromEngineAndClientsNeverCrashes) {
  Stack s;
  std::string accents;
  for (int i = 0; i < 300; ++i) accents += "\xc3\xa9";  // é
  const char* routes[] = {"/v1/completions", "/v1/chat/completions"};
  for (const char* route : routes) {
    for (bool stream : {false, true}) {
      for (const std::string pad : {"", "x"}) {  // the cut at byte 400 falls on both parities
        json body = {{"model", pad + accents}, {"max_tokens", 2}, {"stream", stream}};
        if (std::string(route) == "/v1/completions") {
          body["prompt"] = "hi";
        } else {
          body["messages"] = json::array({{{"role", "user"}, {"content", "hi"}}});
        }
        auto c = s.client();
        auto r = c.Post(route, body.dump(), "application/json");
        ASSERT_TRUE(r) << route << " stream=" << stream;
        EXPECT_TRUE(stream ? r->status == 200 : r->status == 404) << r->status;
        if (stream) {
          EXPECT_NE(r->body.find("\"upstream\""), std::string::npos) << r->body;
        }
      }
    }
  }
  // Client bytes: invalid UTF-8 in a JSON string and in the rollout id header, on every route.
  const char* all_routes[] = {"/v1/completions", "/v1/chat/completions", "/inference/v1/generate"};
  for (const char* route : all_routes) {
    for (bool stream : {false, true}) {
      const std::string bad_body = std::string("{\"model\":\"m\xff\xfe\",\"stream\":") +
                                   (stream ? "true" : "false") + ",\"prompt\":\"\xc3\"}";
      EXPECT_EQ(status_of(raw_exchange(s.svc->port(), post_bytes(route, bad_body))), 400);
      const std::string bad_header = "X-RolloutCore-Rollout-Id: r\xc3\x28\r\n";
      EXPECT_EQ(status_of(raw_exchange(s.svc->port(),
                                       post_bytes(route, completion_body(stream), bad_header))),
                400);
    }
  }
  // Engine bodies that are not JSON at all (garbage on a 200).
  fixtures::RouteFault garbage;
  garbage.garbage_body = true;
  s.engine->SetRouteFault("/v1/completions", garbage);
  for (bool stream : {false, true}) {
    auto c = s.client();
    auto r = c.Post("/v1/completions", completion_body(stream), "application/json");
    ASSERT_TRUE(r);
  }
  s.engine->ClearFaults();
  auto c = s.client();
  auto r = c.Get("/v1/state");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(s.svc->metrics().proxy_in_flight.load(), 0);
}

// Proves that X-RolloutCore-Rollout-Id is taken verbatim and validated: "zz%00yy" is admitted as
// "zz%00yy" (not percent-decoded to "zz"), control bytes and over-long values are 400. Catches:
// the header decoding of cpp-httplib 0.11 reaching the journal, and unvalidated ids.
TEST(ProxyText, RolloutIdHeaderIsVerbatimAndValidated) {
  Stack s;
  const std::string body = completion_body(false);
  std::string ok = raw_exchange(
      s.svc->port(), post_bytes("/v1/completions", body, "X-RolloutCore-Rollout-Id: zz%00yy\r\n"));
  EXPECT_EQ(status_of(ok), 200) << ok;
  EXPECT_NE(ok.find("X-RolloutCore-Rollout-Id: zz%00yy\r\n"), std::string::npos) << ok;
  bool journaled = false;
  Status st = s.svc->journal().Scan(1, 0, [&](const journal::Record& rec) {
    if (const auto* a = std::get_if<RolloutAdmitted>(&rec.event)) {
      journaled = journaled || a->rollout_id == "zz%00yy";
    }
    return Status::OK();
  });
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(journaled);
  const std::string bad[] = {
      "X-RolloutCore-Rollout-Id: a\x01"
      "b\r\n",
      "X-RolloutCore-Rollout-Id: " + std::string(129, 'a') + "\r\n",
      "X-RolloutCore-Rollout-Id: a\r\nX-RolloutCore-Rollout-Id: b\r\n"};
  for (const std::string& h : bad) {
    EXPECT_EQ(status_of(raw_exchange(s.svc->port(), post_bytes("/v1/completions", body, h))), 400)
        << h;
  }
}

// Proves a body nested 100,000 deep (about 200 KB, valid JSON) is refused 400 on every proxy and
// trainer route, journals nothing and leaves serve serving. Catches: the parser accepting any
// depth and the admitted request then overflowing the event loop's stack when the proxy copies or
// dumps it for the engine (the whole process killed by one small request).
TEST(ProxyText, DeeplyNestedJsonIsRefusedAndChangesNothing) {
  Stack s;
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::uint64_t head = s.svc->journal().head_seq();
  for (const char* route : {"/v1/completions", "/v1/chat/completions", "/inference/v1/generate",
                            "/v1/updates", "/v1/rollouts"}) {
    const std::string body = R"({"prompt":"a","max_tokens":2,"x":)" + deep + "}";
    const std::string r = raw_exchange(s.svc->port(), post_bytes(route, body));
    EXPECT_EQ(status_of(r), 400) << route << ": " << r.substr(0, 300);
  }
  EXPECT_EQ(s.svc->journal().head_seq(), head) << "a nested body reached the journal";
  auto c = s.client();
  auto ok = c.Post("/v1/completions", completion_body(false), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// Proves the parsed copy of a proxied body counts against body_memory_bytes_max: a 2 MiB body of
// empty arrays (~50 MiB once parsed) is refused 503 under a 16 MiB budget, journals nothing, and
// a long but ordinary prompt of token ids still passes. Catches only the raw bytes being charged:
// clients holding the parse trees of many such bodies (10-25x their text) through an admission
// wait or a generation, far past the budget, until serve is killed for memory.
TEST(ProxyText, AParsedBodyIsHeldAgainstTheBodyBudget) {
  Stack s([](ServeConfig& c) { c.body_memory_bytes_max = 16 << 20; });
  std::string pad = "[";
  while (pad.size() < (2u << 20)) pad += "[],";
  pad += "[]]";
  const std::uint64_t head = s.svc->journal().head_seq();
  const std::string body = R"({"prompt":"a","max_tokens":2,"pad":)" + pad + "}";
  const std::string r = raw_exchange(s.svc->port(), post_bytes("/v1/completions", body));
  EXPECT_EQ(status_of(r), 503) << r.substr(0, 300);
  EXPECT_NE(r.find("body_memory_bytes_max"), std::string::npos) << r.substr(0, 300);
  EXPECT_EQ(s.svc->journal().head_seq(), head) << "the refused body reached the journal";
  std::string ids = "[1";
  for (int i = 0; i < 3000; ++i) ids += "," + std::to_string(100 + i % 900);
  ids += "]";
  auto c = s.client();
  auto ok =
      c.Post("/v1/completions", R"({"prompt":)" + ids + R"(,"max_tokens":2})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body.substr(0, 300);
}

// Proves a proxied request asking for more choices than one trace records, or with an `n` vLLM
// reads no integer in, is refused 400 before its admission, on each route that takes `n`: `n`
// past 65536 in any form vLLM reads (65537, 65537.0, a number past 2^64), below 1 (0, -3, false,
// "0"), a fraction, a string of no integer, a body number nlohmann cannot hold (1e400, which vLLM
// refuses as no finite number), and a list of prompts (strings, token-id lists, embeddings) times
// `n` past 65536. Each refusal is one line in the OpenAI error shape naming the field, journals
// nothing and admits nothing; exactly 65536 choices is still admitted, as integer and as string
// (the double then refuses n > 1 itself), a `best_of` vLLM ignores is too, and n 1 is served.
// Catches such a request admitted (a durable RolloutAdmitted) and only its answer's trace going
// wrong, or one vLLM serves refused.
TEST(ProxyText, MoreChoicesThanATraceRecordsAreRefusedBeforeAdmission) {
  Stack s;
  auto c = s.client();
  std::string prompts = "[\"a\"";
  for (int i = 0; i < 65536; ++i) prompts += ",\"a\"";
  prompts += "]";  // 65537 prompts
  const std::string chat = R"({"messages":[{"role":"user","content":"a"}],)";
  const std::vector<std::tuple<std::string, std::string, std::string>> refused = {
      {"/v1/completions", R"({"prompt":"a","n":65537})", "'n' must be in 1..65536"},
      {"/v1/completions", R"({"prompt":"a","n":65537.0})", "'n' must be in 1..65536"},
      {"/v1/completions", R"({"prompt":"a","n":0})", "'n' must be in 1..65536"},
      {"/v1/completions", R"({"prompt":"a","n":-3})", "'n' must be in 1..65536"},
      {"/v1/completions", R"({"prompt":"a","n":false})", "'n' must be in 1..65536"},
      {"/v1/completions", R"({"prompt":"a","n":"0"})", "'n' must be in 1..65536"},
      {"/v1/completions", R"({"prompt":"a","n":1.5})", "'n' must be an integer"},
      {"/v1/completions", R"({"prompt":"a","n":"two"})", "'n' must be an integer"},
      {"/v1/completions", R"({"prompt":"a","n":"2."})", "'n' must be an integer"},
      {"/v1/completions", R"({"prompt":"a","n":18446744073709551617})", "'n' must be in 1..65536"},
      {"/v1/completions", R"({"prompt":"a","n":1e400})", "body is not valid JSON"},
      {"/v1/completions", R"({"prompt":["a","b"],"n":32769})", "asks for 2 x 32769 choices"},
      {"/v1/completions", R"({"prompt":[[1,2],[3]],"n":"32769"})", "asks for 2 x 32769"},
      {"/v1/completions", R"({"prompt":"a","prompt_embeds":["e","f"],"n":21846})",
       "asks for 3 x 21846"},
      {"/v1/completions", R"({"prompt":)" + prompts + "}", "asks for 65537 x 1 choices"},
      {"/v1/chat/completions", chat + R"("n":65537})", "'n' must be in 1..65536"},
      {"/v1/chat/completions", chat + R"("n":"1.5"})", "'n' must be an integer"},
      {"/inference/v1/generate", R"({"token_ids":[1,2],"sampling_params":{"n":65537}})",
       "'sampling_params.n' must be in 1..65536"},
      {"/inference/v1/generate", R"({"token_ids":[1,2],"sampling_params":{"n":"0"}})",
       "'sampling_params.n' must be in 1..65536"}};
  const std::uint64_t head = s.svc->journal().head_seq();
  const std::uint64_t bad_before = s.svc->metrics().bad_requests.load();
  for (const auto& [route, body, why] : refused) {
    auto r = c.Post(route, body, "application/json");
    ASSERT_TRUE(r) << route << " " << body.substr(0, 100);
    EXPECT_EQ(r->status, 400) << route << " " << body.substr(0, 100) << ": " << r->body;
    EXPECT_EQ(r->body.find('\n'), std::string::npos) << r->body;
    const json doc = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(doc.is_object() && doc.contains("error")) << r->body;
    const json& error = doc["error"];
    EXPECT_EQ(error.value("code", 0), 400) << r->body;
    EXPECT_NE(error.value("message", "").find(why), std::string::npos) << why << ": " << r->body;
  }
  EXPECT_EQ(s.svc->journal().head_seq(), head) << "a refused request reached the journal";
  EXPECT_EQ(s.svc->metrics().admissions.load(), 0u);
  EXPECT_EQ(s.svc->metrics().bad_requests.load(), bad_before + refused.size());

  for (const char* at_bound : {R"({"prompt":"a","max_tokens":2,"n":65536})",
                               R"({"prompt":["a","b"],"max_tokens":2,"n":"32768"})"}) {
    auto r = c.Post("/v1/completions", at_bound, "application/json");
    ASSERT_TRUE(r) << at_bound;
    EXPECT_EQ(r->body.find("65536"), std::string::npos) << at_bound << ": " << r->body;
  }
  EXPECT_EQ(s.svc->metrics().admissions.load(), 2u) << "65536 choices are a trace's own";
  auto best_of = c.Post("/v1/completions", R"({"prompt":"a","max_tokens":2,"best_of":65537})",
                        "application/json");
  ASSERT_TRUE(best_of);
  EXPECT_EQ(best_of->status, 200) << "a best_of vLLM ignores was refused: " << best_of->body;
  auto ok = c.Post("/v1/completions", R"({"prompt":"a","max_tokens":2,"n":1})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// A serve whose client bodies are at most 64 KiB and whose body memory budget is `bytes` (1 MiB,
// the least allowed, holds about 32,000 trace entries).
std::function<void(ServeConfig&)> WithBodyMemory(std::uint64_t bytes) {
  return [bytes](ServeConfig& c) {
    c.body_bytes_max = 64 << 10;
    c.body_memory_bytes_max = bytes;
  };
}

// Proves a streamed rollout's trace is held against the body budget as it grows: a generation
// whose token ids and logprobs outgrow what is left is ended with an error event and [DONE],
// finished as aborted, and gives its share back (the next streams pass). Catches traces of
// thousands of long streams held outside body_memory_bytes_max (up to 32 MiB each).
TEST(ProxyText, AStreamsTraceIsHeldAgainstTheBodyBudget) {
  stack::StackOptions o = Stack::Options(WithBodyMemory(1 << 20));
  o.token_delay_ms = 0;
  o.engine_max_model_len = 1 << 17;
  stack::ServiceStack s(o);
  auto c = s.client(120);
  const std::string long_stream = json{
      {"model", "rc-double-model"},
      {"prompt", "hi"},
      {"max_tokens", 40000},
      {"stream", true}}.dump();
  auto cut = c.Post("/v1/completions", long_stream, "application/json");
  ASSERT_TRUE(cut) << httplib::to_string(cut.error());
  EXPECT_EQ(cut->status, 200);
  EXPECT_NE(cut->body.find("body_memory_bytes_max"), std::string::npos)
      << cut->body.substr(cut->body.size() > 600 ? cut->body.size() - 600 : 0);
  EXPECT_NE(cut->body.find("data: [DONE]"), std::string::npos);
  EXPECT_EQ(s.svc->metrics().finishes_aborted.load(), 1u);
  for (int i = 0; i < 3; ++i) {
    auto ok = c.Post("/v1/completions", completion_body(true), "application/json");
    ASSERT_TRUE(ok);
    EXPECT_EQ(ok->body.find("body_memory_bytes_max"), std::string::npos) << ok->body;
    EXPECT_NE(ok->body.find("data: [DONE]"), std::string::npos);
  }
  EXPECT_EQ(s.svc->metrics().finishes_completed.load(), 3u);
}

// Proves a pass-through answer is held to its share of the body budget (a quarter): one that
// declares more is refused 502 before its body is read, and a small one passes. Catches an answer
// charged less than it declares while its whole body is read (memory outside the budget), and
// every answer of undeclared length refused when the budget is under 16 MiB.
TEST(ProxyText, APassThroughAnswerIsHeldToItsShareOfTheBodyBudget) {
  Stack s([](ServeConfig& c) {
    c.body_bytes_max = 512 << 10;
    c.body_memory_bytes_max = 1 << 20;  // a pass-through answer may take 256 KiB
  });
  auto c = s.client();
  std::string words;
  while (words.size() < (200u << 10)) words += "ab ";
  const json big = {{"model", "rc-double-model"}, {"prompt", words}, {"return_token_strs", true}};
  auto refused = c.Post("/tokenize", big.dump(), "application/json");
  ASSERT_TRUE(refused) << httplib::to_string(refused.error());
  EXPECT_EQ(refused->status, 502) << refused->body.substr(0, 300);
  EXPECT_NE(refused->body.find("more than serve takes for one"), std::string::npos)
      << refused->body.substr(0, 300);
  const json small = {{"model", "rc-double-model"}, {"prompt", "ab ab"}};
  auto ok = c.Post("/tokenize", small.dump(), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// Proves a client that keeps trickling bytes after its final answer (Connection: close) is
// closed within the linger bound. Catches: a linger re-armed by every byte, which lets closed-out
// connections (no longer counted against connections_max) stay open forever and exhaust the
// process's file descriptors.
TEST(ConnectionGate, ALingeringClientIsClosedWithinTheLingerBound) {
  Stack s;
  const int fd = connect_loopback(s.svc->port());
  const std::string req = "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  const auto t0 = Clock::now();
  bool closed = false;
  while (!closed && ms_since(t0) < 6000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    // Once serve has closed, a byte sent draws a reset and a later send fails.
    closed = ::send(fd, "x", 1, MSG_NOSIGNAL) < 0;
  }
  ::close(fd);
  EXPECT_TRUE(closed) << "a trickling client kept its connection after the answer";
  EXPECT_LT(ms_since(t0), 3000);
}

// Sends a 10 s non-streamed completion (200 tokens at 50 ms), waits until it is in flight, sends
// `pipelined` (the client's next request, early), hangs up, and says whether serve recorded the
// rollout aborted within 4 s: only the disconnect watch's cancel can end it that early (the double
// does not notice a non-streamed client leaving).
void ExpectALeavingPipelinerSeen(const std::string& pipelined) {
  stack::StackOptions o;
  o.dir_prefix = "rc-proxyfault";
  o.token_delay_ms = 50;
  stack::ServiceStack s(o);
  const int fd = connect_loopback(s.svc->port());
  const std::string req =
      post_bytes("/v1/completions", R"({"prompt":"hang up on me","max_tokens":200})");
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  const auto t0 = Clock::now();
  while (s.svc->metrics().proxy_in_flight.load() == 0 && ms_since(t0) < 5000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(::send(fd, pipelined.data(), pipelined.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(pipelined.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ::close(fd);
  const auto t1 = Clock::now();
  while (s.svc->metrics().finishes_aborted.load() == 0 && ms_since(t1) < 4000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s.svc->metrics().finishes_aborted.load(), 1u) << "the leaving client went unseen";
  EXPECT_GE(s.svc->metrics().client_disconnects.load(), 1u);
}

// Proves a client that pipelines a byte of its next request and then leaves, while its
// non-streamed completion is still generating, is seen leaving: the engine call is cancelled
// and the rollout recorded aborted. Catches: a disconnect watch that stops at the first byte it
// reads, so the engine generates to the end and the rollout is recorded completed.
TEST(ProxyDisconnect, AClientThatPipelinesAndLeavesIsSeenLeaving) {
  ExpectALeavingPipelinerSeen("G");
}

// Proves a client that pipelines more than the header bound (the watch can keep none of it) and
// then leaves is still seen leaving: cancelled and recorded aborted. Catches a watch that stops
// reading at the bound and with it stops looking, so the engine generates to the end for nobody
// and the rollout is recorded completed.
TEST(ProxyDisconnect, AClientThatPipelinesPastTheHeaderBoundAndLeavesIsSeenLeaving) {
  ExpectALeavingPipelinerSeen("GET /health HTTP/1.1\r\nX-Filler: " + std::string(48 << 10, 'a'));
}

// Proves that Shutdown enforces its grace: with an engine request hung in flight it returns false
// within grace + a small bound, the hung rollout is recorded aborted and its client, still
// connected, is answered 503 shutting_down with Retry-After, and requests during the grace are
// refused the same way. Catches: Shutdown joining workers that proxy for up to
// request_timeout_ms, a cancelled rollout left unfinished, refusals without Retry-After, and the
// 499 "client closed the connection" that told a connected client it had left.
TEST(ProxyShutdown, GraceIsEnforcedWithAHungEngineRequest) {
  Stack s;
  fixtures::RouteFault hang;
  hang.hang = true;
  hang.times = 1;
  s.engine->SetRouteFault("/v1/completions", hang);
  std::thread hung([&] {
    auto c = s.client();
    auto r = c.Post("/v1/completions", completion_body(false), "application/json");
    ASSERT_TRUE(r) << "no answer to the client the shutdown cancelled";
    EXPECT_EQ(r->status, 503) << r->body;
    EXPECT_NE(r->body.find("\"shutting_down\""), std::string::npos) << r->body;
    EXPECT_TRUE(r->has_header("Retry-After")) << r->body;
  });
  const auto wait_start = Clock::now();
  while (s.svc->metrics().proxy_in_flight.load() == 0 && ms_since(wait_start) < 5000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(s.svc->metrics().proxy_in_flight.load(), 1);
  constexpr std::uint64_t kGraceMs = 1000;
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const std::string r =
        raw_exchange(s.svc->port(), post_bytes("/v1/completions", completion_body(false)));
    EXPECT_EQ(status_of(r), 503) << r;
    EXPECT_NE(r.find("Retry-After: "), std::string::npos) << r;
  });
  const std::uint64_t aborted_before = s.svc->metrics().finishes_aborted.load();
  const auto t0 = Clock::now();
  const bool clean = s.svc->Shutdown(kGraceMs);
  const std::int64_t took_ms = ms_since(t0);
  EXPECT_FALSE(clean);
  EXPECT_GE(took_ms, static_cast<std::int64_t>(kGraceMs));
  EXPECT_LT(took_ms, static_cast<std::int64_t>(kGraceMs) + 3000);
  EXPECT_EQ(s.svc->metrics().finishes_aborted.load(), aborted_before + 1);
  EXPECT_EQ(s.svc->metrics().proxy_in_flight.load(), 0);
  late.join();
  hung.join();
  s.svc.reset();
}

// ---- a misbehaving engine's streams and statuses ----

// A Stack's tweak that puts `engine` in front of its double: serve calls `engine`, which passes
// what it does not script on to the double.
std::function<void(ServeConfig&)> Scripted(stack::ScriptedEngine& engine,
                                           std::function<void(ServeConfig&)> tweak = nullptr) {
  return [&engine, tweak = std::move(tweak)](ServeConfig& c) {
    engine.ForwardTo(c.engine_url);
    c.engine_url = engine.url();
    if (tweak) tweak(c);
  };
}

// One engine SSE event of a completion chunk: choice 0 with `text` and `token_ids`.
std::string CompletionEvent(const std::string& text, const json& token_ids) {
  const json chunk = {
      {"id", "cmpl-scripted"},
      {"object", "text_completion"},
      {"choices",
       {{{"index", 0}, {"text", text}, {"token_ids", token_ids}, {"prompt_token_ids", {1, 2}}}}}};
  return "data: " + chunk.dump();
}

// The engine answers a streamed 200 of exactly `bytes`, then ends its body.
stack::ScriptedEngine::Script SseBytes(std::string bytes) {
  return [bytes = std::move(bytes)](const httplib::Request&, httplib::Response& res) {
    res.set_chunked_content_provider("text/event-stream", [bytes](size_t, httplib::DataSink& sink) {
      sink.write(bytes.data(), bytes.size());
      sink.done();
      return true;
    });
  };
}

httplib::Result PostStream(httplib::Client& c, const std::string& rollout_id) {
  return c.Post("/v1/completions", {{"X-RolloutCore-Rollout-Id", rollout_id}},
                completion_body(true), "application/json");
}

std::size_t Occurrences(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

// What the journal holds of one rollout: its finish and choice 0's output token ids.
struct JournaledRollout {
  std::optional<RolloutFinished> finish;
  std::vector<std::int32_t> output_ids;
};

JournaledRollout JournaledRolloutOf(Service& svc, const std::string& rollout_id) {
  JournaledRollout out;
  const Status st = svc.journal().Scan(1, 0, [&](const journal::Record& rec) {
    const auto* f = std::get_if<RolloutFinished>(&rec.event);
    if (f != nullptr && f->rollout_id == rollout_id) out.finish = *f;
    const auto* t = std::get_if<TrajectoryRecorded>(&rec.event);
    if (t != nullptr && t->rollout_id == rollout_id) {
      out.output_ids.insert(out.output_ids.end(), t->output_token_ids.begin(),
                            t->output_token_ids.end());
    }
    return Status::OK();
  });
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

// The journal finished `rollout_id` aborted, and serve completed no rollout.
void ExpectAbortedAndNoneCompleted(Service& svc, const std::string& rollout_id) {
  const JournaledRollout j = JournaledRolloutOf(svc, rollout_id);
  ASSERT_TRUE(j.finish.has_value()) << rollout_id << " has no finish";
  EXPECT_EQ(j.finish->outcome, RolloutOutcome::kAborted);
  EXPECT_EQ(svc.metrics().finishes_completed.load(), 0u);
}

// Proves an engine stream whose last event (no blank line, no [DONE]) holds more token ids than
// the body budget has left is aborted with the budget's error event and [DONE], the refused event
// not relayed, as the same refusal mid-stream is. Catches the caller's stop at the stream's end
// counted as a complete stream: the rollout recorded completed on a cut trace, the client told
// [DONE] as if the engine had finished.
TEST(ProxyEngineStream, ALastEventOverTheBudgetAbortsAndIsNeverCompleted) {
  stack::ScriptedEngine engine;
  Stack s(Scripted(engine, WithBodyMemory(1 << 20)));
  json many = json::array();
  for (int i = 0; i < 40000; ++i) many.push_back(100 + i % 900);
  engine.Set("/v1/completions",
             SseBytes(CompletionEvent("before", {11}) + "\n\n" + CompletionEvent("last", many)));
  auto c = s.client();
  auto r = PostStream(c, "over-budget-1");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("body_memory_bytes_max"), std::string::npos) << r->body;
  EXPECT_EQ(r->body.find("\"last\""), std::string::npos) << "the refused event was relayed";
  EXPECT_EQ(Occurrences(r->body, "data: [DONE]"), 1u) << r->body;
  ExpectAbortedAndNoneCompleted(*s.svc, "over-budget-1");
}

// Proves a non-streamed engine answer too large for the fast reader (over 1 MiB) is held against
// the body budget before it is parsed: ~4 MiB of empty objects, whose tree would take well over the
// 64 MiB budget, is a 502 naming the budget and an aborted rollout. Catches the parsed tree held
// outside body_memory_bytes_max until the finish is durable (the answer was completed and relayed).
TEST(ProxyEngineAnswer, ALargeAnswersParsedTreeIsHeldAgainstTheBodyBudget) {
  stack::ScriptedEngine engine;
  Stack s(Scripted(engine, WithBodyMemory(64 << 20)));
  std::string pad = "[{}";
  while (pad.size() < (4u << 20)) pad += ",{}";
  pad += "]";
  const std::string answer =
      R"({"id":"cmpl-scripted","object":"text_completion","choices":[{"index":0,"text":"x",)"
      R"("token_ids":[11],"finish_reason":"length"}],"pad":)" +
      pad + "}";
  engine.Set("/v1/completions", [answer](const httplib::Request&, httplib::Response& res) {
    res.set_content(answer, "application/json");
  });
  auto c = s.client();
  auto r = c.Post("/v1/completions", {{"X-RolloutCore-Rollout-Id", "big-answer-1"}},
                  completion_body(false), "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 502) << r->body.substr(0, 300);
  EXPECT_NE(r->body.find("body_memory_bytes_max"), std::string::npos) << r->body.substr(0, 300);
  ExpectAbortedAndNoneCompleted(*s.svc, "big-answer-1");
}

// ---- answers waiting on a client that does not read ----

// Whether `done` holds within 10 s.
bool Within10s(const std::function<bool()>& done) {
  for (int i = 0; i < 1000 && !done(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

// The outcomes the journal's RolloutFinished records give `rollout_id`, in order.
std::vector<RolloutOutcome> OutcomesOf(Service& svc, const std::string& rollout_id) {
  std::vector<RolloutOutcome> out;
  const Status st = svc.journal().Scan(1, 0, [&](const journal::Record& rec) {
    const auto* f = std::get_if<RolloutFinished>(&rec.event);
    if (f != nullptr && f->rollout_id == rollout_id) out.push_back(f->outcome);
    return Status::OK();
  });
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

// Proves a completed answer stays held against the body budget while it waits on a client that
// does not read: 14 MiB of answer the client has not taken count in the budget once the rollout
// is finished; a second answer that no longer fits beside it is a 502 naming
// body_memory_bytes_max with its rollout finished aborted once; and when the stalled client
// leaves, the budget is back at its idle value and the same answer is served. Catches the answer
// dumped into the client's connection and charged no more (its exchange gone), so clients that
// ask for large answers and read nothing (up to 16 MiB each, on every connection allowed) hold
// memory far past the budget until serve is killed for it: the second answer was served.
TEST(ProxyEngineAnswer, AnAnswerAStalledClientHasNotTakenStaysHeld) {
  constexpr std::size_t kTextBytes = std::size_t{14} << 20;  // past any socket buffers
  stack::ScriptedEngine engine;
  // One answer's read and parse (~44 MiB: its body's buffer, up to 16 MiB, and the tree's bound)
  // fits; not beside another answer still held (14 MiB, in a buffer of up to twice that).
  Stack s(Scripted(engine, [](ServeConfig& c) { c.body_memory_bytes_max = 48u << 20; }));
  const std::string answer =
      R"({"id":"cmpl-scripted","object":"text_completion","choices":[{"index":0,"text":")" +
      std::string(kTextBytes, 'a') +
      R"(","token_ids":[11],"prompt_token_ids":[1,2],"finish_reason":"length"}]})";
  engine.Set("/v1/completions", [answer](const httplib::Request&, httplib::Response& res) {
    res.set_content(answer, "application/json");
  });
  const std::uint64_t idle = stack::BodyMemoryUsed(*s.svc);
  const int stalled = raw_http::send_from_small_window(
      s.svc->port(), post_bytes("/v1/completions", completion_body(false),
                                "X-RolloutCore-Rollout-Id: stalled-answer-1\r\n"));
  char head[64];
  const ssize_t began = ::recv(stalled, head, sizeof(head), 0);
  ASSERT_GT(began, 0) << "no answer began";
  EXPECT_EQ(status_of(std::string(head, static_cast<std::size_t>(began))), 200);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its exchange is gone by now
  EXPECT_EQ(OutcomesOf(*s.svc, "stalled-answer-1"),
            std::vector<RolloutOutcome>{RolloutOutcome::kCompleted});
  EXPECT_GE(stack::BodyMemoryUsed(*s.svc), idle + kTextBytes) << "the answer waiting is not held";

  auto c = s.client();
  auto refused = c.Post("/v1/completions", {{"X-RolloutCore-Rollout-Id", "refused-answer-1"}},
                        completion_body(false), "application/json");
  ASSERT_TRUE(refused) << httplib::to_string(refused.error());
  EXPECT_EQ(refused->status, 502) << refused->body.substr(0, 300);
  EXPECT_NE(refused->body.find("body_memory_bytes_max"), std::string::npos)
      << refused->body.substr(0, 300);
  EXPECT_EQ(OutcomesOf(*s.svc, "refused-answer-1"),
            std::vector<RolloutOutcome>{RolloutOutcome::kAborted});

  ::close(stalled);
  EXPECT_TRUE(Within10s([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }))
      << "held " << stack::BodyMemoryUsed(*s.svc) << " after the client left, " << idle << " idle";
  auto served = c.Post("/v1/completions", {{"X-RolloutCore-Rollout-Id", "served-answer-1"}},
                       completion_body(false), "application/json");
  ASSERT_TRUE(served) << httplib::to_string(served.error());
  EXPECT_EQ(served->status, 200) << served->body.substr(0, 300);
  EXPECT_GT(served->body.size(), kTextBytes);
  EXPECT_EQ(OutcomesOf(*s.svc, "served-answer-1"),
            std::vector<RolloutOutcome>{RolloutOutcome::kCompleted});
  EXPECT_TRUE(Within10s([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }));
}

// Proves a pass-through answer stays held against the body budget while it waits on a client
// that does not read (12 MiB of GET /v1/models), and goes back when the client leaves. Catches the
// answer's hold dying with the call once the answer is handed to the client's connection.
TEST(ProxyText, APassThroughAnswerAStalledClientHasNotTakenStaysHeld) {
  stack::ScriptedEngine engine;
  // A pass-through answer may take a quarter of the budget: 16 MiB.
  Stack s(Scripted(engine, [](ServeConfig& c) { c.body_memory_bytes_max = 64u << 20; }));
  const std::string models =
      R"({"object":"list","data":[{"id":")" + std::string(12u << 20, 'm') + R"("}]})";
  engine.Set("/v1/models", [models](const httplib::Request&, httplib::Response& res) {
    res.set_content(models, "application/json");
  });
  const std::uint64_t idle = stack::BodyMemoryUsed(*s.svc);
  const int stalled =
      raw_http::send_from_small_window(s.svc->port(), "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
  char head[64];
  ASSERT_GT(::recv(stalled, head, sizeof(head), 0), 0) << "no answer began";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the call is gone by now
  EXPECT_GE(stack::BodyMemoryUsed(*s.svc), idle + models.size())
      << "the answer waiting is not held";
  ::close(stalled);
  EXPECT_TRUE(Within10s([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }))
      << "held " << stack::BodyMemoryUsed(*s.svc) << " after the client left, " << idle << " idle";
}

// The engine's answer to a completion whose text is `text_bytes` long, with the token ids the
// proxy asks for (and strips from the client's answer).
std::string CompletionAnswer(std::size_t text_bytes) {
  return R"({"id":"cmpl-scripted","object":"text_completion","choices":[{"index":0,"text":")" +
         std::string(text_bytes, 'a') +
         R"(","token_ids":[11],"prompt_token_ids":[1,2],"finish_reason":"length"}]})";
}

// The client's answer to completion_body(false) made of the engine's `answer` over 1 MiB as serve
// makes it (parsed, the proxy's fields stripped, dumped): the same text in a buffer grown by the
// same appends, so of the same capacity.
std::string ClientAnswerOf(const std::string& answer) {
  json request = json::parse(completion_body(false));
  const AddedFields added = AddTraceFields(ProxyRoute::kCompletions, false, request);
  json doc = json::parse(answer);
  StripAdded(doc, added);
  return DumpSafe(doc);
}

// Proves a completed answer waiting on a client that does not read is held as allocated, not by
// its length: an answer sized just past a step of its buffer's doubling (its dump's buffer is
// about twice its length) holds its whole buffer until the client has read it, and the client
// then reads exactly that text and the budget is back at its idle value. Catches an answer charged
// its length while the buffer that waits on the client for up to write_timeout_ms is up to twice
// that (the budget short by up to 16 MiB per stalled connection).
TEST(ProxyEngineAnswer, AnAnswerAStalledClientHasNotTakenIsHeldAsAllocated) {
  // A dump grows its string by doubling from a capacity its first bytes set, the same for any
  // text length (a 1 MiB probe's capacity is one of its steps): an answer a quarter past a step
  // of at least 8 MiB sits in a buffer of the next step, 1.6 times its length. Past any socket
  // buffers.
  const std::string probe = ClientAnswerOf(CompletionAnswer(1 << 20));
  std::size_t step = 4 * probe.capacity();
  while (step < (std::size_t{8} << 20)) step *= 2;
  const std::size_t text_bytes = (std::size_t{1} << 20) + step + step / 4 - probe.size();
  const std::string answer = CompletionAnswer(text_bytes);
  ASSERT_LT(answer.size(), effects::kResponseBytesMax);
  const std::string expected = ClientAnswerOf(answer);
  ASSERT_GT(expected.capacity(), expected.size() + expected.size() / 2)
      << "size " << expected.size() << ", capacity " << expected.capacity();

  stack::ScriptedEngine engine;
  Stack s(Scripted(engine));
  engine.Set("/v1/completions", [answer](const httplib::Request&, httplib::Response& res) {
    res.set_content(answer, "application/json");
  });
  const std::uint64_t idle = stack::BodyMemoryUsed(*s.svc);
  const int stalled = raw_http::send_from_small_window(
      s.svc->port(),
      post_bytes("/v1/completions", completion_body(false),
                 "X-RolloutCore-Rollout-Id: allocated-answer-1\r\nConnection: close\r\n"));
  char head[64];
  const ssize_t began = ::recv(stalled, head, sizeof(head), 0);
  ASSERT_GT(began, 0) << "no answer began";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its exchange is gone by now
  EXPECT_GE(stack::BodyMemoryUsed(*s.svc), idle + expected.capacity())
      << "an answer of " << expected.size() << " bytes in a buffer of " << expected.capacity()
      << " is held short of its buffer";

  int wide = 4 << 20;
  ::setsockopt(stalled, SOL_SOCKET, SO_RCVBUF, &wide, sizeof(wide));
  const std::string got =
      std::string(head, static_cast<std::size_t>(began)) + raw_http::read_to_close(stalled);
  ::close(stalled);
  EXPECT_EQ(status_of(got), 200) << got.substr(0, 300);
  EXPECT_TRUE(body_of(got) == expected)
      << "the client's answer is not the text measured (" << body_of(got).size()
      << " bytes, expected " << expected.size() << ")";
  EXPECT_EQ(OutcomesOf(*s.svc, "allocated-answer-1"),
            std::vector<RolloutOutcome>{RolloutOutcome::kCompleted});
  EXPECT_TRUE(Within10s([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }))
      << "held " << stack::BodyMemoryUsed(*s.svc) << " after the answer was read, " << idle
      << " idle";
}

// ---- the pass-through's deadline ----

// A TCP front for the loopback port `target_port` whose accepting the test shuts: shut, its
// accept queue is cut to one place and taken by a connection of its own, so a connect to it is
// dropped and waits for the kernel's retry (a second on), as one to a slow or overloaded engine
// host does. Open, it relays each connection it accepts to the port behind it.
class TcpGate {
 public:
  explicit TcpGate(int target_port) : target_port_(target_port) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    RC_CHECK(listen_fd_ >= 0);
    sockaddr_in a = Loopback(0);
    RC_CHECK(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    RC_CHECK(::listen(listen_fd_, kOpenBacklog) == 0);
    socklen_t len = sizeof(a);
    RC_CHECK(::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }
  ~TcpGate() {
    stop_ = true;
    acceptor_.join();
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);  // each relay's reads end
    for (std::thread& t : relays_) t.join();
    for (int fd : fds_) ::close(fd);
    if (filler_ >= 0) ::close(filler_);
    ::close(listen_fd_);
  }
  TcpGate(const TcpGate&) = delete;
  TcpGate& operator=(const TcpGate&) = delete;

  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  // Stops accepting and fills the accept queue: connects from here on are dropped until Open.
  // False when a connect still completes at once (a network stack that queues past the backlog).
  [[nodiscard]] bool Shut() {
    idle_ = false;
    shut_ = true;
    for (int i = 0; i < 2000 && !idle_.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    RC_CHECK(idle_.load());
    RC_CHECK(::listen(listen_fd_, 0) == 0);  // a queue of one place
    filler_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    RC_CHECK(filler_ >= 0);
    sockaddr_in a = Loopback(port_);
    (void)::connect(filler_, reinterpret_cast<sockaddr*>(&a), sizeof(a));  // queued (in progress)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int probe = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    RC_CHECK(probe >= 0);
    (void)::connect(probe, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    pollfd p{probe, POLLOUT, 0};
    const bool waits = ::poll(&p, 1, 200) == 0;
    ::close(probe);
    return waits;
  }
  void Open() {
    RC_CHECK(::listen(listen_fd_, kOpenBacklog) == 0);
    shut_ = false;
  }
  // Connections accepted and relayed so far (Shut's own among them once open again).
  int accepted() const { return accepted_.load(); }

 private:
  static constexpr int kOpenBacklog = 128;  // bursts of connects are never dropped while open

  static sockaddr_in Loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
  }
  // Only this thread adds to fds_ and relays_ (the destructor reads them once it has ended).
  void AcceptLoop() {
    while (!stop_.load()) {
      if (shut_.load()) {
        idle_ = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 5) <= 0) continue;
      const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) continue;
      const int upstream = connect_loopback(target_port_);
      accepted_++;
      fds_.push_back(client);
      fds_.push_back(upstream);
      relays_.emplace_back(&TcpGate::Relay, client, upstream);
      relays_.emplace_back(&TcpGate::Relay, upstream, client);
    }
  }
  // One direction of a connection, until its end (or the upstream's 30 s without a byte).
  static void Relay(int from, int to) {
    char buf[16 << 10];
    for (ssize_t n; (n = ::recv(from, buf, sizeof(buf), 0)) > 0;) {
      if (!raw_http::send_all(to, std::string(buf, static_cast<std::size_t>(n)))) break;
    }
    ::shutdown(to, SHUT_WR);
  }

  const int target_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  int filler_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<bool> shut_{false};
  std::atomic<bool> idle_{false};  // shut, and the acceptor took its last connection
  std::atomic<int> accepted_{0};
  std::thread acceptor_;
  std::vector<int> fds_;
  std::vector<std::thread> relays_;
};

int PortOf(const std::string& url) { return std::atoi(url.substr(url.rfind(':') + 1).c_str()); }

// Proves a pass-through call whose connect outlasts call_timeout_ms (configured below
// connect_timeout_ms, which the config allows) is answered at its deadline, long before the
// connect ends, with the same 502 naming call_timeout_ms as any pass-through timeout; that the
// connection arriving later is never used to send the request; and that the route serves again
// once connects are prompt. Catches the client's answer waiting for the connect (up to
// connect_timeout_ms; here until the gate opens, 2.5 s on) with only a flag set at the deadline,
// and the request sent on the late connection (the engine then held the client past the deadline).
TEST(ProxyPassThrough, ADeadlinePassedDuringTheConnectAnswersTheCallAtTheDeadline) {
  stack::ScriptedEngine engine;
  TcpGate gate(PortOf(engine.url()));
  Stack s([&](ServeConfig& c) {
    engine.ForwardTo(c.engine_url);
    c.engine_url = gate.url();
    c.call_timeout_ms = 500;
    c.connect_timeout_ms = 8000;
  });
  std::atomic<int> reached{0};
  engine.Set("/v1/models", [&](const httplib::Request&, httplib::Response& res) {
    reached++;
    engine.Hold();  // accepts and never answers (10 s at most, or until released)
    res.set_content(R"({"data":[]})", "application/json");
  });
  if (!gate.Shut()) GTEST_SKIP() << "this network stack completes connects past a full backlog";
  // Opened once the client has its answer, or 2.5 s on (a call that waits for its connect gets
  // it at the kernel's next retry then, 3 s on): the dropped connect arrives past the deadline.
  std::atomic<bool> answered{false};
  std::thread opener([&] {
    for (int i = 0; i < 500 && !answered.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    gate.Open();
  });
  auto c = s.client();
  const auto t0 = Clock::now();
  auto r = c.Get("/v1/models");
  const std::int64_t waited_ms = ms_since(t0);
  answered = true;
  opener.join();
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 502) << r->body;
  EXPECT_NE(r->body.find("call_timeout_ms (500 ms)"), std::string::npos) << r->body;
  EXPECT_LT(waited_ms, 2000) << "the answer waited for the connect, past the 500 ms deadline";
  // The late connection arrives (the gate accepts it after its own queued one), and nothing is
  // sent on it.
  for (int i = 0; i < 1000 && gate.accepted() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(gate.accepted(), 2) << "the late connect never arrived";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  engine.Release();
  EXPECT_EQ(reached.load(), 0) << "the request was sent past the call's deadline";

  engine.Clear("/v1/models");
  auto ok = c.Get("/v1/models");
  ASSERT_TRUE(ok) << httplib::to_string(ok.error());
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// A pass-through's share of the budget below: 8 MiB of budget, so an answer may take 2 MiB; bodies
// of up to 1 MiB.
constexpr std::uint64_t kPassBudgetBytes = std::uint64_t{8} << 20;
constexpr std::uint64_t kPassBodyBytesMax = std::uint64_t{1} << 20;
constexpr std::uint64_t kPassAnswerBoundBytes = kPassBudgetBytes / 4;

std::function<void(ServeConfig&)> PassBudget() {
  return [](ServeConfig& c) {
    c.body_bytes_max = kPassBodyBytesMax;
    c.body_memory_bytes_max = kPassBudgetBytes;
  };
}

// Connections whose heads declare bodies never sent, holding `bytes` of serve's body budget
// between them (kPassBodyBytesMax each at most) until they are closed; waits until it holds them.
std::vector<int> SpendBodyBudget(Service& svc, std::uint64_t bytes) {
  const std::uint64_t before = stack::BodyMemoryUsed(svc);
  std::vector<int> fds;
  for (std::uint64_t left = bytes; left > 0;) {
    const std::uint64_t n = std::min(left, kPassBodyBytesMax);
    fds.push_back(connect_loopback(svc.port()));
    EXPECT_TRUE(raw_http::send_all(fds.back(),
                                   "POST /v1/rollouts HTTP/1.1\r\nHost: x\r\n"
                                   "Content-Length: " +
                                       std::to_string(n) + "\r\n\r\n"));
    left -= n;
  }
  EXPECT_TRUE(Within10s([&] { return stack::BodyMemoryUsed(svc) == before + bytes; }))
      << "held " << stack::BodyMemoryUsed(svc) << ", " << before << " before";
  return fds;
}

void CloseAll(const std::vector<int>& fds) {
  for (int fd : fds) ::close(fd);
}

// Proves a pass-through POST's copy of the client's body (what it sends the engine) is held
// against the body budget before it is made: with room left for the client's 600 KiB body but
// not for a second copy, /tokenize is a 503 naming body_memory_bytes_max and never reaches the
// engine; once the budget is free it is served, the copy given back once sent (while the engine
// works, only the client's own body is held), and all of it after. Catches the copy made outside
// the budget: every connection could double its body (up to body_bytes_max) uncharged.
TEST(ProxyPassThrough, ThePostsCopyOfTheClientsBodyIsHeld) {
  constexpr std::uint64_t kBodyBytes = 600 << 10;
  std::atomic<int> reached{0};
  std::atomic<bool> working{false};
  std::atomic<bool> finish{false};
  stack::ScriptedEngine engine;
  Stack s(Scripted(engine, PassBudget()));
  engine.Set("/tokenize", [&](const httplib::Request& req, httplib::Response& res) {
    reached++;
    working = true;
    for (int i = 0; i < 1000 && !finish.load(); ++i) {  // 10 s at most: never a hang
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    res.set_content(R"({"count":)" + std::to_string(req.body.size()) + "}", "application/json");
  });
  const std::string body =
      json{{"model", "rc-double-model"}, {"prompt", std::string(kBodyBytes - 64, 't')}}.dump();
  ASSERT_LE(body.size(), kBodyBytes);
  const std::uint64_t idle = stack::BodyMemoryUsed(*s.svc);
  const std::vector<int> spent =
      SpendBodyBudget(*s.svc, kPassBudgetBytes - idle - kBodyBytes - kBodyBytes / 2);
  auto c = s.client();
  finish = true;  // a request that reaches the engine now is answered at once
  auto refused = c.Post("/tokenize", body, "application/json");
  ASSERT_TRUE(refused) << httplib::to_string(refused.error());
  EXPECT_EQ(refused->status, 503) << refused->body.substr(0, 300);
  EXPECT_NE(refused->body.find("body_memory_bytes_max"), std::string::npos)
      << refused->body.substr(0, 300);
  EXPECT_EQ(reached.load(), 0) << "the copy the budget could not hold was sent to the engine";
  CloseAll(spent);
  ASSERT_TRUE(Within10s([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }));

  finish = false;
  std::optional<httplib::Result> served;
  std::thread caller([&] {
    auto c2 = s.client();
    served.emplace(c2.Post("/tokenize", body, "application/json"));
  });
  ASSERT_TRUE(Within10s([&] { return working.load(); })) << "the call never reached the engine";
  EXPECT_TRUE(Within10s([&] { return stack::BodyMemoryUsed(*s.svc) == idle + body.size(); }))
      << "held " << stack::BodyMemoryUsed(*s.svc) - idle << " while the engine works, for a "
      << body.size() << "-byte body sent";
  finish = true;
  caller.join();
  ASSERT_TRUE(served && *served) << (served ? httplib::to_string(served->error()) : "no call");
  EXPECT_EQ((*served)->status, 200) << (*served)->body.substr(0, 300);
  EXPECT_EQ((*served)->body, R"({"count":)" + std::to_string(body.size()) + "}");
  EXPECT_EQ(reached.load(), 1);
  EXPECT_TRUE(Within10s([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }))
      << "held " << stack::BodyMemoryUsed(*s.svc) << " after the call, " << idle << " idle";
}

// The engine's answer to GET /v1/models: a JSON list `bytes` long, sent chunked (no length) 64 KiB
// a write; while `hold_after` is set, the first `hold_after` bytes go out and the rest waits until
// `released` (10 s at most).
stack::ScriptedEngine::Script ChunkedModels(std::string answer, std::uint64_t hold_after,
                                            std::atomic<bool>& released) {
  return [answer = std::move(answer), hold_after, &released](const httplib::Request&,
                                                             httplib::Response& res) {
    res.set_chunked_content_provider(
        "application/json",
        [answer, hold_after, &released](size_t offset, httplib::DataSink& sink) {
          if (offset >= answer.size()) {
            sink.done();
            return true;
          }
          if (hold_after > 0 && offset >= hold_after) {
            for (int i = 0; i < 1000 && !released.load(); ++i) {
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
            }
          }
          std::size_t n = std::min<std::size_t>(64 << 10, answer.size() - offset);
          if (hold_after > offset) n = std::min<std::size_t>(n, hold_after - offset);
          return sink.write(answer.data() + offset, n);
        });
  };
}

// A /v1/models answer exactly `bytes` long.
std::string ModelsOf(std::size_t bytes) {
  const std::string head = R"({"object":"list","data":[{"id":")";
  const std::string tail = R"("}]})";
  return head + std::string(bytes - head.size() - tail.size(), 'm') + tail;
}

// Proves a pass-through answer of undeclared length (chunked) is held as its buffer grows, not
// past it: with 256 KiB of it received and the rest held back by the engine, the budget holds at
// least those bytes and at most twice them and one read's room (kUpstreamBufferBytesMax), where
// the answer's whole share (2 MiB) was taken up front; the answer, just under its share, is
// served whole, also with only its share of the budget left (its buffer never grows past it), and
// is a 502 naming body_memory_bytes_max with half of that left. Catches the buffer grown by the
// parser's own appends while only the share was held: doubling took it past the share, uncharged
// until the read ended.
TEST(ProxyPassThrough, AnAnswerOfUndeclaredLengthIsHeldAsItsBufferGrows) {
  constexpr std::uint64_t kFirstBytes = 256 << 10;
  const std::string models = ModelsOf(kPassAnswerBoundBytes - (4 << 10));
  std::atomic<bool> released{false};
  stack::ScriptedEngine engine;
  Stack s(Scripted(engine, PassBudget()));
  engine.Set("/v1/models", ChunkedModels(models, kFirstBytes, released));
  const std::uint64_t idle = stack::BodyMemoryUsed(*s.svc);
  const auto held = [&] { return stack::BodyMemoryUsed(*s.svc) - idle; };
  std::optional<httplib::Result> first;
  std::thread caller([&] {
    auto c = s.client();
    first.emplace(c.Get("/v1/models"));
  });
  EXPECT_TRUE(Within10s([&] { return held() >= kFirstBytes; })) << "held " << held();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // serve read what was sent
  EXPECT_GE(held(), kFirstBytes);
  EXPECT_LE(held(), 2 * (kFirstBytes + kUpstreamBufferBytesMax))
      << "held " << held() << " for " << kFirstBytes << " bytes received";
  released = true;
  caller.join();
  ASSERT_TRUE(first && *first) << (first ? httplib::to_string(first->error()) : "no call");
  EXPECT_EQ((*first)->status, 200) << (*first)->body.substr(0, 300);
  EXPECT_TRUE((*first)->body == models) << (*first)->body.size() << " bytes of " << models.size();
  ASSERT_TRUE(Within10s([&] { return held() == 0; })) << "held " << held() << " after the call";

  engine.Set("/v1/models", ChunkedModels(models, 0, released));
  auto c = s.client();
  std::vector<int> spent = SpendBodyBudget(*s.svc, kPassBudgetBytes - idle - kPassAnswerBoundBytes);
  auto at_share = c.Get("/v1/models");
  ASSERT_TRUE(at_share) << httplib::to_string(at_share.error());
  EXPECT_EQ(at_share->status, 200) << at_share->body.substr(0, 300);
  EXPECT_EQ(at_share->body.size(), models.size());
  const std::vector<int> more = SpendBodyBudget(*s.svc, kPassAnswerBoundBytes / 2);
  auto refused = c.Get("/v1/models");
  ASSERT_TRUE(refused) << httplib::to_string(refused.error());
  EXPECT_EQ(refused->status, 502) << refused->body.substr(0, 300);
  EXPECT_NE(refused->body.find("body_memory_bytes_max"), std::string::npos)
      << refused->body.substr(0, 300);
  CloseAll(spent);
  CloseAll(more);
  EXPECT_TRUE(Within10s([&] { return held() == 0; })) << "held " << held() << " at the end";
}

// Proves the prompt token ids an engine sends back on a completion count toward the trace's share
// of the body budget: one chunk carrying ~400,000 of them (12.8 MB held), under a budget with room
// for the chunk's parse and 4 MiB more, ends with the trace's over-budget error event, [DONE], and
// an aborted rollout. Catches prompt ids copied into the trace uncharged (only generate's were):
// the stream completed.
TEST(ProxyEngineStream, PromptIdsTheEngineSendsAreHeldAgainstTheBodyBudget) {
  stack::ScriptedEngine engine;
  json prompt = json::array();
  for (int i = 0; i < 400000; ++i) prompt.push_back(100 + i % 900);
  const json chunk = {
      {"id", "cmpl-scripted"},
      {"object", "text_completion"},
      {"choices",
       {{{"index", 0}, {"text", "a"}, {"token_ids", {11}}, {"prompt_token_ids", prompt}}}}};
  // The event's parse is held while the trace takes its ids: the budget fits the one, not both.
  Stack s(Scripted(engine, WithBodyMemory(StreamEventBytesBound(chunk.dump()) + (4 << 20))));
  engine.Set("/v1/completions", SseBytes("data: " + chunk.dump() + "\n\ndata: [DONE]\n\n"));
  auto c = s.client();
  auto r = PostStream(c, "prompt-ids-1");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("trace would take more of serve's memory budget"), std::string::npos)
      << r->body.substr(0, 300);
  EXPECT_EQ(Occurrences(r->body, "data: [DONE]"), 1u) << r->body.substr(0, 300);
  ExpectAbortedAndNoneCompleted(*s.svc, "prompt-ids-1");
}

// Proves nothing an engine sends after `data: [DONE]` reaches the client or the trajectory, that
// the stream still completes, and that the next rollout is served as usual. Catches events after
// [DONE] relayed (the client saw an event after the engine's end, then the proxy's [DONE]) and
// recorded (the journaled trajectory held a token the engine never counted).
TEST(ProxyEngineStream, EventsAfterDoneAreNeitherRelayedNorRecorded) {
  stack::ScriptedEngine engine;
  Stack s(Scripted(engine));
  engine.Set("/v1/completions",
             SseBytes(CompletionEvent("before", {11}) + "\n\ndata: [DONE]\n\n" +
                      CompletionEvent("after-done", {22}) + "\n\n" + "data: not json\n\n"));
  auto c = s.client();
  auto r = PostStream(c, "after-done-1");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("\"before\""), std::string::npos) << r->body;
  EXPECT_EQ(r->body.find("after-done"), std::string::npos) << r->body;
  EXPECT_EQ(r->body.find("\"error\""), std::string::npos) << r->body;
  EXPECT_EQ(Occurrences(r->body, "data: [DONE]"), 1u) << r->body;
  const JournaledRollout j = JournaledRolloutOf(*s.svc, "after-done-1");
  ASSERT_TRUE(j.finish.has_value());
  EXPECT_EQ(j.finish->outcome, RolloutOutcome::kCompleted);
  EXPECT_EQ(j.finish->completion_tokens, 1u);
  EXPECT_EQ(j.output_ids, std::vector<std::int32_t>{11});
  engine.Clear("/v1/completions");  // the double answers the next one
  auto next = PostStream(c, "after-done-2");
  ASSERT_TRUE(next) << httplib::to_string(next.error());
  EXPECT_NE(next->body.find("data: [DONE]"), std::string::npos) << next->body;
  EXPECT_EQ(next->body.find("\"error\""), std::string::npos) << next->body;
  EXPECT_EQ(s.svc->metrics().finishes_completed.load(), 2u);
}

// Proves only engine errors (400..599) reach a client as the engine's status: a 302, a 304 or a
// 999 is a 502 naming the engine's status, on a non-streamed and a streamed completion and on a
// pass-through route, while a 404 and a 503 still pass with the engine's body. Catches engine
// statuses passed straight on: a 302 without Location, a 304 to a POST, "999 <unknown-status>".
TEST(ProxyEngineStatus, OnlyEngineErrorsArePassedOnAndAnyOtherStatusIsA502) {
  Stack s;
  auto c = s.client();
  const auto fault = [&](const char* path, int status) {
    fixtures::RouteFault f;
    f.status = status;
    f.times = 1;
    s.engine->SetRouteFault(path, f);
  };
  for (int status : {302, 304, 999}) {
    const std::string named = "HTTP " + std::to_string(status);
    fault("/v1/completions", status);
    auto plain = c.Post("/v1/completions", completion_body(false), "application/json");
    ASSERT_TRUE(plain) << status;
    EXPECT_EQ(plain->status, 502) << status << ": " << plain->body;
    EXPECT_NE(plain->body.find(named), std::string::npos) << plain->body;
    EXPECT_TRUE(plain->has_header("X-RolloutCore-Rollout-Id"));
    fault("/v1/completions", status);
    auto streamed = c.Post("/v1/completions", completion_body(true), "application/json");
    ASSERT_TRUE(streamed) << status;
    EXPECT_NE(streamed->body.find("\"code\":502"), std::string::npos) << streamed->body;
    EXPECT_NE(streamed->body.find(named), std::string::npos) << streamed->body;
    fault("/v1/models", status);
    auto models = c.Get("/v1/models");
    ASSERT_TRUE(models) << status;
    EXPECT_EQ(models->status, 502) << status << ": " << models->body;
    EXPECT_NE(models->body.find(named), std::string::npos) << models->body;
  }
  for (int status : {404, 503}) {
    fault("/v1/completions", status);
    auto plain = c.Post("/v1/completions", completion_body(false), "application/json");
    ASSERT_TRUE(plain) << status;
    EXPECT_EQ(plain->status, status) << plain->body;
    EXPECT_NE(plain->body.find("vllm-double injected fault"), std::string::npos) << plain->body;
    fault("/v1/models", status);
    auto models = c.Get("/v1/models");
    ASSERT_TRUE(models) << status;
    EXPECT_EQ(models->status, status) << models->body;
  }
  EXPECT_EQ(s.svc->metrics().proxy_in_flight.load(), 0);
}

// The engine answers 200 with `fields` ("Name: value" pairs) in its head beside its own, and
// `body` as `type`.
stack::ScriptedEngine::Script AnswerWithFields(
    std::vector<std::pair<std::string, std::string>> fields, std::string body, std::string type) {
  return [fields = std::move(fields), body = std::move(body), type = std::move(type)](
             const httplib::Request&, httplib::Response& res) {
    for (const auto& [name, value] : fields) res.headers.emplace(name, value);
    res.set_content(body, type.c_str());
  };
}

// `n` fields "X-Engine-<i>: vvv..." of `value_bytes` value bytes each.
std::vector<std::pair<std::string, std::string>> EngineFields(std::size_t n,
                                                              std::size_t value_bytes) {
  std::vector<std::pair<std::string, std::string>> out;
  for (std::size_t i = 0; i < n; ++i) {
    out.emplace_back("X-Engine-" + std::to_string(i), std::string(value_bytes, 'v'));
  }
  return out;
}

// Proves an engine answer whose head passes a bound ends the exchange as an engine protocol error:
// a head of 20 fields of 3,700 bytes (about 74 KiB: past kUpstreamHeadBytesMax, under the field
// bound) and one of 200 one-byte fields (past kHeaderFieldsMax, about 3 KiB) are each a 502 naming
// the bound on a non-streamed completion, an error event with code 502 on a streamed one (both
// rollouts finished aborted, nothing journaled completed), and a 502 on a pass-through route;
// a head of 60 fields of 900 bytes (under both) is served, and so is everything once the engine
// behaves. Catches engine heads read by async_read_header, whose limit counts only the bytes one
// parse has not consumed (the 74 KiB head, read 8 KiB at a time, passed it) and which bounds no
// field count (18,000 fields, 1.5 MB of parser nodes held for a whole answer, passed).
TEST(ProxyEngineHead, AnEngineHeadPastItsBoundsIsAnEngineError) {
  stack::ScriptedEngine engine;
  Stack s(Scripted(engine));
  auto c = s.client();
  const std::string completion =
      R"({"id":"c","object":"text_completion","choices":[{"index":0,"text":"a","token_ids":[7],)"
      R"("finish_reason":"length"}],"prompt_token_ids":[1,2],)"
      R"("usage":{"prompt_tokens":2,"completion_tokens":1}})";
  const std::vector<std::pair<std::vector<std::pair<std::string, std::string>>, std::string>>
      refused = {{EngineFields(20, 3700), "response head exceeds 65536 bytes"},
                 {EngineFields(200, 1), "response head has more than 100 fields"}};
  int n = 0;
  for (const auto& [fields, why] : refused) {
    engine.Set("/v1/completions", AnswerWithFields(fields, completion, "application/json"));
    const std::string plain_id = "engine-head-" + std::to_string(n++);
    auto plain = c.Post("/v1/completions", {{"X-RolloutCore-Rollout-Id", plain_id}},
                        completion_body(false), "application/json");
    ASSERT_TRUE(plain) << why;
    EXPECT_EQ(plain->status, 502) << why << ": " << plain->body;
    EXPECT_NE(plain->body.find(why), std::string::npos) << plain->body;
    engine.Set("/v1/completions",
               AnswerWithFields(fields, "data: [DONE]\n\n", "text/event-stream"));
    const std::string stream_id = "engine-head-" + std::to_string(n++);
    auto streamed = PostStream(c, stream_id);
    ASSERT_TRUE(streamed) << why;
    EXPECT_NE(streamed->body.find("\"code\":502"), std::string::npos) << streamed->body;
    EXPECT_NE(streamed->body.find(why), std::string::npos) << streamed->body;
    for (const std::string& id : {plain_id, stream_id}) {
      const JournaledRollout j = JournaledRolloutOf(*s.svc, id);
      ASSERT_TRUE(j.finish.has_value()) << id;
      EXPECT_EQ(j.finish->outcome, RolloutOutcome::kAborted) << id;
    }
    engine.Set("/v1/models", AnswerWithFields(fields, R"({"data":[]})", "application/json"));
    auto models = c.Get("/v1/models");
    ASSERT_TRUE(models) << why;
    EXPECT_EQ(models->status, 502) << why << ": " << models->body;
    EXPECT_NE(models->body.find(why), std::string::npos) << models->body;
  }
  EXPECT_EQ(s.svc->metrics().finishes_completed.load(), 0u);

  const auto within = EngineFields(60, 900);
  engine.Set("/v1/completions", AnswerWithFields(within, completion, "application/json"));
  engine.Set("/v1/models", AnswerWithFields(within, R"({"data":[]})", "application/json"));
  auto served = c.Post("/v1/completions", completion_body(false), "application/json");
  ASSERT_TRUE(served);
  EXPECT_EQ(served->status, 200) << served->body;
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(models->status, 200) << models->body;
  engine.Clear("/v1/completions");
  engine.Clear("/v1/models");
  auto next = c.Post("/v1/completions", completion_body(false), "application/json");
  ASSERT_TRUE(next);
  EXPECT_EQ(next->status, 200) << next->body;
  EXPECT_EQ(s.svc->metrics().finishes_completed.load(), 2u);
}

// The trajectory lines of the rollouts `svc` finished, by rollout id, once the file writer has
// written them.
std::map<std::string, json> TrajectoryLines(Stack& s) {
  std::map<std::string, json> out;
  EXPECT_TRUE(s.svc->DrainTrajectories(10000));
  std::ifstream file(s.Config().journal_path + ".trajectories.jsonl");
  for (std::string line; std::getline(file, line);) {
    json doc = json::parse(line, nullptr, false);
    if (!doc.is_object()) continue;
    const std::string id = doc.value("rollout_id", "");  // read before the move below
    out[id] = std::move(doc);
  }
  return out;
}

// Proves a completion whose `n` is 2 in a form vLLM's lax reading of an int takes (2.0, "2",
// " 2 ", 2e0, "2.0") is admitted and reaches the engine as the JSON integer 2, and its trace
// records the engine's two choices (both in the trajectory line, both counted in the journal's
// finish), as n 2 is. Catches such a request refused 400 (vLLM serves it, and Python clients that
// compute n send 2.0), and the body forwarded in the client's form, so that the engine's count of
// choices would be its own reading of the text and not the value the trace was bounded by.
TEST(ProxyText, AnNInAFormVllmReadsIsSentToTheEngineAsThatInteger) {
  stack::ScriptedEngine engine;
  Stack s(Scripted(engine));
  std::mutex mu;
  std::vector<std::string> received;  // the bodies the engine was sent
  engine.Set("/v1/completions", [&](const httplib::Request& req, httplib::Response& res) {
    {
      std::lock_guard<std::mutex> g(mu);
      received.push_back(req.body);
    }
    res.set_content(
        R"({"id":"c","object":"text_completion","model":"rc-double-model","choices":[)"
        R"({"index":0,"text":"a","token_ids":[7],"finish_reason":"length"},)"
        R"({"index":1,"text":"b","token_ids":[8],"finish_reason":"length"}],)"
        R"("prompt_token_ids":[1,2],"usage":{"prompt_tokens":2,"completion_tokens":2}})",
        "application/json");
  });
  const std::vector<std::string> forms = {"2", "2.0", "\"2\"", "\" 2 \"", "2e0", "\"2.0\""};
  auto c = s.client();
  for (std::size_t i = 0; i < forms.size(); ++i) {
    const std::string body =
        R"({"model":"rc-double-model","prompt":"hi","max_tokens":2,"n":)" + forms[i] + "}";
    auto r = c.Post("/v1/completions", {{"X-RolloutCore-Rollout-Id", "lax-n-" + std::to_string(i)}},
                    body, "application/json");
    ASSERT_TRUE(r) << forms[i];
    EXPECT_EQ(r->status, 200) << forms[i] << ": " << r->body;
    const json answer = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(answer.is_object()) << r->body;
    EXPECT_EQ(answer.value("choices", json::array()).size(), 2u) << r->body;
  }
  {
    std::lock_guard<std::mutex> g(mu);
    ASSERT_EQ(received.size(), forms.size());
    for (std::size_t i = 0; i < forms.size(); ++i) {
      const json sent = json::parse(received[i], nullptr, false);
      ASSERT_TRUE(sent.is_object()) << received[i];
      const json n = sent.value("n", json());
      EXPECT_TRUE(n.is_number_integer()) << forms[i] << " sent as " << received[i];
      EXPECT_EQ(n, 2) << forms[i] << " sent as " << received[i];
    }
  }
  const std::map<std::string, json> lines = TrajectoryLines(s);
  for (std::size_t i = 0; i < forms.size(); ++i) {
    const std::string id = "lax-n-" + std::to_string(i);
    ASSERT_EQ(lines.count(id), 1u) << forms[i];
    const json outputs = lines.at(id).value("outputs", json::array());
    ASSERT_EQ(outputs.size(), 2u) << forms[i] << ": " << lines.at(id);
    EXPECT_EQ(outputs[0]["token_ids"], json::parse("[7]")) << forms[i];
    EXPECT_EQ(outputs[1]["index"], 1) << forms[i];
    EXPECT_EQ(outputs[1]["token_ids"], json::parse("[8]")) << forms[i];
    const JournaledRollout j = JournaledRolloutOf(*s.svc, id);
    ASSERT_TRUE(j.finish.has_value()) << id;
    EXPECT_EQ(j.finish->outcome, RolloutOutcome::kCompleted) << id;
    EXPECT_EQ(j.finish->completion_tokens, 2u) << id;
  }
}

// Reads from `fd` into `out` until it holds `marker` (true), or the peer closes or 30 s pass.
bool ReadUntil(int fd, const std::string& marker, std::string& out) {
  timeval tv{30, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  while (out.find(marker) == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return false;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return true;
}

// The body of a raw HTTP/1.1 response in chunked framing: its chunks joined, up to the last one
// that arrived whole.
std::string ChunkedBody(const std::string& response) {
  std::size_t at = response.find("\r\n\r\n");
  if (at == std::string::npos) return "";
  at += 4;
  std::string body;
  for (;;) {
    const std::size_t eol = response.find("\r\n", at);
    if (eol == std::string::npos) return body;
    const std::size_t size = std::strtoul(response.substr(at, eol - at).c_str(), nullptr, 16);
    if (size == 0 || eol + 2 + size > response.size()) return body;
    body += response.substr(eol + 2, size);
    at = eol + 2 + size + 2;
  }
}

// Proves a streamed rollout the shutdown cancels at its grace's end, its client still connected
// and reading, ends with an error event of type shutting_down and then `data: [DONE]`, and is
// recorded aborted. Catches the streamed branch of the cancel's answer cutting the stream
// without telling the client (or telling it the engine failed), and a cancelled stream left
// unfinished.
TEST(ProxyShutdown, AStreamCancelledAtTheGracesEndIsToldShuttingDownThenDone) {
  stack::ScriptedEngine engine;
  Stack s(Scripted(engine));
  engine.Set("/v1/completions", [&engine](const httplib::Request&, httplib::Response& res) {
    res.set_chunked_content_provider(
        "text/event-stream", [&engine](size_t, httplib::DataSink& sink) {
          const std::string first = CompletionEvent("first-of-hung", {11}) + "\n\n";
          sink.write(first.data(), first.size());
          engine.Hold();  // the engine hangs after its first event
          return false;
        });
  });
  const int fd = connect_loopback(s.svc->port());
  const std::string req =
      post_bytes("/v1/completions", completion_body(true), "Connection: close\r\n");
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  std::string got;
  ASSERT_TRUE(ReadUntil(fd, "first-of-hung", got)) << got;  // the stream is under way
  std::thread reader([&] { ReadUntil(fd, "\r\n0\r\n\r\n", got); });
  const std::uint64_t aborted_before = s.svc->metrics().finishes_aborted.load();
  EXPECT_FALSE(s.svc->Shutdown(500));
  reader.join();
  ::close(fd);
  engine.Release();
  const std::string body = ChunkedBody(got);
  const std::size_t error_at = body.find("\"type\":\"shutting_down\"");
  ASSERT_NE(error_at, std::string::npos) << body;
  EXPECT_EQ(body.find("\"upstream\""), std::string::npos) << body;
  const std::size_t done_at = body.find("data: [DONE]\n\n", error_at);
  ASSERT_NE(done_at, std::string::npos) << body;
  EXPECT_EQ(done_at + 14, body.size()) << "the stream goes on after [DONE]: " << body;
  EXPECT_EQ(s.svc->metrics().finishes_aborted.load(), aborted_before + 1);
  EXPECT_EQ(s.svc->metrics().proxy_in_flight.load(), 0);
  s.svc.reset();
}

// A server with one route, GET /echo, answering the X-RolloutCore-Rollout-Id header as the
// route sees it ("dup" when repeated, "none" when absent), and GET /ping answering "pong".
HttpRouter EchoRoutes() {
  HttpRouter r;
  r.Async(bhttp::verb::get, "/echo", [](Exchange ex) {
    bool dup = false;
    const auto v = ex.header("X-RolloutCore-Rollout-Id", &dup);
    ex.Respond(MakeResponse(200, dup ? "dup" : v ? std::string(*v) : "none", "text/plain"));
  });
  r.Async(bhttp::verb::get, "/ping",
          [](Exchange ex) { ex.Respond(MakeResponse(200, "pong", "text/plain")); });
  r.Blocking(bhttp::verb::get, "/hello", [](const ApiRequest&, HttpResponse& res) {
    res = MakeResponse(200, "hi", "text/plain");
  });
  return r;
}

// Proves a route reads a header verbatim (never percent-decoded), case-insensitively, and sees
// duplicates. Catches: decoded or merged header values reaching validation.
TEST(ConnectionGate, HeadersReachRoutesVerbatim) {
  HttpServer http(OneLoop(), EchoRoutes());
  const int port = StartOrDie(http);
  const auto get = [&](const std::string& headers) {
    return body_of(raw_exchange(
        port, "GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + headers + "\r\n"));
  };
  EXPECT_EQ(get("x-rolloutcore-rollout-id:  a%20b \r\n"), "a%20b");
  EXPECT_EQ(get("X-RolloutCore-Rollout-Id: a\r\nX-RolloutCore-Rollout-Id: b\r\n"), "dup");
  EXPECT_EQ(get(""), "none");
  EXPECT_TRUE(http.Stop(5000));
}

// Whether `value` reads 0 within 2 s.
bool eventually_zero(const std::function<std::uint64_t()>& value) {
  for (int i = 0; i < 400 && value() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return value() == 0;
}

// Sends `head`, then `filler` again and again (up to 8 MiB) until the server stops taking it, and
// returns what the server answered.
std::string endless_after(int port, const std::string& head, const std::string& filler) {
  const int fd = connect_loopback(port);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  bool sent = ::send(fd, head.data(), head.size(), MSG_NOSIGNAL) > 0;
  for (std::size_t total = 0; sent && total < (8u << 20); total += filler.size()) {
    sent = ::send(fd, filler.data(), filler.size(), MSG_NOSIGNAL) > 0;
  }
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) {
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

// Proves a chunk-size line or a trailer that never ends is cut off at the connection's buffer
// bound with 431, and the server goes on serving. Catches the read buffer growing with every
// byte of it (Beast's head and body limits do not count chunk framing): one client could hold
// gigabytes of memory per connection until the body deadline.
TEST(ConnectionGate, ChunkFramingWithoutEndIsCutOffAtTheBufferBound) {
  HttpServer http(OneLoop(), EchoRoutes());
  const int port = StartOrDie(http);
  const std::string head = "POST /ping HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  const std::string filler(64 << 10, 'a');
  EXPECT_EQ(status_of(endless_after(port, head + "1;", filler)), 431) << "a chunk extension";
  EXPECT_EQ(status_of(endless_after(port, head + "0\r\nX-T: ", filler)), 431) << "a trailer";
  EXPECT_EQ(
      body_of(raw_exchange(port, "GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")),
      "pong");
  EXPECT_TRUE(http.Stop(5000));
}

// Proves HEAD gets GET's head without a body on the server's own (blocking) routes, keep-alive
// staying in step (the next response on the connection is read whole); HEAD of an async route
// (a relay to an engine) gets a bodiless 405, of a path no route serves a bodiless 404, and a
// route's path asked with another method 405. Catches a body after HEAD, which a keep-alive client
// takes for the start of the next response.
TEST(ConnectionGate, HeadHasNoBodyAndAnotherMethodIs405) {
  HttpServer http(OneLoop(), EchoRoutes());
  const int port = StartOrDie(http);
  const std::string both = raw_exchange(
      port,
      "HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\nConnection: "
      "close\r\n\r\n");
  const std::size_t second = both.find("HTTP/1.1 ", 1);
  ASSERT_NE(second, std::string::npos) << both;
  const std::string head = both.substr(0, second);
  EXPECT_EQ(status_of(head), 200) << head;
  EXPECT_NE(head.find("Content-Length: 2"), std::string::npos) << head;
  EXPECT_EQ(body_of(head), "") << "HEAD answered with a body";
  EXPECT_EQ(body_of(both.substr(second)), "pong");
  const auto bodiless = [&](const std::string& request, int status) {
    const std::string answer = raw_exchange(port, request);
    EXPECT_EQ(status_of(answer), status) << request;
    if (request.rfind("HEAD", 0) == 0) {
      EXPECT_EQ(body_of(answer), "") << request;
    }
  };
  // An async route may relay to an engine, which answers HEAD without the body it declares.
  bodiless("HEAD /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405);
  bodiless("HEAD /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404);
  bodiless("POST /ping HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", 405);
  EXPECT_TRUE(http.Stop(5000));
}

// Proves AbandonWrite ends a chunk's write that waits on a client who stopped reading: the write
// completes undelivered at once, not at write_timeout_ms (here ten minutes). Catches a shutdown
// whose cancel could not end a stream to a stalled client: the rollout stayed unfinished past the
// settle window and serve exited without closing its journal.
TEST(ConnectionGate, AnAbandonedWriteToAStalledClientEndsAtOnce) {
  HttpServerOptions o = OneLoop();
  o.write_timeout_ms = 600000;
  std::atomic<bool> undelivered{false};
  std::atomic<int> writes{0};
  std::mutex mu;
  std::optional<Exchange> held;
  std::vector<std::shared_ptr<std::function<void(bool)>>> pumps;  // each outlives its handler
  HttpRouter r;
  r.Async(bhttp::verb::get, "/flood", [&](Exchange ex) {
    {
      std::lock_guard<std::mutex> g(mu);
      held = ex;
    }
    auto pump = std::make_shared<std::function<void(bool)>>();
    *pump = [ex, weak = std::weak_ptr<std::function<void(bool)>>(pump), &undelivered,
             &writes](bool delivered) mutable {
      if (!delivered) {
        undelivered = true;
        return;
      }
      writes++;
      if (auto next = weak.lock()) ex.Write(std::string(64 << 10, 'x'), *next);
    };
    ex.StartStream(MakeResponse(200, "", "text/plain"), *pump);
    std::lock_guard<std::mutex> g(mu);
    pumps.push_back(pump);
  });
  HttpServer http(o, std::move(r));
  const int port = StartOrDie(http);
  const int fd = connect_loopback(port);
  const std::string req = "GET /flood HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  // The client reads nothing: the socket buffers fill and one write stays pending.
  int seen = -1;
  for (int i = 0; i < 200 && seen != writes.load(); ++i) {
    seen = writes.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_FALSE(undelivered.load());
  {
    std::lock_guard<std::mutex> g(mu);
    ASSERT_TRUE(held.has_value());
    held->Post([ex = *held]() mutable { ex.AbandonWrite(); });
  }
  for (int i = 0; i < 500 && !undelivered.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(undelivered.load()) << "the pending write did not end";
  ::close(fd);
  EXPECT_TRUE(http.Stop(5000));
  std::lock_guard<std::mutex> g(mu);
  held.reset();  // the session goes before its server
  pumps.clear();
}

// Proves AbandonWrite also ends a stream's head write that waits on a client who stopped reading
// (a ~30 MB head no socket buffer takes): it completes undelivered at once, not at
// write_timeout_ms. Catches a shutdown whose cancel could not end a rollout whose stream head was
// stalled: only chunk writes were abandoned, so the rollout stayed unfinished past the settle.
TEST(ConnectionGate, AnAbandonedStreamHeadToAStalledClientEndsAtOnce) {
  HttpServerOptions o = OneLoop();
  o.write_timeout_ms = 600000;
  std::atomic<int> head_done{-1};  // -1: pending; 0: undelivered; 1: delivered
  std::mutex mu;
  std::optional<Exchange> held;
  HttpRouter r;
  r.Async(bhttp::verb::get, "/big-head", [&](Exchange ex) {
    HttpResponse head = MakeResponse(200, "", "text/plain");
    const std::string value(60000, 'h');  // beast bounds one field's value to 65,535 bytes
    for (int i = 0; i < 512; ++i) head.insert("X-Pad-" + std::to_string(i), value);
    ex.StartStream(std::move(head), [&head_done](bool delivered) { head_done = delivered; });
    std::lock_guard<std::mutex> g(mu);
    held = ex;
  });
  HttpServer http(o, std::move(r));
  const int port = StartOrDie(http);
  const int fd = connect_loopback(port);
  const std::string req = "GET /big-head HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  // The client reads nothing: the head's write fills the socket buffers and stays pending.
  bool started = false;
  for (int i = 0; i < 500 && !started; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::lock_guard<std::mutex> g(mu);
    started = held.has_value();
  }
  ASSERT_TRUE(started);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_EQ(head_done.load(), -1) << "the head was taken: it must outgrow the socket buffers";
  const auto t0 = Clock::now();
  {
    std::lock_guard<std::mutex> g(mu);
    held->Post([ex = *held]() mutable { ex.AbandonWrite(); });
  }
  for (int i = 0; i < 100 && head_done.load() == -1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(head_done.load(), 0) << "the pending head write did not end";
  EXPECT_LT(ms_since(t0), 1000);
  ::close(fd);
  EXPECT_TRUE(http.Stop(5000));
  std::lock_guard<std::mutex> g(mu);
  held.reset();  // the session goes before its server
}

// Proves the bodies all connections hold share one budget, a declared length counted from the
// head: while one request holds most of it (its last bytes still to come), another whose body would
// pass it is answered 503, and served once the first is done. Catches each connection bounded alone
// (4,096 connections times an 8 MiB body) with nothing bounding their sum.
TEST(ConnectionGate, BodiesShareOneMemoryBudget) {
  HttpServerOptions o = OneLoop();
  o.body_bytes_max = 64 << 10;
  o.body_memory_bytes_max = 96 << 10;
  HttpServer http(o, EchoRoutes());
  const int port = StartOrDie(http);
  const std::string big(60 << 10, 'a');
  const int holder = connect_loopback(port);
  const std::string head =
      "POST /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: " +
      std::to_string(big.size()) + "\r\n\r\n";
  ASSERT_GT(::send(holder, head.data(), head.size(), MSG_NOSIGNAL), 0);
  const std::size_t early = big.size() - 100;  // the last 100 bytes come later
  ASSERT_EQ(::send(holder, big.data(), early, MSG_NOSIGNAL), static_cast<ssize_t>(early));
  for (int i = 0; i < 400 && http.body_budget().used() < big.size(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(http.body_budget().used(), big.size()) << "its declared length held from the head";
  const std::string second = post_bytes("/ping", big, "Connection: close\r\n");
  const std::string refused = raw_exchange(port, second);
  EXPECT_EQ(status_of(refused), 503) << refused;
  EXPECT_EQ(http.counters().body_memory_refused.load(), 1u);
  ASSERT_GT(::send(holder, big.data() + early, big.size() - early, MSG_NOSIGNAL), 0);
  char buf[512];
  EXPECT_GT(::recv(holder, buf, sizeof(buf), 0), 0);  // answered (no POST route: 405)
  ::close(holder);
  EXPECT_EQ(status_of(raw_exchange(port, second)), 405) << "not served once the budget was back";
  EXPECT_TRUE(eventually_zero([&] { return http.body_budget().used(); }));
  EXPECT_TRUE(http.Stop(5000));
}

// Proves the server alone (no Service): with one event-loop thread and 16 tricklers a plain
// route keeps answering, and tricklers get 408 at the header deadline. Catches: a thread per
// waiting connection, a missing header deadline, a server that never hands complete requests
// over.
TEST(ConnectionGate, GatedServerServesWhileTricklersWait) {
  HttpServerOptions o;
  o.io_threads = 1;
  o.connections_max = 64;
  o.header_timeout_ms = 1000;
  o.idle_timeout_ms = 5000;
  HttpServer http(o, EchoRoutes());
  Result<int> bound = http.Start();
  ASSERT_TRUE(bound.ok());
  const int port = *bound;
  ASSERT_GT(port, 0);
  std::vector<int> tricklers;
  for (int i = 0; i < 16; ++i) {
    tricklers.push_back(connect_loopback(port));
    ASSERT_EQ(::send(tricklers.back(), "G", 1, MSG_NOSIGNAL), 1);
  }
  const auto t0 = Clock::now();
  for (int i = 0; i < 20; ++i) {
    httplib::Client c("127.0.0.1", port);
    auto r = c.Get("/ping");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->body, "pong");
  }
  EXPECT_LT(ms_since(t0), 900);
  for (int fd : tricklers) {
    char buf[256];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0);
    EXPECT_EQ(status_of(std::string(buf, static_cast<std::size_t>(n))), 408);
    ::close(fd);
  }
  EXPECT_GE(ms_since(t0), 900);
  EXPECT_EQ(http.counters().header_timeouts.load(), 16u);
  EXPECT_TRUE(http.Stop(5000));
}

// Throws once, at the step it is armed for (as an allocation or a library call may in any step).
class StepFault {
 public:
  void Arm(const std::string& step) {
    std::lock_guard<std::mutex> g(mu_);
    armed_ = step;
  }
  void Hit(const char* step) {
    std::lock_guard<std::mutex> g(mu_);
    if (armed_ != step) return;
    armed_.clear();
    ++thrown_;
    throw std::runtime_error(std::string("injected at ") + step);
  }
  int thrown() {
    std::lock_guard<std::mutex> g(mu_);
    return thrown_;
  }

 private:
  std::mutex mu_;
  std::string armed_;
  int thrown_ = 0;
};

// A stack whose serve runs every proxied step through `fault` (set before serving).
void ServeWithStepFault(Stack& s, const std::shared_ptr<StepFault>& fault) {
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();
  s.svc->set_step_probe([fault](const char* step) { fault->Hit(step); });
  ASSERT_TRUE(s.svc->Start().ok());
}

std::int64_t ActiveRollouts(const Stack& s) {
  httplib::Client c = s.client();
  auto r = c.Get("/v1/state");
  if (!r || r->status != 200) return -1;
  return json::parse(r->body)["active_rollouts"].get<std::int64_t>();
}

// Proves that an exception in any step of a non-streamed proxied rollout (before or after its
// durable admission, during the engine call, or once its finish is durable) answers the client
// 500, finishes the rollout as aborted, and leaves serve serving. Catches a step whose exception
// escapes to the event loop and drops the rollout with its binding open (an update would then
// wait for it until its drain timed out), or leaves the client waiting for an answer.
TEST(ProxyStepFault, AStepThatThrowsEndsTheRolloutAndAnswersTheClient) {
  Stack s;
  auto fault = std::make_shared<StepFault>();
  ServeWithStepFault(s, fault);
  httplib::Client c = s.client();
  int expected_thrown = 0;
  for (const char* step :
       {"parse", "admitted", "connected", "sent", "response head", "response body", "finished"}) {
    SCOPED_TRACE(step);
    const std::uint64_t aborted_before = s.svc->metrics().finishes_aborted.load();
    fault->Arm(step);
    auto r = c.Post("/v1/completions", completion_body(false), "application/json");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 500) << r->body;
    EXPECT_NE(r->body.find("internal error in step"), std::string::npos) << r->body;
    EXPECT_EQ(fault->thrown(), ++expected_thrown) << "the step was never reached";
    EXPECT_EQ(ActiveRollouts(s), 0) << "a rollout stayed bound after its step threw";
    const bool admitted = std::string(step) != "parse";
    const bool finished_by_the_fault = admitted && std::string(step) != "finished";
    EXPECT_EQ(s.svc->metrics().finishes_aborted.load(),
              aborted_before + (finished_by_the_fault ? 1 : 0));
    EXPECT_EQ(r->has_header("X-RolloutCore-Rollout-Id"), admitted);
    auto ok = c.Post("/v1/completions", completion_body(false), "application/json");
    ASSERT_TRUE(ok);
    EXPECT_EQ(ok->status, 200) << ok->body;
  }
  EXPECT_EQ(s.svc->metrics().proxy_step_failures.load(), 7u);
  EXPECT_FALSE(s.svc->failed());
}

// Proves that an exception while a streamed answer is relayed cuts the client's stream, finishes
// the rollout as aborted before the cut, and lets the next update commit. Catches a stream whose
// step threw leaving the rollout admitted under the old version, so the update's drain waits for
// it (and fails at drain_timeout_ms) while the client waits for more events.
TEST(ProxyStepFault, AStreamWhoseStepThrowsIsCutAndDoesNotHoldTheUpdate) {
  Stack s([](ServeConfig& c) { c.drain_timeout_ms = 3000; });
  auto fault = std::make_shared<StepFault>();
  ServeWithStepFault(s, fault);
  fault->Arm("client took");
  httplib::Client c = s.client();
  auto cut = c.Post("/v1/completions", completion_body(true), "application/json");
  if (cut) {
    EXPECT_EQ(cut->body.find("data: [DONE]"), std::string::npos) << cut->body;
  }
  EXPECT_EQ(fault->thrown(), 1);
  auto events = c.Post("/v1/completions", completion_body(true), "application/json");
  ASSERT_TRUE(events);  // the connection after the cut one is served
  EXPECT_EQ(events->status, 200);
  EXPECT_NE(events->body.find("data: [DONE]"), std::string::npos);
  EXPECT_EQ(ActiveRollouts(s), 0);
  auto u =
      c.Post("/v1/updates", stack::UpdateBody("u1", "rc-1", 1, "run-a").dump(), "application/json");
  ASSERT_TRUE(u);
  EXPECT_EQ(u->status, 200) << u->body;
  EXPECT_EQ(s.svc->metrics().proxy_step_failures.load(), 1u);
}

// Proves that an exception in a read-only pass-through call (GET /v1/models) answers 500 and
// leaves the route serving. Catches the client left waiting with no answer until the call's
// deadline closed it, or the exception taking the event loop's handler down.
TEST(ProxyStepFault, APassThroughStepThatThrowsAnswers500) {
  Stack s;
  auto fault = std::make_shared<StepFault>();
  ServeWithStepFault(s, fault);
  httplib::Client c = s.client();
  fault->Arm("pass-through");
  auto r = c.Get("/v1/models");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 500) << r->body;
  EXPECT_EQ(fault->thrown(), 1);
  auto ok = c.Get("/v1/models");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// Proves that a step beside the rollout's chain that throws (the request deadline's, the client
// leaving) while an engine read is under way finishes the rollout once, and the read that then
// fails ends nothing more. Catches a second finish of the same rollout (an assertion that aborts
// serve), and a retry that sends the request to the engine again for an aborted rollout.
TEST(ProxyStepFault, AStepBesideTheChainThatThrowsFinishesTheRolloutOnce) {
  Stack s([](ServeConfig& c) { c.request_timeout_ms = 300; });
  auto fault = std::make_shared<StepFault>();
  ServeWithStepFault(s, fault);
  const std::string slow =
      json{{"model", "rc-double-model"}, {"prompt", "hi"}, {"max_tokens", 2000}}.dump();
  fault->Arm("deadline");
  httplib::Client c = s.client();
  auto r = c.Post("/v1/completions", slow, "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 500) << r->body;
  EXPECT_EQ(fault->thrown(), 1);
  EXPECT_EQ(ActiveRollouts(s), 0);

  fault->Arm("client gone");
  const std::string streamed = json{
      {"model", "rc-double-model"},
      {"prompt", "hi"},
      {"max_tokens", 200},
      {"stream", true}}.dump();
  const int fd = connect_loopback(s.svc->port());
  const std::string req = post_bytes("/v1/completions", streamed);
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  char buf[512];
  ASSERT_GT(::recv(fd, buf, sizeof(buf), 0), 0);  // the stream began
  ::close(fd);
  const auto t0 = Clock::now();
  while (ActiveRollouts(s) != 0 && ms_since(t0) < 10000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(ActiveRollouts(s), 0);
  EXPECT_EQ(fault->thrown(), 2);
  auto ok = c.Post("/v1/completions", completion_body(false), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_FALSE(s.svc->failed());
}

}  // namespace
}  // namespace rc::service
