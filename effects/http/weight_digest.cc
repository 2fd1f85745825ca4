#include "effects/http/weight_digest.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "encoding/sha256.h"
#include "statemachine/hex.h"
#include "statemachine/state.h"
#include "statemachine/status.h"
#include "statemachine/text.h"

namespace rc::effects {
namespace {

using nlohmann::json;

struct WorkerDigest {
  std::int64_t rank = 0;
  std::string algorithm;
  std::string combined;
  std::uint64_t bytes = 0;
  std::map<std::string, std::string> tensors;  // sorted by name
};

WeightDigest Absent(std::string why) {
  WeightDigest d;
  // Bounded for the fold; sanitized because a cut may split a character.
  d.error = text::sanitize_utf8(std::string_view(why).substr(0, kTextBytesMax / 2));
  return d;
}

bool IsDigestHex(const json& v) {
  return v.is_string() && !v.get_ref<const std::string&>().empty() &&
         v.get_ref<const std::string&>().size() <= kDigestBytesMax &&
         hex::is_lower(v.get_ref<const std::string&>());
}

bool IsTensorName(const std::string& name) {
  return !name.empty() && name.size() <= kTensorNameBytesMax && text::printable_utf8(name);
}

std::string ParseTensors(const json& tensors, WorkerDigest& out) {
  if (!tensors.is_object() || tensors.size() > kTensorDigestsMax) return "bad tensors";
  for (const auto& [name, digest] : tensors.items()) {
    if (!IsTensorName(name)) return "a tensor name is empty, too long or unprintable";
    if (!IsDigestHex(digest)) return "tensor '" + name + "' has a bad digest";
    out.tensors.emplace(name, digest.get<std::string>());
  }
  return {};
}

bool IsCount(const json& v) {
  return v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0);
}

// One worker's entry, or the reason it is not a digest.
std::string ParseWorker(const json& w, WorkerDigest& out) {
  if (!w.is_object()) return "a worker's result is not an object";
  const json& rank = w.value("rank", json(0));
  const json& algorithm = w.value("algorithm", json());
  if (!rank.is_number_integer() || rank.get<std::int64_t>() < 0) return "bad rank";
  if (!algorithm.is_string() || algorithm.get_ref<const std::string&>().size() > kIdBytesMax ||
      !text::printable_utf8(algorithm.get_ref<const std::string&>())) {
    return "bad algorithm";
  }
  if (!IsDigestHex(w.value("combined", json()))) return "bad combined digest";
  const json& bytes = w.value("bytes", json(0));
  if (!IsCount(bytes)) return "bad bytes";
  if (std::string why = ParseTensors(w.value("tensors", json::object()), out); !why.empty()) {
    return why;
  }
  out.rank = rank.get<std::int64_t>();
  out.algorithm = algorithm.get<std::string>();
  out.combined = w["combined"].get<std::string>();
  out.bytes = bytes.get<std::uint64_t>();
  return {};
}

// What the tensors add to an encoded record, at most (see kTensorDigestEntryOverheadBytes).
std::size_t EncodedTensorBytes(const std::vector<TensorDigest>& tensors) {
  std::size_t n = 0;
  for (const TensorDigest& t : tensors) {
    n += t.name.size() + t.digest.size() + kTensorDigestEntryOverheadBytes;
  }
  return n;
}

bool FitsRecord(const std::vector<TensorDigest>& tensors) {
  return tensors.size() <= kTensorDigestsMax &&
         EncodedTensorBytes(tensors) <= kDigestTensorBytesMax;
}

std::vector<TensorDigest> NamedTensors(const std::vector<WorkerDigest>& workers) {
  std::vector<TensorDigest> out;
  const bool prefixed = workers.size() > 1;
  for (const WorkerDigest& w : workers) {
    const std::string prefix = prefixed ? "r" + std::to_string(w.rank) + "/" : "";
    for (const auto& [name, digest] : w.tensors) out.push_back({prefix + name, digest});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

// One entry per worker: what a failure can name when the tensors do not fit a record.
std::vector<TensorDigest> WorkerEntries(const std::vector<WorkerDigest>& workers) {
  std::vector<TensorDigest> out;
  for (const WorkerDigest& w : workers) out.push_back({"r" + std::to_string(w.rank), w.combined});
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

std::string Combined(const std::vector<WorkerDigest>& workers) {
  if (workers.size() == 1) return workers[0].combined;
  std::string lines;
  for (const WorkerDigest& w : workers) lines += std::to_string(w.rank) + " " + w.combined + "\n";
  return encoding::Sha256Hex(lines);
}

WeightDigest Assemble(std::vector<WorkerDigest> workers) {
  RC_CHECK(!workers.empty());
  std::sort(workers.begin(), workers.end(),
            [](const auto& a, const auto& b) { return a.rank < b.rank; });
  WeightDigest d;
  d.algorithm = workers[0].algorithm;
  d.combined = Combined(workers);
  for (const WorkerDigest& w : workers) d.bytes += w.bytes;
  d.tensors = NamedTensors(workers);
  if (!FitsRecord(d.tensors) && workers.size() > 1) d.tensors = WorkerEntries(workers);
  // What still does not fit (one worker's tensors, or worker entries past the bound) names no
  // tensor: the combined digest alone decides.
  if (!FitsRecord(d.tensors)) d.tensors.clear();
  RC_CHECK(d.present());
  return d;
}

// Two answers from one rank would name the same tensors twice.
bool RanksUnique(const std::vector<WorkerDigest>& workers) {
  std::vector<std::int64_t> ranks;
  for (const WorkerDigest& w : workers) ranks.push_back(w.rank);
  std::sort(ranks.begin(), ranks.end());
  return std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end();
}

}  // namespace

WeightDigest ParseWeightDigestReply(const json& body) {
  if (!body.is_object() || !body.contains("results") || !body["results"].is_array()) {
    return Absent("collective_rpc reply has no results list");
  }
  const json& results = body["results"];
  if (results.empty() || results.size() > kRpcWorkersMax) return Absent("bad number of workers");
  std::vector<WorkerDigest> workers;
  for (const json& w : results) {
    WorkerDigest parsed;
    if (std::string why = ParseWorker(w, parsed); !why.empty()) {
      return Absent("worker " + std::to_string(workers.size()) + ": " + why);
    }
    if (!workers.empty() && parsed.algorithm != workers[0].algorithm) {
      return Absent("workers report different digest algorithms");
    }
    workers.push_back(std::move(parsed));
  }
  if (!RanksUnique(workers)) return Absent("two workers report the same rank");
  WeightDigest d = Assemble(std::move(workers));
  // The fold refuses a record holding a digest it cannot check: say why here instead, so the
  // engine's answer costs a missing digest, never a refused observation.
  if (const Status st = check_weight_digest(d); !st.ok()) return Absent(st.message());
  return d;
}

namespace {

// The engine answered that it has no such route or method (no worker extension, or an older one):
// vLLM's 404, or the NotImplementedError of a collective_rpc naming an unknown method.
bool NoDigestMethod(const HttpReply& reply) {
  if (reply.http.transport != Transport::kOk) return false;
  if (reply.http.http_status == 404) return true;
  const bool status = reply.http.http_status == 500 || reply.http.http_status == 501;
  return status && reply.raw.find(std::string("Method '") + kWeightDigestMethod +
                                  "' is not implemented") != std::string::npos;
}

}  // namespace

WeightDigest ReadWeightDigest(EngineClient& client, const CallOptions& o) {
  HttpReply reply = client.CollectiveRpc(kWeightDigestMethod, {}, o);
  if (reply.http.ok_2xx()) return ParseWeightDigestReply(reply.body);
  const std::string call = std::string(" (") + kWeightDigestMethod + ": transport " +
                           transport_name(reply.http.transport) + ", status " +
                           std::to_string(reply.http.http_status) + ")";
  if (NoDigestMethod(reply)) return Absent("the engine computes no weight digest" + call);
  return Absent(std::string(kDigestReadFailedPrefix) + call + ": " + reply.http.error);
}

}  // namespace rc::effects
