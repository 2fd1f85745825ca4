// CUDA/NCCL half of the sender (built only when CUDA and NCCL are found). See nccl_sender.h.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <chrono>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <system_error>
#include <thread>
#include <vector>

#include "effects/clock.h"
#include "effects/nccl/nccl_sender.h"
#include "effects/nccl/rendezvous.h"
#include "effects/nccl/tcp_store.h"
#include "encoding/base64.h"
#include "statemachine/text.h"

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

// Starts `body` on *t. Unavailable naming `what` when the system refuses the thread (a thread
// limit, no memory for its stack or state): `body` then never runs.
template <typename F>
Status SpawnThread(std::thread* t, const char* what, F&& body) {
  try {
    *t = std::thread(std::forward<F>(body));
    return Status::OK();
  } catch (const std::system_error& e) {
    return Status::Unavailable(std::string("no thread for ") + what + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return Status::Unavailable(std::string("no thread for ") + what + ": out of memory");
  }
}

// An HTTP call on its own thread; the sender polls done() while it drives NCCL. The call holds
// `cancel`: Cancel() makes it return within ~50 ms, so Join() after Cancel() is prompt. When the
// system refuses the thread, the call never runs: started() says why, and it is done() and
// failed() at once with a reply that never reached the engine.
class AsyncCall {
 public:
  template <typename F>
  AsyncCall(CancelToken cancel, F&& f) : cancel_(std::move(cancel)) {
    started_ = SpawnThread(&thread_, "the engine call", [this, fn = std::forward<F>(f)]() mutable {
      HttpReply r = fn(cancel_);
      std::lock_guard<std::mutex> lock(mu_);
      reply_ = std::move(r);
      done_.store(true, std::memory_order_release);
    });
    if (!started_.ok()) {  // nothing was sent
      reply_.http.transport = Transport::kConnectFailed;
      reply_.http.error = started_.message();
      done_.store(true, std::memory_order_release);
    }
  }
  const Status& started() const { return started_; }
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
  Status started_;
  std::thread thread_;
  mutable std::mutex mu_;
  HttpReply reply_;
  std::atomic<bool> done_{false};
};

// A stream and an event owned by one call and destroyed on every way out of it, except after an
// abort that may not have drained (`dirty`): aborted kernels may still use them.
class CallStream {
 public:
  explicit CallStream(const bool& dirty) : dirty_(dirty) {}
  ~CallStream() {
    if (dirty_) return;
    if (done != nullptr) cudaEventDestroy(done);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  CallStream(const CallStream&) = delete;
  CallStream& operator=(const CallStream&) = delete;

  cudaError_t Create() {
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    return e;
  }

  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;

 private:
  const bool& dirty_;
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
    RC_CHECK(src->ptrs_.size() == src->file_.manifest.tensors.size());  // device_ptr(i) per tensor
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
  Status last_abort;   // the latest AbortComm's outcome (not OK: it left the sender dirty)
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
  // further work, and only a restart of the executor recovers NCCL. A refused thread is the same
  // outcome without the abort: it is not run on the caller's thread, where a wedged abort would
  // hold the caller past every deadline.
  static Status AbortWithin(ncclComm_t c, Clock::time_point deadline) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread aborter;
    const Status started = SpawnThread(&aborter, "ncclCommAbort", [c, done] {
      ncclCommAbort(c);
      done->store(true, std::memory_order_release);
    });
    if (!started.ok()) {
      return Status(started.code(), started.message() + " (the communicator was left unaborted)");
    }
    aborter.detach();
    while (!done->load(std::memory_order_acquire)) {
      if (Clock::now() >= deadline) {
        return Status::Timeout("ncclCommAbort did not return by the deadline; it runs on");
      }
      std::this_thread::sleep_for(kPollSleep);
    }
    return Status::OK();
  }

  // Aborts the communicator and gives kernels a bounded time to exit (drain_after_abort_ms, and
  // never past `hard_deadline`). Returns the abort's duration and records the longest one.
  std::uint64_t AbortComm(Clock::time_point hard_deadline = Clock::time_point::max()) {
    last_abort = Status::OK();
    if (comm == nullptr) return 0;
    const auto t0 = Clock::now();
    const auto drain_deadline =
        std::min(hard_deadline, t0 + std::chrono::milliseconds(opt.drain_after_abort_ms));
    last_abort = AbortWithin(
        comm, std::min(hard_deadline, t0 + std::chrono::milliseconds(AbortReserveMs())));
    bool drained = last_abort.ok();
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

  // True when the first `count` slots exist with buffers of at least these sizes.
  bool SlotsFit(std::size_t count, std::uint64_t dev_bytes, std::uint64_t host_bytes) const {
    if (slots.size() < count) return false;
    for (std::size_t i = 0; i < count; ++i) {
      if (slots[i].dev_bytes < dev_bytes || slots[i].host_bytes < host_bytes) return false;
    }
    return true;
  }

  bool NoSlotBusy() const {
    return std::none_of(slots.begin(), slots.end(), [](const Slot& s) { return s.busy; });
  }

  Status EnsureSlots(std::size_t count, std::uint64_t dev_bytes, std::uint64_t host_bytes) {
    RC_CHECK(count > 0);
    if (SlotsFit(count, dev_bytes, host_bytes)) return Status::OK();
    if (dirty) return Status::Rejected("device work from an aborted transfer has not drained");
    if (slots.size() < count) slots.resize(count);
    for (std::size_t i = 0; i < count; ++i) {
      if (cudaError_t e = GrowSlot(&slots[i], dev_bytes, host_bytes); e != cudaSuccess) {
        FreeSlots();
        return Status::Unavailable(CudaErr("staging allocation", e));
      }
    }
    RC_CHECK(SlotsFit(count, dev_bytes, host_bytes));
    return Status::OK();
  }

  // Gives s a stream, an event and buffers of at least these sizes (buffers only grow).
  static cudaError_t GrowSlot(Slot* s, std::uint64_t dev_bytes, std::uint64_t host_bytes) {
    RC_CHECK(!s->busy);  // its buffers may be freed: NCCL must not be reading them
    cudaError_t e = cudaSuccess;
    if (s->stream == nullptr) e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess && s->done == nullptr)
      e = cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming);
    if (e == cudaSuccess && s->dev_bytes < dev_bytes) e = GrowDeviceBuffer(s, dev_bytes);
    if (e == cudaSuccess && s->host_bytes < host_bytes) e = GrowHostBuffer(s, host_bytes);
    return e;
  }
  static cudaError_t GrowDeviceBuffer(Slot* s, std::uint64_t bytes) {
    if (s->dev) cudaFree(s->dev);
    s->dev = nullptr;
    s->dev_bytes = 0;
    const cudaError_t e = cudaMalloc(&s->dev, bytes);
    if (e == cudaSuccess) s->dev_bytes = bytes;
    return e;
  }
  static cudaError_t GrowHostBuffer(Slot* s, std::uint64_t bytes) {
    if (s->host) cudaFreeHost(s->host);
    s->host = nullptr;
    s->host_bytes = 0;
    const cudaError_t e = cudaHostAlloc(&s->host, bytes, cudaHostAllocDefault);
    if (e == cudaSuccess) s->host_bytes = bytes;
    return e;
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
    RC_CHECK(op.first_tensor + op.tensor_count <= m.tensors.size());
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

  // ---- Preflight checks: each sets its verdict and returns what it found wrong ----
  // The calling thread, the communicator and a device source on one device. Without a
  // communicator (none yet, or an aborted transfer's) the configured device stands in: whoever
  // transfers sets up a new one first (serve does), and Transfer refuses without one.
  std::string CheckDevices(const WeightSource& src, bool* device_ok) const {
    std::string detail;
    int current = -1;
    cudaError_t e = cudaGetDevice(&current);
    const int device = comm != nullptr ? comm_device : opt.device;
    *device_ok = e == cudaSuccess && current == device;
    if (comm == nullptr) detail += "no communicator yet (set up before the transfer); ";
    if (!*device_ok) {
      detail += "calling thread's CUDA device " + std::to_string(current) + " != the sender's " +
                std::to_string(device) + " (would fail as 'invalid resource handle'); ";
    }
    if (src.where() == WeightSource::Where::kDevice && src.device() != device) {
      *device_ok = false;
      detail += "source tensors on device " + std::to_string(src.device()) + "; ";
    }
    return detail;
  }

  // Free device memory for the staging buffers the plan still needs, plus the margin.
  std::string CheckMemory(const WeightSource& src, const BroadcastPlan& plan,
                          bool* memory_ok) const {
    const Needs needs = StagingNeeds(src, plan);
    const std::uint64_t shortfall = DeviceShortfallBytes(needs.slot_count, needs.dev_bytes);
    std::size_t free_bytes = 0, total_bytes = 0;
    const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes);
    const std::uint64_t want = shortfall == 0 ? 0 : shortfall + opt.memory_margin_bytes;
    *memory_ok = e == cudaSuccess && free_bytes >= want;
    if (*memory_ok) return "";
    return "staging needs " + std::to_string(want) + " bytes of device memory, " +
           std::to_string(free_bytes) + " free; ";
  }

  // ---- Init steps ----
  void StopStore() {
    if (store) {
      store->Stop();
      store.reset();
    }
  }

  // The store serves one rendezvous and nothing after it: vLLM's workers read the id once (the
  // broadcast_obj in PyNcclCommunicator's constructor, on the StatelessProcessGroup its NCCL
  // weight-transfer engine makes) and use only NCCL from then on; the group's store client stays
  // open but sends nothing. Once the warm-up all-reduce completed, every rank has read the id; a
  // failed init leaves nothing worth serving (the next Init publishes a fresh id on a fresh
  // store). Either way the store stops, listener included, so no peer can connect to it and hold
  // its connections for the communicator's lifetime. The stopped object stays for store_port().
  void EndRendezvous() {
    if (store) store->Stop();
  }

  // Publishes `id` (on a store or in init_info) and joins the group with the engine's workers.
  Status PublishAndJoin(const ncclUniqueId& id, Clock::time_point deadline,
                        Clock::time_point hard_deadline) {
    Result<NcclInitParams> init = PublishUniqueId(id);
    if (!init.ok()) return init.status();
    Result<nlohmann::json> built = build_init_info(protocol, *init, opt.packing);
    if (!built.ok()) return built.status();
    return JoinGroup(*built, id, deadline, hard_deadline);
  }

  Status UseDevice() {
    cudaError_t e = cudaSetDevice(opt.device);
    if (e != cudaSuccess) return Status::Unavailable(CudaErr("cudaSetDevice", e));
    comm_device = opt.device;
    return Status::OK();
  }

  // body_parsed guarantees "version" is a string and "world_size" a positive integer.
  Status DetectProtocol(Clock::time_point deadline) {
    HttpReply v = engine.Version(Within(std::min(opt.http_timeout_ms, remaining_ms(deadline))));
    if (!Ok2xx(v) || !v.http.body_parsed) return Status::Unavailable(Describe("GET /version", v));
    protocol = detect_protocol(v.body["version"].get<std::string>(), opt.protocol_override);
    if (protocol.line == ProtocolLine::kUnknown) {
      return Status::InvalidArgument(
          "engine version '" + protocol.version +
          "' has no known weight-transfer protocol line; set protocol_override");
    }
    return Status::OK();
  }

  Status ChooseRendezvous() {
    mode = opt.rendezvous;
    if (mode == Rendezvous::kAuto) {
      mode = protocol.unique_id_rendezvous ? Rendezvous::kUniqueId : Rendezvous::kTcpStore;
    }
    if (mode == Rendezvous::kUniqueId && !protocol.unique_id_rendezvous) {
      return Status::InvalidArgument(
          "unique-id rendezvous needs an engine that accepts nccl_unique_id_b64, got '" +
          protocol.version + "'");
    }
    RC_CHECK(mode != Rendezvous::kAuto);
    return Status::OK();
  }

  // Rank 0 plus the engine's ranks (configured, or 1 + what the engine reports).
  Status ResolveWorldSize(Clock::time_point deadline) {
    world_size = opt.world_size;
    if (world_size <= 0) {
      HttpReply w = engine.GetWorldSize(
          /*include_dp=*/true, Within(std::min(opt.http_timeout_ms, remaining_ms(deadline))));
      if (!Ok2xx(w) || !w.http.body_parsed)
        return Status::Unavailable(Describe("GET /get_world_size", w));
      world_size = 1 + static_cast<int>(std::min<std::int64_t>(
                           w.body["world_size"].get<std::int64_t>(), 1 << 20));
    }
    if (world_size < 2 || world_size > 4096) {
      return Status::InvalidArgument("world size " + std::to_string(world_size) +
                                     " out of [2, 4096]");
    }
    return Status::OK();
  }

  // Makes `id` reachable by the engine's workers (served by a fresh store, or carried as base64
  // in init_info) and returns the init parameters that tell them where to find it.
  Result<NcclInitParams> PublishUniqueId(const ncclUniqueId& id) {
    RC_CHECK(store == nullptr && mode != Rendezvous::kAuto);
    static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes);
    UniqueIdBytes id_bytes;
    std::memcpy(id_bytes.data(), &id, sizeof(id));
    NcclInitParams init;
    if (mode == Rendezvous::kTcpStore) {
      Result<std::uint16_t> port = ServeUniqueId(id_bytes);
      if (!port.ok()) return port.status();
      init.master_address = opt.master_address;
      init.master_port = *port;
    } else {
      init.nccl_unique_id_b64 = encoding::Base64Encode(
          std::string_view(reinterpret_cast<const char*>(id_bytes.data()), id_bytes.size()));
    }
    init.rank_offset = 1;
    init.world_size = static_cast<std::uint32_t>(world_size);
    RC_CHECK((mode == Rendezvous::kTcpStore) == (store != nullptr));
    return init;
  }

  // A TCPStore master holding the pickled id at vLLM's key; returns the port it listens on.
  Result<std::uint16_t> ServeUniqueId(const UniqueIdBytes& id_bytes) {
    TcpStoreOptions so;
    so.bind_address = opt.bind_address.empty() ? opt.master_address : opt.bind_address;
    so.port = opt.master_port;
    auto started = TcpStoreServer::Start(so);
    if (!started.ok()) return started.status();
    store = std::move(*started);
    RC_RETURN_IF_ERROR(store->Set(std::string(kUniqueIdWireKey), PickleNcclUniqueId(id_bytes)));
    return store->port();
  }

  // The warm-up collective's stream and event, destroyed once the engine's call returned.
  struct WarmUp {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
  };

  // Rank 0 creates its communicator and runs the warm-up all-reduce while the engine's workers
  // join from inside its HTTP handler. On any failure the communicator is aborted.
  Status JoinGroup(const nlohmann::json& init_info, const ncclUniqueId& id,
                   Clock::time_point deadline, Clock::time_point hard_deadline) {
    RC_CHECK(comm == nullptr);
    // The engine joins the group inside its HTTP handler: run it beside our own init.
    AsyncCall http(CancelToken{}, [this, init_info, deadline](const CancelToken& cancel) {
      return engine.InitWeightTransferEngine(init_info, Within(remaining_ms(deadline), cancel));
    });
    if (!http.started().ok()) {  // nothing reached the engine and no communicator exists yet
      return Status(http.started().code(),
                    "init (" + std::string(rendezvous_name(mode)) +
                        "): POST /init_weight_transfer_engine: " + http.started().message());
    }
    const Watch w{deadline, &http};
    WarmUp warm;
    Status s = InitComm(id, w);
    if (s.ok()) s = WarmUpAllReduce(&warm, w);
    if (!s.ok()) http.Cancel();  // the engine's side cannot succeed now: stop waiting for it
    if (!s.ok() && comm != nullptr) AbortComm(hard_deadline);
    const HttpReply& reply =
        http.Join();  // bounded: cancelled, or its timeout ends at our deadline
    DestroyWarmUp(warm);
    if (!s.ok()) {
      return Status(s.code(),
                    "init (" + std::string(rendezvous_name(mode)) + "): " + s.message() +
                        (http.done() ? "; " + Describe("init_weight_transfer_engine", reply) : ""));
    }
    if (!Ok2xx(reply)) {
      AbortComm(hard_deadline);
      return Status::Unavailable(Describe("POST /init_weight_transfer_engine", reply));
    }
    return Status::OK();
  }

  Status InitComm(const ncclUniqueId& id, const Watch& w) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, world_size, id, 0, &config);
    return (comm == nullptr && r != ncclSuccess && r != ncclInProgress)
               ? Status::Internal(NcclErr("ncclCommInitRankConfig", r))
               : Settle(r, "ncclCommInitRankConfig", w);
  }

  // A 1-element float32 sum over the fresh group: proves every rank joined.
  Status WarmUpAllReduce(WarmUp* warm, const Watch& w) {
    cudaError_t e = cudaSuccess;
    if (warm_buf == nullptr) {
      e = cudaMalloc(&warm_buf, 2 * sizeof(float));
      if (e != cudaSuccess) return Status::Unavailable(CudaErr("cudaMalloc warm-up", e));
    }
    e = cudaMemset(warm_buf, 0, 2 * sizeof(float));
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&warm->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&warm->done, cudaEventDisableTiming);
    if (e != cudaSuccess) return Status::Unavailable(CudaErr("warm-up setup", e));
    float* f = static_cast<float*>(warm_buf);
    RC_RETURN_IF_ERROR(Settle(ncclAllReduce(f, f + 1, 1, ncclFloat32, ncclSum, comm, warm->stream),
                              "warm-up all-reduce", w));
    e = cudaEventRecord(warm->done, warm->stream);
    return e == cudaSuccess ? WaitEvent(warm->done, w)
                            : Status::Internal(CudaErr("cudaEventRecord", e));
  }

  // Kept when an abort may not have drained (dirty): aborted kernels may still use them.
  void DestroyWarmUp(const WarmUp& warm) const {
    if (warm.done != nullptr && !dirty) cudaEventDestroy(warm.done);
    if (warm.stream != nullptr && !dirty) cudaStreamDestroy(warm.stream);
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
  m.StopStore();
  RC_RETURN_IF_ERROR(m.UseDevice());
  RC_RETURN_IF_ERROR(m.DetectProtocol(deadline));
  RC_RETURN_IF_ERROR(m.ChooseRendezvous());
  RC_RETURN_IF_ERROR(m.ResolveWorldSize(deadline));
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return Status::Internal(NcclErr("ncclGetUniqueId", r));
  const Status joined = m.PublishAndJoin(id, deadline, hard_deadline);
  m.EndRendezvous();
  RC_RETURN_IF_ERROR(joined);
  RC_CHECK(m.comm != nullptr && m.comm_device == m.opt.device && m.world_size >= 2);
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
  detail += m.CheckDevices(**src, &p.device_ok);
  const BroadcastPlan plan =
      PlanFor(manifest, m.opt.packing.packed, m.opt.packing.packed_buffer_size_bytes);
  if (Status packable = CheckPackable(manifest, plan); !packable.ok()) {
    p.source_manifest_digest.clear();  // the source cannot be sent as configured: refused
    p.detail = text::utf8_prefix(packable.ToString(), kTextBytesMax);
    return p;
  }
  detail += m.CheckMemory(**src, plan, &p.memory_ok);
  detail += std::to_string(manifest.tensors.size()) + " tensors, " +
            std::to_string(plan.total_bytes) + " bytes, " + std::to_string(plan.ops.size()) +
            " broadcasts";
  p.detail = text::utf8_prefix(detail, kTextBytesMax);
  return p;
}

namespace {

using Impl = NcclSender::Impl;

// One Transfer call: its deadlines, what it reports, and its steps in the order they run. A step
// that fails returns a Status whose message is the transfer's error text.
class TransferRun {
 public:
  TransferRun(Impl& m, const TransferTarget& target, std::uint64_t deadline_ms)
      : m_(m),
        target_(target),
        deadline_ms_(deadline_ms),
        t0_(Clock::now()),
        hard_deadline_(t0_ + std::chrono::milliseconds(deadline_ms)),
        reserve_ms_(m.AbortReserveMs()),
        deadline_(Impl::WorkDeadline(hard_deadline_, deadline_ms, reserve_ms_)) {
    out_.finish_label = target.target.label;
    timing_.abort_reserve_ms = reserve_ms_;
    m.progress.ops_enqueued = m.progress.ops_completed = 0;
    m.progress.bytes_enqueued = m.progress.bytes_completed = 0;
  }

  TransferObserved Run() {
    const Status s = Steps();
    return Finish(s.ok() ? std::string() : s.message());
  }

 private:
  Status Steps() {
    RC_RETURN_IF_ERROR(Prepare());
    RC_RETURN_IF_ERROR(StartUpdate());
    return UpdateWeights();
  }

  // What the sender promises: kNone only while no broadcast was enqueued, kComplete exactly when
  // the engine acknowledged.
  TransferObserved Finish(const std::string& error) {
    RC_CHECK(out_.mutation != MutationClass::kNone || m_.progress.ops_enqueued == 0);
    RC_CHECK(out_.acknowledged == (out_.mutation == MutationClass::kComplete));
    out_.error = text::utf8_prefix(error, kTextBytesMax);
    out_.duration_us = elapsed_us(t0_);
    std::lock_guard<std::mutex> lock(m_.timing_mu);
    m_.timing = timing_;
    return out_;
  }

  // ---- checks that change nothing (any failure here: MutationClass::kNone) ----
  static Status Refuse(std::string text) { return Status::Rejected(std::move(text)); }

  Status Prepare() {
    RC_RETURN_IF_ERROR(CheckReady());
    auto src_r = m_.OpenSource(target_.source_uri);
    if (!src_r.ok()) return Refuse("source: " + src_r.status().ToString());
    source_ = std::move(*src_r);
    RC_RETURN_IF_ERROR(CheckSource());
    const Manifest& manifest = source_->manifest();
    plan_ = PlanFor(manifest, m_.opt.packing.packed, m_.opt.packing.packed_buffer_size_bytes);
    if (Status packable = CheckPackable(manifest, plan_); !packable.ok())
      return Refuse(packable.ToString());
    const Impl::Needs needs = m_.StagingNeeds(*source_, plan_);
    if (Status s = m_.EnsureSlots(needs.slot_count, needs.dev_bytes, needs.host_bytes); !s.ok()) {
      return Refuse(s.ToString());
    }
    Result<nlohmann::json> built = build_update_info(m_.protocol, manifest, m_.opt.packing);
    if (!built.ok()) return Refuse("update_info: " + built.status().ToString());
    update_info_ = std::move(*built);
    ring_ = needs.slot_count;
    return Status::OK();
  }

  Status CheckReady() const {
    if (m_.comm == nullptr)
      return Refuse("no communicator: Init (a fresh one) before transferring");
    if (deadline_ms_ <= reserve_ms_) {
      return Refuse("deadline " + std::to_string(deadline_ms_) + " ms leaves nothing beyond the " +
                    std::to_string(reserve_ms_) +
                    " ms abort reserve; refusing before any mutation");
    }
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != m_.comm_device) {
      return Refuse("calling thread's CUDA device " + std::to_string(current) +
                    " != communicator's device " + std::to_string(m_.comm_device) +
                    "; refusing (would fail as 'invalid resource handle')");
    }
    return Status::OK();
  }

  Status CheckSource() const {
    const Manifest& manifest = source_->manifest();
    if (Status s = manifest.Validate(); !s.ok()) return Refuse("manifest: " + s.ToString());
    if (!target_.identity.manifest_digest.empty() &&
        target_.identity.manifest_digest != manifest.digest()) {
      return Refuse("source manifest digest differs from the declared identity");
    }
    if (source_->where() == WeightSource::Where::kDevice && source_->device() != m_.comm_device) {
      return Refuse("source tensors are on another device than the communicator");
    }
    return Status::OK();
  }

  // ---- engine: start ----
  Status StartUpdate() {
    HttpReply start = m_.engine.StartWeightUpdate(
        StaleSessionFor(target_.restore),
        Within(std::min(m_.opt.http_timeout_ms, remaining_ms(deadline_))));
    timing_.start_http_us = start.http.latency_us;
    // vLLM 0.25.x's start_weight_update already moves every layer's parameters to the meta device
    // (layerwise reload): from the moment start may have reached the engine, the weights it serves
    // are no longer the old ones, whatever happens next.
    if (!start.http.never_sent()) out_.mutation = MutationClass::kPossible;
    out_.foreign_session = start.foreign_weight_session;
    if (!Ok2xx(start)) return Status::Unavailable(Describe("POST /start_weight_update", start));
    return Status::OK();
  }

  // ---- engine: update (its own thread) + data plane ----
  Status UpdateWeights() {
    const auto update_t0 = Clock::now();
    AsyncCall update(CancelToken{}, [&m = m_, &update_info = update_info_,
                                     deadline = deadline_](const CancelToken& cancel) {
      return m.engine.UpdateWeights(update_info, Within(remaining_ms(deadline), cancel));
    });
    if (!update.started().ok()) {  // nothing enqueued, nothing sent: the engine sits after start
      return Status(update.started().code(), "POST /update_weights: " + update.started().message());
    }
    const Impl::Watch w{deadline_, &update};
    Status s = SendAll(w);
    if (s.ok()) s = DrainSlots(w);
    if (m_.progress.ops_enqueued > 0) timing_.data_plane_us = elapsed_us(dp_t0_);
    out_.tensors_sent = static_cast<std::uint32_t>(source_->manifest().tensors.size());
    if (!s.ok()) return AbandonUpdate(s, &update, update_t0);
    return AwaitEngine(&update, update_t0);
  }

  // The ops go round the first ring_ slots; a slot is reused only once its broadcast completed.
  Status SendAll(const Impl::Watch& w) {
    RC_CHECK(ring_ >= 1 && ring_ <= m_.slots.size() && m_.NoSlotBusy());
    std::size_t next_slot = 0;
    for (const BroadcastOp& op : plan_.ops) {
      Impl::Slot& slot = m_.slots[next_slot];
      next_slot = (next_slot + 1) % ring_;
      RC_RETURN_IF_ERROR(SendOne(op, &slot, w));
    }
    return Status::OK();
  }

  Status SendOne(const BroadcastOp& op, Impl::Slot* slot, const Impl::Watch& w) {
    // never overwrite (or over-queue) a buffer NCCL may still read
    if (slot->busy) RC_RETURN_IF_ERROR(Release(slot, w));
    RC_RETURN_IF_ERROR(m_.Check(w));
    const void* buf = nullptr;
    if (Impl::Direct(*source_, op)) {
      buf = source_->device_ptr(op.first_tensor);
      timing_.direct_ops++;
    } else {
      timing_.staged_ops++;
      RC_RETURN_IF_ERROR(Stage(op, *slot, w.deadline));
      buf = slot->dev;
    }
    return Enqueue(op, buf, slot, w);
  }

  // Waits for the slot's broadcast and counts it complete.
  Status Release(Impl::Slot* slot, const Impl::Watch& w) {
    RC_CHECK(slot->busy);
    RC_RETURN_IF_ERROR(m_.WaitEvent(slot->done, w));
    slot->busy = false;
    m_.progress.ops_completed++;
    m_.progress.bytes_completed += slot->op_bytes;
    return Status::OK();
  }

  // Copies the op's tensors into the slot's device buffer (through its pinned host buffer when
  // the source is a file; the file read stops at `deadline`). StagingNeeds sized every slot of the
  // ring for the largest staged op.
  Status Stage(const BroadcastOp& op, const Impl::Slot& slot, Clock::time_point deadline) {
    RC_CHECK(op.bytes <= slot.dev_bytes);
    char* dev = static_cast<char*>(slot.dev);
    cudaError_t e = cudaSuccess;
    if (source_->where() == WeightSource::Where::kHost) {
      RC_CHECK(op.bytes <= slot.host_bytes);
      char* host = static_cast<char*>(slot.host);
      RC_RETURN_IF_ERROR(ReadToHost(op, host, deadline));
      e = cudaMemcpyAsync(dev, host, op.bytes, cudaMemcpyHostToDevice, slot.stream);
    } else {
      e = CopyOnDevice(op, dev, slot.stream);
    }
    if (e != cudaSuccess) return Status::Internal(CudaErr("staging copy", e));
    return Status::OK();
  }

  Status ReadToHost(const BroadcastOp& op, char* host, Clock::time_point deadline) const {
    std::uint64_t off = 0;
    for (std::size_t i = op.first_tensor; i < op.first_tensor + op.tensor_count; ++i) {
      RC_RETURN_IF_ERROR(source_->ReadHost(i, host + off, deadline));
      off += source_->manifest().tensors[i].nbytes();
    }
    return Status::OK();
  }

  cudaError_t CopyOnDevice(const BroadcastOp& op, char* dev, cudaStream_t stream) const {
    std::uint64_t off = 0;
    for (std::size_t i = op.first_tensor; i < op.first_tensor + op.tensor_count; ++i) {
      const std::uint64_t n = source_->manifest().tensors[i].nbytes();
      const cudaError_t e =
          cudaMemcpyAsync(dev + off, source_->device_ptr(i), n, cudaMemcpyDeviceToDevice, stream);
      if (e != cudaSuccess) return e;
      off += n;
    }
    return cudaSuccess;
  }

  // Broadcasts `buf` on the slot's stream; the slot stays busy until the broadcast completed.
  Status Enqueue(const BroadcastOp& op, const void* buf, Impl::Slot* slot, const Impl::Watch& w) {
    RC_CHECK(!slot->busy);
    const Manifest& manifest = source_->manifest();
    const std::uint64_t count = op.packed ? op.bytes : manifest.tensors[op.first_tensor].numel();
    const ncclDataType_t type =
        op.packed ? ncclUint8 : NcclType(manifest.tensors[op.first_tensor].dtype);
    if (m_.progress.ops_enqueued == 0) {
      dp_t0_ = Clock::now();
      timing_.first_enqueue_steady_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(dp_t0_.time_since_epoch()).count();
    }
    // Root passes sendbuff == recvbuff, as vLLM's PyNcclCommunicator does.
    ncclResult_t r =
        ncclBroadcast(buf, const_cast<void*>(buf), count, type, 0, m_.comm, slot->stream);
    m_.progress.ops_enqueued++;  // counted even if the call failed: bytes may be queued
    m_.progress.bytes_enqueued += op.bytes;
    RC_RETURN_IF_ERROR(m_.Settle(r, "ncclBroadcast", w));
    cudaError_t e = cudaEventRecord(slot->done, slot->stream);
    if (e != cudaSuccess) return Status::Internal(CudaErr("cudaEventRecord", e));
    slot->busy = true;
    slot->op_bytes = op.bytes;
    return Status::OK();
  }

  Status DrainSlots(const Impl::Watch& w) {
    for (auto& slot : m_.slots) {
      if (slot.busy) RC_RETURN_IF_ERROR(Release(&slot, w));
    }
    // Every op of the plan was broadcast and completed exactly once.
    RC_CHECK(m_.progress.ops_completed == plan_.ops.size() &&
             m_.progress.bytes_completed == plan_.total_bytes);
    return Status::OK();
  }

  // The data plane failed after start succeeded: the layers are mid-reload already.
  Status AbandonUpdate(const Status& s, AsyncCall* update, Clock::time_point update_t0) {
    const bool enqueued = m_.progress.ops_enqueued > 0;
    out_.mutation = MutationClass::kPossible;  // start succeeded: layers are mid-reload already
    out_.tensors_sent = 0;
    out_.bytes_sent = m_.progress.bytes_completed;
    // The engine's answer can no longer be a success: stop waiting for it (the call returns
    // within ~50 ms) while the communicator is aborted.
    update->Cancel();
    // The group is unusable once bytes were queued, or while the engine may sit in its receives.
    const bool abort = enqueued || !update->done();
    if (abort) timing_.abort_us = m_.AbortComm(hard_deadline_);
    const HttpReply& ur = update->Join();
    timing_.update_http_us = elapsed_us(update_t0);
    RC_CHECK(!enqueued || m_.comm == nullptr);
    std::string aborted = enqueued ? " (communicator aborted)" : "";
    if (abort && !m_.last_abort.ok()) aborted = " (" + m_.last_abort.ToString() + ")";
    return Status::Unavailable("data plane: " + s.ToString() + aborted + "; " +
                               Describe("POST /update_weights", ur));
  }

  Status AwaitEngine(AsyncCall* update, Clock::time_point update_t0) {
    out_.bytes_sent = plan_.total_bytes;
    out_.mutation = MutationClass::kPossible;  // every byte left; the engine has not confirmed yet
    // The engine answers once it has received everything: wait for that, bounded by the deadline.
    while (!update->done() && Clock::now() < deadline_)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (!update->done()) update->Cancel();  // past the work deadline: the answer comes too late
    const HttpReply& ur = update->Join();
    timing_.update_http_us = elapsed_us(update_t0);
    if (!Ok2xx(ur)) return Status::Unavailable(Describe("POST /update_weights", ur));
    return FinishUpdate();
  }

  // ---- engine: finish ----
  Status FinishUpdate() {
    HttpReply fin = m_.engine.FinishWeightUpdate(
        target_.target.label,
        Within(std::min(m_.opt.http_timeout_ms, remaining_ms(hard_deadline_))));
    timing_.finish_http_us = fin.http.latency_us;
    if (!Ok2xx(fin)) return Status::Unavailable(Describe("POST /finish_weight_update", fin));
    out_.acknowledged = true;
    out_.mutation = MutationClass::kComplete;
    return Status::OK();
  }

  Impl& m_;
  const TransferTarget& target_;
  const std::uint64_t deadline_ms_;
  const Clock::time_point t0_;
  const Clock::time_point hard_deadline_;
  const std::uint64_t reserve_ms_;
  // Everything but the abort (and the kernel drain after it) stops at deadline_, so that an
  // abort started there still returns by hard_deadline_.
  const Clock::time_point deadline_;
  TransferObserved out_;
  TransferTiming timing_;
  // What Prepare checked; the source is held until the transfer returns.
  std::shared_ptr<WeightSource> source_;
  BroadcastPlan plan_;
  nlohmann::json update_info_;
  std::size_t ring_ = 0;       // the ring is the first ring_ slots
  Clock::time_point dp_t0_{};  // the first broadcast's enqueue
};

}  // namespace

TransferObserved NcclSender::Transfer(const TransferTarget& target, std::uint64_t deadline_ms) {
  return TransferRun(*impl_, target, deadline_ms).Run();
}

Result<std::uint64_t> NcclSender::RawBroadcast(const void* device_ptr, std::uint64_t bytes,
                                               std::uint64_t chunk_bytes,
                                               std::uint64_t deadline_ms) {
  Impl& m = *impl_;
  if (m.comm == nullptr) return Status::Rejected("no communicator");
  if (chunk_bytes == 0) return Status::InvalidArgument("chunk_bytes must be positive");
  const auto deadline = Clock::now() + std::chrono::milliseconds(deadline_ms);
  Impl::Watch w{deadline, nullptr};
  CallStream cs(m.dirty);  // destroyed on every return below, after the abort if there is one
  if (cudaError_t e = cs.Create(); e != cudaSuccess) {
    return Status::Internal(CudaErr("stream/event creation", e));
  }
  const auto t0 = Clock::now();
  Status s;
  char* p = static_cast<char*>(const_cast<void*>(device_ptr));
  for (std::uint64_t off = 0; off < bytes && s.ok(); off += chunk_bytes) {
    const std::uint64_t n = std::min(chunk_bytes, bytes - off);
    s = m.Settle(ncclBroadcast(p + off, p + off, n, ncclUint8, 0, m.comm, cs.stream),
                 "ncclBroadcast", w);
  }
  if (s.ok()) {
    const cudaError_t e = cudaEventRecord(cs.done, cs.stream);
    s = e == cudaSuccess ? m.WaitEvent(cs.done, w)
                         : Status::Internal(CudaErr("cudaEventRecord", e));
  }
  const std::uint64_t us = elapsed_us(t0);
  if (!s.ok()) {
    m.AbortComm(deadline + std::chrono::milliseconds(m.opt.drain_after_abort_ms));
    if (!m.last_abort.ok()) return Status(s.code(), s.message() + "; " + m.last_abort.ToString());
    return s;
  }
  return us;
}

}  // namespace rc::effects::nccl
