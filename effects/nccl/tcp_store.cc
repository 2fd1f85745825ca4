#include "effects/nccl/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <system_error>
#include <thread>
#include <vector>

namespace rc::effects::nccl {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint8_t kCheckReady = 0, kCheckNotReady = 1;
constexpr std::uint8_t kWaitStop = 0, kWaitCanceled = 1;
constexpr int kPollTickMs = 100;
constexpr std::size_t kIdleBufferBytesMax = 64u << 10;  // an emptied buffer keeps at most this

enum class Parse { kOk, kNeedMore, kBad };

// Reads one query's fields from a connection's input without consuming it until complete.
class Reader {
 public:
  Reader(const std::string& buf, std::size_t key_max, std::size_t value_max)
      : buf_(buf), key_max_(key_max), value_max_(value_max) {}
  template <typename T>
  Parse Pod(T* out) {
    if (buf_.size() - pos_ < sizeof(T)) return Parse::kNeedMore;
    std::memcpy(out, buf_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Parse::kOk;
  }
  Parse Bytes(std::string* out, bool is_key) {
    std::uint64_t len = 0;
    if (Parse p = Pod(&len); p != Parse::kOk) return p;
    if (len > (is_key ? key_max_ : value_max_)) return Parse::kBad;
    if (buf_.size() - pos_ < len) return Parse::kNeedMore;
    out->assign(buf_.data() + pos_, len);
    pos_ += len;
    return Parse::kOk;
  }
  std::size_t pos() const { return pos_; }

 private:
  const std::string& buf_;
  std::size_t pos_ = 0;
  std::size_t key_max_, value_max_;
};

#define RC_PARSE(expr)               \
  do {                               \
    Parse p_ = (expr);               \
    if (p_ != Parse::kOk) return p_; \
  } while (0)

struct Conn {
  int fd = -1;
  std::string in;
  std::string out;
  std::vector<std::string> wait_keys;  // non-empty while a WAIT is deferred
  bool closing = false;
  // The last sign of life the idle deadline counts: accepted, a query served, a WAIT answered.
  Clock::time_point active_at = Clock::now();
  Clock::time_point wait_since;  // when the deferred WAIT began (meaningful with wait_keys)
};

template <typename T>
void PutPod(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void PutBytes(std::string* out, const std::string& s) {
  PutPod<std::uint64_t>(out, s.size());
  out->append(s);
}

}  // namespace

struct TcpStoreServer::Impl {
  TcpStoreOptions opt;
  std::set<std::string> write_once;
  int listen_fd = -1;
  int wake_fd = -1;
  std::thread thread;
  // Set without `mu`: Stop() must not queue behind a round of serving for the lock.
  std::atomic<bool> stop{false};
  mutable std::mutex mu;  // guards everything below
  std::map<std::string, std::string> store;
  std::size_t stored_bytes = 0;  // sum of key + value sizes in `store`
  std::vector<std::unique_ptr<Conn>> conns;
  TcpStoreStats stats;

  ~Impl() {
    CloseListener();
    if (wake_fd >= 0) ::close(wake_fd);
  }

  // Only once the serving thread is gone: it polls listen_fd.
  void CloseListener() {
    if (listen_fd >= 0) ::close(listen_fd);
    listen_fd = -1;
  }

  void Configure(const TcpStoreOptions& options, std::size_t connections) {
    opt = options;
    write_once.insert(options.write_once_keys.begin(), options.write_once_keys.end());
    conns.reserve(connections);
  }

  // Opens the listening socket and the wake-up descriptor; returns the port it listens on.
  Result<std::uint16_t> Listen() {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(opt.port);
    if (::inet_pton(AF_INET, opt.bind_address.c_str(), &addr.sin_addr) != 1) {
      return Status::InvalidArgument("tcp store bind address is not IPv4: " + opt.bind_address);
    }
    listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listen_fd < 0) return Status::IOError(std::string("socket: ") + std::strerror(errno));
    int one = 1;
    ::setsockopt(listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return Status::IOError("tcp store bind " + opt.bind_address + ":" + std::to_string(opt.port) +
                             ": " + std::strerror(errno));
    }
    if (::listen(listen_fd, 128) != 0) {
      return Status::IOError(std::string("listen: ") + std::strerror(errno));
    }
    socklen_t len = sizeof(addr);
    ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
    wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd < 0) return Status::IOError(std::string("eventfd: ") + std::strerror(errno));
    return ntohs(addr.sin_port);
  }

  void Wake() {
    std::uint64_t one = 1;
    ssize_t n = ::write(wake_fd, &one, sizeof(one));
    (void)n;
  }

  bool AllExist(const std::vector<std::string>& keys) const {
    for (const auto& k : keys) {
      if (store.find(k) == store.end()) return false;
    }
    return true;
  }

  // Bytes held for connections: buffered input, unsent replies, the keys of a deferred WAIT.
  std::size_t BufferedBytes() const {
    std::size_t total = 0;
    for (const auto& c : conns) {
      total += c->in.capacity() + c->out.capacity();
      for (const auto& k : c->wait_keys) total += k.size();
    }
    return total;
  }

  // True when `bytes` more of reply fit c's output bound and the all-connection budget. Called
  // BEFORE the reply is built, so a reply that would not fit is never allocated.
  bool ReplyFits(const Conn* c, std::size_t bytes) {
    const bool fits =
        bytes <= opt.output_bytes_max - std::min(opt.output_bytes_max, c->out.size()) &&
        bytes <= opt.buffered_bytes_max - std::min(opt.buffered_bytes_max, BufferedBytes());
    if (!fits) ++stats.budget_refusals;
    return fits;
  }

  // A deferred WAIT's wake-up is one byte; a waiter that cannot take it is dropped. A woken waiter
  // gets a fresh idle deadline for the GET that follows.
  void WakeWaiters() {
    for (auto& c : conns) {
      if (!c->wait_keys.empty() && AllExist(c->wait_keys)) {
        c->wait_keys.clear();
        if (c->out.size() >= opt.output_bytes_max) {
          Disconnect(c.get());
          continue;
        }
        PutPod<std::uint8_t>(&c->out, kWaitStop);
        c->active_at = Clock::now();
      }
    }
  }

  bool Protected(const std::string& key) const {
    return write_once.count(key) != 0 && store.count(key) != 0;
  }
  // Refuses (and counts) any client mutation of a write-once key, set or not: only the master
  // writes it (server-side Set), so no peer can overwrite it, delete it, or win a race to set it
  // first with its own NCCL unique id.
  bool RefuseWriteOnce(const std::string& key) {
    if (write_once.count(key) == 0) return false;
    ++stats.write_once_refusals;
    return true;
  }

  // True when `key` may hold a value of `value_bytes` within every store bound.
  bool StoreFits(const std::string& key, std::size_t value_bytes) {
    if (value_bytes > opt.value_bytes_max) return false;
    auto it = store.find(key);
    const std::size_t old_bytes = it == store.end() ? 0 : key.size() + it->second.size();
    const bool fits = (it != store.end() || store.size() < opt.keys_max) &&
                      key.size() + value_bytes <= opt.store_bytes_max - (stored_bytes - old_bytes);
    if (!fits) ++stats.budget_refusals;
    return fits;
  }

  bool PutValue(const std::string& key, std::string value) {
    if (Protected(key) || !StoreFits(key, value.size())) return false;
    auto it = store.find(key);
    if (it != store.end()) stored_bytes -= key.size() + it->second.size();
    stored_bytes += key.size() + value.size();
    store[key] = std::move(value);
    RC_CHECK(WithinStoreBounds());
    return true;
  }

  // Every write goes through StoreFits first, so this holds after each one.
  bool WithinStoreBounds() const {
    return stored_bytes <= opt.store_bytes_max && store.size() <= opt.keys_max;
  }

  std::size_t Erase(const std::string& key) {
    auto it = store.find(key);
    if (it == store.end()) return 0;
    stored_bytes -= key.size() + it->second.size();
    store.erase(it);
    return 1;
  }

  Parse ReadKeys(Reader* r, std::vector<std::string>* keys) {
    std::uint64_t n = 0;
    RC_PARSE(r->Pod(&n));
    if (n > opt.keys_per_query_max) return Parse::kBad;
    keys->resize(n);
    for (auto& k : *keys) RC_PARSE(r->Bytes(&k, true));
    return Parse::kOk;
  }

  Parse ReadPairs(Reader* r, std::vector<std::pair<std::string, std::string>>* kvs) {
    std::uint64_t n = 0;
    RC_PARSE(r->Pod(&n));
    if (n > opt.keys_per_query_max) return Parse::kBad;
    kvs->resize(n);
    for (auto& [k, v] : *kvs) {
      RC_PARSE(r->Bytes(&k, true));
      RC_PARSE(r->Bytes(&v, false));
    }
    return Parse::kOk;
  }

  template <typename T>
  Parse ReplyPod(Conn* c, T v) {
    if (!ReplyFits(c, sizeof(T))) return Parse::kBad;
    PutPod(&c->out, v);
    return Parse::kOk;
  }
  Parse ReplyBytes(Conn* c, const std::string& v) {
    if (!ReplyFits(c, sizeof(std::uint64_t) + v.size())) return Parse::kBad;
    PutBytes(&c->out, v);
    return Parse::kOk;
  }

  Parse CompareSet(Conn* c, const std::string& key, const std::string& expected,
                   std::string desired) {
    if (RefuseWriteOnce(key)) return Parse::kBad;
    auto it = store.find(key);
    const bool swap = it == store.end() ? expected.empty() : it->second == expected;
    if (!swap) return ReplyBytes(c, it == store.end() ? expected : it->second);
    if (!ReplyFits(c, sizeof(std::uint64_t) + desired.size())) return Parse::kBad;
    if (!PutValue(key, desired)) return Parse::kBad;
    PutBytes(&c->out, desired);
    WakeWaiters();
    return Parse::kOk;
  }

  Parse Add(Conn* c, const std::string& key, std::int64_t delta) {
    if (RefuseWriteOnce(key)) return Parse::kBad;
    std::int64_t current = 0;
    auto it = store.find(key);
    if (it != store.end()) {
      const std::string& s = it->second;
      auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), current);
      if (ec != std::errc() || ptr != s.data() + s.size()) return Parse::kBad;
    }
    if ((delta > 0 && current > INT64_MAX - delta) || (delta < 0 && current < INT64_MIN - delta)) {
      return Parse::kBad;
    }
    current += delta;
    if (!ReplyFits(c, sizeof(std::int64_t))) return Parse::kBad;
    if (!PutValue(key, std::to_string(current))) return Parse::kBad;
    PutPod<std::int64_t>(&c->out, current);
    WakeWaiters();
    return Parse::kOk;
  }

  Parse Append(const std::string& key, const std::string& value) {
    if (RefuseWriteOnce(key)) return Parse::kBad;
    auto it = store.find(key);
    const std::size_t old_size = it == store.end() ? 0 : it->second.size();
    if (value.size() > opt.value_bytes_max - std::min(opt.value_bytes_max, old_size) ||
        !StoreFits(key, old_size + value.size())) {
      return Parse::kBad;
    }
    if (it == store.end()) return PutValue(key, value) ? Parse::kOk : Parse::kBad;
    it->second.append(value);  // in place: the joined value was bounded above
    stored_bytes += value.size();
    RC_CHECK(WithinStoreBounds() && it->second.size() <= opt.value_bytes_max);
    return Parse::kOk;
  }

  // The reply's size is summed and checked before a byte of it is built.
  Parse MultiGet(Conn* c, const std::vector<std::string>& keys) {
    std::size_t reply_bytes = 0;
    for (const auto& k : keys) {
      auto it = store.find(k);
      if (it == store.end()) return Parse::kBad;
      reply_bytes += sizeof(std::uint64_t) + it->second.size();
      if (reply_bytes > opt.output_bytes_max) {
        ++stats.budget_refusals;
        return Parse::kBad;
      }
    }
    if (!ReplyFits(c, reply_bytes)) return Parse::kBad;
    for (const auto& k : keys) PutBytes(&c->out, store.find(k)->second);
    return Parse::kOk;
  }

  // All pairs are checked before any is stored: a refused MULTI_SET changes nothing.
  Parse MultiSet(std::vector<std::pair<std::string, std::string>>& kvs) {
    std::size_t added_bytes = 0, added_keys = 0;
    for (const auto& [k, v] : kvs) {
      if (RefuseWriteOnce(k)) return Parse::kBad;
      if (v.size() > opt.value_bytes_max) return Parse::kBad;
      added_bytes += k.size() + v.size();  // upper bound: replaced values are not subtracted
      added_keys += store.count(k) == 0 ? 1 : 0;
    }
    if (added_keys > opt.keys_max - std::min(opt.keys_max, store.size()) ||
        added_bytes > opt.store_bytes_max - stored_bytes) {
      ++stats.budget_refusals;
      return Parse::kBad;
    }
    for (auto& [k, v] : kvs) {
      if (!PutValue(k, std::move(v))) return Parse::kBad;
    }
    WakeWaiters();
    return Parse::kOk;
  }

  // ---- one handler per query type: read the query's fields, then act ----
  Parse OnValidate(Reader* r) {
    std::uint32_t magic = 0;
    RC_PARSE(r->Pod(&magic));
    return magic == kTcpStoreValidateMagic ? Parse::kOk : Parse::kBad;
  }
  Parse OnPing(Conn* c, Reader* r) {
    std::uint32_t nonce = 0;
    RC_PARSE(r->Pod(&nonce));
    return ReplyPod(c, nonce);
  }
  Parse OnSet(Reader* r) {
    std::string key, value;
    RC_PARSE(r->Bytes(&key, true));
    RC_PARSE(r->Bytes(&value, false));
    if (RefuseWriteOnce(key) || !PutValue(key, std::move(value))) return Parse::kBad;
    WakeWaiters();
    return Parse::kOk;
  }
  Parse OnCompareSet(Conn* c, Reader* r) {
    std::string key, expected, desired;
    RC_PARSE(r->Bytes(&key, true));
    RC_PARSE(r->Bytes(&expected, false));
    RC_PARSE(r->Bytes(&desired, false));
    return CompareSet(c, key, expected, std::move(desired));
  }
  Parse OnGet(Conn* c, Reader* r) {
    std::string key;
    RC_PARSE(r->Bytes(&key, true));
    auto it = store.find(key);
    if (it == store.end()) return Parse::kBad;  // torch's server errors; the client must WAIT first
    return ReplyBytes(c, it->second);
  }
  Parse OnAdd(Conn* c, Reader* r) {
    std::string key;
    RC_PARSE(r->Bytes(&key, true));
    std::int64_t delta = 0;
    RC_PARSE(r->Pod(&delta));
    return Add(c, key, delta);
  }
  Parse OnCheck(Conn* c, Reader* r) {
    std::vector<std::string> keys;
    RC_PARSE(ReadKeys(r, &keys));
    return ReplyPod<std::uint8_t>(c, AllExist(keys) ? kCheckReady : kCheckNotReady);
  }
  Parse OnWait(Conn* c, Reader* r) {
    std::vector<std::string> keys;
    RC_PARSE(ReadKeys(r, &keys));
    if (!c->wait_keys.empty()) return Parse::kBad;  // one deferred wait per connection
    if (AllExist(keys)) return ReplyPod<std::uint8_t>(c, kWaitStop);
    c->wait_keys = std::move(keys);
    c->wait_since = Clock::now();
    return Parse::kOk;
  }
  Parse OnCancelWait(Conn* c) {
    c->wait_keys.clear();
    return ReplyPod<std::uint8_t>(c, kWaitCanceled);
  }
  Parse OnGetNumKeys(Conn* c) {
    return ReplyPod<std::int64_t>(c, static_cast<std::int64_t>(store.size()));
  }
  Parse OnDeleteKey(Conn* c, Reader* r) {
    std::string key;
    RC_PARSE(r->Bytes(&key, true));
    if (RefuseWriteOnce(key)) return Parse::kBad;
    if (!ReplyFits(c, sizeof(std::int64_t))) return Parse::kBad;
    PutPod<std::int64_t>(&c->out, static_cast<std::int64_t>(Erase(key)));
    return Parse::kOk;
  }
  Parse OnAppend(Reader* r) {
    std::string key, value;
    RC_PARSE(r->Bytes(&key, true));
    RC_PARSE(r->Bytes(&value, false));
    RC_PARSE(Append(key, value));
    WakeWaiters();
    return Parse::kOk;
  }
  Parse OnMultiGet(Conn* c, Reader* r) {
    std::vector<std::string> keys;
    RC_PARSE(ReadKeys(r, &keys));
    return MultiGet(c, keys);
  }
  Parse OnMultiSet(Reader* r) {
    std::vector<std::pair<std::string, std::string>> kvs;
    RC_PARSE(ReadPairs(r, &kvs));
    return MultiSet(kvs);
  }

  Parse Serve(StoreQuery type, Conn* c, Reader* r) {
    switch (type) {
      case StoreQuery::kValidate:
        return OnValidate(r);
      case StoreQuery::kSet:
        return OnSet(r);
      case StoreQuery::kCompareSet:
        return OnCompareSet(c, r);
      case StoreQuery::kGet:
        return OnGet(c, r);
      case StoreQuery::kAdd:
        return OnAdd(c, r);
      case StoreQuery::kCheck:
        return OnCheck(c, r);
      case StoreQuery::kWait:
        return OnWait(c, r);
      case StoreQuery::kGetNumKeys:
        return OnGetNumKeys(c);
      case StoreQuery::kDeleteKey:
        return OnDeleteKey(c, r);
      case StoreQuery::kAppend:
        return OnAppend(r);
      case StoreQuery::kMultiGet:
        return OnMultiGet(c, r);
      case StoreQuery::kMultiSet:
        return OnMultiSet(r);
      case StoreQuery::kCancelWait:
        return OnCancelWait(c);
      case StoreQuery::kPing:
        return OnPing(c, r);
    }
    return Parse::kBad;  // a type byte outside the grammar
  }

  // Parses and executes one query from c->in. kNeedMore leaves the input untouched.
  Parse HandleOne(Conn* c, std::size_t* consumed) {
    Reader r(c->in, opt.key_bytes_max, opt.value_bytes_max);
    std::uint8_t type = 0;
    RC_PARSE(r.Pod(&type));
    RC_PARSE(Serve(static_cast<StoreQuery>(type), c, &r));
    *consumed = r.pos();
    RC_CHECK(*consumed > 0 && *consumed <= c->in.size());
    ++stats.queries;
    return Parse::kOk;
  }

  // Serves every complete query in c->in; what stays buffered is one incomplete query.
  void HandleInput(Conn* c) {
    while (!c->closing && HandleNext(c)) {
    }
    RC_CHECK(c->closing || c->in.size() <= opt.query_bytes_max);
  }

  // Serves the next query of c->in. False when c must wait for more bytes or was dropped.
  bool HandleNext(Conn* c) {
    std::size_t consumed = 0;
    const Parse p = HandleOne(c, &consumed);
    if (p == Parse::kNeedMore) {
      if (c->in.size() > opt.query_bytes_max) Disconnect(c);  // an incomplete query too large
      return false;
    }
    if (p == Parse::kBad) {
      Disconnect(c);
      return false;
    }
    c->active_at = Clock::now();
    c->in.erase(0, consumed);
    if (c->in.empty() && c->in.capacity() > kIdleBufferBytesMax) std::string().swap(c->in);
    if (c->out.size() > opt.output_bytes_max) {
      Disconnect(c);
      return false;
    }
    return true;
  }

  void Disconnect(Conn* c) {
    if (!c->closing) ++stats.protocol_errors;
    c->closing = true;
  }

  // How many bytes c may receive now: its query bound (plus one byte, so an oversize query is
  // detected) and the all-connection budget. 0 means c must be dropped.
  std::size_t ReceiveRoom(const Conn* c) const {
    const std::size_t own =
        opt.query_bytes_max + 1 - std::min(opt.query_bytes_max + 1, c->in.size());
    const std::size_t used = BufferedBytes();
    const std::size_t shared = opt.buffered_bytes_max - std::min(opt.buffered_bytes_max, used);
    return std::min(own, shared);
  }

  // Reads at most one buffer of what c sent and serves the complete queries. One recv per poll
  // round, not until EAGAIN: a peer that sends faster than its queries are served would otherwise
  // keep the serving thread here, holding `mu`, so no other connection, Set or Stop would
  // proceed. poll() is level-triggered: what is left is read next round. Only this connection is
  // dropped when a bound is hit or an allocation fails.
  void Receive(Conn* c, char* buf, std::size_t buf_bytes) {
    try {
      const std::size_t room = std::min(buf_bytes, ReceiveRoom(c));
      if (room == 0) {
        ++stats.budget_refusals;
        Disconnect(c);
        return;
      }
      const ssize_t got = ::recv(c->fd, buf, room, 0);
      if (got > 0) {
        c->in.append(buf, static_cast<std::size_t>(got));
        HandleInput(c);
        return;
      }
      if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        c->closing = true;  // peer closed: not a protocol error
      }
    } catch (const std::bad_alloc&) {
      DropAfterAllocationFailure(c);
    }
  }

  void Accept() {
    for (;;) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0 || !TakeConnection(fd)) return;
    }
  }

  // Serves fd, or closes it when connections_max are open. False: out of memory, stop accepting.
  bool TakeConnection(int fd) {
    if (conns.size() >= opt.connections_max) {
      ::close(fd);
      ++stats.connections_refused;
      return true;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    try {
      auto c = std::make_unique<Conn>();
      c->fd = fd;
      conns.push_back(std::move(c));  // capacity reserved at Start: no reallocation
    } catch (const std::bad_alloc&) {
      ::close(fd);
      ++stats.allocation_failures;
      return false;
    }
    ++stats.connections_accepted;
    RC_CHECK(conns.size() <= opt.connections_max);
    return true;
  }

  // Serves until Stop(): poll every descriptor, then serve what is ready, under the lock.
  void Loop() {
    RC_CHECK(listen_fd >= 0 && wake_fd >= 0);
    std::vector<pollfd> fds;
    char buf[64 * 1024];
    while (PollSet(&fds)) {
      const int n = ::poll(fds.data(), fds.size(), kPollTickMs);
      if ((n < 0 && errno != EINTR) || stop.load()) break;
      std::lock_guard<std::mutex> lock(mu);
      ServeReady(fds, buf, sizeof(buf));
    }
    CloseAll();
  }

  // fds := listener, wake-up, then one entry per connection in `conns` order. False once stopped.
  bool PollSet(std::vector<pollfd>* fds) {
    fds->clear();
    if (stop.load()) return false;
    std::lock_guard<std::mutex> lock(mu);
    fds->push_back({listen_fd, POLLIN, 0});
    fds->push_back({wake_fd, POLLIN, 0});
    for (auto& c : conns) {
      short ev = POLLIN;
      if (!c->out.empty()) ev |= POLLOUT;
      fds->push_back({c->fd, ev, 0});
    }
    return true;
  }

  void ServeReady(const std::vector<pollfd>& fds, char* buf, std::size_t buf_bytes) {
    if (fds[1].revents & POLLIN) DrainWakeFd();
    ReceiveReady(fds, buf, buf_bytes);
    // Flush every connection (waiters may have been woken by another connection's SET).
    for (auto& c : conns) Flush(c.get());
    if (fds[0].revents & POLLIN) Accept();
    ExpireIdle(Clock::now());  // after every ready input was served: a query just read counts
    Reap();
    PublishStats();
  }

  // Closes (not as protocol errors) the connections past their deadline: idle_timeout_ms since
  // their last sign of life, or wait_timeout_ms in a deferred WAIT. A deferred WAIT is not idle:
  // the store answers it as soon as another rank or the master sets the key.
  void ExpireIdle(Clock::time_point now) {
    const auto idle_timeout = std::chrono::milliseconds(opt.idle_timeout_ms);
    const auto wait_timeout = std::chrono::milliseconds(opt.wait_timeout_ms);
    for (auto& c : conns) {
      if (c->closing) continue;
      if (!c->wait_keys.empty()) {
        if (now - c->wait_since < wait_timeout) continue;
        ++stats.wait_timeouts;
      } else {
        if (now - c->active_at < idle_timeout) continue;
        ++stats.idle_disconnects;
      }
      c->closing = true;
    }
  }

  void DrainWakeFd() {
    std::uint64_t v;
    ssize_t r = ::read(wake_fd, &v, sizeof(v));
    (void)r;
    WakeWaiters();
  }

  void ReceiveReady(const std::vector<pollfd>& fds, char* buf, std::size_t buf_bytes) {
    // Connections were only appended since the snapshot was taken (removal happens in Reap).
    RC_CHECK(fds.size() >= 2 && fds.size() - 2 <= conns.size());
    for (std::size_t i = 2; i < fds.size(); ++i) {
      Conn* c = conns[i - 2].get();
      RC_CHECK(c->fd == fds[i].fd);
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) Receive(c, buf, buf_bytes);
    }
  }

  // Sends what the socket takes now; a send error other than "try again" closes c.
  void Flush(Conn* c) {
    while (!c->closing && !c->out.empty()) {
      const ssize_t sent = ::send(c->fd, c->out.data(), c->out.size(), MSG_NOSIGNAL);
      if (sent > 0) {
        c->out.erase(0, static_cast<std::size_t>(sent));
        if (c->out.empty() && c->out.capacity() > kIdleBufferBytesMax) std::string().swap(c->out);
      } else {
        if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
          c->closing = true;
        break;
      }
    }
  }

  void Reap() {
    std::erase_if(conns, [](const std::unique_ptr<Conn>& c) {
      if (c->closing) ::close(c->fd);
      return c->closing;
    });
  }

  void PublishStats() {
    stats.connections_open = conns.size();
    stats.stored_bytes = stored_bytes;
    stats.waiters = 0;
    for (auto& c : conns) stats.waiters += c->wait_keys.empty() ? 0 : 1;
  }

  void CloseAll() {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& c : conns) ::close(c->fd);
    conns.clear();
    stats.connections_open = 0;
    stats.waiters = 0;
  }

  // What the server-side Set checks and stores; the caller holds `mu` and wakes the waiters.
  Status ServerSet(const std::string& wire_key, const std::string& value) {
    if (Protected(wire_key)) return Status::Rejected("tcp store key is write-once and already set");
    if (!PutValue(wire_key, value)) return Status::InvalidArgument("value too large or store full");
    RC_CHECK(store.at(wire_key) == value);
    return Status::OK();
  }

  // A connection whose serving ran out of memory: dropped, its buffers released.
  void DropAfterAllocationFailure(Conn* c) {
    ++stats.allocation_failures;
    Disconnect(c);
    std::string().swap(c->in);
    std::string().swap(c->out);
    std::vector<std::string>().swap(c->wait_keys);
  }
};

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl, std::uint16_t port)
    : impl_(std::move(impl)), port_(port) {}

namespace {

Status CheckBounds(const TcpStoreOptions& options) {
  if (options.connections_max == 0 || options.key_bytes_max == 0 || options.keys_max == 0 ||
      options.keys_per_query_max == 0) {
    return Status::InvalidArgument("tcp store bounds must be positive");
  }
  if (options.query_bytes_max == 0 || options.output_bytes_max == 0 ||
      options.buffered_bytes_max == 0 || options.store_bytes_max == 0) {
    return Status::InvalidArgument("tcp store byte bounds must be positive");
  }
  if (options.idle_timeout_ms == 0 || options.wait_timeout_ms == 0) {
    return Status::InvalidArgument("tcp store idle and wait timeouts must be positive");
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(const TcpStoreOptions& options) {
  RC_RETURN_IF_ERROR(CheckBounds(options));
  auto impl = std::make_unique<Impl>();
  impl->Configure(options, options.connections_max);
  Result<std::uint16_t> port = impl->Listen();
  if (!port.ok()) return port.status();
  Impl* raw = impl.get();
  try {
    impl->thread = std::thread([raw] { raw->Loop(); });
  } catch (const std::system_error& e) {  // a thread limit: nothing would serve the port
    return Status::Unavailable(std::string("tcp store: no thread to serve it: ") + e.what());
  } catch (const std::bad_alloc&) {
    return Status::Unavailable("tcp store: no thread to serve it: out of memory");
  }
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl), *port));
}

TcpStoreServer::~TcpStoreServer() { Stop(); }

void TcpStoreServer::Stop() {
  if (!impl_) return;
  impl_->stop.store(true);
  impl_->Wake();
  if (impl_->thread.joinable()) impl_->thread.join();
  RC_CHECK(impl_->conns.empty());  // the serving thread closed every connection on its way out
  impl_->CloseListener();          // a connect now is refused, not queued for no one to accept
}

Status TcpStoreServer::Set(const std::string& wire_key, const std::string& value) {
  if (wire_key.size() > impl_->opt.key_bytes_max) return Status::InvalidArgument("key too long");
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    RC_RETURN_IF_ERROR(impl_->ServerSet(wire_key, value));
  }
  impl_->Wake();
  return Status::OK();
}

std::optional<std::string> TcpStoreServer::Get(const std::string& wire_key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->store.find(wire_key);
  if (it == impl_->store.end()) return std::nullopt;
  return it->second;
}

TcpStoreStats TcpStoreServer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

TcpStoreFrameHarness::TcpStoreFrameHarness(const TcpStoreOptions& options, std::size_t connections)
    : impl_(std::make_unique<TcpStoreServer::Impl>()) {
  impl_->Configure(options, connections);
  for (std::size_t i = 0; i < connections; ++i) {
    impl_->conns.push_back(std::make_unique<Conn>());
    impl_->conns.back()->fd = -1;
  }
}

TcpStoreFrameHarness::~TcpStoreFrameHarness() = default;

void TcpStoreFrameHarness::Feed(std::size_t conn, const char* data, std::size_t size) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Conn* c = impl_->conns.at(conn).get();
  // Receive() with the bytes in hand instead of recv(): same room, same handler, same drop.
  try {
    while (size > 0 && !c->closing) {
      const std::size_t room = std::min(size, impl_->ReceiveRoom(c));
      if (room == 0) {
        ++impl_->stats.budget_refusals;
        impl_->Disconnect(c);
        return;
      }
      c->in.append(data, room);
      data += room;
      size -= room;
      impl_->HandleInput(c);
    }
  } catch (const std::bad_alloc&) {
    impl_->DropAfterAllocationFailure(c);
  }
}

std::string TcpStoreFrameHarness::TakeOutput(std::size_t conn) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::string out;
  out.swap(impl_->conns.at(conn)->out);
  return out;
}

bool TcpStoreFrameHarness::closed(std::size_t conn) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->conns.at(conn)->closing;
}

bool TcpStoreFrameHarness::waiting(std::size_t conn) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return !impl_->conns.at(conn)->wait_keys.empty();
}

Status TcpStoreFrameHarness::SetServer(const std::string& wire_key, const std::string& value) {
  if (wire_key.size() > impl_->opt.key_bytes_max) return Status::InvalidArgument("key too long");
  std::lock_guard<std::mutex> lock(impl_->mu);
  RC_RETURN_IF_ERROR(impl_->ServerSet(wire_key, value));
  impl_->WakeWaiters();  // what the serving thread does on the wake-up
  return Status::OK();
}

std::optional<std::string> TcpStoreFrameHarness::Get(const std::string& wire_key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->store.find(wire_key);
  if (it == impl_->store.end()) return std::nullopt;
  return it->second;
}

TcpStoreStats TcpStoreFrameHarness::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

std::string TcpStoreFrameHarness::CheckInvariants() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const TcpStoreOptions& o = impl_->opt;
  std::size_t bytes = 0;
  for (const auto& [k, v] : impl_->store) {
    if (k.size() > o.key_bytes_max) return "a stored key exceeds key_bytes_max";
    if (v.size() > o.value_bytes_max) return "a stored value exceeds value_bytes_max";
    bytes += k.size() + v.size();
  }
  if (bytes != impl_->stored_bytes) return "stored_bytes does not match the store";
  if (bytes > o.store_bytes_max) return "the store exceeds store_bytes_max";
  if (impl_->store.size() > o.keys_max) return "the store exceeds keys_max";
  for (const auto& c : impl_->conns) {
    if (c->wait_keys.size() > o.keys_per_query_max) return "a WAIT holds too many keys";
    if (!c->closing && c->in.size() > o.query_bytes_max)
      return "an open connection buffers too much";
  }
  return {};
}

}  // namespace rc::effects::nccl
