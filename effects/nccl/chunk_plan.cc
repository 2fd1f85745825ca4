#include "effects/nccl/chunk_plan.h"

#include <algorithm>
#include <string>

namespace rc::effects::nccl {
namespace {

// True when `plan` broadcasts every tensor exactly once, in manifest order, each op's byte count
// is the sum of its tensors' sizes, and the totals agree with the ops.
bool CoversEachTensorOnce(const BroadcastPlan& plan, const std::vector<std::uint64_t>& bytes) {
  std::size_t next = 0;
  std::uint64_t total = 0, max_op = 0;
  for (const auto& op : plan.ops) {
    if (op.first_tensor != next || op.tensor_count == 0) return false;
    if (op.tensor_count > bytes.size() - next) return false;
    std::uint64_t op_bytes = 0;
    for (std::size_t i = next; i < next + op.tensor_count; ++i) op_bytes += bytes[i];
    if (op_bytes != op.bytes) return false;
    next += op.tensor_count;
    total += op.bytes;
    max_op = std::max(max_op, op.bytes);
  }
  return next == bytes.size() && total == plan.total_bytes && max_op == plan.max_op_bytes;
}

void AddTotals(BroadcastPlan* plan) {
  for (const auto& op : plan->ops) {
    plan->total_bytes += op.bytes;
    plan->max_op_bytes = std::max(plan->max_op_bytes, op.bytes);
  }
}

Status CheckPackedTensor(const TensorSpec& t, std::uint64_t offset) {
  if (t.shape.empty()) {
    return Status::InvalidArgument("packed transfer cannot carry the 0-d tensor '" + t.name +
                                   "' (vLLM's unpack views it with an empty shape); send "
                                   "unpacked");
  }
  if (offset % dtype_bytes(t.dtype) != 0) {
    return Status::InvalidArgument("packed transfer would place '" + t.name + "' (" +
                                   dtype_torch_name(t.dtype) + ") at byte offset " +
                                   std::to_string(offset) + " of its chunk, not a multiple of " +
                                   std::to_string(dtype_bytes(t.dtype)) +
                                   " (vLLM's unpack cannot view it); send unpacked "
                                   "or reorder the manifest");
  }
  return Status::OK();
}

Status CheckPackedOp(const Manifest& manifest, const BroadcastOp& op) {
  RC_CHECK(op.first_tensor + op.tensor_count <= manifest.tensors.size());
  std::uint64_t offset = 0;
  for (std::size_t i = op.first_tensor; i < op.first_tensor + op.tensor_count; ++i) {
    const TensorSpec& t = manifest.tensors[i];
    RC_RETURN_IF_ERROR(CheckPackedTensor(t, offset));
    offset += t.nbytes();
  }
  RC_CHECK(offset == op.bytes);
  return Status::OK();
}

}  // namespace

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
  AddTotals(&plan);
  RC_CHECK(CoversEachTensorOnce(plan, tensor_bytes));
  return plan;
}

BroadcastPlan PlanUnpacked(const std::vector<std::uint64_t>& tensor_bytes) {
  BroadcastPlan plan;
  for (std::size_t i = 0; i < tensor_bytes.size(); ++i) {
    plan.ops.push_back(BroadcastOp{i, 1, tensor_bytes[i], false});
  }
  AddTotals(&plan);
  RC_CHECK(CoversEachTensorOnce(plan, tensor_bytes));
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
    if (op.packed) RC_RETURN_IF_ERROR(CheckPackedOp(manifest, op));
  }
  return Status::OK();
}

}  // namespace rc::effects::nccl
