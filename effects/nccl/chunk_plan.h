// The data-plane plan: which broadcasts carry which tensors, shared by the sender and its tests.
//
// Packed mode (vLLM packed_tensor.py): walk tensors in update_info order, append each tensor and
// add its byte size to the running total; close the chunk as soon as the total is STRICTLY
// greater than buffer_bytes (the crossing tensor is included). Flush the last partial chunk if it
// holds any tensor. A tensor larger than the buffer makes a one-tensor (oversize) chunk. Chunks
// are raw concatenations (no padding) broadcast as uint8.
// Unpacked mode: one broadcast per tensor, in the tensor's own dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "effects/manifest.h"
#include "statemachine/status.h"

namespace rc::effects::nccl {

struct BroadcastOp {
  std::size_t first_tensor = 0;  // index into the manifest
  std::size_t tensor_count = 0;
  std::uint64_t bytes = 0;  // sum of the tensors' nbytes
  bool packed = false;      // true: uint8 x bytes; false: one tensor, its dtype x numel
  bool operator==(const BroadcastOp&) const = default;
};

struct BroadcastPlan {
  std::vector<BroadcastOp> ops;
  std::uint64_t total_bytes = 0;
  std::uint64_t max_op_bytes = 0;  // staging buffer size needed per buffer
};

// Packed chunking over byte sizes (the rule above). Both plans broadcast every tensor exactly once,
// in order, and their totals are the sums of their ops.
BroadcastPlan PlanPacked(const std::vector<std::uint64_t>& tensor_bytes,
                         std::uint64_t buffer_bytes);
BroadcastPlan PlanUnpacked(const std::vector<std::uint64_t>& tensor_bytes);
BroadcastPlan PlanFor(const Manifest& manifest, bool packed, std::uint64_t buffer_bytes);

// What vLLM's packed consumer can unpack (vLLM 0.25.1 packed_tensor.py: each tensor is
// chunk[offset:offset+nbytes].view(dtype).view(*shape)): no 0-d tensor (view() of an empty shape
// raises) and every tensor's byte offset inside its chunk a multiple of its element size (a view
// at a misaligned offset raises). The engine finds out only after that chunk was broadcast, with
// its layers mid-reload, so the sender checks before anything is sent. Unpacked plans always pass.
// Requires `plan` to be PlanFor(manifest, ...).
[[nodiscard]] Status CheckPackable(const Manifest& manifest, const BroadcastPlan& plan);

}  // namespace rc::effects::nccl
