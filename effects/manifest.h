// The manifest of a set of weights: ordered (name, dtype, shape) entries and their digest.
//
// The digest identifies an architecture's parameter layout, not its values: two checkpoints of
// one architecture share it (which is why WeightIdentity also carries checkpoint/run/step).
//
// Canonical form hashed with SHA-256 (one line per tensor, in transfer order):
//   manifest := "rolloutcore-manifest-v1\n" entry*
//   entry    := name "\t" dtype "\t" dim ("," dim)* "\n"      (a scalar has the empty dim list)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "statemachine/status.h"

namespace rc::effects {

inline constexpr std::size_t kTensorsMax = 1u << 20;  // entries in one manifest
inline constexpr std::size_t kTensorNameBytesMax = 1024;
inline constexpr std::size_t kTensorRankMax = 8;

// vLLM / torch dtype names (`getattr(torch, name)` on the engine side) and their NCCL codes.
enum class DType : std::uint8_t {
  kBFloat16,
  kFloat16,
  kFloat32,
  kFloat64,
  kInt8,
  kUInt8,
  kInt32,
  kInt64,
  kFloat8E4M3
};
std::size_t dtype_bytes(DType d);
const char* dtype_torch_name(DType d);        // "bfloat16", "float16", ...
const char* dtype_safetensors_name(DType d);  // "BF16", "F16", ...
[[nodiscard]] Result<DType> dtype_from_torch_name(const std::string& name);
[[nodiscard]] Result<DType> dtype_from_safetensors_name(const std::string& name);

struct TensorSpec {
  std::string name;
  DType dtype = DType::kBFloat16;
  std::vector<std::uint64_t> shape;
  std::uint64_t numel() const;
  std::uint64_t nbytes() const { return numel() * dtype_bytes(dtype); }
  bool operator==(const TensorSpec&) const = default;
};

struct Manifest {
  std::vector<TensorSpec> tensors;
  std::uint64_t total_bytes() const;
  // Lowercase hex SHA-256 of the canonical form above.
  std::string digest() const;
  // Names unique, ranks and name lengths bounded, no overflow in byte counts.
  [[nodiscard]] Status Validate() const;
};

}  // namespace rc::effects
