#include "service/nccl_transfer.h"

#include <spdlog/spdlog.h>

#include "service/engine_startup.h"
#include "statemachine/text.h"

#ifdef RC_HAVE_CUDA  // defined (PUBLIC) by the effects target when CUDA and NCCL were found
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>

#include "effects/clock.h"
#include "effects/nccl/nccl_sender.h"
#endif

namespace rc::service {

std::string DescribeNcclEngine(const NcclEngine& e, const ServeConfig& config) {
  const std::string who =
      e.name.empty() ? "the engine" : "engine '" + text::escape_line(e.name) + "'";
  return who + " at " + text::escape_line(e.url) + " (cuda_device " +
         std::to_string(config.cuda_device) + ", rendezvous " +
         text::escape_line(e.rendezvous.host) + ":" + std::to_string(e.rendezvous.port) +
         ", deadline " + std::to_string(config.nccl_init_timeout_ms) + " ms)";
}

std::string NcclReadyLine(const std::string& described, const std::string& protocol_version,
                          const std::string& rendezvous_mode, std::uint16_t store_port,
                          std::uint64_t abort_reserve_ms) {
  return "NCCL sender ready: " + described + " (protocol line of " +
         text::escape_line(protocol_version) + "), rendezvous " +
         text::escape_line(rendezvous_mode) + ", store port " + std::to_string(store_port) +
         ", abort reserve " + std::to_string(abort_reserve_ms) + " ms";
}

#ifdef RC_HAVE_CUDA
namespace {

std::string CudaError(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

// Checked before the journal is opened, so a host without the configured GPU changes nothing.
Status CheckCudaDevice(int device) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count <= 0) {
    return Status::Unavailable(
        "transfer 'nccl': CUDA device " + std::to_string(device) + " is not usable: " +
        (e != cudaSuccess ? CudaError("cudaGetDeviceCount", e) : std::string("no CUDA device")) +
        " (no GPU or no driver on this host?)");
  }
  if (device >= count) {
    return Status::InvalidArgument("transfer 'nccl': cuda_device " + std::to_string(device) +
                                   " does not exist: this host has " + std::to_string(count) +
                                   " CUDA device(s), 0.." + std::to_string(count - 1));
  }
  e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    return Status::Unavailable("transfer 'nccl': CUDA device " + std::to_string(device) +
                               " is not usable: " + CudaError("cudaSetDevice", e));
  }
  return Status::OK();
}

// The NcclSender as serve calls it: from its blocking-call workers (the runner on the update route,
// /v1/manifest on any worker). The sender needs the communicator's device current on the calling
// thread and is not safe for concurrent calls (its source cache), so every call here makes the
// device current and holds one lock. A manifest preflight waits at most preflight_wait_ms for a
// running transfer, then answers without a digest (the route says why) instead of blocking.
// The communicator is trusted only with the engine process it was set up with: a transfer to
// another one (a restart), or to one not known to be the same, sets up a new one first.
class ServeNcclTransfer final : public effects::WeightTransfer {
 public:
  ServeNcclTransfer(effects::EngineClient& engine, effects::nccl::NcclSenderOptions options,
                    std::uint64_t preflight_wait_ms, std::uint64_t init_timeout_ms)
      : engine_(engine),
        device_(options.device),
        call_timeout_ms_(options.http_timeout_ms),
        preflight_wait_ms_(preflight_wait_ms),
        init_timeout_ms_(init_timeout_ms),
        sender_(engine, std::move(options)) {}

  [[nodiscard]] Status Init(std::uint64_t deadline_ms) {
    std::lock_guard<std::timed_mutex> lock(mu_);
    return InitLocked(deadline_ms);
  }

  PreflightObserved Preflight(const effects::TransferTarget& target) override {
    std::unique_lock<std::timed_mutex> lock(mu_, std::defer_lock);
    if (!lock.try_lock_for(std::chrono::milliseconds(preflight_wait_ms_))) {
      PreflightObserved p;
      p.detail = "the NCCL sender is busy with a transfer (waited " +
                 std::to_string(preflight_wait_ms_) + " ms); try again";
      return p;
    }
    // A failure leaves the thread on another device: the sender's own check then reports it.
    (void)cudaSetDevice(device_);
    return sender_.Preflight(target);
  }

  TransferObserved Transfer(const effects::TransferTarget& target,
                            std::uint64_t deadline_ms) override {
    const auto t0 = SteadyClock::now();
    std::unique_lock<std::timed_mutex> lock(mu_, std::defer_lock);
    if (!lock.try_lock_for(std::chrono::milliseconds(deadline_ms)) ||
        effects::elapsed_us(t0) / 1000 >= deadline_ms) {
      return Refused(target, t0, "the NCCL sender stayed busy for the whole transfer deadline");
    }
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      return Refused(target, t0, CudaError("cudaSetDevice", e));
    }
    const SteadyClock::time_point until = t0 + std::chrono::milliseconds(deadline_ms);
    if (std::string why = EnsureCommunicator(until); !why.empty()) {
      return Refused(target, t0, std::move(why));
    }
    const std::uint64_t spent_ms = effects::elapsed_us(t0) / 1000;
    if (spent_ms >= deadline_ms) {
      return Refused(target, t0,
                     "the transfer deadline was spent setting up a new NCCL communicator");
    }
    return sender_.Transfer(target, deadline_ms - spent_ms);
  }

  const effects::nccl::NcclSender& sender() const { return sender_; }

 private:
  using SteadyClock = std::chrono::steady_clock;

  // A transfer that never reached the engine (mutation kNone).
  static TransferObserved Refused(const effects::TransferTarget& target, SteadyClock::time_point t0,
                                  std::string why) {
    TransferObserved refused;
    refused.finish_label = target.target.label;
    refused.error = text::utf8_prefix(std::move(why), kTextBytesMax);
    refused.duration_us = effects::elapsed_us(t0);
    return refused;
  }

  static std::uint64_t MsUntil(SteadyClock::time_point until) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(until - SteadyClock::now());
    return left.count() > 0 ? static_cast<std::uint64_t>(left.count()) : 0;
  }

  // The engine process that answers now ("" unknown), within a call's timeout and `until`.
  std::string ReadInstance(SteadyClock::time_point until) {
    const std::uint64_t left_ms = MsUntil(until);
    if (left_ms == 0) return "";
    return engine_.Instance(
        effects::CallOptions{std::min(left_ms, call_timeout_ms_), std::nullopt});
  }

  // Holds mu_. Records the engine process the communicator was set up with, read before and
  // after the setup and kept only when both name one process ("" otherwise: set up again at the
  // next transfer), so a restart during the setup is never taken for the process set up. The
  // reads and the setup together end by deadline_ms.
  Status InitLocked(std::uint64_t deadline_ms) {
    const SteadyClock::time_point until =
        SteadyClock::now() + std::chrono::milliseconds(deadline_ms);
    initialized_on_.clear();
    const std::string before = ReadInstance(until);
    RC_RETURN_IF_ERROR(sender_.Init(MsUntil(until)));  // sets this thread's device itself
    initialized_on_ = effects::OneInstance(before, ReadInstance(until));
    return Status::OK();
  }

  // Holds mu_. "" when a live communicator was set up with the process that answers now; else it
  // sets up a new one (none left by an aborted transfer, or a restarted engine) and says why no
  // transfer may start if that fails. Setting one up changes no weights, so its failure is a
  // refusal. Everything here ends by `until`, the transfer's deadline.
  std::string EnsureCommunicator(SteadyClock::time_point until) {
    if (sender_.ready() && effects::SameEngineAs(engine_, initialized_on_,
                                                 std::min(MsUntil(until), call_timeout_ms_))) {
      return "";
    }
    spdlog::warn(
        "serve: NCCL sender: no live communicator with the process the engine runs now; setting "
        "up a new one");
    Status st = InitLocked(std::min(MsUntil(until), init_timeout_ms_));
    if (st.ok()) return "";
    return "no live NCCL communicator with the engine's process (an earlier transfer aborted it, "
           "or the engine restarted), and setting up a new one failed: " +
           st.ToString();
  }

  effects::EngineClient& engine_;
  const int device_;
  const std::uint64_t call_timeout_ms_;
  const std::uint64_t preflight_wait_ms_;
  const std::uint64_t init_timeout_ms_;
  std::timed_mutex mu_;
  effects::nccl::NcclSender sender_;
  std::string initialized_on_;  // guarded by mu_
};

effects::nccl::NcclSenderOptions NcclOptionsOf(const ServeConfig& config,
                                               const HostPort& rendezvous) {
  effects::nccl::NcclSenderOptions so;
  so.device = config.cuda_device;
  so.master_address = rendezvous.host;
  so.master_port = rendezvous.port;
  so.world_size = config.nccl_world_size;
  so.packing = PackingOf(config);
  so.http_timeout_ms = config.call_timeout_ms;
  so.abort_reserve_ms = config.nccl_abort_reserve_ms;
  return so;
}

// The sender's rendezvous with the engine, once its RecoveryStarted is recorded or it bootstrapped.
Status InitNcclSender(ServeNcclTransfer& sender, const ServeConfig& config,
                      const NcclEngine& target) {
  spdlog::info("serve: NCCL sender: rendezvous with {}", DescribeNcclEngine(target, config));
  Status st = sender.Init(config.nccl_init_timeout_ms);
  if (!st.ok()) {
    return Status(st.code(), "transfer 'nccl': init with " + DescribeNcclEngine(target, config) +
                                 " failed: " + st.message());
  }
  spdlog::info("serve: {}",
               NcclReadyLine(DescribeNcclEngine(target, config), sender.sender().protocol().version,
                             effects::nccl::rendezvous_name(sender.sender().rendezvous()),
                             sender.sender().store_port(), sender.sender().abort_reserve_ms()));
  return Status::OK();
}

}  // namespace

Status CheckNcclDevice(const ServeConfig& config) {
  if (config.transfer != "nccl") return Status::OK();
  return CheckCudaDevice(config.cuda_device);
}

NcclTransfer MakeNcclTransfer(effects::EngineClient& engine, const ServeConfig& config,
                              NcclEngine target) {
  auto sender =
      std::make_unique<ServeNcclTransfer>(engine, NcclOptionsOf(config, target.rendezvous),
                                          config.call_timeout_ms, config.nccl_init_timeout_ms);
  ServeNcclTransfer* s = sender.get();
  return NcclTransfer{std::move(sender), [s, &config, target = std::move(target)] {
                        return InitNcclSender(*s, config, target);
                      }};
}

#else  // no CUDA: nothing here can run

Status CheckNcclDevice(const ServeConfig& config) {
  if (config.transfer != "nccl") return Status::OK();
  return Status::Unavailable(
      "transfer 'nccl' needs CUDA and NCCL, and this rolloutcore was built without them (CMake "
      "found no CUDA toolkit/NCCL when it was configured): rebuild on a host with both, or use "
      "--transfer http");
}

NcclTransfer MakeNcclTransfer(effects::EngineClient&, const ServeConfig&, NcclEngine) {
  RC_CHECK(false);  // CheckNcclDevice refused it before anything was opened
  return {};
}

#endif  // RC_HAVE_CUDA

}  // namespace rc::service
