// The HTTP server's framing and memory bounds seen from a raw client over loopback: streams to
// HTTP/1.0 clients (no chunked coding), request bodies charged to the body budget for the
// memory they take (a declared length from the head, a chunked body what its buffer reserved),
// answers charged until their clients took them, blocking handlers outliving a stop (the server's
// and the Service's teardown wait for them), request heads bounded in bytes and fields whatever
// their shape, and the client sockets held at once.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/post.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "service/http_server.h"
#include "service/service.h"
#include "tests/service/raw_http.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

using raw_http::body_of;
using raw_http::connect_loopback;
using raw_http::head_of;
using raw_http::OneLoop;
using raw_http::raw_exchange;
using raw_http::read_to_close;
using raw_http::send_all;
using raw_http::StartOrDie;
using raw_http::status_of;

// Whether `value` reads `want` within `ms` (2 s unless told).
bool eventually(const std::function<std::uint64_t()>& value, std::uint64_t want, int ms = 2000) {
  for (int i = 0; i < ms / 5 && value() != want; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return value() == want;
}

// GET /stream streams "hello " then ends with "world"; GET /ping answers "pong"; no POST route
// (a complete POST is answered 405).
HttpRouter StreamRoutes() {
  HttpRouter r;
  r.Async(bhttp::verb::get, "/stream", [](Exchange ex) {
    ex.StartStream(MakeResponse(200, "", "text/event-stream"), [ex](bool delivered) mutable {
      if (!delivered) return ex.Close();
      ex.Write("hello ", [ex](bool written) mutable {
        if (!written) return ex.Close();
        ex.End("world");
      });
    });
  });
  r.Async(bhttp::verb::get, "/ping",
          [](Exchange ex) { ex.Respond(MakeResponse(200, "pong", "text/plain")); });
  return r;
}

// Proves a stream to an HTTP/1.0 client has no chunked coding: its body is the bytes written,
// delimited by the connection's close (Connection: close), and the connection takes no further
// request even when the client asked for keep-alive; an HTTP/1.1 client still gets chunks.
// Catches Transfer-Encoding: chunked sent to a 1.0 client, which reads the chunk-size lines as
// body, and a keep-alive attempted after a body only the close can end.
TEST(HttpStream, AnHttp10StreamIsCloseDelimitedAndEndsTheConnection) {
  HttpServer http(OneLoop(), StreamRoutes());
  const int port = StartOrDie(http);
  const std::string old = raw_exchange(
      port, "GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /ping HTTP/1.0\r\n\r\n");
  EXPECT_EQ(status_of(old), 200) << old;
  EXPECT_EQ(head_of(old).find("Transfer-Encoding"), std::string::npos) << old;
  EXPECT_NE(head_of(old).find("Connection: close"), std::string::npos) << old;
  EXPECT_EQ(body_of(old), "hello world") << "chunk framing, or a second answer on the connection";
  const std::string current =
      raw_exchange(port, "GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_NE(head_of(current).find("Transfer-Encoding: chunked"), std::string::npos) << current;
  EXPECT_EQ(body_of(current), "6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n");
  EXPECT_TRUE(http.Stop(5000));
}

// Proves a proxied streamed rollout asked over HTTP/1.0 reaches its client whole and unchunked,
// ending with [DONE] as the connection closes, and is finished as completed. Catches the
// reported failure: an HTTP/1.0 client of `"stream": true` handed a chunked body it cannot read.
TEST(HttpStream, AProxiedHttp10StreamReachesItsClientUnchunked) {
  stack::StackOptions o;
  o.dir_prefix = "rc-httpserver";
  stack::ServiceStack s(o);
  const std::string body = nlohmann::json{
      {"model", "rc-double-model"},
      {"prompt", "hi"},
      {"max_tokens", 4},
      {"stream", true}}.dump();
  const std::string request =
      "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  const std::string answer = raw_exchange(s.svc->port(), request);
  EXPECT_EQ(status_of(answer), 200) << answer.substr(0, 400);
  EXPECT_EQ(head_of(answer).find("Transfer-Encoding"), std::string::npos) << head_of(answer);
  const std::string events = body_of(answer);
  EXPECT_EQ(events.rfind("data: ", 0), 0u) << events.substr(0, 200);
  const std::string done = "data: [DONE]\n\n";
  ASSERT_GE(events.size(), done.size());
  EXPECT_EQ(events.substr(events.size() - done.size()), done) << events;
  EXPECT_EQ(s.svc->metrics().finishes_completed.load(), 1u);
}

// A request head for POST /ping declaring `length` bytes of body.
std::string declaring(std::size_t length, const std::string& extra_headers = "") {
  return "POST /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra_headers +
         "Content-Length: " + std::to_string(length) + "\r\n\r\n";
}

HttpServerOptions SmallBudget() {
  HttpServerOptions o = OneLoop();
  o.body_bytes_max = 64 << 10;
  o.body_memory_bytes_max = 96 << 10;  // one 60 KiB body, not two
  return o;
}

// Proves a declared Content-Length is charged to the body budget from the head, before any of
// the body comes: a second request declaring a body that would pass the budget is answered 503
// at once (with Expect: 100-continue, instead of the 100), and the charge goes back when the
// body completes and when its client leaves mid-body. Catches the budget counting only bytes
// received while Beast reserves the whole declared length as the body starts: slow clients each
// declaring a large body made the process reserve memory the budget never saw.
TEST(BodyBudget, ADeclaredLengthIsChargedFromTheHead) {
  HttpServer http(SmallBudget(), StreamRoutes());
  const int port = StartOrDie(http);
  const auto used = [&] { return http.body_budget().used(); };
  const std::string big(60 << 10, 'a');
  const int holder = connect_loopback(port);
  ASSERT_TRUE(send_all(holder, declaring(big.size()) + big.substr(0, 10)));
  ASSERT_TRUE(eventually(used, big.size()))
      << "charged " << used() << " for a declared " << big.size();
  const std::string refused = raw_exchange(port, declaring(big.size()));
  EXPECT_EQ(status_of(refused), 503) << refused;
  EXPECT_NE(refused.find("body_memory_bytes_max"), std::string::npos) << refused;
  const std::string expecting =
      raw_exchange(port, declaring(big.size(), "Expect: 100-continue\r\n"));
  EXPECT_EQ(status_of(expecting), 503) << expecting;
  EXPECT_EQ(expecting.find("100 Continue"), std::string::npos) << expecting;
  EXPECT_EQ(http.counters().body_memory_refused.load(), 2u);
  ASSERT_TRUE(send_all(holder, big.substr(10)));
  EXPECT_EQ(status_of(read_to_close(holder)), 405) << "the complete request is served";
  ::close(holder);
  EXPECT_TRUE(eventually(used, 0)) << "a completed request kept " << used();
  const int leaver = connect_loopback(port);
  ASSERT_TRUE(send_all(leaver, declaring(big.size())));
  ASSERT_TRUE(eventually(used, big.size()));
  ::close(leaver);
  EXPECT_TRUE(eventually(used, 0)) << "a client that left mid-body kept " << used();
  EXPECT_TRUE(http.Stop(5000));
}

// Proves the charge a declared length took from the head goes back when the body misses its
// deadline (408). Catches a charge taken at the head but given back only with a complete body.
TEST(BodyBudget, ADeclaredBodyCutByItsDeadlineGivesItsChargeBack) {
  HttpServerOptions o = SmallBudget();
  o.body_timeout_ms = 1000;
  HttpServer http(o, StreamRoutes());
  const int port = StartOrDie(http);
  const auto used = [&] { return http.body_budget().used(); };
  const int fd = connect_loopback(port);
  ASSERT_TRUE(send_all(fd, declaring(60 << 10) + "abc"));
  EXPECT_TRUE(eventually(used, 60 << 10)) << "charged " << used();
  EXPECT_EQ(status_of(read_to_close(fd)), 408);
  ::close(fd);
  EXPECT_TRUE(eventually(used, 0)) << "a body cut at its deadline kept " << used();
  EXPECT_TRUE(http.Stop(5000));
}

// Proves a chunked body is charged what its buffer reserved, not its length: after 15 * 2^12 + 1
// bytes in one-byte chunks, a string grown by doubling holds more than it received, and the
// budget shows more. Catches chunked bodies charged their length while their strings hold up
// to twice it.
TEST(BodyBudget, AChunkedBodyIsChargedWhatItsBufferReserved) {
  HttpServerOptions o = OneLoop();
  o.body_bytes_max = 64 << 10;
  o.body_memory_bytes_max = 1 << 20;
  HttpServer http(o, StreamRoutes());
  const int port = StartOrDie(http);
  const std::uint64_t received = 15 * 4096 + 1;
  std::string chunks = "POST /ping HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (std::uint64_t i = 0; i < received; ++i) chunks += "1\r\na\r\n";
  const int fd = connect_loopback(port);
  ASSERT_TRUE(send_all(fd, chunks));  // the last chunk is never sent: the body stays open
  for (int i = 0; i < 400 && http.body_budget().used() < received; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GT(http.body_budget().used(), received) << "charged the length, not the reservation";
  ::close(fd);
  EXPECT_TRUE(eventually([&] { return http.body_budget().used(); }, 0));
  EXPECT_TRUE(http.Stop(5000));
}

// Reads all `fd` is sent until the server closes, its receive buffer grown first: a window of a
// few KiB would take a round of acknowledgements per few KiB.
std::string ReadAllWidened(int fd) {
  int wide = 4 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &wide, sizeof(wide));
  return read_to_close(fd);
}

constexpr std::uint64_t kHeldAnswerBytes = std::uint64_t{16} << 20;  // past any socket buffers

// GET /held answers kHeldAnswerBytes whose hold of the body budget goes with the answer; GET
// /held-end streams them as its last bytes (End). A budget that cannot give them is a 503.
HttpRouter HeldRoutes() {
  HttpRouter r;
  r.Async(bhttp::verb::get, "/held", [](Exchange ex) {
    BudgetHold hold(&ex.body_budget());
    if (!hold.Grow(kHeldAnswerBytes)) return ex.Respond(MakeResponse(503, "", "text/plain"));
    ex.Respond(MakeResponse(200, std::string(kHeldAnswerBytes, 'h'), "text/plain"),
               std::move(hold));
  });
  r.Async(bhttp::verb::get, "/held-end", [](Exchange ex) {
    ex.StartStream(MakeResponse(200, "", "text/plain"), [ex](bool delivered) mutable {
      if (!delivered) return ex.Close();
      BudgetHold hold(&ex.body_budget());
      if (!hold.Grow(kHeldAnswerBytes)) return ex.Close();
      ex.End(std::string(kHeldAnswerBytes, 'e'), std::move(hold));
    });
  });
  return r;
}

// Proves the hold handed with an answer (Respond, or a stream's End) stays charged while the
// answer waits on a client that does not read, goes back once the client has read it all, and
// goes back when a client leaves without reading. Catches an answer's bytes charged only until
// they are handed to the connection (they then wait on a stalled client for write_timeout_ms
// uncharged: 16 MiB per connection outside body_memory_bytes_max), and a hold kept past the
// write or the client's leaving (the budget shrinking for good).
TEST(BodyBudget, AnAnswersHoldStaysUntilItsClientTookIt) {
  HttpServerOptions o = OneLoop();
  o.body_memory_bytes_max = std::uint64_t{64} << 20;
  HttpServer http(o, HeldRoutes());
  const int port = StartOrDie(http);
  const auto used = [&] { return http.body_budget().used(); };
  for (const char* path : {"/held", "/held-end"}) {
    const std::string request =
        std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    const int reader = raw_http::send_from_small_window(port, request);
    ASSERT_TRUE(eventually(used, kHeldAnswerBytes)) << path << ": charged " << used();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_EQ(used(), kHeldAnswerBytes) << path << ": the answer waiting on its client";
    const std::string answer = ReadAllWidened(reader);
    ::close(reader);
    EXPECT_EQ(status_of(answer), 200) << path;
    EXPECT_GT(answer.size(), kHeldAnswerBytes) << path;
    EXPECT_TRUE(eventually(used, 0)) << path << ": a written answer kept " << used();

    const int leaver = raw_http::send_from_small_window(port, request);
    ASSERT_TRUE(eventually(used, kHeldAnswerBytes)) << path << ": charged " << used();
    ::close(leaver);
    EXPECT_TRUE(eventually(used, 0)) << path << ": a client that left kept " << used();
  }
  EXPECT_TRUE(http.Stop(5000));
}

// GET /big answers kHeldAnswerBytes from a blocking route (a trainer route's large JSON, a page of
// /v1/events) and GET /small a few bytes; neither takes a hold of its own.
HttpRouter BlockingAnswerRoutes() {
  HttpRouter r;
  r.Blocking(bhttp::verb::get, "/big", [](const ApiRequest&, HttpResponse& res) {
    SetBody(res, 200, std::string(kHeldAnswerBytes, 'b'), "application/json");
  });
  r.Blocking(bhttp::verb::get, "/small", [](const ApiRequest&, HttpResponse& res) {
    SetBody(res, 200, "{}", "application/json");
  });
  r.Blocking(bhttp::verb::post, "/ran", [](const ApiRequest&, HttpResponse& res) {
    SetBody(res, 200, std::string(kHeldAnswerBytes, 'r'), "application/json");  // its outcome
  });
  return r;
}

// Proves a blocking route's large answer is held against the body budget from when its handler
// returns until its client took it: 16 MiB waiting on a client that does not read are charged,
// a second such answer that the budget cannot hold beside it is answered 503 naming
// body_memory_bytes_max (counted), a small answer is still served, and the budget is back at
// zero once the first client read its answer. Catches trainer answers (a full /v1/state, a
// 4 MiB page of /v1/events) handed to connections uncharged: clients that ask and never read
// held that memory outside body_memory_bytes_max until write_timeout_ms.
TEST(BodyBudget, ABlockingRoutesLargeAnswerIsHeldAndRefusedOnceTheBudgetIsSpent) {
  HttpServerOptions o = OneLoop();
  o.body_memory_bytes_max = std::uint64_t{24} << 20;  // one answer, not two
  HttpServer http(o, BlockingAnswerRoutes());
  const int port = StartOrDie(http);
  const auto used = [&] { return http.body_budget().used(); };
  const std::string big = "GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  const int reader = raw_http::send_from_small_window(port, big);
  ASSERT_TRUE(eventually(used, kHeldAnswerBytes)) << "charged " << used();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(used(), kHeldAnswerBytes) << "the answer waiting on its client";
  const std::string refused = raw_exchange(port, big);
  EXPECT_EQ(status_of(refused), 503) << refused.substr(0, 300);
  EXPECT_NE(refused.find("body_memory_bytes_max"), std::string::npos) << refused.substr(0, 300);
  EXPECT_EQ(http.counters().body_memory_refused.load(), 1u);
  const std::string small =
      raw_exchange(port, "GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(small), 200) << small;
  EXPECT_EQ(used(), kHeldAnswerBytes) << "the refused answer kept a charge";
  const std::string answer = ReadAllWidened(reader);
  ::close(reader);
  EXPECT_EQ(status_of(answer), 200);
  EXPECT_GT(answer.size(), kHeldAnswerBytes);
  EXPECT_TRUE(eventually(used, 0)) << "a written answer kept " << used();
  EXPECT_TRUE(http.Stop(5000));
}

// Proves the large answer of a request whose effects already ran (a POST: an update's outcome) is
// served and held past the body budget when the budget cannot hold it, and given back once
// written, while a GET's is refused; catches a 503 "overloaded, try again" for an update that
// ran, whose caller could then not tell that it did.
TEST(BodyBudget, TheAnswerOfARequestThatRanIsHeldPastTheBudgetNotRefused) {
  HttpServerOptions o = OneLoop();
  o.body_memory_bytes_max = std::uint64_t{24} << 20;  // one answer, not two
  HttpServer http(o, BlockingAnswerRoutes());
  const int port = StartOrDie(http);
  const auto used = [&] { return http.body_budget().used(); };
  const int reader = raw_http::send_from_small_window(
      port, "GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  ASSERT_TRUE(eventually(used, kHeldAnswerBytes)) << "charged " << used();
  const std::string ran = raw_exchange(
      port, "POST /ran HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(ran), 200) << ran.substr(0, 300);
  EXPECT_GT(ran.size(), kHeldAnswerBytes);
  EXPECT_EQ(http.counters().body_memory_refused.load(), 0u);
  EXPECT_TRUE(eventually(used, kHeldAnswerBytes)) << "the POST's answer kept " << used();
  const std::string refused =
      raw_exchange(port, "GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(status_of(refused), 503) << refused.substr(0, 300);
  const std::string answer = ReadAllWidened(reader);
  ::close(reader);
  EXPECT_EQ(status_of(answer), 200);
  EXPECT_TRUE(eventually(used, 0)) << "a written answer kept " << used();
  EXPECT_TRUE(http.Stop(5000));
}

// GET /plain answers kHeldAnswerBytes and GET /plain-end streams them as its last bytes, neither
// with a hold: as any route that hands over an answer it made (an error answer, a relayed body).
HttpRouter UnheldRoutes() {
  HttpRouter r;
  r.Async(bhttp::verb::get, "/plain", [](Exchange ex) {
    ex.Respond(MakeResponse(200, std::string(kHeldAnswerBytes, 'p'), "text/plain"));
  });
  r.Async(bhttp::verb::get, "/plain-end", [](Exchange ex) {
    ex.StartStream(MakeResponse(200, "", "text/plain"), [ex](bool delivered) mutable {
      if (!delivered) return ex.Close();
      ex.End(std::string(kHeldAnswerBytes, 'e'));
    });
  });
  return r;
}

// Proves an answer handed to its connection without a hold is held there once its buffer passes
// kAnswerUnheldBytesMax, whether a complete answer or a stream's last bytes: charged while its
// client does not read, given back when the client read it or left; and with the budget taken by
// one, the other is refused (a 503 naming body_memory_bytes_max, a stream cut after its head).
// Catches answers without a hold written uncharged: every connection could keep one of any size
// waiting on its client outside body_memory_bytes_max.
TEST(BodyBudget, AnAnswerHandedOverWithoutAHoldIsHeldPastTheUnheldBound) {
  HttpServerOptions o = OneLoop();
  o.body_memory_bytes_max = std::uint64_t{24} << 20;  // one answer, not two
  HttpServer http(o, UnheldRoutes());
  const int port = StartOrDie(http);
  const auto used = [&] { return http.body_budget().used(); };
  const auto get = [](const char* path) {
    return std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  };
  for (const char* path : {"/plain", "/plain-end"}) {
    const int reader = raw_http::send_from_small_window(port, get(path));
    ASSERT_TRUE(eventually(used, kHeldAnswerBytes)) << path << ": charged " << used();
    const char* other = std::string(path) == "/plain" ? "/plain-end" : "/plain";
    const std::string refused = raw_exchange(port, get(other));
    if (std::string(other) == "/plain") {
      EXPECT_EQ(status_of(refused), 503) << refused.substr(0, 300);
      EXPECT_NE(refused.find("body_memory_bytes_max"), std::string::npos);
    } else {
      EXPECT_EQ(status_of(refused), 200) << "its head went before its last bytes";
      EXPECT_LT(refused.size(), std::size_t{64} << 10) << "the refused last bytes were sent";
      EXPECT_EQ(refused.find("0\r\n\r\n"), std::string::npos) << "the cut stream was ended";
    }
    EXPECT_EQ(used(), kHeldAnswerBytes) << path << ": the refusal kept a charge";
    const std::string answer = ReadAllWidened(reader);
    ::close(reader);
    EXPECT_EQ(status_of(answer), 200) << path;
    EXPECT_GT(answer.size(), kHeldAnswerBytes) << path;
    EXPECT_TRUE(eventually(used, 0)) << path << ": a written answer kept " << used();
    const int leaver = raw_http::send_from_small_window(port, get(path));
    ASSERT_TRUE(eventually(used, kHeldAnswerBytes)) << path << ": charged " << used();
    ::close(leaver);
    EXPECT_TRUE(eventually(used, 0)) << path << ": a client that left kept " << used();
  }
  EXPECT_EQ(http.counters().body_memory_refused.load(), 2u);
  EXPECT_TRUE(http.Stop(5000));
}

// Proves the server's own error answer is held once it passes kAnswerUnheldBytesMax: a 404 naming
// a 20 KiB path is 503 naming body_memory_bytes_max while a request body holds all but 16 KiB of
// the budget, a 404 naming a short path (under the bound, held nowhere) is still served, and once
// the budget is free the long 404 is served too. Catches error answers that quote what a client
// sent (a path up to header_bytes_max, escaped) written uncharged whatever the budget holds.
TEST(BodyBudget, ALargeErrorAnswerIsRefusedOnceTheBudgetIsSpent) {
  HttpServerOptions o = OneLoop();
  o.header_bytes_max = 64 << 10;
  o.body_bytes_max = 64 << 10;
  o.body_memory_bytes_max = 80 << 10;  // a 64 KiB body leaves 16 KiB
  HttpServer http(o, StreamRoutes());
  const int port = StartOrDie(http);
  const auto used = [&] { return http.body_budget().used(); };
  const auto get = [](const std::string& path) {
    return "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  };
  const std::string long_path = "/" + std::string(20 << 10, 'n');
  const int holder = connect_loopback(port);
  ASSERT_TRUE(send_all(holder, declaring(64 << 10)));
  ASSERT_TRUE(eventually(used, 64 << 10)) << "charged " << used();
  const std::string refused = raw_exchange(port, get(long_path));
  EXPECT_EQ(status_of(refused), 503) << refused.substr(0, 300);
  EXPECT_NE(refused.find("body_memory_bytes_max"), std::string::npos) << refused.substr(0, 300);
  EXPECT_EQ(http.counters().body_memory_refused.load(), 1u);
  EXPECT_EQ(status_of(raw_exchange(port, get("/nowhere"))), 404);
  EXPECT_EQ(used(), std::uint64_t{64} << 10) << "an answer kept a charge";
  ::close(holder);
  ASSERT_TRUE(eventually(used, 0));
  const std::string served = raw_exchange(port, get(long_path));
  EXPECT_EQ(status_of(served), 404) << served.substr(0, 300);
  EXPECT_GT(served.size(), std::size_t{20} << 10);
  EXPECT_TRUE(eventually(used, 0)) << "a written answer kept " << used();
  EXPECT_TRUE(http.Stop(5000));
}

// Proves that an answer a blocking handler gives while Stop is under way reaches its client: Stop
// lets the running handlers end first, then closes the connections. Catches Stop closing every
// connection before the handlers ended, which cut the answer of an update that ended as serve
// shut down (the trainer got no answer although the outcome was journaled).
TEST(HttpStop, AnAnswerGivenWhileStopWaitsReachesItsClient) {
  std::atomic<bool> entered{false};
  std::atomic<bool> released{false};
  HttpRouter r;
  r.Blocking(bhttp::verb::get, "/slow", [&](const ApiRequest&, HttpResponse& res) {
    entered = true;
    for (int i = 0; i < 1000 && !released.load(); ++i) {  // 10 s at most: never a hang
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    SetBody(res, 200, "done", "text/plain");
  });
  HttpServer http(OneLoop(), std::move(r));
  const int port = StartOrDie(http);
  std::string answer;
  std::thread client([&] {
    answer = raw_exchange(port, "GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  });
  for (int i = 0; i < 1000 && !entered.load(); ++i) {  // 10 s at most
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(entered.load());
  bool stopped = false;
  std::thread stopper([&] { stopped = http.Stop(10000); });
  // Stop is under way before the answer is given (the answer must not depend on it being so).
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  released = true;
  stopper.join();
  client.join();
  EXPECT_TRUE(stopped);
  EXPECT_EQ(status_of(answer), 200) << answer;
  EXPECT_EQ(body_of(answer), "done") << answer;
}

// Proves a blocking handler that Stop left running past its deadline (Stop returned false) ends,
// and posts its answer to its connection's loop, before the server's destructor destroys the
// loops: the destructor joins the pool first. Catches the loops destroyed while such a handler
// still ran (its answer was then posted to a freed event loop as serve exited behind a slow
// trainer call: a use-after-free).
TEST(HttpStop, AHandlerStopLeftRunningEndsBeforeTheLoopsGo) {
  std::atomic<bool> entered{false};
  std::atomic<bool> destroying{false};
  std::atomic<bool> loop_gone{false};
  std::atomic<bool> ended_after_loop{false};
  HttpRouter r;
  r.Blocking(bhttp::verb::get, "/slow", [&](const ApiRequest&, HttpResponse& res) {
    entered = true;
    for (int i = 0; i < 1000 && !destroying.load(); ++i) {  // 10 s at most: never a hang
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    // Well into the destructor: one that does not wait for this handler has destroyed the loops.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ended_after_loop = loop_gone.load();
    SetBody(res, 200, "done", "text/plain");
  });
  auto http = std::make_unique<HttpServer>(OneLoop(), std::move(r));
  const int port = StartOrDie(*http);
  const int fd = connect_loopback(port);
  ASSERT_TRUE(send_all(fd, "GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  for (int i = 0; i < 1000 && !entered.load(); ++i) {  // 10 s at most
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(entered.load());
  EXPECT_FALSE(http->Stop(0)) << "a handler still running was counted as ended";
  boost::asio::post(http->io(),
                    [at = std::make_shared<stack::AtDestruction>([&] { loop_gone = true; })] {});
  destroying = true;
  http.reset();
  EXPECT_TRUE(loop_gone.load());
  EXPECT_FALSE(ended_after_loop.load())
      << "the loops were destroyed while a handler that posts its answer to one still ran";
  EXPECT_EQ(read_to_close(fd), "") << "Stop closed the connection: no answer follows";
  ::close(fd);
}

// Whether `done` holds within 10 s.
bool Within10s(const std::function<bool()>& done) {
  for (int i = 0; i < 1000 && !done(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

// Proves a Stop after one that left a blocking handler running waits for that handler (up to its
// own deadline) and joins the pool before it returns true: a second Stop whose deadline passes
// first returns false, and a third returns true only once the handler has returned. Catches a
// later Stop that returned true at once because the server was already stopping: its caller (the
// Service's destructor, after a Shutdown whose Stop was not drained) then destroyed the journal
// and the engine connections the handler still used.
TEST(HttpStop, ALaterStopWaitsForTheHandlersAnEarlierOneLeftRunning) {
  std::atomic<bool> entered{false};
  std::atomic<bool> released{false};
  std::atomic<bool> returned{false};
  HttpRouter r;
  r.Blocking(bhttp::verb::get, "/slow", [&](const ApiRequest&, HttpResponse& res) {
    entered = true;
    for (int i = 0; i < 1000 && !released.load(); ++i) {  // 10 s at most: never a hang
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    SetBody(res, 200, "done", "text/plain");
    returned = true;
  });
  HttpServer http(OneLoop(), std::move(r));
  const int port = StartOrDie(http);
  const int fd = connect_loopback(port);
  ASSERT_TRUE(send_all(fd, "GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  ASSERT_TRUE(Within10s([&] { return entered.load(); }));
  EXPECT_FALSE(http.Stop(0)) << "a handler still running was counted as ended";
  EXPECT_FALSE(http.Stop(100)) << "a later Stop returned while the handler still ran";
  EXPECT_FALSE(returned.load());
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    released = true;
  });
  EXPECT_TRUE(http.Stop(10000));
  EXPECT_TRUE(returned.load()) << "Stop returned true before the handler left running returned";
  releaser.join();
  EXPECT_TRUE(http.Stop(0)) << "a pool joined already has nothing left to wait for";
  EXPECT_EQ(read_to_close(fd), "") << "the first Stop closed the connection: no answer follows";
  ::close(fd);
}

// Proves a trainer call that Shutdown left running (its HTTP stop not drained by the settle
// deadline) returns before the Service's destructor destroys anything it uses: a /v1/watch held
// inside its first look past the shutdown reads the journal once released, and the destructor,
// already running by then, ends only after it. Catches the destructor's Stop returning at once
// (the server already stopping) and the engine connections, runner and journal reset under the
// handler: released, it read the journal through a null pointer and crashed the test binary.
TEST(ServiceTeardown, AHandlerShutdownLeftRunningEndsBeforeWhatItUsesGoes) {
  stack::StackOptions o;
  o.dir_prefix = "rc-teardown";
  stack::ServiceStack s(o);
  ASSERT_TRUE(s.svc->Shutdown(5000));
  s.OpenWithoutStarting();
  std::atomic<bool> armed{false};
  std::atomic<bool> holding{false};
  std::atomic<bool> released{false};
  // The first look of the armed watch waits until released (10 s at most: never a hang); the
  // handler then reads the journal (Service::CatchUpDurable).
  s.svc->set_step_probe([&](const char* step) {
    if (!armed.load() || std::string(step) != "watch looked" || holding.exchange(true)) return;
    for (int i = 0; i < 1000 && !released.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  ASSERT_TRUE(s.svc->Start().ok());
  armed = true;
  std::thread watcher([&] {
    httplib::Client c = s.client(30);
    (void)c.Get("/v1/watch?after=1000000&timeout_ms=60000");  // its connection is closed unanswered
  });
  ASSERT_TRUE(Within10s([&] { return holding.load(); })) << "the watch never looked";
  EXPECT_FALSE(s.svc->Shutdown(0)) << "the held watch was not left running";
  std::atomic<bool> destroyed{false};
  std::thread destroyer([&] {
    s.svc.reset();
    destroyed = true;
  });
  // Well into the destructor: one that does not wait for the handler has reset the journal.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_FALSE(destroyed.load()) << "the Service went while a handler it serves still ran";
  released = true;
  destroyer.join();
  watcher.join();
  EXPECT_TRUE(destroyed.load());
}

// ---- request heads: header_bytes_max and kHeaderFieldsMax, whatever the head's shape ----

// kHeaderFieldsMax and SocketsMaxFor(4) (4 + 16), written out so that these tests build, and
// fail, against a server without those bounds.
constexpr std::size_t kFieldsBound = 100;
constexpr std::size_t kSocketsForFour = 20;

// A proxied POST /v1/completions (Connection: close) whose head carries `fields` after its own
// four (Host, Connection, Content-Type, Content-Length).
std::string CompletionRequest(const std::vector<std::string>& fields) {
  const std::string body = R"({"model":"rc-double-model","prompt":"hi","max_tokens":2})";
  std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
      "Content-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n";
  for (const std::string& f : fields) head += f + "\r\n";
  return head + "\r\n" + body;
}

// `n` fields "X-Pad-<i>: vvv..." of `value_bytes` value bytes each.
std::vector<std::string> PadFields(std::size_t n, std::size_t value_bytes) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < n; ++i) {
    out.push_back("X-Pad-" + std::to_string(i) + ": " + std::string(value_bytes, 'v'));
  }
  return out;
}

// The head's bytes: its request line through its blank line.
std::size_t HeadBytes(const std::string& request) { return request.find("\r\n\r\n") + 4; }

// `fields` with the last one's value grown so the request's head is exactly `head_bytes` long.
std::string RequestWithHeadOf(std::size_t head_bytes, std::vector<std::string> fields) {
  const std::size_t now = HeadBytes(CompletionRequest(fields));
  RC_CHECK(!fields.empty() && now <= head_bytes);
  fields.back() += std::string(head_bytes - now, 'w');
  const std::string request = CompletionRequest(fields);
  RC_CHECK(HeadBytes(request) == head_bytes);
  return request;
}

// Sends `request` in `piece`-byte writes `gap_ms` apart (until the server stops taking them) and
// returns everything the server answered.
std::string TrickledExchange(int port, const std::string& request, std::size_t piece, int gap_ms) {
  const int fd = connect_loopback(port);
  for (std::size_t at = 0; at < request.size(); at += piece) {
    if (!send_all(fd, request.substr(at, piece))) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
  }
  std::string out = read_to_close(fd);
  ::close(fd);
  return out;
}

stack::StackOptions HeadStack() {
  stack::StackOptions o;
  o.dir_prefix = "rc-httphead";
  o.tweak = [](ServeConfig& c) { c.header_bytes_max = 16 << 10; };
  return o;
}

// Proves serve answers 431 naming header_bytes_max to every request head past it whose fields are
// within kHeaderFieldsMax, whatever its shape (60 fields of 300 bytes sent 256 bytes at a time,
// 90 fields of 200 bytes sent at once or trickled, one byte past the limit), and never processes
// it (no admission), while a head of exactly the limit is served. Catches the reported failure:
// Beast's header_limit counting only the bytes one parse had not consumed, so a head read in
// pieces smaller than what each parse took (each read's whole fields leaving the buffer) passed
// any limit and reached the proxy.
TEST(HttpHead, AHeadPastTheByteLimitIs431WhateverItsShape) {
  stack::ServiceStack s(HeadStack());
  const int port = s.svc->port();
  const std::string over_bytes = "exceeds 16384 bytes";
  const std::string pieces = CompletionRequest(PadFields(60, 300));  // fewer than kHeaderFieldsMax
  ASSERT_GT(HeadBytes(pieces), 16u << 10);
  const std::string small_reads = TrickledExchange(port, pieces, 256, 1);
  EXPECT_EQ(status_of(small_reads), 431) << head_of(small_reads);
  EXPECT_NE(body_of(small_reads).find(over_bytes), std::string::npos) << small_reads;
  const std::string wide = CompletionRequest(PadFields(90, 200));  // fewer than kHeaderFieldsMax
  ASSERT_GT(HeadBytes(wide), 16u << 10);
  const std::string at_once = raw_exchange(port, wide);
  EXPECT_EQ(status_of(at_once), 431) << head_of(at_once);
  EXPECT_NE(body_of(at_once).find(over_bytes), std::string::npos) << at_once;
  const std::string trickled = TrickledExchange(port, wide, 700, 2);
  EXPECT_EQ(status_of(trickled), 431) << "trickled";
  EXPECT_NE(body_of(trickled).find(over_bytes), std::string::npos) << trickled;
  const std::string over =
      raw_exchange(port, RequestWithHeadOf((16 << 10) + 1, PadFields(60, 200)));
  EXPECT_EQ(status_of(over), 431) << "one byte past the limit";
  EXPECT_NE(body_of(over).find(over_bytes), std::string::npos) << over;
  EXPECT_EQ(s.svc->metrics().admissions.load(), 0u) << "a head past the limit was processed";
  const std::string at_limit = RequestWithHeadOf(16 << 10, PadFields(60, 200));
  const std::string served = raw_exchange(port, at_limit);
  EXPECT_EQ(status_of(served), 200) << served.substr(0, 300);
  EXPECT_EQ(s.svc->metrics().admissions.load(), 1u);
}

// Proves a request with more than kHeaderFieldsMax fields, in its head or in a chunked body's
// trailer (counted with its head's), is answered 431 naming the field bound and not processed
// even far below header_bytes_max (and a head of 2,000 small fields, past header_bytes_max too,
// is refused by the field bound, checked as each read's fields are parsed), while one with
// exactly kHeaderFieldsMax is served. Catches a head of thousands of 4-byte fields (each a
// node the parser allocates, about 20 times the bytes) taken whole because its bytes fit the
// limit.
TEST(HttpHead, MoreFieldsThanTheBoundAre431) {
  stack::ServiceStack s(HeadStack());
  const int port = s.svc->port();
  const std::string over_fields = "more than 100 header fields";
  constexpr std::size_t kOwnFields = 4;  // Host, Connection, Content-Type, Content-Length
  std::vector<std::string> tiny;
  for (std::size_t i = 0; i + kOwnFields <= kFieldsBound; ++i) {
    tiny.push_back("a" + std::to_string(i) + ": v");
  }
  ASSERT_EQ(tiny.size() + kOwnFields, kFieldsBound + 1);
  const std::string too_many = raw_exchange(port, CompletionRequest(tiny));
  EXPECT_EQ(status_of(too_many), 431) << too_many.substr(0, 300);
  EXPECT_NE(body_of(too_many).find(over_fields), std::string::npos) << too_many;
  std::vector<std::string> small;
  for (int i = 0; i < 2000; ++i) small.push_back("X-H" + std::to_string(i) + ": v");
  const std::string reported = CompletionRequest(small);
  ASSERT_GT(HeadBytes(reported), 16u << 10);
  const std::string thousands = raw_exchange(port, reported);
  EXPECT_EQ(status_of(thousands), 431) << thousands.substr(0, 300);
  EXPECT_NE(body_of(thousands).find(over_fields), std::string::npos) << thousands;
  const std::string trailer_head =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
      "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
  const std::string body = R"({"model":"rc-double-model","prompt":"hi","max_tokens":2})";
  std::string trailer;
  for (std::size_t i = 0; i <= kFieldsBound; ++i) trailer += "t" + std::to_string(i) + ": v\r\n";
  char chunk_size[16];
  std::snprintf(chunk_size, sizeof(chunk_size), "%zx", body.size());
  const std::string chunked =
      trailer_head + chunk_size + "\r\n" + body + "\r\n0\r\n" + trailer + "\r\n";
  const std::string trailed = raw_exchange(port, chunked);
  EXPECT_EQ(status_of(trailed), 431) << "fields in the trailer";
  EXPECT_NE(body_of(trailed).find(over_fields), std::string::npos) << trailed;
  EXPECT_EQ(s.svc->metrics().admissions.load(), 0u) << "a request past the field bound ran";
  tiny.pop_back();
  const std::string served = raw_exchange(port, CompletionRequest(tiny));
  EXPECT_EQ(status_of(served), 200) << served.substr(0, 300);
  EXPECT_EQ(s.svc->metrics().admissions.load(), 1u);
}

// Whether a connected socket has something to read (an answer, or the server's close) within
// `ms`.
bool Readable(int fd, int ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, ms) > 0;
}

// The sockets of `fds` with something to read now (an answer, or the server's close).
std::uint64_t Answered(const std::vector<int>& fds) {
  std::uint64_t n = 0;
  for (int fd : fds) n += Readable(fd, 0) ? 1 : 0;
  return n;
}

// Proves the server holds at most SocketsMaxFor(connections_max) client sockets: with 4
// connections allowed, 40 idle clients get 4 connections and 16 refusals (503) and the other 20
// wait unaccepted in the listen backlog, then are accepted once sockets close, and the server
// serves on; the pause is counted once, timed while it lasts and over once the sockets close.
// The refusals linger (linger_ms) until the test closes them, so every wait is on a condition and
// a slow machine sees the same sockets held. Catches a server that accepts every connection (to
// refuse it), so idle clients take every descriptor the process has and the engine monitor and
// journal find none, and a pause nothing tells an operator of (no count, no time, no "paused
// now").
TEST(HttpAccept, SocketsBeyondTheMarginWaitInTheBacklog) {
  constexpr int kWaitMs = 20000;  // a bound on each wait, never a pace
  HttpServerOptions o = OneLoop();
  o.connections_max = 4;
  o.idle_timeout_ms = 60000;
  o.linger_ms = 60000;
  HttpServer http(o, StreamRoutes());
  const int port = StartOrDie(http);
  const std::size_t sockets_max = kSocketsForFour;
  std::vector<int> fds;
  for (int i = 0; i < 40; ++i) fds.push_back(connect_loopback(port));
  ASSERT_TRUE(eventually([&] { return http.accept_paused().now ? 1 : 0; }, 1, kWaitMs))
      << "accepting never paused: " << http.counters().accepted.load() << " accepted";
  ASSERT_TRUE(eventually([&] { return Answered(fds); }, sockets_max - 4, kWaitMs))
      << "the refused were not answered";
  // A window in which a server that accepts past the bound would: nothing it holds closes in it.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(http.counters().accepted.load(), sockets_max) << "accepted past the socket bound";
  EXPECT_EQ(http.counters().refused_over_budget.load(), sockets_max - 4);
  EXPECT_EQ(Answered(fds), sockets_max - 4) << "only the refused are answered";
  EXPECT_EQ(http.counters().accept_pauses.load(), 1u);
  const HttpServer::AcceptPaused paused = http.accept_paused();
  EXPECT_TRUE(paused.now);
  EXPECT_GE(paused.paused_us, 250000u) << "the pause going on is not timed";
  for (int fd : fds) ::close(fd);
  EXPECT_TRUE(eventually([&] { return http.counters().accepted.load(); }, 40, kWaitMs))
      << "connections left in the backlog were never accepted";
  EXPECT_TRUE(eventually([&] { return http.accept_paused().now ? 1 : 0; }, 0, kWaitMs));
  const std::uint64_t paused_us = http.accept_paused().paused_us;
  EXPECT_GE(paused_us, paused.paused_us);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(http.accept_paused().paused_us, paused_us) << "timed past the pause's end";
  EXPECT_GE(http.counters().accept_pauses.load(), 1u);
  EXPECT_EQ(
      body_of(raw_exchange(port, "GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")),
      "pong");
  EXPECT_TRUE(http.Stop(5000));
}

}  // namespace
}  // namespace rc::service
