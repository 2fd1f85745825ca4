// CUDA/NCCL half of the sender (built only when CUDA and NCCL are found). See nccl_sender.h.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "effects/nccl/nccl_sender.h"
#include "effects/nccl/rendezvous.h"
#include "effects/nccl/tcp_store.h"

namespace rc::effects::nccl {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollSleep = std::chrono::microseconds(20);

std::uint64_t UsSince(Clock::time_point t) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t).count());
}
std::uint64_t MsUntil(Clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms > 0 ? static_cast<std::uint64_t>(ms) : 0;
}
std::string CudaErr(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}
std::string NcclErr(const char* what, ncclResult_t r) {
  return std::string(what) + ": " + ncclGetErrorString(r);
}

ncclDataType_t NcclType(DType d) {
  switch (d) {
    case DType::kInt8: return ncclInt8;
    case DType::kUInt8: return ncclUint8;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat8E4M3: return ncclFloat8e4m3;
  }
  return ncclUint8;
}

bool Ok2xx(const EngineReply& r) {
  return r.http.transport == Transport::kOk && r.http.http_status >= 200 && r.http.http_status < 300;
}
std::string Describe(const char* route, const EngineReply& r) {
  return std::string(route) + ": " + transport_name(r.http.transport) + " status " +
         std::to_string(r.http.http_status) + (r.http.error.empty() ? "" : " " + r.http.error);
}

// An HTTP call on its own thread; the sender polls done() while it drives NCCL.
class AsyncCall {
 public:
  template <typename F>
  explicit AsyncCall(F&& f) {
    thread_ = std::thread([this, fn = std::forward<F>(f)]() mutable {
      EngineReply r = fn();
      std::lock_guard<std::mutex> lock(mu_);
      reply_ = std::move(r);
      done_.store(true, std::memory_order_release);
    });
  }
  ~AsyncCall() { Join(); }
  bool done() const { return done_.load(std::memory_order_acquire); }
  bool failed() const { return done() && !Ok2xx(reply()); }
  // The call carries its own timeout (never beyond the caller's deadline), so this is bounded.
  const EngineReply& Join() {
    if (thread_.joinable()) thread_.join();
    return reply_;
  }
  const EngineReply& reply() const { return reply_; }

 private:
  std::thread thread_;
  mutable std::mutex mu_;
  EngineReply reply_;
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
      return Status::Rejected("ipc file tensors live on device " + std::to_string(src->file_.device) +
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

struct NcclSender::Impl {
  EngineApi* engine;
  NcclSenderOptions opt;
  ProtocolLine line = ProtocolLine::kPackedInInitInfo;
  Rendezvous mode = Rendezvous::kTcpStore;
  std::unique_ptr<TcpStoreServer> store;
  ncclComm_t comm = nullptr;
  int comm_device = -1;
  int world_size = 0;
  bool dirty = false;  // device work may still run after an abort: never free buffers then
  std::map<std::string, std::shared_ptr<WeightSource>> sources;

  // Ring of slots: each has a stream, an event and (when staging) device + pinned host buffers.
  struct Slot {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
    void* dev = nullptr;
    void* host = nullptr;
    bool busy = false;
    std::uint64_t op_bytes = 0;
  };
  std::vector<Slot> slots;
  std::uint64_t dev_staging_bytes = 0, host_staging_bytes = 0;
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
        return Status::Unavailable(std::string(what) + " while " + Describe("engine", w.call->reply()));
      }
      if (Clock::now() >= w.deadline) return Status::Timeout(std::string(what) + " passed the deadline");
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

  // Aborts the communicator and gives kernels a bounded time to exit. Returns the abort's duration.
  std::uint64_t AbortComm() {
    if (comm == nullptr) return 0;
    const auto t0 = Clock::now();
    ncclCommAbort(comm);
    comm = nullptr;
    const auto drain_deadline = t0 + std::chrono::milliseconds(opt.drain_after_abort_ms);
    bool drained = true;
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
    return UsSince(t0);
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
    dev_staging_bytes = host_staging_bytes = 0;
  }

  Status EnsureSlots(std::size_t count, std::uint64_t dev_bytes, std::uint64_t host_bytes) {
    if (slots.size() == count && dev_staging_bytes >= dev_bytes && host_staging_bytes >= host_bytes) {
      return Status::OK();
    }
    if (dirty) return Status::Rejected("device work from an aborted transfer has not drained");
    FreeSlots();
    slots.resize(count);
    for (auto& s : slots) {
      cudaError_t e = cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming);
      if (e == cudaSuccess && dev_bytes > 0) e = cudaMalloc(&s.dev, dev_bytes);
      if (e == cudaSuccess && host_bytes > 0) e = cudaHostAlloc(&s.host, host_bytes, cudaHostAllocDefault);
      if (e != cudaSuccess) {
        FreeSlots();
        return Status::Unavailable(CudaErr("staging allocation", e));
      }
    }
    dev_staging_bytes = dev_bytes;
    host_staging_bytes = host_bytes;
    return Status::OK();
  }

  Result<std::shared_ptr<WeightSource>> OpenSource(const std::string& uri) {
    if (auto it = sources.find(uri); it != sources.end()) return it->second;
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
    sources[uri] = src;
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

NcclSender::NcclSender(EngineApi* engine, NcclSenderOptions options) : impl_(std::make_unique<Impl>()) {
  RC_ASSERT(engine != nullptr);
  impl_->engine = engine;
  impl_->opt = std::move(options);
}

NcclSender::~NcclSender() {
  // Abort, not destroy: local and bounded even if the peer vanished (vLLM just drops its side).
  if (impl_->comm != nullptr) impl_->AbortComm();
  impl_->FreeSlots();
  if (impl_->warm_buf != nullptr && !impl_->dirty) cudaFree(impl_->warm_buf);
  impl_->sources.clear();
  if (impl_->store) impl_->store->Stop();
}

void NcclSender::RegisterSource(const std::string& uri, std::shared_ptr<WeightSource> source) {
  impl_->sources[uri] = std::move(source);
}

bool NcclSender::ready() const { return impl_->comm != nullptr; }
ProtocolLine NcclSender::line() const { return impl_->line; }
Rendezvous NcclSender::rendezvous() const { return impl_->mode; }
std::uint16_t NcclSender::store_port() const { return impl_->store ? impl_->store->port() : 0; }
const SenderProgress& NcclSender::progress() const { return impl_->progress; }
TransferTiming NcclSender::last_timing() const {
  std::lock_guard<std::mutex> lock(impl_->timing_mu);
  return impl_->timing;
}

Status NcclSender::Init(std::uint64_t deadline_ms) {
  Impl& m = *impl_;
  const auto deadline = Clock::now() + std::chrono::milliseconds(deadline_ms);
  if (m.comm != nullptr) m.AbortComm();  // re-init: never reuse a communicator
  if (m.store) {
    m.store->Stop();
    m.store.reset();
  }
  cudaError_t e = cudaSetDevice(m.opt.device);
  if (e != cudaSuccess) return Status::Unavailable(CudaErr("cudaSetDevice", e));
  m.comm_device = m.opt.device;

  if (m.opt.line) {
    m.line = *m.opt.line;
  } else {
    EngineReply v = m.engine->Version(std::min(m.opt.http_timeout_ms, MsUntil(deadline)));
    if (!Ok2xx(v) || !v.body.is_object() || !v.body.contains("version") || !v.body["version"].is_string()) {
      return Status::Unavailable(Describe("GET /version", v));
    }
    m.line = DetectProtocolLine(v.body["version"].get<std::string>());
  }
  m.mode = m.opt.rendezvous;
  if (m.mode == Rendezvous::kAuto) {
    m.mode = m.line == ProtocolLine::kUniqueIdCapable ? Rendezvous::kUniqueId : Rendezvous::kTcpStore;
  }
  if (m.mode == Rendezvous::kUniqueId && m.line != ProtocolLine::kUniqueIdCapable) {
    return Status::InvalidArgument(std::string("unique-id rendezvous needs a unique-id-capable engine, got ") +
                                   protocol_line_name(m.line));
  }
  m.world_size = m.opt.world_size;
  if (m.world_size <= 0) {
    EngineReply w = m.engine->GetWorldSize(std::min(m.opt.http_timeout_ms, MsUntil(deadline)));
    if (!Ok2xx(w) || !w.body.is_object() || !w.body.contains("world_size") ||
        !w.body["world_size"].is_number_integer()) {
      return Status::Unavailable(Describe("GET /get_world_size", w));
    }
    m.world_size = 1 + w.body["world_size"].get<int>();
  }
  if (m.world_size < 2 || m.world_size > 4096) {
    return Status::InvalidArgument("world size " + std::to_string(m.world_size) + " out of [2, 4096]");
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
    so.bind_address = m.opt.bind_address;
    so.port = m.opt.master_port;
    auto store = TcpStoreServer::Start(so);
    if (!store.ok()) return store.status();
    m.store = std::move(*store);
    if (Status s = m.store->Set(std::string(kUniqueIdWireKey), PickleNcclUniqueId(id_bytes)); !s.ok()) return s;
    port = m.store->port();
  } else {
    uid_b64 = Base64Encode(std::string_view(reinterpret_cast<const char*>(id_bytes.data()), id_bytes.size()));
  }
  const nlohmann::json init_info =
      BuildInitInfo(m.line, m.mode, m.opt.master_address, port, m.world_size, uid_b64, m.opt.packing);

  // The engine joins the group inside its HTTP handler: run it beside our own init.
  AsyncCall http([&m, init_info, deadline] {
    return m.engine->InitWeightTransferEngine(init_info, MsUntil(deadline));
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
    s = m.Settle(ncclAllReduce(f, f + 1, 1, ncclFloat32, ncclSum, m.comm, warm_stream), "warm-up all-reduce", w);
  }
  if (s.ok()) {
    e = cudaEventRecord(warm_done, warm_stream);
    s = e == cudaSuccess ? m.WaitEvent(warm_done, w) : Status::Internal(CudaErr("cudaEventRecord", e));
  }
  if (!s.ok() && m.comm != nullptr) m.AbortComm();
  const EngineReply& reply = http.Join();  // bounded: its timeout ends at our deadline
  if (warm_done != nullptr && !m.dirty) cudaEventDestroy(warm_done);
  if (warm_stream != nullptr && !m.dirty) cudaStreamDestroy(warm_stream);
  if (!s.ok()) {
    return Status(s.code(), "init (" + std::string(rendezvous_name(m.mode)) + "): " + s.message() +
                                (http.done() ? "; " + Describe("init_weight_transfer_engine", reply) : ""));
  }
  if (!Ok2xx(reply)) {
    m.AbortComm();
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
  if (!target.identity.manifest_digest.empty() && target.identity.manifest_digest != p.source_manifest_digest) {
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
  const BroadcastPlan plan = PlanFor(manifest, m.opt.packing.packed, m.opt.packing.packed_buffer_size_bytes);
  const Impl::Needs needs = m.StagingNeeds(**src, plan);
  const bool have = m.slots.size() == needs.slot_count && m.dev_staging_bytes >= needs.dev_bytes;
  std::size_t free_bytes = 0, total_bytes = 0;
  e = cudaMemGetInfo(&free_bytes, &total_bytes);
  const std::uint64_t want = have ? 0 : needs.dev_bytes * needs.slot_count + m.opt.memory_margin_bytes;
  p.memory_ok = e == cudaSuccess && free_bytes >= want;
  if (!p.memory_ok) {
    detail += "staging needs " + std::to_string(want) + " bytes of device memory, " +
              std::to_string(free_bytes) + " free; ";
  }
  detail += std::to_string(manifest.tensors.size()) + " tensors, " + std::to_string(plan.total_bytes) +
            " bytes, " + std::to_string(plan.ops.size()) + " broadcasts";
  p.detail = detail.substr(0, kTextBytesMax);
  return p;
}

TransferObserved NcclSender::Transfer(const TransferTarget& target, std::uint64_t deadline_ms) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::milliseconds(deadline_ms);
  TransferObserved out;
  out.finish_label = target.target.label;
  TransferTiming timing;
  auto finish = [&](std::string error) {
    out.error = error.substr(0, kTextBytesMax);
    out.duration_us = UsSince(t0);
    std::lock_guard<std::mutex> lock(m.timing_mu);
    m.timing = timing;
    return out;
  };
  m.progress.ops_enqueued = m.progress.ops_completed = 0;
  m.progress.bytes_enqueued = m.progress.bytes_completed = 0;

  // ---- checks that change nothing (any failure here: MutationClass::kNone) ----
  if (m.comm == nullptr) return finish("no communicator: Init (a fresh one) before transferring");
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != m.comm_device) {
    return finish("calling thread's CUDA device " + std::to_string(current) + " != communicator's device " +
                  std::to_string(m.comm_device) + "; refusing (would fail as 'invalid resource handle')");
  }
  auto src_r = m.OpenSource(target.source_uri);
  if (!src_r.ok()) return finish("source: " + src_r.status().ToString());
  const WeightSource& src = **src_r;
  const Manifest& manifest = src.manifest();
  if (Status s = manifest.Validate(); !s.ok()) return finish("manifest: " + s.ToString());
  if (!target.identity.manifest_digest.empty() && target.identity.manifest_digest != manifest.digest()) {
    return finish("source manifest digest differs from the declared identity");
  }
  if (src.where() == WeightSource::Where::kDevice && src.device() != m.comm_device) {
    return finish("source tensors are on another device than the communicator");
  }
  const BroadcastPlan plan = PlanFor(manifest, m.opt.packing.packed, m.opt.packing.packed_buffer_size_bytes);
  const Impl::Needs needs = m.StagingNeeds(src, plan);
  if (Status s = m.EnsureSlots(needs.slot_count, needs.dev_bytes, needs.host_bytes); !s.ok()) {
    return finish(s.ToString());
  }
  const nlohmann::json update_info = BuildUpdateInfo(m.line, manifest, m.opt.packing);

  // ---- engine: start ----
  EngineReply start = m.engine->StartWeightUpdate(std::min(m.opt.http_timeout_ms, MsUntil(deadline)));
  timing.start_http_us = start.http.latency_us;
  if (!Ok2xx(start)) return finish(Describe("POST /start_weight_update", start));

  // ---- engine: update (its own thread) + data plane ----
  const auto update_t0 = Clock::now();
  AsyncCall update([&m, &update_info, deadline] { return m.engine->UpdateWeights(update_info, MsUntil(deadline)); });
  Impl::Watch w{deadline, &update};
  Status s;
  std::size_t next_slot = 0;
  Clock::time_point dp_t0{};
  for (std::size_t k = 0; k < plan.ops.size() && s.ok(); ++k) {
    const BroadcastOp& op = plan.ops[k];
    Impl::Slot& slot = m.slots[next_slot];
    next_slot = (next_slot + 1) % m.slots.size();
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
        for (std::size_t i = op.first_tensor; i < op.first_tensor + op.tensor_count && s.ok(); ++i) {
          s = src.ReadHost(i, host + off);
          off += manifest.tensors[i].nbytes();
        }
        if (!s.ok()) break;
        e = cudaMemcpyAsync(dev, host, op.bytes, cudaMemcpyHostToDevice, slot.stream);
      } else {
        for (std::size_t i = op.first_tensor; i < op.first_tensor + op.tensor_count && e == cudaSuccess; ++i) {
          const std::uint64_t n = manifest.tensors[i].nbytes();
          e = cudaMemcpyAsync(dev + off, src.device_ptr(i), n, cudaMemcpyDeviceToDevice, slot.stream);
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
    const ncclDataType_t type = op.packed ? ncclUint8 : NcclType(manifest.tensors[op.first_tensor].dtype);
    if (m.progress.ops_enqueued == 0) dp_t0 = Clock::now();
    // Root passes sendbuff == recvbuff, as vLLM's PyNcclCommunicator does.
    ncclResult_t r = ncclBroadcast(buf, const_cast<void*>(buf), count, type, 0, m.comm, slot.stream);
    m.progress.ops_enqueued++;           // counted even if the call failed: bytes may be queued
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
  if (m.progress.ops_enqueued > 0) timing.data_plane_us = UsSince(dp_t0);
  out.tensors_sent = static_cast<std::uint32_t>(manifest.tensors.size());

  if (!s.ok()) {
    const bool enqueued = m.progress.ops_enqueued > 0;
    out.mutation = enqueued ? MutationClass::kPossible : MutationClass::kNone;
    out.tensors_sent = 0;
    out.bytes_sent = m.progress.bytes_completed;
    // The group is unusable once bytes were queued, or while the engine may sit in its receives.
    if (enqueued || !update.done()) timing.abort_us = m.AbortComm();
    const EngineReply& ur = update.Join();  // bounded by the same deadline
    timing.update_http_us = UsSince(update_t0);
    return finish("data plane: " + s.ToString() + (enqueued ? " (communicator aborted)" : "") + "; " +
                  Describe("POST /update_weights", ur));
  }
  out.bytes_sent = plan.total_bytes;
  out.mutation = MutationClass::kPossible;  // every byte left; the engine has not confirmed yet
  // The engine answers once it has received everything: wait for that, bounded by the deadline.
  while (!update.done() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::microseconds(100));
  const EngineReply& ur = update.Join();
  timing.update_http_us = UsSince(update_t0);
  if (!Ok2xx(ur)) return finish(Describe("POST /update_weights", ur));
  EngineReply fin = m.engine->FinishWeightUpdate(target.target.label, std::min(m.opt.http_timeout_ms, MsUntil(deadline)));
  timing.finish_http_us = fin.http.latency_us;
  if (!Ok2xx(fin)) return finish(Describe("POST /finish_weight_update", fin));
  out.acknowledged = true;
  out.mutation = MutationClass::kComplete;
  return finish("");
}

Result<std::uint64_t> NcclSender::RawBroadcast(const void* device_ptr, std::uint64_t bytes,
                                               std::uint64_t chunk_bytes, std::uint64_t deadline_ms) {
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
    s = m.Settle(ncclBroadcast(p + off, p + off, n, ncclUint8, 0, m.comm, stream), "ncclBroadcast", w);
  }
  if (s.ok()) {
    cudaEventRecord(done, stream);
    s = m.WaitEvent(done, w);
  }
  const std::uint64_t us = UsSince(t0);
  if (!s.ok()) {
    m.AbortComm();
    return s;
  }
  cudaEventDestroy(done);
  cudaStreamDestroy(stream);
  return us;
}

}  // namespace rc::effects::nccl
