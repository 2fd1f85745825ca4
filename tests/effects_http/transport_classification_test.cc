// The transport table of engine_client.h, row by row, against classify_transport() and
// refusal_before_sending(), plus every curl code the classifier does not name.
#include "effects/http/engine_client.h"

#include <curl/curl.h>
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "tests/effects_http/test_servers.h"

namespace rc::effects {
namespace {

using rc::testing::ClosedPort;

TransferEnd End(int curl_code, long http_status, bool request_bytes_sent) {
  TransferEnd e;
  e.curl_code = curl_code;
  e.http_status = http_status;
  e.request_bytes_sent = request_bytes_sent;
  return e;
}

void ExpectVerdict(const TransferEnd& e, Transport transport, std::int32_t http_status,
                   TransferEnding ending) {
  SCOPED_TRACE("curl_code=" + std::to_string(e.curl_code) + " status=" +
               std::to_string(e.http_status) + " sent=" + std::to_string(e.request_bytes_sent) +
               " cancelled=" + std::to_string(e.cancelled_in_flight) +
               " write_refused=" + std::to_string(e.write_refused));
  const TransportVerdict v = classify_transport(e);
  EXPECT_EQ(v.transport, transport);
  EXPECT_EQ(v.http_status, http_status);
  EXPECT_EQ(v.ending, ending);
}

// kConnectFailed row, curl part: proves a refused connect or a failed name lookup is "never
// sent"; would catch one of them reported as kBroken or kTimeout (a possible mutation).
TEST(TransportClassification, ConnectAndResolveFailuresNeverReachedTheEngine) {
  for (int code :
       {CURLE_COULDNT_CONNECT, CURLE_COULDNT_RESOLVE_HOST, CURLE_COULDNT_RESOLVE_PROXY}) {
    ExpectVerdict(End(code, 0, false), Transport::kConnectFailed, 0, TransferEnding::kCurlFailed);
  }
}

// kConnectFailed and kTimeout rows, curl timeout: proves a timeout is "never sent" only while no
// request byte left and kTimeout once one did; would catch a curl timeout classified as a
// refusal (the fold would retry an update that may have run) or a connect timeout as kTimeout.
TEST(TransportClassification, CurlTimeoutDependsOnWhetherAByteWasSent) {
  ExpectVerdict(End(CURLE_OPERATION_TIMEDOUT, 0, false), Transport::kConnectFailed, 0,
                TransferEnding::kCurlFailed);
  ExpectVerdict(End(CURLE_OPERATION_TIMEDOUT, 0, true), Transport::kTimeout, 0,
                TransferEnding::kCurlFailed);
  // Timed out while the body arrived: the status line does not make it a response.
  ExpectVerdict(End(CURLE_OPERATION_TIMEDOUT, 200, true), Transport::kTimeout, 0,
                TransferEnding::kCurlFailed);
}

// kConnectFailed and kTimeout rows, cancellation, and the rule that a cancel outranks curl:
// proves a cancel is "never sent" before a byte left and kTimeout after, whatever curl said;
// would catch a cancel after the request left reported as a refusal, or a cancel that lost to a
// status line already received.
TEST(TransportClassification, CancelDependsOnWhetherAByteWasSentAndOutranksCurl) {
  for (int code : {CURLE_OK, CURLE_OPERATION_TIMEDOUT, CURLE_RECV_ERROR, CURLE_WRITE_ERROR}) {
    for (long status : {0L, 200L, 503L}) {
      TransferEnd before = End(code, status, false);
      before.cancelled_in_flight = true;
      ExpectVerdict(before, Transport::kConnectFailed, 0, TransferEnding::kCancelled);
      TransferEnd after = End(code, status, true);
      after.cancelled_in_flight = true;
      after.write_refused = true;
      ExpectVerdict(after, Transport::kTimeout, 0, TransferEnding::kCancelled);
    }
  }
}

// kConnectFailed row, local refusals: proves a spent deadline, a cancel before start and a body
// over kRequestBytesMax are refused in that order with their texts, and a body at the bound is
// sent; would catch an off-by-one on the bound or a zero deadline handed to curl (no deadline).
TEST(TransportClassification, LocalRefusalsInOrder) {
  EXPECT_EQ(refusal_before_sending(0, true, kRequestBytesMax + 1), "deadline spent before sending");
  EXPECT_EQ(refusal_before_sending(1, true, kRequestBytesMax + 1), "cancelled before sending");
  EXPECT_EQ(refusal_before_sending(1, false, kRequestBytesMax + 1),
            "request body of " + std::to_string(kRequestBytesMax + 1) + " bytes exceeds " +
                std::to_string(kRequestBytesMax) + "; not sent");
  EXPECT_EQ(refusal_before_sending(1, false, kRequestBytesMax), std::nullopt);
  EXPECT_EQ(refusal_before_sending(1, false, 0), std::nullopt);
}

// kConnectFailed row through the client: proves a refused call is never sent, with status 0 and
// the refusal's text; would catch a refusal that still reaches curl (a closed port would then
// answer with curl's own connect error) or one reported as a response.
TEST(TransportClassification, ClientReportsLocalRefusalsAsNeverSent) {
  EngineClient c("http://127.0.0.1:" + std::to_string(ClosedPort()));
  HttpReply spent = c.Health(CallOptions{0, std::nullopt});
  EXPECT_TRUE(spent.http.never_sent());
  EXPECT_EQ(spent.http.http_status, 0);
  EXPECT_EQ(spent.http.error, "deadline spent before sending");
  CancelToken token;
  token.Cancel();
  HttpReply cancelled = c.Health(CallOptions{std::nullopt, token});
  EXPECT_TRUE(cancelled.http.never_sent());
  EXPECT_EQ(cancelled.http.error, "cancelled before sending");
}

// kBroken row, named codes: proves a connection dropped mid-exchange is kBroken whether or not a
// status line had arrived; would catch a dropped exchange reported as a response or as "never
// sent" (the engine may have acted on it).
TEST(TransportClassification, DroppedExchangeIsBroken) {
  for (int code : {CURLE_RECV_ERROR, CURLE_SEND_ERROR, CURLE_GOT_NOTHING, CURLE_PARTIAL_FILE}) {
    for (long status : {0L, 200L}) {
      ExpectVerdict(End(code, status, true), Transport::kBroken, 0, TransferEnding::kCurlFailed);
    }
  }
}

// kBroken row, the rest: proves a clean curl end without a status line and a write error the
// body sink did not cause are kBroken; would catch either read as a response.
TEST(TransportClassification, NoStatusLineAndForeignWriteErrorAreBroken) {
  ExpectVerdict(End(CURLE_OK, 0, true), Transport::kBroken, 0, TransferEnding::kNoStatus);
  TransferEnd refused_without_status = End(CURLE_WRITE_ERROR, 0, true);
  refused_without_status.write_refused = true;
  ExpectVerdict(refused_without_status, Transport::kBroken, 0, TransferEnding::kNoStatus);
  ExpectVerdict(End(CURLE_WRITE_ERROR, 200, true), Transport::kBroken, 0,
                TransferEnding::kCurlFailed);
}

// kBroken row, "every other curl failure": walks every CURLcode the classifier does not name and
// proves each is kBroken with status 0; would catch a new special case that lets some curl
// failure pass as a response or as "never sent".
TEST(TransportClassification, EveryOtherCurlFailureIsBroken) {
  const std::set<int> named = {CURLE_OK,
                               CURLE_COULDNT_CONNECT,
                               CURLE_COULDNT_RESOLVE_HOST,
                               CURLE_COULDNT_RESOLVE_PROXY,
                               CURLE_OPERATION_TIMEDOUT,
                               CURLE_FILESIZE_EXCEEDED,
                               CURLE_WRITE_ERROR};
  int walked = 0;
  for (int code = 0; code < CURL_LAST; ++code) {
    if (named.count(code) != 0) continue;
    ++walked;
    for (bool sent : {false, true}) {
      for (long status : {0L, 200L, 503L}) {
        TransferEnd e = End(code, status, sent);
        e.write_refused = (code % 2) == 0;  // only a write error may be the sink's own
        ExpectVerdict(e, Transport::kBroken, 0, TransferEnding::kCurlFailed);
      }
    }
  }
  EXPECT_GE(walked, 80);  // the table covers the codes this libcurl defines
}

// kOk row: proves a status line that curl ended cleanly is a response carrying that status
// (non-2xx included), and so is a body cut off at kResponseBytesMax by the sink or by
// CURLE_FILESIZE_EXCEEDED (whose body is then not read); would catch a 5xx or a cut-off body
// reported as a transport failure (the fold would then call a well-answered request lost).
TEST(TransportClassification, StatusLineIsAResponse) {
  for (long status : {200L, 204L, 404L, 503L}) {
    ExpectVerdict(End(CURLE_OK, status, true), Transport::kOk, static_cast<std::int32_t>(status),
                  TransferEnding::kResponse);
  }
  TransferEnd cut_by_sink = End(CURLE_WRITE_ERROR, 200, true);
  cut_by_sink.write_refused = true;
  ExpectVerdict(cut_by_sink, Transport::kOk, 200, TransferEnding::kResponse);
  ExpectVerdict(End(CURLE_FILESIZE_EXCEEDED, 200, true), Transport::kOk, 200,
                TransferEnding::kCurlFailed);
}

}  // namespace
}  // namespace rc::effects
