// NcclSender: the trainer-side (rank 0) NCCL weight sender that speaks vLLM's receiver protocol
// (docs/vllm-protocol.md §5), implementing rc::effects::WeightTransfer.
//
// Init: ncclGetUniqueId; TCPStore master serving the pickled id at /broadcast_from/0/0 (or the id
// as base64 in init_info); POST /init_weight_transfer_engine from a second thread while rank 0
// runs ncclCommInitRankConfig (blocking=0) and the 1-element float32 ncclSum all-reduce warm-up.
// The engine is reached through the project's one HTTP client (rc::effects::EngineClient); the
// protocol line comes from effects/http/protocol.h (detect_protocol, build_init_info,
// build_update_info).
// Transfer: POST /start_weight_update; POST /update_weights from a second thread; broadcasts
// (packed chunks per chunk_plan.h, or one per tensor) on a ring of streams whose staging buffers
// are reused only after their event fired; POST /finish_weight_update {"weight_version": label}.
// Never hangs: every NCCL call and every wait is polled (ncclCommGetAsyncError, cudaEventQuery)
// against the deadline and against the engine's /update_weights outcome (a dead receiver breaks
// that connection); on failure the communicator is aborted (ncclCommAbort) and the outcome
// classified: MutationClass::kNone only if no broadcast was enqueued, else kPossible. The abort
// fits inside the deadline: the data plane and the HTTP calls stop at deadline - abort reserve
// (max of abort_reserve_ms and 5/4 of the longest abort measured so far), and the /update_weights
// call is cancelled (CancelToken) as soon as the broadcast fails. A new Init
// builds a fresh communicator (and store, on a fresh port when the configured port is 0).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "effects/http/engine_client.h"
#include "effects/http/protocol.h"
#include "effects/nccl/chunk_plan.h"
#include "effects/nccl/weight_source.h"
#include "effects/transfer.h"

namespace rc::effects::nccl {

enum class Rendezvous : std::uint8_t { kAuto = 0, kTcpStore = 1, kUniqueId = 2 };
const char* rendezvous_name(Rendezvous r);

struct NcclSenderOptions {
  int device = 0;                            // CUDA device of rank 0
  std::string master_address = "127.0.0.1";  // what workers dial (TCPStore mode)
  // Where the TCPStore master listens: "" = master_address (the one address the workers are
  // told to dial, so nothing else can reach the unauthenticated store); "0.0.0.0" only if set.
  std::string bind_address;
  std::uint16_t master_port = 0;              // 0: ephemeral (a fresh port on every Init)
  int world_size = 0;                         // 0: 1 + GET /get_world_size
  Rendezvous rendezvous = Rendezvous::kAuto;  // kAuto: unique id where the engine accepts it
  ProtocolOverride protocol_override;         // applied to detect_protocol(GET /version)
  PackingParams packing;
  std::uint64_t http_timeout_ms =
      30000;  // short calls (version, start, finish), capped by deadlines
  std::uint64_t memory_margin_bytes = 256ull << 20;  // free device memory kept beyond staging
  std::uint32_t direct_window_ops = 16;       // in-flight broadcasts when no staging is needed
  std::uint64_t drain_after_abort_ms = 2000;  // how long to wait for kernels to exit after abort
  // Time kept at the end of every Init/Transfer deadline for ncclCommAbort and the kernel drain
  // (measured ~0.55 s on 2x H200, NCCL 2.28.9). The sender uses the larger of this and 5/4 of
  // the longest abort it has measured.
  std::uint64_t abort_reserve_ms = 1000;
};

// Live counters (read from other threads: tests kill a receiver mid-transfer with them).
struct SenderProgress {
  std::atomic<std::uint64_t> ops_enqueued{0};
  std::atomic<std::uint64_t> ops_completed{0};
  std::atomic<std::uint64_t> bytes_enqueued{0};
  std::atomic<std::uint64_t> bytes_completed{0};
};

// Timing of the last Transfer's phases (microseconds; for benchmarks).
struct TransferTiming {
  std::uint64_t data_plane_us = 0;  // first broadcast enqueued -> last broadcast completed
  std::uint64_t start_http_us = 0;
  std::uint64_t update_http_us = 0;
  std::uint64_t finish_http_us = 0;
  std::uint64_t abort_us = 0;          // ncclCommAbort + kernel drain, if aborted
  std::uint64_t abort_reserve_ms = 0;  // what this transfer kept for the abort
  std::int64_t first_enqueue_steady_ns =
      0;                         // steady_clock (CLOCK_MONOTONIC) at the first broadcast
  std::uint32_t direct_ops = 0;  // broadcast straight from the source (no staging copy)
  std::uint32_t staged_ops = 0;
};

class NcclSender final : public WeightTransfer {
 public:
  // `engine` must outlive the sender; it is used from two threads (EngineClient is thread-safe).
  NcclSender(EngineClient& engine, NcclSenderOptions options);
  ~NcclSender() override;
  NcclSender(const NcclSender&) = delete;
  NcclSender& operator=(const NcclSender&) = delete;

  // Rendezvous + communicator + warm-up, bounded by deadline_ms (a duration from the call). Sets
  // the calling thread's CUDA device to options.device. A previous communicator is aborted first.
  [[nodiscard]] Status Init(std::uint64_t deadline_ms);
  // Sources by URI: registered ones first, then "safetensors:<path>" and "ipc:<path>".
  void RegisterSource(const std::string& uri, std::shared_ptr<WeightSource> source);

  PreflightObserved Preflight(const TransferTarget& target) override;
  TransferObserved Transfer(const TransferTarget& target, std::uint64_t deadline_ms) override;

  // Benchmark baseline: plain ncclBroadcast of [ptr, ptr+bytes) in chunk_bytes pieces on one
  // stream, polled like Transfer. Returns the data-plane time in microseconds.
  [[nodiscard]] Result<std::uint64_t> RawBroadcast(const void* device_ptr, std::uint64_t bytes,
                                                   std::uint64_t chunk_bytes,
                                                   std::uint64_t deadline_ms);

  bool ready() const;                // a live communicator
  EngineProtocol protocol() const;   // as detected by the last Init
  Rendezvous rendezvous() const;     // the mode the last Init used
  std::uint16_t store_port() const;  // 0 in unique-id mode
  const SenderProgress& progress() const;
  TransferTiming last_timing() const;
  std::uint64_t abort_reserve_ms() const;  // what the next Transfer will keep for an abort

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace rc::effects::nccl
