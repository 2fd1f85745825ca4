// Proves that every TCPStore query type acts exactly once however its bytes are split across
// receives: a session of all fourteen query types fed one byte at a time leaves the same replies,
// store and counters as the same session fed whole. It catches a query handler that replies or
// writes before it has read its last field, which would repeat that effect (an ADD counted twice,
// a reply sent twice) each time the rest of the query is still in flight.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "effects/nccl/tcp_store.h"

namespace rc::effects::nccl {
namespace {

using Q = StoreQuery;

class Session {
 public:
  Session& Type(Q q) { return Pod(static_cast<std::uint8_t>(q)); }
  template <typename T>
  Session& Pod(T v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  Session& Str(const std::string& s) {
    Pod<std::uint64_t>(s.size());
    bytes_.append(s);
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

// One of each query type, each one's outcome depending on the ones before it.
std::string EveryQueryType() {
  Session s;
  s.Type(Q::kValidate).Pod<std::uint32_t>(kTcpStoreValidateMagic);
  s.Type(Q::kPing).Pod<std::uint32_t>(0xBEEF);
  s.Type(Q::kSet).Str("/a").Str("alpha");
  s.Type(Q::kCompareSet).Str("/a").Str("alpha").Str("beta");
  s.Type(Q::kGet).Str("/a");
  s.Type(Q::kAdd).Str("/n").Pod<std::int64_t>(5);
  s.Type(Q::kCheck).Pod<std::uint64_t>(2).Str("/a").Str("/n");
  s.Type(Q::kWait).Pod<std::uint64_t>(1).Str("/later");
  s.Type(Q::kCancelWait);
  s.Type(Q::kGetNumKeys);
  s.Type(Q::kDeleteKey).Str("/a");
  s.Type(Q::kAppend).Str("/n").Str("0");
  s.Type(Q::kMultiSet).Pod<std::uint64_t>(2).Str("/x").Str("1").Str("/y").Str("2");
  s.Type(Q::kMultiGet).Pod<std::uint64_t>(3).Str("/x").Str("/y").Str("/n");
  return s.bytes();
}

struct Outcome {
  std::string replies;
  TcpStoreStats stats;
  bool closed = false;
};

Outcome Serve(const std::string& bytes, std::size_t piece_bytes) {
  TcpStoreFrameHarness h(TcpStoreOptions{}, 1);
  for (std::size_t at = 0; at < bytes.size(); at += piece_bytes) {
    h.Feed(0, bytes.data() + at, std::min(piece_bytes, bytes.size() - at));
  }
  Outcome o{h.TakeOutput(0), h.stats(), h.closed(0)};
  EXPECT_EQ(h.Get("/n"), std::optional<std::string>("50"));
  EXPECT_EQ(h.Get("/a"), std::nullopt);
  EXPECT_EQ(h.CheckInvariants(), "");
  return o;
}

TEST(TcpStoreSplit, EveryQueryTypeActsOnceWhateverTheSplit) {
  const std::string session = EveryQueryType();
  const Outcome whole = Serve(session, session.size());
  ASSERT_FALSE(whole.closed);
  EXPECT_EQ(whole.stats.queries, 14u);
  EXPECT_EQ(whole.stats.protocol_errors, 0u);
  for (std::size_t piece : {1u, 2u, 3u, 7u, 13u}) {
    const Outcome split = Serve(session, piece);
    EXPECT_FALSE(split.closed) << piece;
    EXPECT_EQ(split.replies, whole.replies) << piece;
    EXPECT_EQ(split.stats.queries, whole.stats.queries) << piece;
    EXPECT_EQ(split.stats.stored_bytes, whole.stats.stored_bytes) << piece;
  }
}

}  // namespace
}  // namespace rc::effects::nccl
