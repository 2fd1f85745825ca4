#include "service/config.h"

#include <fstream>
#include <functional>
#include <map>
#include <sstream>

namespace rc::service {
namespace {

using Setter = std::function<Status(const nlohmann::json&)>;

template <typename T>
Setter bind_field(const char* name, T& slot) {
  return [name, &slot](const nlohmann::json& v) -> Status {
    if constexpr (std::is_same_v<T, std::string>) {
      if (!v.is_string()) return Status::InvalidArgument(std::string(name) + " must be a string");
      slot = v.get<std::string>();
    } else if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) return Status::InvalidArgument(std::string(name) + " must be a bool");
      slot = v.get<bool>();
    } else if constexpr (std::is_signed_v<T>) {
      if (!v.is_number_integer()) {
        return Status::InvalidArgument(std::string(name) + " must be an integer");
      }
      slot = v.get<T>();
    } else {
      if (!v.is_number_unsigned()) {
        return Status::InvalidArgument(std::string(name) + " must be a non-negative integer");
      }
      slot = v.get<T>();
    }
    return Status::OK();
  };
}

std::map<std::string, Setter> setters(ServeConfig& c) {
  std::map<std::string, Setter> m;
#define RC_FIELD(f) m.emplace(#f, bind_field(#f, c.f))
  RC_FIELD(engine_url); RC_FIELD(journal_path); RC_FIELD(trajectories_path);
  RC_FIELD(listen_host); RC_FIELD(listen_port); RC_FIELD(auth_token); RC_FIELD(executor_id);
  RC_FIELD(initial_label); RC_FIELD(initial_manifest_digest); RC_FIELD(initial_source);
  RC_FIELD(initial_checkpoint); RC_FIELD(initial_run); RC_FIELD(initial_step);
  RC_FIELD(connect_timeout_ms); RC_FIELD(call_timeout_ms); RC_FIELD(drain_timeout_ms);
  RC_FIELD(transfer_timeout_ms); RC_FIELD(request_timeout_ms); RC_FIELD(admit_wait_ms);
  RC_FIELD(retry_after_s); RC_FIELD(shutdown_grace_ms); RC_FIELD(watch_timeout_ms_max);
  RC_FIELD(body_bytes_max); RC_FIELD(http_threads);
  RC_FIELD(engine_connections_max); RC_FIELD(events_page_max);
  RC_FIELD(trajectories_bytes_max); RC_FIELD(transfer); RC_FIELD(packed_buffer_size_bytes);
  RC_FIELD(packed_num_buffers); RC_FIELD(rendezvous); RC_FIELD(journal_sync);
  RC_FIELD(cuda_device); RC_FIELD(nccl_world_size); RC_FIELD(nccl_init_timeout_ms);
  RC_FIELD(nccl_abort_reserve_ms); RC_FIELD(engine_monitor_interval_ms);
  RC_FIELD(engine_startup_timeout_ms); RC_FIELD(adopt_engine); RC_FIELD(rollout_lease_ms);
  RC_FIELD(finish_retry_ms);
  RC_FIELD(header_timeout_ms); RC_FIELD(idle_timeout_ms); RC_FIELD(http_connections_max);  // proxy owner
#undef RC_FIELD
  return m;
}

}  // namespace

Result<HostPort> ParseHostPort(const std::string& text) {
  std::string host;
  std::string port;
  if (!text.empty() && text.front() == '[') {  // [IPv6]:PORT
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return Status::InvalidArgument("'" + text + "' is not [IPv6]:PORT");
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) return Status::InvalidArgument("'" + text + "' is not HOST:PORT");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != std::string::npos) {
      return Status::InvalidArgument("'" + text + "': write an IPv6 host as [addr]:PORT");
    }
  }
  if (host.empty() || host.size() > kRendezvousHostBytesMax) {
    return Status::InvalidArgument("'" + text + "': host must be 1.." +
                                   std::to_string(kRendezvousHostBytesMax) + " bytes");
  }
  for (char ch : host) {
    if (ch <= ' ' || ch == '/' || ch == '[' || ch == ']' || static_cast<unsigned char>(ch) >= 0x7f) {
      return Status::InvalidArgument("'" + text + "': host has a character that is not allowed");
    }
  }
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos || std::stoul(port) > 65535) {
    return Status::InvalidArgument("'" + text + "': port must be a number in 0..65535");
  }
  return HostPort{host, static_cast<std::uint16_t>(std::stoul(port))};
}

Status MergeConfigJson(const nlohmann::json& doc, ServeConfig& config) {
  if (!doc.is_object()) return Status::InvalidArgument("config must be a JSON object");
  ServeConfig merged = config;
  auto m = setters(merged);
  for (const auto& [key, value] : doc.items()) {
    auto it = m.find(key);
    if (it == m.end()) return Status::InvalidArgument("unknown config key '" + key + "'");
    RC_RETURN_IF_ERROR(it->second(value));
  }
  config = std::move(merged);
  return Status::OK();
}

Status MergeConfigFile(const std::string& path, ServeConfig& config) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot open config file '" + path + "'");
  std::string text(kConfigFileBytesMax + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > kConfigFileBytesMax) {
    return Status::InvalidArgument("config file '" + path + "' exceeds " +
                                   std::to_string(kConfigFileBytesMax) + " bytes");
  }
  nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Status::InvalidArgument("config file '" + path + "' is not JSON");
  Status st = MergeConfigJson(doc, config);
  if (!st.ok()) return Status::InvalidArgument(path + ": " + st.message());
  return Status::OK();
}

Status ValidateConfig(const ServeConfig& c) {
  if (c.engine_url.rfind("http://", 0) != 0 && c.engine_url.rfind("https://", 0) != 0) {
    return Status::InvalidArgument("engine_url must start with http:// or https:// (got '" +
                                   c.engine_url + "')");
  }
  if (c.journal_path.empty()) return Status::InvalidArgument("journal_path is required");
  if (c.listen_port < 0 || c.listen_port > 65535) {
    return Status::InvalidArgument("listen_port out of range");
  }
  if (c.initial_label.empty() || c.initial_label.size() > kIdBytesMax) {
    return Status::InvalidArgument("initial_label must be 1.." + std::to_string(kIdBytesMax) +
                                   " bytes");
  }
  if (c.http_threads < 4 || c.http_threads > 8192) {
    return Status::InvalidArgument("http_threads must be in 4..8192");
  }
  if (c.engine_connections_max < 1 || c.engine_connections_max > 8192) {
    return Status::InvalidArgument("engine_connections_max must be in 1..8192");
  }
  if (c.body_bytes_max < 1024 || c.body_bytes_max > (std::size_t{256} << 20)) {
    return Status::InvalidArgument("body_bytes_max must be in 1 KiB..256 MiB");
  }
  if (c.events_page_max == 0 || c.events_page_max > 100000) {
    return Status::InvalidArgument("events_page_max must be in 1..100000");
  }
  if (c.transfer != "http" && c.transfer != "nccl") {
    return Status::InvalidArgument("transfer must be 'http' or 'nccl'");
  }
  if (c.packed_buffer_size_bytes < kPackedBufferBytesMin ||
      c.packed_buffer_size_bytes > kPackedBufferBytesMax) {
    return Status::InvalidArgument("packed_buffer_size_bytes must be in " +
                                   std::to_string(kPackedBufferBytesMin) + ".." +
                                   std::to_string(kPackedBufferBytesMax) + " (1 MiB..64 GiB), got " +
                                   std::to_string(c.packed_buffer_size_bytes));
  }
  if (c.packed_num_buffers == 0 || c.packed_num_buffers > kPackedNumBuffersMax) {
    return Status::InvalidArgument("packed_num_buffers must be in 1.." +
                                   std::to_string(kPackedNumBuffersMax) + ", got " +
                                   std::to_string(c.packed_num_buffers));
  }
  if (!c.rendezvous.empty()) {
    auto hp = ParseHostPort(c.rendezvous);
    if (!hp.ok()) return Status::InvalidArgument("rendezvous: " + hp.status().message());
  }
  if (c.cuda_device < 0 || c.cuda_device > kCudaDeviceMax) {
    return Status::InvalidArgument("cuda_device must be in 0.." + std::to_string(kCudaDeviceMax) +
                                   ", got " + std::to_string(c.cuda_device));
  }
  if (c.nccl_world_size != 0 && (c.nccl_world_size < 2 || c.nccl_world_size > kNcclWorldSizeMax)) {
    return Status::InvalidArgument("nccl_world_size must be 0 (ask the engine) or 2.." +
                                   std::to_string(kNcclWorldSizeMax));
  }
  if (c.nccl_init_timeout_ms == 0 || c.nccl_init_timeout_ms > 3600ull * 1000) {
    return Status::InvalidArgument("nccl_init_timeout_ms must be in 1 ms..1 h");
  }
  if (c.transfer == "nccl") {
    if (c.rendezvous.empty()) {
      return Status::InvalidArgument(
          "transfer 'nccl' needs rendezvous HOST:PORT (the address the engine's workers dial; "
          "PORT 0 = ephemeral)");
    }
    // The abort must fit inside every deadline it is reserved from, with time left for work.
    if (c.nccl_abort_reserve_ms >= c.nccl_init_timeout_ms ||
        c.nccl_abort_reserve_ms >= c.transfer_timeout_ms) {
      return Status::InvalidArgument(
          "nccl_abort_reserve_ms (" + std::to_string(c.nccl_abort_reserve_ms) +
          ") must be below nccl_init_timeout_ms (" + std::to_string(c.nccl_init_timeout_ms) +
          ") and transfer_timeout_ms (" + std::to_string(c.transfer_timeout_ms) + ")");
    }
  }
  for (auto [name, v] : {std::pair{"connect_timeout_ms", c.connect_timeout_ms},
                         {"call_timeout_ms", c.call_timeout_ms},
                         {"drain_timeout_ms", c.drain_timeout_ms},
                         {"transfer_timeout_ms", c.transfer_timeout_ms},
                         {"request_timeout_ms", c.request_timeout_ms},
                         {"watch_timeout_ms_max", c.watch_timeout_ms_max}}) {
    if (v == 0 || v > 24ull * 3600 * 1000) {
      return Status::InvalidArgument(std::string(name) + " must be in 1 ms..24 h");
    }
  }
  if (c.engine_monitor_interval_ms < kEngineMonitorIntervalMsMin ||
      c.engine_monitor_interval_ms > kEngineMonitorIntervalMsMax) {
    return Status::InvalidArgument("engine_monitor_interval_ms must be in " +
                                   std::to_string(kEngineMonitorIntervalMsMin) + ".." +
                                   std::to_string(kEngineMonitorIntervalMsMax));
  }
  if (c.engine_startup_timeout_ms == 0 || c.engine_startup_timeout_ms > 24ull * 3600 * 1000) {
    return Status::InvalidArgument("engine_startup_timeout_ms must be in 1 ms..24 h");
  }
  if (c.rollout_lease_ms < kRolloutLeaseMsMin || c.rollout_lease_ms > kRolloutLeaseMsMax) {
    return Status::InvalidArgument("rollout_lease_ms must be in " +
                                   std::to_string(kRolloutLeaseMsMin) + ".." +
                                   std::to_string(kRolloutLeaseMsMax));
  }
  if (c.journal_commit_stall_timeout_ms < 100 || c.journal_commit_stall_timeout_ms > 600000) {
    return Status::InvalidArgument("journal_commit_stall_timeout_ms must be in 100..600000");
  }
  if (c.finish_retry_ms == 0 || c.finish_retry_ms > 600ull * 1000) {
    return Status::InvalidArgument("finish_retry_ms must be in 1 ms..10 min");
  }
  if (c.admit_wait_ms > 3600ull * 1000) return Status::InvalidArgument("admit_wait_ms max 1 h");
  // proxy owner: the connection gate.
  if (c.header_timeout_ms == 0 || c.header_timeout_ms > 3600ull * 1000 ||
      c.idle_timeout_ms == 0 || c.idle_timeout_ms > 3600ull * 1000) {
    return Status::InvalidArgument("header_timeout_ms and idle_timeout_ms must be in 1 ms..1 h");
  }
  if (c.http_connections_max < static_cast<std::uint64_t>(c.http_threads) ||
      c.http_connections_max > 65536) {
    return Status::InvalidArgument("http_connections_max must be in http_threads..65536");
  }
  if (c.shutdown_grace_ms > 3600ull * 1000) {
    return Status::InvalidArgument("shutdown_grace_ms max 1 h");
  }
  return Status::OK();
}

nlohmann::json ConfigToJson(const ServeConfig& c) {
  nlohmann::json j;
#define RC_OUT(f) j[#f] = c.f
  RC_OUT(engine_url); RC_OUT(journal_path); RC_OUT(trajectories_path); RC_OUT(listen_host);
  RC_OUT(listen_port); RC_OUT(executor_id); RC_OUT(initial_label);
  RC_OUT(initial_manifest_digest); RC_OUT(initial_source); RC_OUT(initial_checkpoint);
  RC_OUT(initial_run); RC_OUT(initial_step); RC_OUT(connect_timeout_ms); RC_OUT(call_timeout_ms);
  RC_OUT(drain_timeout_ms); RC_OUT(transfer_timeout_ms); RC_OUT(request_timeout_ms);
  RC_OUT(admit_wait_ms); RC_OUT(retry_after_s); RC_OUT(shutdown_grace_ms);
  RC_OUT(watch_timeout_ms_max); RC_OUT(body_bytes_max); RC_OUT(http_threads);
  RC_OUT(engine_connections_max);
  RC_OUT(events_page_max); RC_OUT(trajectories_bytes_max); RC_OUT(transfer);
  RC_OUT(packed_buffer_size_bytes); RC_OUT(packed_num_buffers); RC_OUT(rendezvous);
  RC_OUT(journal_sync); RC_OUT(cuda_device); RC_OUT(nccl_world_size);
  RC_OUT(nccl_init_timeout_ms); RC_OUT(nccl_abort_reserve_ms);
  RC_OUT(engine_monitor_interval_ms); RC_OUT(engine_startup_timeout_ms); RC_OUT(adopt_engine);
  RC_OUT(rollout_lease_ms); RC_OUT(finish_retry_ms); RC_OUT(journal_commit_stall_timeout_ms);
  RC_OUT(header_timeout_ms); RC_OUT(idle_timeout_ms); RC_OUT(http_connections_max);  // proxy owner
#undef RC_OUT
  j["auth_token"] = c.auth_token.empty() ? "" : "<redacted>";
  return j;
}

}  // namespace rc::service
