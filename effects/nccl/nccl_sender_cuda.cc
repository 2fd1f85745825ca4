// CUDA/NCCL half of the sender (built only when CUDA and NCCL are found). See nccl_sender.h.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "effects/clock.h"
#include "effects/nccl/nccl_sender.h"
#include "effects/nccl/rendezvous.h"
#include "effects/nccl/tcp_store.h"
#include "encoding/base64.h"

namespace rc::effects::nccl {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollSleep = std::chrono::microseconds(20);

std::string CudaErr(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}
std::string NcclErr(const char* what, ncclResult_t r) {
  return std::string(what) + ": " + ncclGetErrorString(r);
}

ncclDataType_t NcclType(DType d) {
  switch (d) {
    case DType::kInt8:
      return ncclInt8;
    case DType::kUInt8:
      return ncclUint8;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kFloat8E4M3:
      return ncclFloat8e4m3;
  }
  return ncclUint8;
}

bool Ok2xx(const HttpReply& r) { return r.http.ok_2xx(); }
std::string Describe(const char* route, const HttpReply& r) {
  return std::string(route) + ": " + transport_name(r.http.transport) + " status " +
         std::to_string(r.http.http_status) + (r.http.error.empty() ? "" : " " + r.http.error);
}

// Never 0: a libcurl timeout of 0 means "no timeout".
CallOptions Within(std::uint64_t timeout_ms, std::optional<CancelToken> cancel = std::nullopt) {
  CallOptions o;
  o.timeout_ms = std::max<std::uint64_t>(1, timeout_ms);
  o.cancel = std::move(cancel);
  return o;
}

// An HTTP call on its own thread; the sender polls done() while it drives NCCL. The call holds
// `cancel`: Cancel() makes it return within ~50 ms, so Join() after Cancel() is prompt.
class AsyncCall {
 public:
  template <typename F>
  AsyncCall(CancelToken cancel, F&& f) : cancel_(std::move(cancel)) {
    thread_ = std::thread([this, fn = std::forward<F>(f)]() mutable {
      HttpReply r = fn(cancel_);
      std::lock_guard<std::mutex> lock(mu_);
      reply_ = std::move(r);
      done_.store(true, std::memory_order_release);
    });
  }
  ~AsyncCall() {
    cancel_.Cancel();
    Join();
  }
  void Cancel() { cancel_.Cancel(); }
  bool done() const { return done_.load(std::memory_order_acquire); }
  bool failed() const { return done() && !Ok2xx(reply()); }
  // The call carries its own timeout (never beyond the caller's deadline), so this is bounded.
  const HttpReply& Join() {
    if (thread_.joinable()) thread_.join();
    return reply_;
  }
  const HttpReply& reply() const { return reply_; }

 private:
  CancelToken cancel_;
  std::thread thread_;
  mutable std::mutex mu_;
  HttpReply reply_;
  std::atomic<bool> done_{false};
};

// Tensors exported by a trainer on this host through cudaIpcGetMemHandle.
class IpcSource final : public WeightSource {
 public:
  static Result<std::shared_ptr<IpcSource>> Open(const std::string& path) {
    auto file = ReadIpcHandleFile(path);
    if (!file.ok()) return file.status();
    auto src = std::shared_ptr<IpcSource>(new IpcSource());
    src->file_ = std::move(*file);
    int current = -1;
    cudaGetDevice(&current);
    if (current != src->file_.device) {
      return Status::Rejected("ipc file tensors live on device " +
                              std::to_string(src->file_.device) +
                              ", the calling thread is on device " + std::to_string(current));
    }
    std::map<std::string, void*> opened;
    for (const auto& ref : src->file_.refs) {
      auto it = opened.find(ref.handle);
      if (it == opened.end()) {
        cudaIpcMemHandle_t h;
        std::memcpy(&h, ref.handle.data(), sizeof(h));
        void* base = nullptr;
        cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) return Status::Unavailable(CudaErr("cudaIpcOpenMemHandle", e));
        it = opened.emplace(ref.handle, base).first;
        src->bases_.push_back(base);
      }
      src->ptrs_.push_back(static_cast<const char*>(it->second) + ref.offset);
    }
    return src;
  }
  ~IpcSource() override {
    for (void* b : bases_) cudaIpcCloseMemHandle(b);
  }
  const Manifest& manifest() const override { return file_.manifest; }
  Where where() const override { return Where::kDevice; }
  int device() const override { return file_.device; }
  const void* device_ptr(std::size_t i) const override { return ptrs_.at(i); }

 private:
  IpcSource() = default;
  IpcHandleFile file_;
  std::vector<void*> bases_;
  std::vector<const void*> ptrs_;
};

}  // namespace

const char* rendezvous_name(Rendezvous r) {
  switch (r) {
    case Rendezvous::kAuto:
      return "auto";
    case Rendezvous::kTcpStore:
      return "tcpstore";
    case Rendezvous::kUniqueId:
      return "unique-id";
  }
  return "?";
}

struct NcclSender::Impl {
  explicit Impl(EngineClient& e) : engine(e) {}
  EngineClient& engine;
  NcclSenderOptions opt;
  EngineProtocol protocol;
  std::uint64_t abort_max_us = 0;  // longest abort measured (sizes the reserve)
  Rendezvous mode = Rendezvous::kTcpStore;
  std::unique_ptr<TcpStoreServer> store;
  ncclComm_t comm = nullptr;
  int comm_device = -1;
  int world_size = 0;
  bool dirty = false;  // device work may still run after an abort: never free buffers then
  // Sources by URI, reopened when the file behind them changed (weight_source.h).
  SourceCache sources{[](const std::string& uri) { return OpenUri(uri); }};

  // Ring of slots: each has a stream, an event and (when staging) device + pinned host buffers.
  struct Slot {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
    void* dev = nullptr;
    void* host = nullptr;
    std::uint64_t dev_bytes = 0, host_bytes = 0;  // capacity of dev / host
    bool busy = false;
    std::uint64_t op_bytes = 0;
  };
  // Streams and events persist across transfers (a ring of `count` uses the first `count`
  // slots); buffers grow only. Re-creating them whenever the direct (16-op window) and staged
  // (packed_num_buffers) rings alternate cost a stream/buffer churn per Transfer.
  std::vector<Slot> slots;
  void* warm_buf = nullptr;

  SenderProgress progress;
  TransferTiming timing;
  mutable std::mutex timing_mu;

  // ---- polling ----
  struct Watch {
    Clock::time_point deadline;
    const AsyncCall* call = nullptr;  // the engine's side of this collective
  };
  Status Check(const Watch& w) {
    if (comm != nullptr) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) return Status::Internal(NcclErr("ncclCommGetAsyncError", r));
      if (state != ncclSuccess && state != ncclInProgress) {
        return Status::Unavailable(NcclErr("communicator error", state));
      }
    }
    if (w.call != nullptr && w.call->failed()) {
      return Status::Unavailable("engine side ended first: " + Describe("engine", w.call->reply()));
    }
    if (Clock::now() >= w.deadline) return Status::Timeout("deadline passed");
    return Status::OK();
  }
  // A non-blocking NCCL call returned r: wait until the communicator leaves ncclInProgress.
  Status Settle(ncclResult_t r, const char* what, const Watch& w) {
    if (r != ncclSuccess && r != ncclInProgress) return Status::Internal(NcclErr(what, r));
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t q = ncclCommGetAsyncError(comm, &state);
      if (q != ncclSuccess) return Status::Internal(NcclErr("ncclCommGetAsyncError", q));
      if (state == ncclSuccess) return Status::OK();
      if (state != ncclInProgress) return Status::Unavailable(NcclErr(what, state));
      if (w.call != nullptr && w.call->failed()) {
        return Status::Unavailable(std::string(what) + " while " +
                                   Describe("engine", w.call->reply()));
      }
      if (Clock::now() >= w.deadline)
        return Status::Timeout(std::string(what) + " passed the deadline");
      std::this_thread::sleep_for(kPollSleep);
    }
  }
  Status WaitEvent(cudaEvent_t ev, const Watch& w) {
    for (;;) {
      cudaError_t e = cudaEventQuery(ev);
      if (e == cudaSuccess) return Status::OK();
      if (e != cudaErrorNotReady) return Status::Internal(CudaErr("cudaEventQuery", e));
      if (Status s = Check(w); !s.ok()) return s;
      std::this_thread::sleep_for(kPollSleep);
    }
  }

  std::uint64_t AbortReserveMs() const {
    return std::max<std::uint64_t>(opt.abort_reserve_ms, (abort_max_us * 5 / 4 + 999) / 1000);
  }
  // [t0, deadline): the time left for work once the abort reserve is set aside (all of it when
  // the deadline is shorter than the reserve: the caller then refuses or accepts the overshoot).
  static Clock::time_point WorkDeadline(Clock::time_point deadline, std::uint64_t deadline_ms,
                                        std::uint64_t reserve_ms) {
    return deadline_ms > reserve_ms ? deadline - std::chrono::milliseconds(reserve_ms) : deadline;
  }

  // ncclCommAbort normally returns well within the reserve. If it does not (a wedged proxy
  // thread), the sender stops waiting at `deadline` and leaves the abort running on its own
  // thread: the transfer is already ambiguous (TAINTED), the sender is marked dirty and refuses
  // further work, and only a restart of the executor recovers NCCL.
  static bool AbortWithin(ncclComm_t c, Clock::time_point deadline) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread([c, done] {
      ncclCommAbort(c);
      done->store(true, std::memory_order_release);
    }).detach();
    while (!done->load(std::memory_order_acquire)) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(kPollSleep);
    }
    return true;
  }

  // Aborts the communicator and gives kernels a bounded time to exit (drain_after_abort_ms, and
  // never past `hard_deadline`). Returns the abort's duration and records the longest one.
  std::uint64_t AbortComm(Clock::time_point hard_deadline = Clock::time_point::max()) {
    if (comm == nullptr) return 0;
    const auto t0 = Clock::now();
    const auto drain_deadline =
        std::min(hard_deadline, t0 + std::chrono::milliseconds(opt.drain_after_abort_ms));
    bool drained = AbortWithin(
        comm, std::min(hard_deadline, t0 + std::chrono::milliseconds(AbortReserveMs())));
    comm = nullptr;
    for (auto& s : slots) {
      while (s.done != nullptr && cudaEventQuery(s.done) == cudaErrorNotReady) {
        if (Clock::now() >= drain_deadline) {
          drained = false;
          break;
        }
        std::this_thread::sleep_for(kPollSleep);
      }
      s.busy = false;
    }
    if (!drained) dirty = true;
    cudaGetLastError();  // clear a sticky-free error left by aborted kernels, if any
    const std::uint64_t us = elapsed_us(t0);
    abort_max_us = std::max(abort_max_us, us);
    return us;
  }

  void FreeSlots() {
    if (dirty) return;  // kernels may still read these buffers: leak rather than corrupt
    for (auto& s : slots) {
      if (s.dev) cudaFree(s.dev);
      if (s.host) cudaFreeHost(s.host);
      if (s.done) cudaEventDestroy(s.done);
      if (s.stream) cudaStreamDestroy(s.stream);
    }
    slots.clear();
  }

  // Bytes of device memory EnsureSlots(count, dev_bytes, ...) would still allocate.
  std::uint64_t DeviceShortfallBytes(std::size_t count, std::uint64_t dev_bytes) const {
    std::uint64_t need = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t have = i < slots.size() ? slots[i].dev_bytes : 0;
      if (have < dev_bytes) need += dev_bytes;
    }
    return need;
  }

  Status EnsureSlots(std::size_t count, std::uint64_t dev_bytes, std::uint64_t host_bytes) {
    RC_CHECK(count > 0);
    bool fits = slots.size() >= count;
    for (std::size_t i = 0; fits && i < count; ++i) {
      fits = slots[i].dev_bytes >= dev_bytes && slots[i].host_bytes >= host_bytes;
    }
    if (fits) return Status::OK();
    if (dirty) return Status::Rejected("device work from an aborted transfer has not drained");
    if (slots.size() < count) slots.resize(count);
    for (std::size_t i = 0; i < count; ++i) {
      Slot& s = slots[i];
      RC_CHECK(!s.busy);
      cudaError_t e = cudaSuccess;
      if (s.stream == nullptr) e = cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking);
      if (e == cudaSuccess && s.done == nullptr)
        e = cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming);
      if (e == cudaSuccess && s.dev_bytes < dev_bytes) {
        if (s.dev) cudaFree(s.dev);
        s.dev = nullptr;
        s.dev_bytes = 0;
        e = cudaMalloc(&s.dev, dev_bytes);
        if (e == cudaSuccess) s.dev_bytes = dev_bytes;
      }
      if (e == cudaSuccess && s.host_bytes < host_bytes) {
        if (s.host) cudaFreeHost(s.host);
        s.host = nullptr;
        s.host_bytes = 0;
        e = cudaHostAlloc(&s.host, host_bytes, cudaHostAllocDefault);
        if (e == cudaSuccess) s.host_bytes = host_bytes;
      }
      if (e != cudaSuccess) {
        FreeSlots();
        return Status::Unavailable(CudaErr("staging allocation", e));
      }
    }
    return Status::OK();
  }

  Result<std::shared_ptr<WeightSource>> OpenSource(const std::string& uri) {
    return sources.Get(uri);
  }
  static Result<std::shared_ptr<WeightSource>> OpenUri(const std::string& uri) {
    std::shared_ptr<WeightSource> src;
    if (uri.rfind("safetensors:", 0) == 0) {
      auto s = SafetensorsSource::Open(uri.substr(12));
      if (!s.ok()) return s.status();
      src = std::move(*s);
    } else if (uri.rfind("ipc:", 0) == 0) {
      auto s = IpcSource::Open(uri.substr(4));
      if (!s.ok()) return s.status();
      src = std::move(*s);
    } else {
      return Status::InvalidArgument("unknown weight source '" + uri + "'");
    }
    return src;
  }

  // Per-op: can it be broadcast straight from the source (device-resident and contiguous)?
  static bool Direct(const WeightSource& src, const BroadcastOp& op) {
    if (src.where() != WeightSource::Where::kDevice) return false;
    const auto& m = src.manifest();
    const char* expect = static_cast<const char*>(src.device_ptr(op.first_tensor));
    for (std::size_t i = op.first_tensor; i < op.first_tensor + op.tensor_count; ++i) {
      if (static_cast<const char*>(src.device_ptr(i)) != expect) return false;
      expect += m.tensors[i].nbytes();
    }
    return true;
  }

  struct Needs {
    std::uint64_t dev_bytes = 0, host_bytes = 0;
    std::size_t slot_count = 0;
  };
  Needs StagingNeeds(const WeightSource& src, const BroadcastPlan& plan) const {
    Needs n;
    std::uint64_t staged_max = 0;
    for (const auto& op : plan.ops) {
      if (!Direct(src, op)) staged_max = std::max(staged_max, op.bytes);
    }
    n.dev_bytes = staged_max;
    n.host_bytes = src.where() == WeightSource::Where::kHost ? staged_max : 0;
    n.slot_count = staged_max > 0 ? std::max<std::uint32_t>(1, opt.packing.packed_num_buffers)
                                  : std::max<std::uint32_t>(1, opt.direct_window_ops);
    return n;
  }
};

NcclSender::NcclSender(EngineClient& engine, NcclSenderOptions options)
    : impl_(std::make_unique<Impl>(engine)) {
  impl_->opt = std::move(options);
}

NcclSender::~NcclSender() {
  // Abort, not destroy: local and bounded even if the peer vanished (vLLM just drops its side).
  if (impl_->comm != nullptr) impl_->AbortComm();
  impl_->FreeSlots();
  if (impl_->warm_buf != nullptr && !impl_->dirty) cudaFree(impl_->warm_buf);
  impl_->sources.Clear();
  if (impl_->store) impl_->store->Stop();
}

void NcclSender::RegisterSource(const std::string& uri, std::shared_ptr<WeightSource> source) {
  impl_->sources.Register(uri, std::move(source));
}

bool NcclSender::ready() const { return impl_->comm != nullptr; }
EngineProtocol NcclSender::protocol() const { return impl_->protocol; }
std::uint64_t NcclSender::abort_reserve_ms() const { return impl_->AbortReserveMs(); }
Rendezvous NcclSender::rendezvous() const { return impl_->mode; }
std::uint16_t NcclSender::store_port() const { return impl_->store ? impl_->store->port() : 0; }
const SenderProgress& NcclSender::progress() const { return impl_->progress; }
TransferTiming NcclSender::last_timing() const {
  std::lock_guard<std::mutex> lock(impl_->timing_mu);
  return impl_->timing;
}

Status NcclSender::Init(std::uint64_t deadline_ms) {
  Impl& m = *impl_;
  const auto hard_deadline = Clock::now() + std::chrono::milliseconds(deadline_ms);
  if (m.comm != nullptr) m.AbortComm(hard_deadline);  // re-init: never reuse a communicator
  // Work stops early enough that an abort still returns by the caller's deadline.
  const auto deadline = Impl::WorkDeadline(hard_deadline, deadline_ms, m.AbortReserveMs());
  if (m.store) {
    m.store->Stop();
    m.store.reset();
  }
  cudaError_t e = cudaSetDevice(m.opt.device);
  if (e != cudaSuccess) return Status::Unavailable(CudaErr("cudaSetDevice", e));
  m.comm_device = m.opt.device;

  // body_parsed guarantees "version" is a string and "world_size" a positive integer.
  HttpReply v = m.engine.Version(Within(std::min(m.opt.http_timeout_ms, remaining_ms(deadline))));
  if (!Ok2xx(v) || !v.http.body_parsed) return Status::Unavailable(Describe("GET /version", v));
  m.protocol = detect_protocol(v.body["version"].get<std::string>(), m.opt.protocol_override);
  if (m.protocol.line == ProtocolLine::kUnknown) {
    return Status::InvalidArgument(
        "engine version '" + m.protocol.version +
        "' has no known weight-transfer protocol line; set protocol_override");
  }
  m.mode = m.opt.rendezvous;
  if (m.mode == Rendezvous::kAuto) {
    m.mode = m.protocol.unique_id_rendezvous ? Rendezvous::kUniqueId : Rendezvous::kTcpStore;
  }
  if (m.mode == Rendezvous::kUniqueId && !m.protocol.unique_id_rendezvous) {
    return Status::InvalidArgument(
        "unique-id rendezvous needs an engine that accepts nccl_unique_id_b64, got '" +
        m.protocol.version + "'");
  }
  m.world_size = m.opt.world_size;
  if (m.world_size <= 0) {
    HttpReply w = m.engine.GetWorldSize(
        /*include_dp=*/true, Within(std::min(m.opt.http_timeout_ms, remaining_ms(deadline))));
    if (!Ok2xx(w) || !w.http.body_parsed)
      return Status::Unavailable(Describe("GET /get_world_size", w));
    m.world_size = 1 + static_cast<int>(std::min<std::int64_t>(
                           w.body["world_size"].get<std::int64_t>(), 1 << 20));
  }
  if (m.world_size < 2 || m.world_size > 4096) {
    return Status::InvalidArgument("world size " + std::to_string(m.world_size) +
                                   " out of [2, 4096]");
  }

  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return Status::Internal(NcclErr("ncclGetUniqueId", r));
  static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes);
  UniqueIdBytes id_bytes;
  std::memcpy(id_bytes.data(), &id, sizeof(id));
  std::string uid_b64;
  std::uint16_t port = 0;
  if (m.mode == Rendezvous::kTcpStore) {
    TcpStoreOptions so;
    so.bind_address = m.opt.bind_address.empty() ? m.opt.master_address : m.opt.bind_address;
    so.port = m.opt.master_port;
    auto store = TcpStoreServer::Start(so);
    if (!store.ok()) return store.status();
    m.store = std::move(*store);
    if (Status s = m.store->Set(std::string(kUniqueIdWireKey), PickleNcclUniqueId(id_bytes));
        !s.ok())
      return s;
    port = m.store->port();
  } else {
    uid_b64 = encoding::Base64Encode(
        std::string_view(reinterpret_cast<const char*>(id_bytes.data()), id_bytes.size()));
  }
  NcclInitParams init;
  if (m.mode == Rendezvous::kTcpStore) {
    init.master_address = m.opt.master_address;
    init.master_port = port;
  } else {
    init.nccl_unique_id_b64 = uid_b64;
  }
  init.rank_offset = 1;
  init.world_size = static_cast<std::uint32_t>(m.world_size);
  Result<nlohmann::json> built = build_init_info(m.protocol, init, m.opt.packing);
  if (!built.ok()) return built.status();
  const nlohmann::json init_info = std::move(*built);

  // The engine joins the group inside its HTTP handler: run it beside our own init.
  AsyncCall http(CancelToken{}, [&m, init_info, deadline](const CancelToken& cancel) {
    return m.engine.InitWeightTransferEngine(init_info, Within(remaining_ms(deadline), cancel));
  });
  Impl::Watch w{deadline, &http};
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  r = ncclCommInitRankConfig(&m.comm, m.world_size, id, 0, &config);
  Status s = (m.comm == nullptr && r != ncclSuccess && r != ncclInProgress)
                 ? Status::Internal(NcclErr("ncclCommInitRankConfig", r))
                 : m.Settle(r, "ncclCommInitRankConfig", w);
  cudaStream_t warm_stream = nullptr;
  cudaEvent_t warm_done = nullptr;
  if (s.ok() && m.warm_buf == nullptr) {
    e = cudaMalloc(&m.warm_buf, 2 * sizeof(float));
    if (e != cudaSuccess) s = Status::Unavailable(CudaErr("cudaMalloc warm-up", e));
  }
  if (s.ok()) {
    e = cudaMemset(m.warm_buf, 0, 2 * sizeof(float));
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&warm_stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&warm_done, cudaEventDisableTiming);
    if (e != cudaSuccess) s = Status::Unavailable(CudaErr("warm-up setup", e));
  }
  if (s.ok()) {
    float* f = static_cast<float*>(m.warm_buf);
    s = m.Settle(ncclAllReduce(f, f + 1, 1, ncclFloat32, ncclSum, m.comm, warm_stream),
                 "warm-up all-reduce", w);
  }
  if (s.ok()) {
    e = cudaEventRecord(warm_done, warm_stream);
    s = e == cudaSuccess ? m.WaitEvent(warm_done, w)
                         : Status::Internal(CudaErr("cudaEventRecord", e));
  }
  if (!s.ok()) http.Cancel();  // the engine's side cannot succeed now: stop waiting for it
  if (!s.ok() && m.comm != nullptr) m.AbortComm(hard_deadline);
  const HttpReply& reply = http.Join();  // bounded: cancelled, or its timeout ends at our deadline
  if (warm_done != nullptr && !m.dirty) cudaEventDestroy(warm_done);
  if (warm_stream != nullptr && !m.dirty) cudaStreamDestroy(warm_stream);
  if (!s.ok()) {
    return Status(s.code(),
                  "init (" + std::string(rendezvous_name(m.mode)) + "): " + s.message() +
                      (http.done() ? "; " + Describe("init_weight_transfer_engine", reply) : ""));
  }
  if (!Ok2xx(reply)) {
    m.AbortComm(hard_deadline);
    return Status::Unavailable(Describe("POST /init_weight_transfer_engine", reply));
  }
  return Status::OK();
}

PreflightObserved NcclSender::Preflight(const TransferTarget& target) {
  Impl& m = *impl_;
  PreflightObserved p;
  auto src = m.OpenSource(target.source_uri);
  if (!src.ok()) {
    p.detail = "source: " + src.status().ToString();
    return p;
  }
  const Manifest& manifest = (*src)->manifest();
  if (Status s = manifest.Validate(); !s.ok()) {
    p.detail = "manifest: " + s.ToString();
    return p;
  }
  p.source_manifest_digest = manifest.digest();
  std::string detail;
  if (!target.identity.manifest_digest.empty() &&
      target.identity.manifest_digest != p.source_manifest_digest) {
    detail += "source manifest digest differs from the declared identity; ";
  }
  int current = -1;
  cudaError_t e = cudaGetDevice(&current);
  p.device_ok = e == cudaSuccess && m.comm != nullptr && current == m.comm_device;
  if (!p.device_ok) {
    detail += m.comm == nullptr ? "no communicator (Init first); "
                                : "calling thread's CUDA device " + std::to_string(current) +
                                      " != communicator's device " + std::to_string(m.comm_device) +
                                      " (would fail as 'invalid resource handle'); ";
  }
  if ((*src)->where() == WeightSource::Where::kDevice && (*src)->device() != m.comm_device) {
    p.device_ok = false;
    detail += "source tensors on device " + std::to_string((*src)->device()) + "; ";
  }
  const BroadcastPlan plan =
      PlanFor(manifest, m.opt.packing.packed, m.opt.packing.packed_buffer_size_bytes);
  if (Status packable = CheckPackable(manifest, plan); !packable.ok()) {
    p.source_manifest_digest.clear();  // the source cannot be sent as configured: refused
    p.detail = packable.ToString().substr(0, kTextBytesMax);
    return p;
  }
  const Impl::Needs needs = m.StagingNeeds(**src, plan);
  const std::uint64_t shortfall = m.DeviceShortfallBytes(needs.slot_count, needs.dev_bytes);
  std::size_t free_bytes = 0, total_bytes = 0;
  e = cudaMemGetInfo(&free_bytes, &total_bytes);
  const std::uint64_t want = shortfall == 0 ? 0 : shortfall + m.opt.memory_margin_bytes;
  p.memory_ok = e == cudaSuccess && free_bytes >= want;
  if (!p.memory_ok) {
    detail += "staging needs " + std::to_string(want) + " bytes of device memory, " +
              std::to_string(free_bytes) + " free; ";
  }
  detail += std::to_string(manifest.tensors.size()) + " tensors, " +
            std::to_string(plan.total_bytes) + " bytes, " + std::to_string(plan.ops.size()) +
            " broadcasts";
  p.detail = detail.substr(0, kTextBytesMax);
  return p;
}

TransferObserved NcclSender::Transfer(const TransferTarget& target, std::uint64_t deadline_ms) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  const auto hard_deadline = t0 + std::chrono::milliseconds(deadline_ms);
  TransferObserved out;
  out.finish_label = target.target.label;
  TransferTiming timing;
  // Everything but the abort (and the kernel drain after it) stops at `deadline`, so that an
  // abort started there still returns by hard_deadline.
  const std::uint64_t reserve_ms = m.AbortReserveMs();
  timing.abort_reserve_ms = reserve_ms;
  const auto deadline = Impl::WorkDeadline(hard_deadline, deadline_ms, reserve_ms);
  auto finish = [&](std::string error) {
    out.error = error.substr(0, kTextBytesMax);
    out.duration_us = elapsed_us(t0);
    std::lock_guard<std::mutex> lock(m.timing_mu);
    m.timing = timing;
    return out;
  };
  m.progress.ops_enqueued = m.progress.ops_completed = 0;
  m.progress.bytes_enqueued = m.progress.bytes_completed = 0;

  // ---- checks that change nothing (any failure here: MutationClass::kNone) ----
  if (m.comm == nullptr) return finish("no communicator: Init (a fresh one) before transferring");
  if (deadline_ms <= reserve_ms) {
    return finish("deadline " + std::to_string(deadline_ms) + " ms leaves nothing beyond the " +
                  std::to_string(reserve_ms) + " ms abort reserve; refusing before any mutation");
  }
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != m.comm_device) {
    return finish("calling thread's CUDA device " + std::to_string(current) +
                  " != communicator's device " + std::to_string(m.comm_device) +
                  "; refusing (would fail as 'invalid resource handle')");
  }
  auto src_r = m.OpenSource(target.source_uri);
  if (!src_r.ok()) return finish("source: " + src_r.status().ToString());
  const WeightSource& src = **src_r;
  const Manifest& manifest = src.manifest();
  if (Status s = manifest.Validate(); !s.ok()) return finish("manifest: " + s.ToString());
  if (!target.identity.manifest_digest.empty() &&
      target.identity.manifest_digest != manifest.digest()) {
    return finish("source manifest digest differs from the declared identity");
  }
  if (src.where() == WeightSource::Where::kDevice && src.device() != m.comm_device) {
    return finish("source tensors are on another device than the communicator");
  }
  const BroadcastPlan plan =
      PlanFor(manifest, m.opt.packing.packed, m.opt.packing.packed_buffer_size_bytes);
  if (Status packable = CheckPackable(manifest, plan); !packable.ok())
    return finish(packable.ToString());
  const Impl::Needs needs = m.StagingNeeds(src, plan);
  if (Status s = m.EnsureSlots(needs.slot_count, needs.dev_bytes, needs.host_bytes); !s.ok()) {
    return finish(s.ToString());
  }
  Result<nlohmann::json> built = build_update_info(m.protocol, manifest, m.opt.packing);
  if (!built.ok()) return finish("update_info: " + built.status().ToString());
  const nlohmann::json update_info = std::move(*built);
  const std::size_t ring = needs.slot_count;

  // ---- engine: start ----
  HttpReply start =
      m.engine.StartWeightUpdate(Within(std::min(m.opt.http_timeout_ms, remaining_ms(deadline))));
  timing.start_http_us = start.http.latency_us;
  // vLLM 0.25.x's start_weight_update already moves every layer's parameters to the meta device
  // (layerwise reload): from the moment start may have reached the engine, the weights it serves
  // are no longer the old ones, whatever happens next.
  if (!start.http.never_sent()) out.mutation = MutationClass::kPossible;
  if (!Ok2xx(start)) return finish(Describe("POST /start_weight_update", start));

  // ---- engine: update (its own thread) + data plane ----
  const auto update_t0 = Clock::now();
  AsyncCall update(CancelToken{}, [&m, &update_info, deadline](const CancelToken& cancel) {
    return m.engine.UpdateWeights(update_info, Within(remaining_ms(deadline), cancel));
  });
  Impl::Watch w{deadline, &update};
  Status s;
  std::size_t next_slot = 0;
  Clock::time_point dp_t0{};
  for (std::size_t k = 0; k < plan.ops.size() && s.ok(); ++k) {
    const BroadcastOp& op = plan.ops[k];
    Impl::Slot& slot = m.slots[next_slot];
    next_slot = (next_slot + 1) % ring;
    if (slot.busy) {  // never overwrite (or over-queue) a buffer NCCL may still read
      s = m.WaitEvent(slot.done, w);
      if (!s.ok()) break;
      slot.busy = false;
      m.progress.ops_completed++;
      m.progress.bytes_completed += slot.op_bytes;
    }
    if (s = m.Check(w); !s.ok()) break;
    const void* buf = nullptr;
    if (Impl::Direct(src, op)) {
      buf = src.device_ptr(op.first_tensor);
      timing.direct_ops++;
    } else {
      timing.staged_ops++;
      char* dev = static_cast<char*>(slot.dev);
      std::uint64_t off = 0;
      cudaError_t e = cudaSuccess;
      if (src.where() == WeightSource::Where::kHost) {
        char* host = static_cast<char*>(slot.host);
        for (std::size_t i = op.first_tensor; i < op.first_tensor + op.tensor_count && s.ok();
             ++i) {
          s = src.ReadHost(i, host + off);
          off += manifest.tensors[i].nbytes();
        }
        if (!s.ok()) break;
        e = cudaMemcpyAsync(dev, host, op.bytes, cudaMemcpyHostToDevice, slot.stream);
      } else {
        for (std::size_t i = op.first_tensor;
             i < op.first_tensor + op.tensor_count && e == cudaSuccess; ++i) {
          const std::uint64_t n = manifest.tensors[i].nbytes();
          e = cudaMemcpyAsync(dev + off, src.device_ptr(i), n, cudaMemcpyDeviceToDevice,
                              slot.stream);
          off += n;
        }
      }
      if (e != cudaSuccess) {
        s = Status::Internal(CudaErr("staging copy", e));
        break;
      }
      buf = dev;
    }
    const std::uint64_t count = op.packed ? op.bytes : manifest.tensors[op.first_tensor].numel();
    const ncclDataType_t type =
        op.packed ? ncclUint8 : NcclType(manifest.tensors[op.first_tensor].dtype);
    if (m.progress.ops_enqueued == 0) {
      dp_t0 = Clock::now();
      timing.first_enqueue_steady_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(dp_t0.time_since_epoch()).count();
    }
    // Root passes sendbuff == recvbuff, as vLLM's PyNcclCommunicator does.
    ncclResult_t r =
        ncclBroadcast(buf, const_cast<void*>(buf), count, type, 0, m.comm, slot.stream);
    m.progress.ops_enqueued++;  // counted even if the call failed: bytes may be queued
    m.progress.bytes_enqueued += op.bytes;
    s = m.Settle(r, "ncclBroadcast", w);
    if (!s.ok()) break;
    cudaError_t e = cudaEventRecord(slot.done, slot.stream);
    if (e != cudaSuccess) {
      s = Status::Internal(CudaErr("cudaEventRecord", e));
      break;
    }
    slot.busy = true;
    slot.op_bytes = op.bytes;
  }
  for (auto& slot : m.slots) {
    if (!s.ok()) break;
    if (!slot.busy) continue;
    s = m.WaitEvent(slot.done, w);
    if (s.ok()) {
      slot.busy = false;
      m.progress.ops_completed++;
      m.progress.bytes_completed += slot.op_bytes;
    }
  }
  if (m.progress.ops_enqueued > 0) timing.data_plane_us = elapsed_us(dp_t0);
  out.tensors_sent = static_cast<std::uint32_t>(manifest.tensors.size());

  if (!s.ok()) {
    const bool enqueued = m.progress.ops_enqueued > 0;
    out.mutation = MutationClass::kPossible;  // start succeeded: layers are mid-reload already
    out.tensors_sent = 0;
    out.bytes_sent = m.progress.bytes_completed;
    // The engine's answer can no longer be a success: stop waiting for it (the call returns
    // within ~50 ms) while the communicator is aborted.
    update.Cancel();
    // The group is unusable once bytes were queued, or while the engine may sit in its receives.
    if (enqueued || !update.done()) timing.abort_us = m.AbortComm(hard_deadline);
    const HttpReply& ur = update.Join();
    timing.update_http_us = elapsed_us(update_t0);
    return finish("data plane: " + s.ToString() + (enqueued ? " (communicator aborted)" : "") +
                  "; " + Describe("POST /update_weights", ur));
  }
  out.bytes_sent = plan.total_bytes;
  out.mutation = MutationClass::kPossible;  // every byte left; the engine has not confirmed yet
  // The engine answers once it has received everything: wait for that, bounded by the deadline.
  while (!update.done() && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  if (!update.done()) update.Cancel();  // past the work deadline: the answer comes too late
  const HttpReply& ur = update.Join();
  timing.update_http_us = elapsed_us(update_t0);
  if (!Ok2xx(ur)) return finish(Describe("POST /update_weights", ur));
  HttpReply fin = m.engine.FinishWeightUpdate(
      target.target.label, Within(std::min(m.opt.http_timeout_ms, remaining_ms(hard_deadline))));
  timing.finish_http_us = fin.http.latency_us;
  if (!Ok2xx(fin)) return finish(Describe("POST /finish_weight_update", fin));
  out.acknowledged = true;
  out.mutation = MutationClass::kComplete;
  return finish("");
}

Result<std::uint64_t> NcclSender::RawBroadcast(const void* device_ptr, std::uint64_t bytes,
                                               std::uint64_t chunk_bytes,
                                               std::uint64_t deadline_ms) {
  Impl& m = *impl_;
  if (m.comm == nullptr) return Status::Rejected("no communicator");
  if (chunk_bytes == 0) return Status::InvalidArgument("chunk_bytes must be positive");
  const auto deadline = Clock::now() + std::chrono::milliseconds(deadline_ms);
  Impl::Watch w{deadline, nullptr};
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) {
    return Status::Internal("stream/event creation failed");
  }
  const auto t0 = Clock::now();
  Status s;
  char* p = static_cast<char*>(const_cast<void*>(device_ptr));
  for (std::uint64_t off = 0; off < bytes && s.ok(); off += chunk_bytes) {
    const std::uint64_t n = std::min(chunk_bytes, bytes - off);
    s = m.Settle(ncclBroadcast(p + off, p + off, n, ncclUint8, 0, m.comm, stream), "ncclBroadcast",
                 w);
  }
  if (s.ok()) {
    cudaEventRecord(done, stream);
    s = m.WaitEvent(done, w);
  }
  const std::uint64_t us = elapsed_us(t0);
  if (!s.ok()) {
    m.AbortComm(deadline + std::chrono::milliseconds(m.opt.drain_after_abort_ms));
    return s;
  }
  cudaEventDestroy(done);
  cudaStreamDestroy(stream);
  return us;
}

}  // namespace rc::effects::nccl
