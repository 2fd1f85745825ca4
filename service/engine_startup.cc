#include "service/engine_startup.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include <spdlog/spdlog.h>

#include "effects/clock.h"
#include "effects/http/checkpoint_reload.h"
#include "effects/http/ipc_transfer.h"
#include "effects/http/sequence_transfer.h"
#include "statemachine/text.h"

namespace rc::service {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

std::string Esc(const std::string& s) { return text::escape_line(s); }

// What one GET /version attempt that gave no version saw.
std::string VersionAttemptFailure(const effects::HttpReply& v) {
  if (v.http.ok_2xx()) {
    return "HTTP " + std::to_string(v.http.http_status) + " without a 'version' string";
  }
  if (v.http.http_status != 0)
    return "HTTP " + std::to_string(v.http.http_status) + " " + v.http.error;
  return v.http.error;
}

void LogEngineWait(const std::string& url, std::uint64_t timeout_ms, Clock::time_point start,
                   const std::string& last) {
  spdlog::info(
      "serve: waiting for the engine at {} to answer GET /version ({} s so far, up to {} s): {}",
      Esc(url), effects::elapsed_us(start) / 1000000, timeout_ms / 1000, Esc(last));
}

Status EngineVersionTimeout(const std::string& url, std::uint64_t timeout_ms,
                            const std::string& last) {
  return Status::Unavailable("engine " + Esc(url) +
                             " did not answer GET /version within engine_startup_timeout_ms " +
                             std::to_string(timeout_ms) + " ms (last: " + Esc(last) +
                             "); is it running and reachable from this host?");
}

// The engine's GET /get_world_size, or 1 when it does not say.
std::int64_t EngineWorldSize(effects::EngineClient& client) {
  effects::HttpReply ws = client.GetWorldSize(true);
  return ws.http.ok_2xx() && ws.body.value("world_size", json()).is_number_integer()
             ? ws.body["world_size"].get<std::int64_t>()
             : 1;
}

class RefusingTransfer final : public effects::WeightTransfer {
 public:
  explicit RefusingTransfer(std::string why) : why_(std::move(why)) {}
  PreflightObserved Preflight(const effects::TransferTarget&) override {
    return PreflightObserved{"", false, false, why_};
  }
  TransferObserved Transfer(const effects::TransferTarget&, std::uint64_t) override {
    TransferObserved refused;
    refused.mutation = MutationClass::kNone;  // nothing was sent
    refused.error = why_;
    return refused;
  }

 private:
  const std::string why_;
};

}  // namespace

std::optional<std::string> VersionOf(const effects::HttpReply& v) {
  if (!v.http.ok_2xx() || !v.body.is_object() || !v.body.value("version", json()).is_string()) {
    return std::nullopt;
  }
  return v.body["version"].get<std::string>();
}

std::unique_ptr<effects::WeightTransfer> MakeRefusingTransfer(std::string why) {
  RC_CHECK(!why.empty());  // a refusal says why
  return std::make_unique<RefusingTransfer>(text::utf8_prefix(why, kTextBytesMax / 2));
}

effects::PackingParams PackingOf(const ServeConfig& config) {
  effects::PackingParams packing;
  packing.packed_buffer_size_bytes = config.packed_buffer_size_bytes;
  packing.packed_num_buffers = config.packed_num_buffers;
  return packing;
}

effects::EngineDeadlines ControlDeadlines(const ServeConfig& config) {
  effects::EngineDeadlines d;
  d.connect_timeout_ms = config.connect_timeout_ms;
  d.call_timeout_ms = config.call_timeout_ms;
  d.drain_timeout_ms = config.drain_timeout_ms;
  d.update_timeout_ms = config.transfer_timeout_ms;
  return d;
}

effects::RunnerOptions RunnerOptionsOf(const ServeConfig& config) {
  effects::RunnerOptions ro;
  ro.executor_id = config.executor_id;
  ro.drain_timeout_ms = config.drain_timeout_ms;
  ro.transfer_timeout_ms = config.transfer_timeout_ms;
  ro.sleep_timeout_ms = config.sleep_timeout_ms;
  ro.call_timeout_ms = config.call_timeout_ms;
  return ro;
}

EngineVersionWait WaitForEngineVersion(effects::EngineClient& client, const std::string& url,
                                       std::uint64_t startup_timeout_ms) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(startup_timeout_ms);
  auto next_log = start + std::chrono::milliseconds(kEngineWaitLogMs);
  for (std::uint32_t attempt = 1;; ++attempt) {
    const effects::HttpReply v = client.Version();
    if (std::optional<std::string> version = VersionOf(v)) {
      spdlog::info("serve: engine {} answers GET /version: '{}' (after {} ms, {} attempt(s))",
                   Esc(url), Esc(*version), effects::elapsed_us(start) / 1000, attempt);
      return {Status::OK(), *version};
    }
    const std::string last = VersionAttemptFailure(v);
    const auto now = Clock::now();
    if (now >= deadline) return {EngineVersionTimeout(url, startup_timeout_ms, last), ""};
    if (now >= next_log) {
      LogEngineWait(url, startup_timeout_ms, start, last);
      next_log = now + std::chrono::milliseconds(kEngineWaitLogMs);
    }
    std::this_thread::sleep_for(
        std::min<Clock::duration>(std::chrono::milliseconds(kEngineWaitPollMs), deadline - now));
  }
}

Result<std::unique_ptr<effects::WeightTransfer>> MakeGpuFreeTransfer(const ServeConfig& config,
                                                                     effects::EngineClient& client,
                                                                     const std::string& version) {
  RC_CHECK(config.transfer != "nccl");  // the NCCL sender is made by the service (CUDA builds)
  if (config.transfer == "reload") {
    // Nothing to initialise: the engine reads the checkpoint itself, no data plane to set up.
    return std::unique_ptr<effects::WeightTransfer>(
        std::make_unique<effects::CheckpointReload>(client));
  }
  if (config.transfer == "ipc") {
    // The engine initialises its ipc backend on the first transfer ({"init_info": {}}).
    return std::unique_ptr<effects::WeightTransfer>(std::make_unique<effects::IpcTransfer>(client));
  }
  // The protocol line comes from the engine's own /version, never a guess.
  const effects::EngineProtocol protocol = effects::detect_protocol(version);
  if (protocol.line == effects::ProtocolLine::kUnknown) {
    return Status::Unavailable("engine " + Esc(client.base_url()) + " reports version '" +
                               Esc(version) + "', which no protocol line of this build speaks");
  }
  return std::unique_ptr<effects::WeightTransfer>(
      std::make_unique<effects::HttpSequenceTransfer>(client, protocol, PackingOf(config)));
}

void InitHttpWeightTransfer(effects::EngineClient& client, const effects::EngineProtocol& protocol,
                            const ServeConfig& config) {
  effects::NcclInitParams init;
  auto rv = ParseHostPort(config.rendezvous.empty() ? kHttpRendezvousDefault : config.rendezvous);
  RC_CHECK(rv.ok());  // ValidateConfig checked it
  init.master_address = rv->host;
  init.master_port = rv->port;
  init.world_size =
      static_cast<std::uint32_t>(1 + std::max<std::int64_t>(1, EngineWorldSize(client)));
  auto info = effects::build_init_info(protocol, init, PackingOf(config));
  if (!info.ok()) {
    spdlog::warn("serve: weight-transfer init of {} skipped: {}", Esc(client.base_url()),
                 Esc(info.status().ToString()));
    return;
  }
  effects::HttpReply r = client.InitWeightTransferEngine(*info);
  if (!r.http.ok_2xx()) {
    spdlog::warn("serve: /init_weight_transfer_engine of {} failed: HTTP {} {}",
                 Esc(client.base_url()), r.http.http_status, Esc(r.http.error));
  }
}

}  // namespace rc::service
