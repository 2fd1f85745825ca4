// Proves that the TCPStore master's frame handler, fed arbitrary bytes on several connections,
// keeps every store bound and its byte count exact, never lets a client create or change the
// write-once rendezvous key, and still answers a well-formed PING / SET / GET exactly afterwards;
// catches a length or budget slip that would let a peer on the rendezvous address grow the store,
// corrupt it, or hijack the NCCL unique id.
//
// Input: a sequence of operations. Op byte: bits 0-1 the connection (0-2), bits 6-7 the kind
// (0-2: feed the next n bytes, n = the byte after the op byte; 3: a server-side Set of the
// write-once key or of an ordinary key). A probe on a fourth connection ends every input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "effects/nccl/rendezvous.h"
#include "effects/nccl/tcp_store.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

namespace nccl = rc::effects::nccl;

const std::string kWriteOnce(nccl::kUniqueIdWireKey);

template <typename T>
void put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void put_bytes(std::string* out, const std::string& s) {
  put<std::uint64_t>(out, s.size());
  out->append(s);
}

nccl::TcpStoreOptions small_bounds() {
  nccl::TcpStoreOptions o;
  o.connections_max = 4;
  o.key_bytes_max = 64;
  o.value_bytes_max = 256;
  o.keys_max = 16;
  o.store_bytes_max = 2048;
  o.keys_per_query_max = 8;
  o.query_bytes_max = 1024;
  o.output_bytes_max = 512;
  o.buffered_bytes_max = 16384;
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  nccl::TcpStoreFrameHarness h(small_bounds(), 4);
  std::optional<std::string> write_once;  // what the master set, once
  std::size_t i = 0;
  while (i < size) {
    const std::uint8_t op = data[i++];
    const std::size_t conn = std::min<std::size_t>(op & 3, 2);
    std::size_t n = 0;
    if (i < size) {
      const std::uint8_t want = data[i++];
      n = std::min<std::size_t>(want, size - i);
    }
    const char* bytes = reinterpret_cast<const char*>(data + i);
    i += n;
    if ((op >> 6) == 3) {
      const std::string value(bytes, n);
      if (op & 4) {
        const rc::Status st = h.SetServer(kWriteOnce, value);
        if (write_once) FUZZ_CHECK(!st.ok());  // a write-once key is set once
        if (st.ok()) write_once = value;
      } else {
        (void)h.SetServer("/server/" + std::to_string(op & 3), value);
      }
    } else {
      const bool was_closed = h.closed(conn);
      h.Feed(conn, bytes, n);
      if (was_closed) FUZZ_CHECK(h.closed(conn));
      if (op & 0x20) (void)h.TakeOutput(conn);  // the peer reads its replies now and then
    }
    const std::string bad = h.CheckInvariants();
    if (!bad.empty()) {
      std::fprintf(stderr, "invariant: %s\n", bad.c_str());
      std::abort();
    }
    FUZZ_CHECK(h.Get(kWriteOnce) == write_once);  // no client created, changed or deleted it
  }

  // A well-behaved peer on a fresh connection is still served exactly.
  std::string q;
  put<std::uint8_t>(&q, 0);  // VALIDATE
  put<std::uint32_t>(&q, nccl::kTcpStoreValidateMagic);
  put<std::uint8_t>(&q, 13);  // PING
  put<std::uint32_t>(&q, 0xA5C3u);
  h.Feed(3, q.data(), q.size());
  FUZZ_CHECK(!h.closed(3));
  std::string out = h.TakeOutput(3);
  std::string want;
  put<std::uint32_t>(&want, 0xA5C3u);
  FUZZ_CHECK(out == want);

  const std::string value = "probe-" + std::to_string(size);
  q.clear();
  put<std::uint8_t>(&q, 1);  // SET /probe
  put_bytes(&q, "/probe");
  put_bytes(&q, value);
  put<std::uint8_t>(&q, 3);  // GET /probe
  put_bytes(&q, "/probe");
  h.Feed(3, q.data(), q.size());
  out = h.TakeOutput(3);
  if (!h.closed(3)) {  // closed only when the store was full (a budget refusal)
    want.clear();
    put_bytes(&want, value);
    FUZZ_CHECK(out == want);
    FUZZ_CHECK(h.Get("/probe") == value);
  } else {
    FUZZ_CHECK(h.stats().budget_refusals > 0);
  }
  FUZZ_CHECK(h.CheckInvariants().empty());
  return 0;
}
