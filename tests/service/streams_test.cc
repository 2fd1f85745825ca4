// Streams through the event-driven proxy at scale and at length: thousands of concurrent streamed
// rollouts each admitted durably before their first byte and finished in the journal, a stream
// longer than any buffer relayed whole, and a client that stops reading cut at the write deadline
// (the engine stream is not buffered for it), and each streamed event's parse held against the
// body budget. Real Service, real RocksDB, the in-process vLLM double (behind a scripted engine
// where a test needs events the double never sends), loopback HTTP; the clients are one
// Boost.Beast event loop, httplib, or a raw socket.
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <gtest/gtest.h>

#include "service/proxy_stream.h"
#include "tests/service/raw_http.h"
#include "tests/service/scripted_engine.h"
#include "tests/service/service_stack.h"

namespace rc::service {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;
using nlohmann::json;

// One streamed rollout as a client sees it.
struct StreamResult {
  bool connected = false;
  unsigned status = 0;
  std::string rollout_id;
  std::uint64_t admission_seq = 0;
  bool admission_durable_at_head = false;  // the admission record was durable when the head came
  std::uint64_t bytes = 0;
  std::uint64_t events = 0;
  bool done = false;  // saw data: [DONE]
  std::string error;
};

// Reads one streamed response through a response_parser with a fixed buffer: memory per client is
// constant however long the stream.
class StreamClient : public std::enable_shared_from_this<StreamClient> {
 public:
  StreamClient(asio::io_context& io, tcp::endpoint ep, std::string body, StreamResult& out,
               std::function<void(StreamResult&)> on_head)
      : socket_(io), ep_(ep), out_(out), on_head_(std::move(on_head)) {
    req_ = {beast::http::verb::post, "/v1/completions", 11};
    req_.set(beast::http::field::host, "127.0.0.1");
    req_.set(beast::http::field::content_type, "application/json");
    req_.body() = std::move(body);
    req_.prepare_payload();
  }
  void Start() {
    socket_.async_connect(ep_, [self = shared_from_this()](beast::error_code ec) {
      if (ec) return self->Fail("connect: " + ec.message());
      self->out_.connected = true;
      beast::http::async_write(self->socket_, self->req_,
                               [self](beast::error_code wec, std::size_t) {
                                 if (wec) return self->Fail("write: " + wec.message());
                                 self->ReadHead();
                               });
    });
  }

 private:
  void ReadHead() {
    parser_.body_limit(boost::none);
    beast::http::async_read_header(socket_, buf_, parser_,
                                   [self = shared_from_this()](beast::error_code ec, std::size_t) {
                                     if (ec) return self->Fail("head: " + ec.message());
                                     self->OnHead();
                                   });
  }
  void OnHead() {
    const auto& h = parser_.get();
    out_.status = h.result_int();
    out_.rollout_id = std::string(h["X-RolloutCore-Rollout-Id"]);
    out_.admission_seq =
        std::strtoull(std::string(h["X-RolloutCore-Admission-Seq"]).c_str(), nullptr, 10);
    if (on_head_) on_head_(out_);
    ReadSome();
  }
  void ReadSome() {
    if (parser_.is_done()) return Finish();
    parser_.get().body().data = chunk_.data();
    parser_.get().body().size = chunk_.size();
    beast::http::async_read_some(
        socket_, buf_, parser_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
          if (ec == beast::http::error::need_buffer) ec = {};
          if (ec) return self->Fail("body: " + ec.message());
          self->Take(self->chunk_.size() - self->parser_.get().body().size);
          self->ReadSome();
        });
  }
  // Counts events across reads (an event may be split between two reads).
  void Take(std::size_t n) {
    out_.bytes += n;
    tail_.append(chunk_.data(), n);
    for (std::size_t at; (at = tail_.find("\n\n")) != std::string::npos;) {
      const std::string event = tail_.substr(0, at);
      tail_.erase(0, at + 2);
      if (event == "data: [DONE]")
        out_.done = true;
      else
        ++out_.events;
    }
    RC_CHECK(tail_.size() < (1 << 20));
  }
  void Finish() {
    beast::error_code ignored;
    socket_.close(ignored);
  }
  void Fail(const std::string& why) {
    out_.error = why;
    Finish();
  }

  tcp::socket socket_;
  tcp::endpoint ep_;
  StreamResult& out_;
  std::function<void(StreamResult&)> on_head_;
  beast::http::request<beast::http::string_body> req_;
  beast::flat_buffer buf_;
  beast::http::response_parser<beast::http::buffer_body> parser_;
  std::array<char, 16384> chunk_{};
  std::string tail_;
};

std::string stream_body(int max_tokens) {
  return json{{"model", "rc-double-model"},
              {"prompt", "hello"},
              {"max_tokens", max_tokens},
              {"stream", true}}
      .dump();
}

// The rollout's outcome in the journal: every admission and finish folded from the records.
std::map<std::string, RolloutOutcome> JournaledFinishes(journal::Journal& j) {
  std::map<std::string, RolloutOutcome> out;
  Status st = j.Scan(1, 0, [&](const journal::Record& r) {
    if (const auto* f = std::get_if<RolloutFinished>(&r.event)) out[f->rollout_id] = f->outcome;
    return Status::OK();
  });
  RC_CHECK(st.ok());
  return out;
}

void RaiseDescriptorLimit() {
  rlimit lim{};
  RC_CHECK(::getrlimit(RLIMIT_NOFILE, &lim) == 0);
  lim.rlim_cur = lim.rlim_max;
  (void)::setrlimit(RLIMIT_NOFILE, &lim);
}

// Proves the proxy holds 2,000 concurrent streamed rollouts on a few event-loop threads: every
// stream completes with [DONE] and all its tokens, every response head arrives only once its
// admission is durable in the journal, and every rollout's RolloutFinished{completed} is
// journaled. Catches a thread (or any other per-connection resource with a small bound) per
// stream, a head forwarded before its admission's group commit, and a finish lost under load.
TEST(ProxyStreams, TwoThousandConcurrentStreamsAreAdmittedAndFinishedDurably) {
  constexpr int kStreams = 2000;
  constexpr int kTokens = 20;
  RaiseDescriptorLimit();
  stack::StackOptions o;
  o.token_delay_ms = 20;
  o.engine_http_threads = kStreams + 64;
  o.tweak = [](ServeConfig& c) {
    c.http_connections_max = kStreams + 256;
    c.engine_connections_max = kStreams;
    c.io_threads = 2;
  };
  stack::ServiceStack s(o);
  asio::io_context io;
  const tcp::endpoint ep(asio::ip::make_address("127.0.0.1"),
                         static_cast<std::uint16_t>(s.svc->port()));
  std::vector<StreamResult> results(kStreams);
  journal::Journal& journal = s.svc->journal();
  for (auto& r : results) {
    std::make_shared<StreamClient>(io, ep, stream_body(kTokens), r, [&journal](StreamResult& h) {
      // The head is sent after the admission's commit: its record must be readable already.
      Result<journal::Record> rec = journal.Read(h.admission_seq);
      h.admission_durable_at_head =
          rec.ok() && std::holds_alternative<RolloutAdmitted>(rec->event) &&
          std::get<RolloutAdmitted>(rec->event).rollout_id == h.rollout_id;
    })->Start();
  }
  std::thread runner([&io] { io.run(); });
  runner.join();
  std::set<std::string> ids;
  int complete = 0;
  for (const StreamResult& r : results) {
    EXPECT_TRUE(r.error.empty()) << r.error;
    EXPECT_EQ(r.status, 200u);
    EXPECT_TRUE(r.admission_durable_at_head) << r.rollout_id;
    EXPECT_EQ(r.events, static_cast<std::uint64_t>(kTokens) + 1) << r.rollout_id;  // + usage-free
    complete += r.done ? 1 : 0;
    ids.insert(r.rollout_id);
  }
  EXPECT_EQ(complete, kStreams);
  EXPECT_EQ(ids.size(), static_cast<std::size_t>(kStreams));
  const auto finishes = JournaledFinishes(journal);
  for (const std::string& id : ids) {
    auto it = finishes.find(id);
    ASSERT_NE(it, finishes.end()) << "no RolloutFinished for " << id;
    EXPECT_EQ(it->second, RolloutOutcome::kCompleted) << id;
  }
  EXPECT_EQ(s.svc->metrics().proxy_in_flight.load(), 0);
}

// Proves a streamed generation far larger than any buffer of the proxy (over 16 MiB, the old
// whole-response bound) is relayed whole and finished completed. Catches a relay that appends
// the stream to one buffer (and aborts it at the bound) instead of passing it on read by read.
TEST(ProxyStreams, AStreamLongerThanAnyBufferIsRelayedWhole) {
  constexpr int kTokens = 120000;
  stack::StackOptions o;
  o.token_delay_ms = 0;
  o.engine_max_model_len = kTokens + 64;
  stack::ServiceStack s(o);
  asio::io_context io;
  const tcp::endpoint ep(asio::ip::make_address("127.0.0.1"),
                         static_cast<std::uint16_t>(s.svc->port()));
  StreamResult r;
  std::make_shared<StreamClient>(io, ep, stream_body(kTokens), r, nullptr)->Start();
  io.run();
  EXPECT_TRUE(r.error.empty()) << r.error;
  EXPECT_TRUE(r.done);
  EXPECT_GT(r.bytes, effects::kResponseBytesMax);
  EXPECT_EQ(r.events, static_cast<std::uint64_t>(kTokens) + 1);
  const auto finishes = JournaledFinishes(s.svc->journal());
  ASSERT_EQ(finishes.count(r.rollout_id), 1u);
  EXPECT_EQ(finishes.at(r.rollout_id), RolloutOutcome::kCompleted);
}

// Proves a client that stops reading a stream is cut at write_timeout_ms and its rollout
// finished as aborted, while the proxy stops reading the engine for it (back-pressure): the
// stream does not run to its end into a buffer. Catches unbounded buffering for a slow client
// and a rollout held open forever by a client that went silent.
TEST(ProxyStreams, AClientThatStopsReadingIsCutAtTheWriteDeadline) {
  constexpr int kTokens = 400000;  // far more than socket buffers hold
  stack::StackOptions o;
  o.token_delay_ms = 0;
  o.tweak = [](ServeConfig& c) { c.write_timeout_ms = 500; };
  o.engine_max_model_len = kTokens + 64;
  stack::ServiceStack s(o);
  const int fd = [&] {
    const int sock = ::socket(AF_INET, SOCK_STREAM, 0);
    int small = 4096;
    ::setsockopt(sock, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(s.svc->port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    RC_CHECK(::connect(sock, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    return sock;
  }();
  const std::string body = stream_body(kTokens);
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
      "application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  // Never read. The proxy must give up on this client and record the rollout aborted.
  const auto t0 = std::chrono::steady_clock::now();
  while (s.svc->metrics().finishes_aborted.load() == 0 &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(s.svc->metrics().finishes_aborted.load(), 1u);
  EXPECT_EQ(s.svc->metrics().finishes_completed.load(), 0u)
      << "the stream ran to its end although its client never read";
  EXPECT_EQ(s.svc->metrics().proxy_in_flight.load(), 0);
  ::close(fd);
}

// ---- streamed events held against the body budget ----

// A serve in front of `engine` (which passes what it does not script on to the double) with
// body_bytes_max `body_bytes` and body_memory_bytes_max `memory_bytes`.
stack::StackOptions BudgetedBehind(stack::ScriptedEngine& engine, std::uint64_t memory_bytes,
                                   std::size_t body_bytes) {
  stack::StackOptions o;
  o.dir_prefix = "rc-streambudget";
  o.tweak = [&engine, memory_bytes, body_bytes](ServeConfig& c) {
    engine.ForwardTo(c.engine_url);
    c.engine_url = engine.url();
    c.admit_wait_ms = 5000;
    c.body_bytes_max = body_bytes;
    c.body_memory_bytes_max = memory_bytes;
  };
  return o;
}

// A completion chunk's data with `text` in choice 0, padded with about `pad_bytes` of empty
// objects: a tree ~30 times its text.
std::string PaddedChunk(const std::string& text, std::size_t pad_bytes) {
  const std::string head = R"({"id":"cmpl-scripted","object":"text_completion","choices":[)";
  const std::string choice = R"({"index":0,"token_ids":[11],"prompt_token_ids":[1,2],"text":")";
  std::string data = head + choice + text + R"("}],"pad":[{})";
  while (data.size() < pad_bytes) data += ",{}";
  return data + "]}";
}

// The engine streams `data` as one event, then `[DONE]`.
stack::ScriptedEngine::Script EventThenDone(const std::string& data) {
  const std::string bytes = "data: " + data + "\n\ndata: [DONE]\n\n";
  return [bytes](const httplib::Request&, httplib::Response& res) {
    res.set_chunked_content_provider("text/event-stream", [bytes](size_t, httplib::DataSink& sink) {
      sink.write(bytes.data(), bytes.size());
      sink.done();
      return true;
    });
  };
}

// The engine streams `data` as one event, then keeps the stream open with a comment every 10 ms
// (10 s at most: never a hung test) until a write fails: `cut` is set once serve closed the
// engine request.
stack::ScriptedEngine::Script EventThenHang(const std::string& data, std::atomic<bool>& cut) {
  const std::string bytes = "data: " + data + "\n\n";
  return [bytes, &cut](const httplib::Request&, httplib::Response& res) {
    res.set_chunked_content_provider("text/event-stream",
                                     [bytes, &cut](size_t, httplib::DataSink& sink) {
                                       bool open = sink.write(bytes.data(), bytes.size());
                                       for (int i = 0; open && i < 1000; ++i) {
                                         std::this_thread::sleep_for(std::chrono::milliseconds(10));
                                         open = sink.write(": ping\n\n", 8);
                                       }
                                       if (!open) cut.store(true);
                                       sink.done();
                                       return open;
                                     });
  };
}

// Whether `done` holds within 10 s.
bool Eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 1000 && !done(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

// The outcomes the journal's RolloutFinished records give `rollout_id`, in order.
std::vector<RolloutOutcome> FinishesOf(journal::Journal& j, const std::string& rollout_id) {
  std::vector<RolloutOutcome> out;
  Status st = j.Scan(1, 0, [&](const journal::Record& r) {
    const auto* f = std::get_if<RolloutFinished>(&r.event);
    if (f != nullptr && f->rollout_id == rollout_id) out.push_back(f->outcome);
    return Status::OK();
  });
  RC_CHECK(st.ok());
  return out;
}

std::size_t Occurrences(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

httplib::Result PostStream(httplib::Client& c, const std::string& rollout_id) {
  return c.Post("/v1/completions", {{"X-RolloutCore-Rollout-Id", rollout_id}}, stream_body(4),
                "application/json");
}

// Proves a streamed event whose parse would take more of the body budget than is left (though
// less than the budget: the same event passes while the budget is free) is never parsed: the
// client gets an error event naming body_memory_bytes_max and one [DONE], the event is not
// relayed, the rollout is finished aborted exactly once, the engine request is closed, the budget
// returns to its idle value, and a normal stream then completes. Catches each stream's event
// trees (hundreds of MB for 4 MiB of "[{},...]") built outside body_memory_bytes_max: without the
// hold the refused event is relayed and the rollout completed.
TEST(ProxyStreamBudget, AnEventParsedPastWhatIsLeftEndsTheStream) {
  constexpr std::uint64_t kBudgetBytes = std::uint64_t{32} << 20;
  constexpr std::size_t kDeclaredBytes = std::size_t{16} << 20;  // what a slow upload holds
  stack::ScriptedEngine engine;
  stack::ServiceStack s(BudgetedBehind(engine, kBudgetBytes, kDeclaredBytes));
  const std::string event = PaddedChunk("held-event", 384 << 10);
  const std::uint64_t bound = StreamEventBytesBound(event);
  ASSERT_GT(bound, kBudgetBytes - kDeclaredBytes);
  ASSERT_LT(bound + (std::uint64_t{1} << 20), kBudgetBytes);
  const std::uint64_t idle = stack::BodyMemoryUsed(*s.svc);
  auto c = s.client(60);

  engine.Set("/v1/completions", EventThenDone(event));
  auto fits = PostStream(c, "event-fits-1");
  ASSERT_TRUE(fits) << httplib::to_string(fits.error());
  EXPECT_NE(fits->body.find("held-event"), std::string::npos) << fits->body.substr(0, 300);
  EXPECT_EQ(fits->body.find("body_memory_bytes_max"), std::string::npos);
  EXPECT_EQ(FinishesOf(s.svc->journal(), "event-fits-1"),
            std::vector<RolloutOutcome>{RolloutOutcome::kCompleted});

  // A client declaring a 16 MiB body and sending one byte holds 16 MiB from its head on.
  const int uploader = raw_http::connect_loopback(s.svc->port());
  ASSERT_TRUE(raw_http::send_all(uploader,
                                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 "Content-Type: application/json\r\nContent-Length: " +
                                     std::to_string(kDeclaredBytes) + "\r\n\r\n{"));
  ASSERT_TRUE(Eventually([&] { return stack::BodyMemoryUsed(*s.svc) >= idle + kDeclaredBytes; }));
  std::atomic<bool> engine_cut{false};
  engine.Set("/v1/completions", EventThenHang(event, engine_cut));
  const std::uint64_t completed = s.svc->metrics().finishes_completed.load();
  auto refused = PostStream(c, "event-refused-1");
  ASSERT_TRUE(refused) << httplib::to_string(refused.error());
  EXPECT_EQ(refused->status, 200);
  EXPECT_NE(refused->body.find("body_memory_bytes_max"), std::string::npos) << refused->body;
  EXPECT_EQ(refused->body.find("held-event"), std::string::npos) << "the refused event was relayed";
  EXPECT_EQ(Occurrences(refused->body, "data: [DONE]"), 1u) << refused->body;
  EXPECT_EQ(FinishesOf(s.svc->journal(), "event-refused-1"),
            std::vector<RolloutOutcome>{RolloutOutcome::kAborted});
  EXPECT_EQ(s.svc->metrics().finishes_completed.load(), completed);
  EXPECT_TRUE(Eventually([&] { return engine_cut.load(); })) << "the engine request stayed open";
  ::close(uploader);
  EXPECT_TRUE(Eventually([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }))
      << "held " << stack::BodyMemoryUsed(*s.svc) << " after the streams ended, " << idle
      << " idle";

  engine.Clear("/v1/completions");  // the double's own stream
  auto normal = PostStream(c, "normal-1");
  ASSERT_TRUE(normal) << httplib::to_string(normal.error());
  EXPECT_EQ(normal->body.find("body_memory_bytes_max"), std::string::npos) << normal->body;
  EXPECT_EQ(Occurrences(normal->body, "data: [DONE]"), 1u) << normal->body;
  EXPECT_EQ(FinishesOf(s.svc->journal(), "normal-1"),
            std::vector<RolloutOutcome>{RolloutOutcome::kCompleted});
  EXPECT_TRUE(Eventually([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }));
}

// Proves a streamed event's share of the body budget goes back once the event is relayed, while
// its stream goes on, and that a client that then leaves takes nothing with it: the rollout is
// aborted once, the engine request closed, the budget back at its idle value. Catches a share
// held until the stream ends (a few long streams with one large event each refusing everyone
// else) and one kept by a stream its client left.
TEST(ProxyStreamBudget, AnEventsShareGoesBackOnceRelayedAndWhenTheClientLeaves) {
  stack::ScriptedEngine engine;
  stack::ServiceStack s(BudgetedBehind(engine, std::uint64_t{64} << 20, 64 << 10));
  const std::string event = PaddedChunk("held-event", 384 << 10);
  const std::uint64_t bound = StreamEventBytesBound(event);
  const std::uint64_t idle = stack::BodyMemoryUsed(*s.svc);
  std::atomic<bool> engine_cut{false};
  engine.Set("/v1/completions", EventThenHang(event, engine_cut));
  const std::string body = stream_body(4);
  const int fd = raw_http::connect_loopback(s.svc->port());
  ASSERT_TRUE(raw_http::send_all(
      fd,
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "X-RolloutCore-Rollout-Id: leaver-1\r\nContent-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body));
  std::string got;
  char buf[4096];
  while (got.find("held-event") == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0) << "the stream ended before its event: " << got.substr(0, 300);
    got.append(buf, static_cast<std::size_t>(n));
  }
  // The event was relayed; the stream still holds its request and trace, not the event's trees.
  EXPECT_LT(stack::BodyMemoryUsed(*s.svc), idle + bound / 2)
      << "the relayed event's share is still held";
  EXPECT_FALSE(engine_cut.load());
  ::close(fd);
  EXPECT_TRUE(Eventually([&] { return !FinishesOf(s.svc->journal(), "leaver-1").empty(); }));
  EXPECT_EQ(FinishesOf(s.svc->journal(), "leaver-1"),
            std::vector<RolloutOutcome>{RolloutOutcome::kAborted});
  EXPECT_TRUE(Eventually([&] { return engine_cut.load(); })) << "the engine request stayed open";
  EXPECT_TRUE(Eventually([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }))
      << "held " << stack::BodyMemoryUsed(*s.svc) << " after the client left, " << idle << " idle";
}

// The engine streams `events` events of `data` each, back to back, then keeps the stream open
// with a comment every 10 ms (10 s at most: never a hung test) until a write fails.
stack::ScriptedEngine::Script EventsThenHang(const std::string& data, int events) {
  const std::string bytes = "data: " + data + "\n\n";
  return [bytes, events](const httplib::Request&, httplib::Response& res) {
    res.set_chunked_content_provider("text/event-stream",
                                     [bytes, events](size_t, httplib::DataSink& sink) {
                                       bool open = true;
                                       for (int i = 0; open && i < events; ++i)
                                         open = sink.write(bytes.data(), bytes.size());
                                       for (int i = 0; open && i < 1000; ++i) {
                                         std::this_thread::sleep_for(std::chrono::milliseconds(10));
                                         open = sink.write(": ping\n\n", 8);
                                       }
                                       sink.done();
                                       return open;
                                     });
  };
}

// Proves the events a stalled client has not taken stay held against the body budget: with the
// engine streaming 3 MiB events to a client that reads nothing, the budget holds at least one
// event's bytes for as long as the client stalls (not just while an event is parsed), and once
// the client leaves the rollout is finished aborted once and the budget is back at its idle
// value. Catches a stream's client events (and its pending SSE bytes)
// held outside body_memory_bytes_max while the write of them waits on the client: up to ~8 MiB
// per stream, on every connection allowed.
TEST(ProxyStreamBudget, EventsAStalledClientHasNotTakenStayHeld) {
  constexpr std::size_t kTextBytes = std::size_t{3} << 20;  // an event, under kSseEventBytesMax
  stack::ScriptedEngine engine;
  stack::ServiceStack s(BudgetedBehind(engine, std::uint64_t{64} << 20, 64 << 10));
  const std::string data =
      R"({"id":"cmpl-scripted","object":"text_completion","choices":[{"index":0,"text":")" +
      std::string(kTextBytes, 'a') + R"(","token_ids":[11],"prompt_token_ids":[1,2]}]})";
  engine.Set("/v1/completions", EventsThenHang(data, 6));  // past any socket buffers
  const std::uint64_t idle = stack::BodyMemoryUsed(*s.svc);
  const std::string body = stream_body(4);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int small = 4096;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(s.svc->port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_TRUE(raw_http::send_all(
      fd,
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "X-RolloutCore-Rollout-Id: stalled-stream-1\r\nContent-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body));
  // Never read. Each event's parse holds more than this for an instant; what waits on the
  // client must hold it for as long as the client stalls.
  ASSERT_TRUE(Eventually([&] { return stack::BodyMemoryUsed(*s.svc) >= idle + kTextBytes; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_GE(stack::BodyMemoryUsed(*s.svc), idle + kTextBytes) << "the events waiting are not held";
  EXPECT_TRUE(FinishesOf(s.svc->journal(), "stalled-stream-1").empty());
  ::close(fd);
  EXPECT_TRUE(
      Eventually([&] { return !FinishesOf(s.svc->journal(), "stalled-stream-1").empty(); }));
  EXPECT_EQ(FinishesOf(s.svc->journal(), "stalled-stream-1"),
            std::vector<RolloutOutcome>{RolloutOutcome::kAborted});
  EXPECT_TRUE(Eventually([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }))
      << "held " << stack::BodyMemoryUsed(*s.svc) << " after the client left, " << idle << " idle";
}

// The engine streams one event of `big` data, then up to `tokens` events of `token` data 2 ms
// apart, then [DONE], stopping once a write fails.
stack::ScriptedEngine::Script BigEventThenTokens(const std::string& big, const std::string& token,
                                                 int tokens) {
  const std::string first = "data: " + big + "\n\n";
  const std::string each = "data: " + token + "\n\n";
  return [first, each, tokens](const httplib::Request&, httplib::Response& res) {
    res.set_chunked_content_provider("text/event-stream",
                                     [first, each, tokens](size_t, httplib::DataSink& sink) {
                                       bool open = sink.write(first.data(), first.size());
                                       for (int i = 0; open && i < tokens; ++i) {
                                         std::this_thread::sleep_for(std::chrono::milliseconds(2));
                                         open = sink.write(each.data(), each.size());
                                       }
                                       if (open) open = sink.write("data: [DONE]\n\n", 14);
                                       sink.done();
                                       return open;
                                     });
  };
}

// Proves a stream that relayed one large event (300 KiB, whose SSE bytes grew the stream's
// pending buffer to several hundred KiB) holds none of the body budget for its buffers while the
// token events that follow stream on: once its client took the large event, the budget comes
// back under its idle value plus kStreamBufferUnheldBytesMax (the request's copy and the trace
// are all it holds) and stays there token after token. Catches the buffer a large event left kept
// for the rest of the stream (it was given back only past 1 MiB): every stream that once relayed
// such an event held it to its end, and paid two atomic operations on the shared budget for every
// token read.
TEST(ProxyStreamBudget, AStreamHoldsNothingForTheBufferALargeEventLeft) {
  stack::ScriptedEngine engine;
  stack::ServiceStack s(BudgetedBehind(engine, std::uint64_t{64} << 20, 64 << 10));
  const std::string big = R"({"id":"cmpl-scripted","object":"text_completion",)"
                          R"("choices":[{"index":0,"text":"big-event)" +
                          std::string(300 << 10, 'b') +
                          R"(","token_ids":[11],"prompt_token_ids":[1,2]}]})";
  const std::string token = R"({"id":"cmpl-scripted","object":"text_completion",)"
                            R"("choices":[{"index":0,"text":"tok-ev","token_ids":[12]}]})";
  // Tokens for 20 s at least: the stream outlives the waits below (its end gives all back).
  engine.Set("/v1/completions", BigEventThenTokens(big, token, 10000));
  const std::uint64_t idle = stack::BodyMemoryUsed(*s.svc);
  const std::string body = stream_body(4);
  const int fd = raw_http::connect_loopback(s.svc->port());
  ASSERT_TRUE(raw_http::send_all(
      fd,
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "X-RolloutCore-Rollout-Id: after-big-1\r\nContent-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body));
  std::string got;
  // Reads until `tokens` token events came after the large one.
  const auto read_tokens = [&](std::size_t tokens) {
    char buf[16 << 10];
    for (;;) {
      const std::size_t at = got.find("big-event");
      if (at != std::string::npos && Occurrences(got.substr(at), "tok-ev") >= tokens) return true;
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) return false;
      got.append(buf, static_cast<std::size_t>(n));
    }
  };
  const auto held = [&] {
    const std::uint64_t used = stack::BodyMemoryUsed(*s.svc);
    return used > idle ? used - idle : 0;
  };
  ASSERT_TRUE(read_tokens(20)) << got.substr(got.size() > 300 ? got.size() - 300 : 0);
  EXPECT_TRUE(Eventually([&] { return held() < kStreamBufferUnheldBytesMax; }))
      << "a token stream holds " << held() << " bytes after its large event";
  ASSERT_TRUE(read_tokens(40)) << got.substr(got.size() > 300 ? got.size() - 300 : 0);
  EXPECT_LT(held(), kStreamBufferUnheldBytesMax) << "a token read after the large event was held";
  EXPECT_EQ(got.find("body_memory_bytes_max"), std::string::npos) << "the stream was refused";
  EXPECT_TRUE(FinishesOf(s.svc->journal(), "after-big-1").empty()) << "the stream ended early";
  ::close(fd);
  EXPECT_TRUE(Eventually([&] { return !FinishesOf(s.svc->journal(), "after-big-1").empty(); }));
  EXPECT_TRUE(Eventually([&] { return stack::BodyMemoryUsed(*s.svc) == idle; }))
      << "held " << stack::BodyMemoryUsed(*s.svc) << " after the client left, " << idle << " idle";
}

}  // namespace
}  // namespace rc::service
