#include "effects/nccl/chunk_plan.h"

#include <algorithm>
#include <string>

namespace rc::effects::nccl {

BroadcastPlan PlanPacked(const std::vector<std::uint64_t>& tensor_bytes,
                         std::uint64_t buffer_bytes) {
  BroadcastPlan plan;
  BroadcastOp open{0, 0, 0, true};
  for (std::size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (open.tensor_count == 0) open.first_tensor = i;
    ++open.tensor_count;
    open.bytes += tensor_bytes[i];
    if (open.bytes > buffer_bytes) {  // strictly greater: the crossing tensor stays in
      plan.ops.push_back(open);
      open = BroadcastOp{i + 1, 0, 0, true};
    }
  }
  if (open.tensor_count > 0) plan.ops.push_back(open);
  for (const auto& op : plan.ops) {
    plan.total_bytes += op.bytes;
    plan.max_op_bytes = std::max(plan.max_op_bytes, op.bytes);
  }
  return plan;
}

BroadcastPlan PlanUnpacked(const std::vector<std::uint64_t>& tensor_bytes) {
  BroadcastPlan plan;
  for (std::size_t i = 0; i < tensor_bytes.size(); ++i) {
    plan.ops.push_back(BroadcastOp{i, 1, tensor_bytes[i], false});
    plan.total_bytes += tensor_bytes[i];
    plan.max_op_bytes = std::max(plan.max_op_bytes, tensor_bytes[i]);
  }
  return plan;
}

BroadcastPlan PlanFor(const Manifest& manifest, bool packed, std::uint64_t buffer_bytes) {
  std::vector<std::uint64_t> sizes;
  sizes.reserve(manifest.tensors.size());
  for (const auto& t : manifest.tensors) sizes.push_back(t.nbytes());
  return packed ? PlanPacked(sizes, buffer_bytes) : PlanUnpacked(sizes);
}

Status CheckPackable(const Manifest& manifest, const BroadcastPlan& plan) {
  for (const auto& op : plan.ops) {
    if (!op.packed) continue;
    std::uint64_t offset = 0;
    for (std::size_t i = op.first_tensor; i < op.first_tensor + op.tensor_count; ++i) {
      RC_CHECK(i < manifest.tensors.size());
      const TensorSpec& t = manifest.tensors[i];
      if (t.shape.empty()) {
        return Status::InvalidArgument("packed transfer cannot carry the 0-d tensor '" + t.name +
                                       "' (vLLM's unpack views it with an empty shape); send "
                                       "unpacked");
      }
      if (offset % dtype_bytes(t.dtype) != 0) {
        return Status::InvalidArgument(
            "packed transfer would place '" + t.name + "' (" + dtype_torch_name(t.dtype) +
            ") at byte offset " + std::to_string(offset) + " of its chunk, not a multiple of " +
            std::to_string(dtype_bytes(t.dtype)) +
            " (vLLM's unpack cannot view it); send unpacked "
            "or reorder the manifest");
      }
      offset += t.nbytes();
    }
  }
  return Status::OK();
}

}  // namespace rc::effects::nccl
