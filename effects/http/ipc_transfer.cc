#include "effects/http/ipc_transfer.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <sstream>

#include "effects/clock.h"
#include "effects/http/response_parsers.h"
#include "effects/nccl/weight_source.h"
#include "encoding/sha256.h"
#include "statemachine/describe.h"
#include "statemachine/text.h"

namespace rc::effects {

using nlohmann::json;

namespace {

bool printable_ascii(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return c >= 0x20 && c < 0x7f; });
}

// Absolute and normal: "/" first, no empty, "." or ".." component, no trailing "/".
bool normal_absolute(const std::string& path) {
  if (path.size() < 2 || path.front() != '/' || path.back() == '/') return false;
  std::size_t start = 1;
  while (start <= path.size()) {
    const std::size_t end = std::min(path.find('/', start), path.size());
    const std::string part = path.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

bool standard_base64(const std::string& s) {
  if (s.empty() || s.size() % 4 != 0) return false;
  return std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return std::isalnum(c) != 0 || c == '+' || c == '/' || c == '=';
  });
}

Status only_keys(const json& j) {
  static const std::set<std::string> kKeys = {
      "format", "version", "gpu_uuids", "names", "dtype_names", "shapes", "ipc_handles_pickled"};
  for (const auto& [key, value] : j.items()) {
    (void)value;
    if (kKeys.count(key) == 0) {
      return Status::InvalidArgument(
          "a key other than format, version, gpu_uuids, names, dtype_names, shapes, "
          "ipc_handles_pickled");
    }
  }
  return Status::OK();
}

Result<std::vector<std::string>> parse_uuids(const json& j) {
  auto it = j.find("gpu_uuids");
  if (it == j.end() || !it->is_array() || it->empty() || it->size() > kVllmIpcUuidsMax) {
    return Status::InvalidArgument("'gpu_uuids' must list 1.." + std::to_string(kVllmIpcUuidsMax) +
                                   " GPU UUIDs");
  }
  std::set<std::string> uuids;
  for (const json& u : *it) {
    if (!u.is_string() || u.get_ref<const std::string&>().empty() ||
        u.get_ref<const std::string&>().size() > kIdBytesMax ||
        !printable_ascii(u.get_ref<const std::string&>())) {
      return Status::InvalidArgument("a GPU UUID must be 1.." + std::to_string(kIdBytesMax) +
                                     " printable ASCII bytes");
    }
    uuids.insert(u.get<std::string>());
  }
  if (uuids.size() != it->size()) return Status::InvalidArgument("'gpu_uuids' repeats a UUID");
  return std::vector<std::string>(uuids.begin(), uuids.end());
}

const json* array_of(const json& j, const char* key, std::size_t size) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_array() || it->size() != size) return nullptr;
  return &*it;
}

Result<std::vector<std::uint64_t>> parse_shape(const json& s) {
  if (!s.is_array() || s.size() > kTensorRankMax) {
    return Status::InvalidArgument("a shape must be a list of at most " +
                                   std::to_string(kTensorRankMax) + " sizes");
  }
  std::vector<std::uint64_t> shape;
  for (const json& d : s) {
    if (!d.is_number_unsigned()) return Status::InvalidArgument("a size must be an integer >= 0");
    shape.push_back(d.get<std::uint64_t>());
  }
  return shape;
}

// Tensors are named by position in errors: an error never quotes the file's content.
Result<TensorSpec> parse_tensor(std::size_t i, const json& name, const json& dtype,
                                const json& shape) {
  const std::string who = "tensor #" + std::to_string(i) + ": ";
  if (!name.is_string() || !dtype.is_string()) {
    return Status::InvalidArgument(who + "names and dtype_names must be strings");
  }
  TensorSpec t;
  t.name = name.get<std::string>();
  if (t.name.empty() || t.name.size() > kTensorNameBytesMax || !printable_ascii(t.name)) {
    return Status::InvalidArgument(who + "a name must be 1.." +
                                   std::to_string(kTensorNameBytesMax) + " printable ASCII bytes");
  }
  if (!dtype_from_torch_name(dtype.get<std::string>()).ok()) {
    return Status::InvalidArgument(who + "not a dtype vLLM's ipc backend can name");
  }
  t.dtype = *dtype_from_torch_name(dtype.get<std::string>());
  Result<std::vector<std::uint64_t>> s = parse_shape(shape);
  if (!s.ok()) return Status::InvalidArgument(who + s.status().message());
  t.shape = std::move(s).value();
  return t;
}

Result<Manifest> parse_manifest(const json& j) {
  auto names = j.find("names");
  if (names == j.end() || !names->is_array() || names->empty() || names->size() > kTensorsMax) {
    return Status::InvalidArgument("'names' must list 1.." + std::to_string(kTensorsMax) +
                                   " tensors");
  }
  const json* dtypes = array_of(j, "dtype_names", names->size());
  const json* shapes = array_of(j, "shapes", names->size());
  if (dtypes == nullptr || shapes == nullptr) {
    return Status::InvalidArgument("'dtype_names' and 'shapes' must have one entry per name");
  }
  Manifest m;
  m.tensors.reserve(names->size());
  for (std::size_t i = 0; i < names->size(); ++i) {
    Result<TensorSpec> t = parse_tensor(i, (*names)[i], (*dtypes)[i], (*shapes)[i]);
    if (!t.ok()) return t.status();
    m.tensors.push_back(std::move(t).value());
  }
  RC_RETURN_IF_ERROR(m.Validate());
  return m;
}

Status check_header(const json& j) {
  if (!j.is_object()) return Status::InvalidArgument("not a JSON object");
  RC_RETURN_IF_ERROR(only_keys(j));
  auto format = j.find("format");
  auto version = j.find("version");
  if (format == j.end() || *format != kVllmIpcFormat || version == j.end() ||
      !version->is_number_unsigned() || version->get<std::uint64_t>() != 1) {
    return Status::InvalidArgument(std::string("not a '") + kVllmIpcFormat + "' file, version 1");
  }
  auto handles = j.find("ipc_handles_pickled");
  if (handles == j.end() || !handles->is_string() ||
      !standard_base64(handles->get_ref<const std::string&>())) {
    return Status::InvalidArgument("'ipc_handles_pickled' must be standard base64");
  }
  return Status::OK();
}

std::uint64_t remaining_ms(std::uint64_t deadline_at_ms) {
  const auto now_ms = static_cast<std::uint64_t>(steady_now_ms());
  return now_ms >= deadline_at_ms ? 0 : deadline_at_ms - now_ms;
}

std::string summary(const char* route, const HttpEvidence& h) {
  return std::string(route) + ": " + describe(h);
}

using StepFailed = IpcTransfer::StepFailed;

StepFailed at_start(const HttpReply& start) {
  return StepFailed{start.http.never_sent() ? MutationClass::kNone : MutationClass::kPossible,
                    summary("/start_weight_update", start.http), start.foreign_weight_session};
}

}  // namespace

Result<std::string> VllmIpcPath(const std::string& source_uri) {
  const std::string scheme = kVllmIpcScheme;
  if (source_uri.rfind(scheme, 0) != 0) {
    return Status::InvalidArgument(
        "a colocated source is vllm-ipc:/path (the file the trainer's "
        "export_vllm_ipc wrote)");
  }
  std::string path = source_uri.substr(scheme.size());
  if (path.size() > kTextBytesMax || !printable_ascii(path) || !normal_absolute(path)) {
    return Status::InvalidArgument("vllm-ipc: needs an absolute, normal path");
  }
  return path;
}

// Bounded in bytes (kVllmIpcFileBytesMax) and, before it is parsed, in the tree it makes
// (kFileJsonTreeBytesMax).
Result<VllmIpcFile> ParseVllmIpcFile(const std::string& text) {
  RC_RETURN_IF_ERROR(check_file_json_tree(text, "the file"));
  json j = parse_outside_json(text);
  if (j.is_discarded()) return Status::InvalidArgument("not JSON");
  RC_RETURN_IF_ERROR(check_header(j));
  Result<std::vector<std::string>> uuids = parse_uuids(j);
  if (!uuids.ok()) return uuids.status();
  Result<Manifest> manifest = parse_manifest(j);
  if (!manifest.ok()) return manifest.status();
  VllmIpcFile f;
  f.manifest = std::move(manifest).value();
  f.gpu_uuids = std::move(uuids).value();
  f.update_info = json{{"names", j["names"]},
                       {"dtype_names", j["dtype_names"]},
                       {"shapes", j["shapes"]},
                       {"ipc_handles_pickled", j["ipc_handles_pickled"]},
                       {"packed", false}};
  f.content_sha256 = encoding::Sha256Hex(text);
  RC_CHECK(!f.gpu_uuids.empty() && !f.manifest.tensors.empty());
  return f;
}

Result<VllmIpcFile> ReadVllmIpcFile(const std::string& source_uri) {
  Result<std::string> path = VllmIpcPath(source_uri);
  if (!path.ok()) return path.status();
  // One guarded open: a FIFO (or any non-regular file) swapped in is refused, never waited on.
  Result<std::string> text = nccl::ReadSmallFile(*path, kVllmIpcFileBytesMax);
  if (!text.ok()) return text.status();
  Result<VllmIpcFile> f = ParseVllmIpcFile(*text);
  if (!f.ok()) return Status::InvalidArgument("'" + *path + "': " + f.status().message());
  return f;
}

std::string IpcTransfer::DeviceMismatch(const VllmIpcFile& file, const CallOptions& o) {
  HttpReply reply = client_.DeviceInfo(o);
  if (!reply.http.ok_2xx()) {
    return "the engine did not report its GPUs (rc_device_info needs the worker extension): " +
           describe(reply.http);
  }
  Result<std::vector<WorkerDevice>> devices = parse_device_info(reply.body);
  if (!devices.ok()) return devices.status().message();
  for (const WorkerDevice& d : devices.value()) {
    if (!std::binary_search(file.gpu_uuids.begin(), file.gpu_uuids.end(), d.gpu_uuid)) {
      return "engine GPU " + d.gpu_uuid + " has no handles in the file (it names " +
             std::to_string(file.gpu_uuids.size()) + " other GPU(s))";
    }
  }
  return {};
}

PreflightObserved IpcTransfer::Preflight(const TransferTarget& target) {
  PreflightObserved p;
  p.memory_ok = true;  // nothing is staged: the engine reads the trainer's tensors in place
  Result<VllmIpcFile> file = ReadVllmIpcFile(target.source_uri);
  if (!file.ok()) {
    p.detail = text::utf8_prefix(file.status().ToString(), kTextBytesMax);  // no digest: refused
    return p;
  }
  p.source_manifest_digest = file->manifest.digest();
  const std::string mismatch = DeviceMismatch(*file, CallOptions{});
  p.device_ok = mismatch.empty();
  p.detail = std::to_string(file->manifest.tensors.size()) + " tensors, " +
             std::to_string(file->manifest.total_bytes()) + " bytes over CUDA IPC" +
             (mismatch.empty() ? "" : "; " + mismatch);
  p.detail = text::utf8_prefix(std::move(p.detail), kTextBytesMax);
  RC_CHECK(!p.source_manifest_digest.empty());
  return p;
}

// /init_weight_transfer_engine {"init_info": {}} once per engine: the ipc backend needs nothing
// (and refuses any key); it changes no weights, so a failure is a refusal.
std::optional<StepFailed> IpcTransfer::InitializeOnce(std::uint64_t deadline_at_ms) {
  const std::uint64_t left = remaining_ms(deadline_at_ms);
  if (left == 0) return StepFailed{MutationClass::kNone, "deadline spent before the first call"};
  // The instance check is one label read (and /metrics) within a call's timeout; whatever it
  // leaves of the deadline is all the init gets.
  std::string before;
  if (SameEngineAs(client_, initialized_on_, std::min(left, client_.deadlines().call_timeout_ms),
                   &before)) {
    return std::nullopt;
  }
  // The process is read before (unless just read) and after: a restart in between is not the
  // process initialized.
  if (before.empty()) before = client_.Instance(UntilDeadlineMs(deadline_at_ms));
  HttpReply init =
      client_.InitWeightTransferEngine(json::object(), UntilDeadlineMs(deadline_at_ms));
  if (!init.http.ok_2xx()) {
    return StepFailed{MutationClass::kNone, summary("/init_weight_transfer_engine", init.http)};
  }
  initialized_on_ = OneInstance(before, client_.Instance(UntilDeadlineMs(deadline_at_ms)));
  return std::nullopt;
}

std::optional<StepFailed> IpcTransfer::RunUpdate(const TransferTarget& target,
                                                 std::uint64_t deadline_at_ms,
                                                 TransferObserved& out) {
  Result<VllmIpcFile> file = ReadVllmIpcFile(target.source_uri);
  if (!file.ok()) return StepFailed{MutationClass::kNone, file.status().ToString()};
  if (file->manifest.digest() != target.identity.manifest_digest) {
    return StepFailed{MutationClass::kNone,
                      "the source file no longer holds the declared manifest"};
  }
  if (std::string mismatch = DeviceMismatch(*file, UntilDeadlineMs(deadline_at_ms));
      !mismatch.empty()) {
    return StepFailed{MutationClass::kNone, mismatch};
  }
  if (std::optional<StepFailed> failed = InitializeOnce(deadline_at_ms)) return failed;
  HttpReply start =
      client_.StartWeightUpdate(StaleSessionFor(target.restore), UntilDeadlineMs(deadline_at_ms));
  if (!start.http.ok_2xx()) return at_start(start);
  if (remaining_ms(deadline_at_ms) == 0) {
    return StepFailed{MutationClass::kPossible, "deadline passed after start"};
  }
  HttpReply update = client_.UpdateWeights(file->update_info, UntilDeadlineMs(deadline_at_ms));
  if (!update.http.ok_2xx()) {
    return StepFailed{MutationClass::kPossible, summary("/update_weights", update.http)};
  }
  out.bytes_sent = file->manifest.total_bytes();
  out.tensors_sent = static_cast<std::uint32_t>(file->manifest.tensors.size());
  out.finish_label = target.target.label;
  HttpReply fin = client_.FinishWeightUpdate(target.target.label, UntilDeadlineMs(deadline_at_ms));
  if (fin.http.ok_2xx()) return std::nullopt;
  return StepFailed{MutationClass::kPossible, summary("/finish_weight_update", fin.http)};
}

TransferObserved IpcTransfer::Transfer(const TransferTarget& target, std::uint64_t deadline_ms) {
  RC_CHECK(deadline_ms > 0);
  const std::int64_t start_ms = steady_now_ms();
  const std::uint64_t deadline_at_ms = static_cast<std::uint64_t>(start_ms) + deadline_ms;
  TransferObserved out;
  const std::optional<StepFailed> failed = RunUpdate(target, deadline_at_ms, out);
  out.mutation = failed ? failed->mutation : MutationClass::kComplete;
  out.acknowledged = out.mutation == MutationClass::kComplete;
  out.error = failed ? text::utf8_prefix(failed->error, kTextBytesMax) : std::string();
  out.foreign_session = failed && failed->foreign_session;
  out.duration_us = static_cast<std::uint64_t>(steady_now_ms() - start_ms) * 1000;
  RC_CHECK(!out.acknowledged || (out.error.empty() && out.tensors_sent > 0));
  return out;
}

}  // namespace rc::effects
