#include "effects/nccl/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace rc::effects::nccl {
namespace {

constexpr std::uint8_t kCheckReady = 0, kCheckNotReady = 1;
constexpr std::uint8_t kWaitStop = 0, kWaitCanceled = 1;
constexpr int kPollTickMs = 100;

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

#define RC_PARSE(expr)                         \
  do {                                         \
    Parse p_ = (expr);                         \
    if (p_ != Parse::kOk) return p_;           \
  } while (0)

struct Conn {
  int fd = -1;
  std::string in;
  std::string out;
  std::vector<std::string> wait_keys;  // non-empty while a WAIT is deferred
  bool closing = false;
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
  int listen_fd = -1;
  int wake_fd = -1;
  std::thread thread;
  mutable std::mutex mu;  // guards everything below
  std::map<std::string, std::string> store;
  std::vector<std::unique_ptr<Conn>> conns;
  TcpStoreStats stats;
  bool stop = false;

  ~Impl() {
    if (listen_fd >= 0) ::close(listen_fd);
    if (wake_fd >= 0) ::close(wake_fd);
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

  void WakeWaiters() {
    for (auto& c : conns) {
      if (!c->wait_keys.empty() && AllExist(c->wait_keys)) {
        c->wait_keys.clear();
        PutPod<std::uint8_t>(&c->out, kWaitStop);
      }
    }
  }

  bool PutValue(const std::string& key, std::string value) {
    auto it = store.find(key);
    if (it == store.end() && store.size() >= opt.keys_max) return false;
    if (value.size() > opt.value_bytes_max) return false;
    store[key] = std::move(value);
    return true;
  }

  Parse ReadKeys(Reader* r, std::vector<std::string>* keys) {
    std::uint64_t n = 0;
    RC_PARSE(r->Pod(&n));
    if (n > opt.keys_per_query_max) return Parse::kBad;
    keys->resize(n);
    for (auto& k : *keys) RC_PARSE(r->Bytes(&k, true));
    return Parse::kOk;
  }

  // Parses and executes one query from c->in. kNeedMore leaves the input untouched.
  Parse HandleOne(Conn* c, std::size_t* consumed) {
    Reader r(c->in, opt.key_bytes_max, opt.value_bytes_max);
    std::uint8_t type = 0;
    RC_PARSE(r.Pod(&type));
    std::string key, value, value2;
    std::vector<std::string> keys;
    switch (static_cast<StoreQuery>(type)) {
      case StoreQuery::kValidate: {
        std::uint32_t magic = 0;
        RC_PARSE(r.Pod(&magic));
        if (magic != kTcpStoreValidateMagic) return Parse::kBad;
        break;
      }
      case StoreQuery::kPing: {
        std::uint32_t nonce = 0;
        RC_PARSE(r.Pod(&nonce));
        PutPod(&c->out, nonce);
        break;
      }
      case StoreQuery::kSet: {
        RC_PARSE(r.Bytes(&key, true));
        RC_PARSE(r.Bytes(&value, false));
        if (!PutValue(key, std::move(value))) return Parse::kBad;
        WakeWaiters();
        break;
      }
      case StoreQuery::kCompareSet: {
        RC_PARSE(r.Bytes(&key, true));
        RC_PARSE(r.Bytes(&value, false));   // expected
        RC_PARSE(r.Bytes(&value2, false));  // desired
        auto it = store.find(key);
        if (it == store.end()) {
          if (value.empty()) {
            if (!PutValue(key, value2)) return Parse::kBad;
            PutBytes(&c->out, value2);
            WakeWaiters();
          } else {
            PutBytes(&c->out, value);
          }
        } else if (it->second == value) {
          it->second = value2;
          PutBytes(&c->out, value2);
          WakeWaiters();
        } else {
          PutBytes(&c->out, it->second);
        }
        break;
      }
      case StoreQuery::kGet: {
        RC_PARSE(r.Bytes(&key, true));
        auto it = store.find(key);
        if (it == store.end()) return Parse::kBad;  // torch's server errors; the client must WAIT first
        PutBytes(&c->out, it->second);
        break;
      }
      case StoreQuery::kAdd: {
        RC_PARSE(r.Bytes(&key, true));
        std::int64_t delta = 0;
        RC_PARSE(r.Pod(&delta));
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
        if (!PutValue(key, std::to_string(current))) return Parse::kBad;
        PutPod<std::int64_t>(&c->out, current);
        WakeWaiters();
        break;
      }
      case StoreQuery::kCheck: {
        RC_PARSE(ReadKeys(&r, &keys));
        PutPod<std::uint8_t>(&c->out, AllExist(keys) ? kCheckReady : kCheckNotReady);
        break;
      }
      case StoreQuery::kWait: {
        RC_PARSE(ReadKeys(&r, &keys));
        if (!c->wait_keys.empty()) return Parse::kBad;  // one deferred wait per connection
        if (AllExist(keys)) {
          PutPod<std::uint8_t>(&c->out, kWaitStop);
        } else {
          c->wait_keys = std::move(keys);
        }
        break;
      }
      case StoreQuery::kCancelWait: {
        c->wait_keys.clear();
        PutPod<std::uint8_t>(&c->out, kWaitCanceled);
        break;
      }
      case StoreQuery::kGetNumKeys: {
        PutPod<std::int64_t>(&c->out, static_cast<std::int64_t>(store.size()));
        break;
      }
      case StoreQuery::kDeleteKey: {
        RC_PARSE(r.Bytes(&key, true));
        PutPod<std::int64_t>(&c->out, static_cast<std::int64_t>(store.erase(key)));
        break;
      }
      case StoreQuery::kAppend: {
        RC_PARSE(r.Bytes(&key, true));
        RC_PARSE(r.Bytes(&value, false));
        auto it = store.find(key);
        std::string joined = it == store.end() ? value : it->second + value;
        if (!PutValue(key, std::move(joined))) return Parse::kBad;
        WakeWaiters();
        break;
      }
      case StoreQuery::kMultiGet: {
        RC_PARSE(ReadKeys(&r, &keys));
        std::string reply;
        for (const auto& k : keys) {
          auto it = store.find(k);
          if (it == store.end()) return Parse::kBad;
          PutBytes(&reply, it->second);
        }
        c->out.append(reply);
        break;
      }
      case StoreQuery::kMultiSet: {
        std::uint64_t n = 0;
        RC_PARSE(r.Pod(&n));
        if (n > opt.keys_per_query_max) return Parse::kBad;
        std::vector<std::pair<std::string, std::string>> kvs(n);
        for (auto& [k, v] : kvs) {
          RC_PARSE(r.Bytes(&k, true));
          RC_PARSE(r.Bytes(&v, false));
        }
        for (auto& [k, v] : kvs) {
          if (!PutValue(k, std::move(v))) return Parse::kBad;
        }
        WakeWaiters();
        break;
      }
      default:
        return Parse::kBad;
    }
    *consumed = r.pos();
    ++stats.queries;
    return Parse::kOk;
  }

  void HandleInput(Conn* c) {
    while (!c->closing) {
      std::size_t consumed = 0;
      const Parse p = HandleOne(c, &consumed);
      if (p == Parse::kNeedMore) {
        if (c->in.size() > opt.query_bytes_max) Disconnect(c);  // an incomplete query too large
        return;
      }
      if (p == Parse::kBad) {
        Disconnect(c);
        return;
      }
      c->in.erase(0, consumed);
      if (c->out.size() > opt.output_bytes_max) {
        Disconnect(c);
        return;
      }
    }
  }

  void Disconnect(Conn* c) {
    if (!c->closing) ++stats.protocol_errors;
    c->closing = true;
  }

  void Accept() {
    for (;;) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      if (conns.size() >= opt.connections_max) {
        ::close(fd);
        ++stats.connections_refused;
        continue;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto c = std::make_unique<Conn>();
      c->fd = fd;
      conns.push_back(std::move(c));
      ++stats.connections_accepted;
    }
  }

  void Loop() {
    std::vector<pollfd> fds;
    char buf[64 * 1024];
    for (;;) {
      fds.clear();
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stop) break;
        fds.push_back({listen_fd, POLLIN, 0});
        fds.push_back({wake_fd, POLLIN, 0});
        for (auto& c : conns) {
          short ev = POLLIN;
          if (!c->out.empty()) ev |= POLLOUT;
          fds.push_back({c->fd, ev, 0});
        }
      }
      const int n = ::poll(fds.data(), fds.size(), kPollTickMs);
      if (n < 0 && errno != EINTR) break;
      std::lock_guard<std::mutex> lock(mu);
      if (stop) break;
      if (fds[1].revents & POLLIN) {
        std::uint64_t v;
        ssize_t r = ::read(wake_fd, &v, sizeof(v));
        (void)r;
        WakeWaiters();
      }
      // Connections were only appended since the snapshot was taken (removal happens below).
      for (std::size_t i = 2; i < fds.size(); ++i) {
        Conn* c = conns[i - 2].get();
        RC_CHECK(c->fd == fds[i].fd);
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
          for (;;) {
            const ssize_t got = ::recv(c->fd, buf, sizeof(buf), 0);
            if (got > 0) {
              c->in.append(buf, static_cast<std::size_t>(got));
              HandleInput(c);
              if (c->closing) break;
              continue;
            }
            if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
              c->closing = true;  // peer closed: not a protocol error
            }
            break;
          }
        }
      }
      // Flush every connection (waiters may have been woken by another connection's SET).
      for (auto& c : conns) {
        while (!c->closing && !c->out.empty()) {
          const ssize_t sent = ::send(c->fd, c->out.data(), c->out.size(), MSG_NOSIGNAL);
          if (sent > 0) {
            c->out.erase(0, static_cast<std::size_t>(sent));
          } else {
            if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c->closing = true;
            break;
          }
        }
      }
      if (fds[0].revents & POLLIN) Accept();
      std::erase_if(conns, [](const std::unique_ptr<Conn>& c) {
        if (c->closing) ::close(c->fd);
        return c->closing;
      });
      stats.connections_open = conns.size();
      stats.waiters = 0;
      for (auto& c : conns) stats.waiters += c->wait_keys.empty() ? 0 : 1;
    }
    std::lock_guard<std::mutex> lock(mu);
    for (auto& c : conns) ::close(c->fd);
    conns.clear();
    stats.connections_open = 0;
    stats.waiters = 0;
  }
};

TcpStoreServer::TcpStoreServer(std::unique_ptr<Impl> impl, std::uint16_t port)
    : impl_(std::move(impl)), port_(port) {}

Result<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(const TcpStoreOptions& options) {
  if (options.connections_max == 0 || options.key_bytes_max == 0 || options.keys_max == 0 ||
      options.keys_per_query_max == 0) {
    return Status::InvalidArgument("tcp store bounds must be positive");
  }
  auto impl = std::make_unique<Impl>();
  impl->opt = options;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(options.port);
  if (::inet_pton(AF_INET, options.bind_address.c_str(), &addr.sin_addr) != 1) {
    return Status::InvalidArgument("tcp store bind address is not IPv4: " + options.bind_address);
  }
  impl->listen_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (impl->listen_fd < 0) return Status::IOError(std::string("socket: ") + std::strerror(errno));
  int one = 1;
  ::setsockopt(impl->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(impl->listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Status::IOError("tcp store bind " + options.bind_address + ":" +
                           std::to_string(options.port) + ": " + std::strerror(errno));
  }
  if (::listen(impl->listen_fd, 128) != 0) {
    return Status::IOError(std::string("listen: ") + std::strerror(errno));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(impl->listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  impl->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl->wake_fd < 0) return Status::IOError(std::string("eventfd: ") + std::strerror(errno));
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<TcpStoreServer>(new TcpStoreServer(std::move(impl), ntohs(addr.sin_port)));
}

TcpStoreServer::~TcpStoreServer() { Stop(); }

void TcpStoreServer::Stop() {
  if (!impl_) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->Wake();
  if (impl_->thread.joinable()) impl_->thread.join();
}

Status TcpStoreServer::Set(const std::string& wire_key, const std::string& value) {
  if (wire_key.size() > impl_->opt.key_bytes_max) return Status::InvalidArgument("key too long");
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (!impl_->PutValue(wire_key, value)) {
      return Status::InvalidArgument("value too large or store full");
    }
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

}  // namespace rc::effects::nccl
