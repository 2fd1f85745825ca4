#include "effects/manifest.h"

#include <set>

#include "encoding/sha256.h"
#include "statemachine/text.h"

namespace rc::effects {

std::size_t dtype_bytes(DType d) {
  switch (d) {
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kFloat8E4M3:
      return 1;
  }
  return 0;
}

namespace {
struct DTypeNames {
  DType d;
  const char* torch;
  const char* st;
};
constexpr DTypeNames kNames[] = {
    {DType::kBFloat16, "bfloat16", "BF16"},
    {DType::kFloat16, "float16", "F16"},
    {DType::kFloat32, "float32", "F32"},
    {DType::kFloat64, "float64", "F64"},
    {DType::kInt8, "int8", "I8"},
    {DType::kUInt8, "uint8", "U8"},
    {DType::kInt32, "int32", "I32"},
    {DType::kInt64, "int64", "I64"},
    {DType::kFloat8E4M3, "float8_e4m3fn", "F8_E4M3"},
};
}  // namespace

const char* dtype_torch_name(DType d) {
  for (const auto& n : kNames)
    if (n.d == d) return n.torch;
  return "?";
}
const char* dtype_safetensors_name(DType d) {
  for (const auto& n : kNames)
    if (n.d == d) return n.st;
  return "?";
}
Result<DType> dtype_from_torch_name(const std::string& name) {
  for (const auto& n : kNames)
    if (name == n.torch) return n.d;
  return Status::InvalidArgument("unsupported dtype '" + text::escape_line(name.substr(0, 64)) +
                                 "'");
}
Result<DType> dtype_from_safetensors_name(const std::string& name) {
  for (const auto& n : kNames)
    if (name == n.st) return n.d;
  return Status::InvalidArgument("unsupported safetensors dtype '" +
                                 text::escape_line(name.substr(0, 64)) + "'");
}

std::uint64_t TensorSpec::numel() const {
  std::uint64_t n = 1;
  for (std::uint64_t d : shape) n *= d;
  return n;
}

std::uint64_t Manifest::total_bytes() const {
  std::uint64_t total = 0;
  for (const auto& t : tensors) total += t.nbytes();
  return total;
}

Status Manifest::Validate() const {
  if (tensors.size() > kTensorsMax) return Status::InvalidArgument("too many tensors");
  std::set<std::string> names;
  constexpr std::uint64_t kBytesMax = std::uint64_t{1} << 50;  // 1 PiB: far above any model
  std::uint64_t total = 0;
  // Tensors are named by position: names come from files a caller may point at, and an error
  // message must not carry a file's content (see SourceManifestDigest).
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const std::string who = "tensor #" + std::to_string(i);
    // Printable: the digest's canonical text separates fields by tab and tensors by newline,
    // so a name holding either could make two manifests one digest.
    if (t.name.empty() || t.name.size() > kTensorNameBytesMax || !text::printable_utf8(t.name)) {
      return Status::InvalidArgument(who + ": name empty, longer than " +
                                     std::to_string(kTensorNameBytesMax) + " or unprintable");
    }
    if (!names.insert(t.name).second) return Status::InvalidArgument(who + ": duplicate name");
    if (t.shape.size() > kTensorRankMax) return Status::InvalidArgument(who + ": rank too high");
    std::uint64_t n = 1;
    for (std::uint64_t d : t.shape) {
      if (d != 0 && n > kBytesMax / d) return Status::InvalidArgument(who + ": shape overflows");
      n *= d;
    }
    const std::uint64_t bytes = n * dtype_bytes(t.dtype);
    if (bytes > kBytesMax || total > kBytesMax - bytes) {
      return Status::InvalidArgument("manifest larger than 1 PiB");
    }
    total += bytes;
  }
  return Status::OK();
}

std::string Manifest::digest() const {
  std::string canon = "rolloutcore-manifest-v1\n";
  for (const auto& t : tensors) {
    canon += t.name;
    canon += '\t';
    canon += dtype_torch_name(t.dtype);
    canon += '\t';
    for (std::size_t i = 0; i < t.shape.size(); ++i) {
      if (i) canon += ',';
      canon += std::to_string(t.shape[i]);
    }
    canon += '\n';
  }
  return encoding::Sha256Hex(canon);
}

}  // namespace rc::effects
