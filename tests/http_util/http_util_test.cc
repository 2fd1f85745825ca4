// Tests of service/http_util.h: every reply serialises without throwing whatever bytes it holds,
// and query integers are parsed without exceptions (400 for anything that is not one in range).
#include "service/http_util.h"

#include <gtest/gtest.h>

#include <cctype>
#include <string>
#include <vector>

namespace rc::service {
namespace {

// A request whose target carries `?key=value` (percent-encoded as a client would send it).
struct WithParam {
  WithParam(const std::string& key, const std::string& value) {
    static const char* kHex = "0123456789ABCDEF";
    std::string target = "/v1/events?" + key + "=";
    for (unsigned char c : value) {
      if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
        target += static_cast<char>(c);
      } else {
        target += '%';
        target += kHex[c >> 4];
        target += kHex[c & 15];
      }
    }
    message.target(target);
  }
  operator const ApiRequest&() const { return api; }  // NOLINT: reads like the old request
  HttpRequest message;
  ApiRequest api{message, {}, {}};
};

// Proves SendError serialises a message cut inside a UTF-8 character (an engine error body
// truncated to its byte bound) instead of throwing; catches the dump() that threw type_error 316
// and terminated the server from a streaming callback.
TEST(HttpUtil, SendErrorWithCutUtf8DoesNotThrow) {
  HttpResponse res;
  const std::string cut = "engine said: caf\xC3";  // "café" cut after the first byte of 'é'
  EXPECT_NO_THROW(SendError(res, 502, "engine_error", cut));
  EXPECT_EQ(res.result_int(), 502u);
  const nlohmann::json back = nlohmann::json::parse(res.body(), nullptr, false);
  ASSERT_FALSE(back.is_discarded()) << res.body();
  EXPECT_EQ(back["error"]["message"], "engine said: caf\xEF\xBF\xBD");
  EXPECT_EQ(back["error"]["code"], 502);
}

// Proves DumpSafe and SendJson survive every byte value in keys and values and produce one
// line of valid JSON; catches a helper that passes the default (throwing) error handler.
TEST(HttpUtil, DumpSafeNeverThrows) {
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  nlohmann::json j = {{"v", all}, {all, 1}, {"nested", {{"x", std::string("\xFF\xFE")}}}};
  std::string out;
  EXPECT_NO_THROW(out = DumpSafe(j));
  EXPECT_EQ(out.find('\n'), std::string::npos);
  EXPECT_FALSE(nlohmann::json::parse(out, nullptr, false).is_discarded());
  EXPECT_NO_THROW(out = DumpSafe(j, 2));
  EXPECT_FALSE(nlohmann::json::parse(out, nullptr, false).is_discarded());
  HttpResponse res;
  EXPECT_NO_THROW(SendJson(res, 200, j));
  EXPECT_FALSE(nlohmann::json::parse(res.body(), nullptr, false).is_discarded());
}

// Proves the query parser accepts exactly the decimal integers in range, up to 2^64-1, and turns
// everything else into InvalidArgument (400); catches std::stoull throwing out_of_range on
// since=18446744073709551616 (a 500) and any sign, space or hex prefix slipping through.
TEST(HttpUtil, QueryU64RejectsBeyond64BitsWithoutThrowing) {
  auto q = [](const std::string& v, std::uint64_t lo = 0, std::uint64_t hi = UINT64_MAX) {
    return QueryU64(WithParam("since", v), "since", 42, lo, hi);
  };
  EXPECT_EQ(*q("0"), 0u);
  EXPECT_EQ(*q("18446744073709551615"), UINT64_MAX);
  EXPECT_EQ(*q("000000000000000000000000007"), 7u);
  for (const std::string& bad : std::vector<std::string>{
           "18446744073709551616", "99999999999999999999", std::string(1000, '9'), "", "-1", "+1",
           " 1", "1 ", "0x10", "1e3", "1.0", "١", std::string("1\0", 2)}) {
    Result<std::uint64_t> r = Result<std::uint64_t>(Status::Internal("unset"));
    EXPECT_NO_THROW(r = q(bad)) << bad;
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(HttpStatusFor(r.status()), 400);
  }
  EXPECT_FALSE(q("5", 1, 4).ok());
  EXPECT_FALSE(q("0", 1, 4).ok());
  EXPECT_EQ(*q("4", 1, 4), 4u);
  const HttpRequest bare;
  EXPECT_EQ(*QueryU64(ApiRequest{bare, {}, {}}, "limit", 42, 1, 100), 42u);  // absent: fallback
  for (const char* key : {"limit", "after", "timeout_ms"}) {
    EXPECT_FALSE(QueryU64(WithParam(key, "18446744073709551616"), key, 1, 0, UINT64_MAX).ok());
  }
}

// Proves a JSON body integer above INT64_MAX is out of range rather than wrapping to a negative
// that a [-1, N] bound would accept; catches get<int64_t>() on an unsigned value.
TEST(HttpUtil, GetIntDoesNotWrapUnsigned) {
  const nlohmann::json body = nlohmann::json::parse(R"({"n": 18446744073709551615, "m": 7})");
  auto n = GetInt(body, "n", 0, -1, 100);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(*GetInt(body, "m", 0, -1, 100), 7);
  EXPECT_EQ(*GetInt(body, "absent", 5, -1, 100), 5);
}

}  // namespace
}  // namespace rc::service
