// Streams through the event-driven proxy at scale and at length: thousands of concurrent streamed
// rollouts each admitted durably before their first byte and finished in the journal, a stream
// longer than any buffer relayed whole, and a client that stops reading cut at the write deadline
// (the engine stream is not buffered for it). Real Service, real RocksDB, the in-process vLLM
// double, loopback HTTP; the clients are one Boost.Beast event loop.
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
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

}  // namespace
}  // namespace rc::service
