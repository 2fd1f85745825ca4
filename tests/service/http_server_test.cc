// The HTTP server's framing and memory bounds seen from a raw client over loopback: streams to
// HTTP/1.0 clients (no chunked coding), and request bodies charged to the body budget for the
// memory they take (a declared length from the head, a chunked body what its buffer reserved).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

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

// Whether `value` reads `want` within 2 s.
bool eventually(const std::function<std::uint64_t()>& value, std::uint64_t want) {
  for (int i = 0; i < 400 && value() != want; ++i) {
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

}  // namespace
}  // namespace rc::service
