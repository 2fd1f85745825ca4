#include "effects/nccl/rendezvous.h"

#include <cstring>

namespace rc::effects::nccl {
namespace {

constexpr std::string_view kPrefix =
    "\x80\x03"
    "c_ctypes\n_unpickle\n"
    "cvllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId\n"
    "}"
    "C\x80";
constexpr std::string_view kSuffix = "\x86\x86R.";
static_assert(kPrefix.size() + kNcclUniqueIdBytes + kSuffix.size() == kPickledUniqueIdBytes);

}  // namespace

std::string PickleNcclUniqueId(const UniqueIdBytes& id) {
  std::string out;
  out.reserve(kPickledUniqueIdBytes);
  out.append(kPrefix);
  out.append(reinterpret_cast<const char*>(id.data()), id.size());
  out.append(kSuffix);
  RC_CHECK(out.size() == kPickledUniqueIdBytes);
  return out;
}

Result<UniqueIdBytes> UnpickleNcclUniqueId(std::string_view pickled) {
  if (pickled.size() != kPickledUniqueIdBytes) {
    return Status::InvalidArgument("pickled ncclUniqueId must be " +
                                   std::to_string(kPickledUniqueIdBytes) + " bytes, got " +
                                   std::to_string(pickled.size()));
  }
  if (pickled.substr(0, kPrefix.size()) != kPrefix ||
      pickled.substr(kPrefix.size() + kNcclUniqueIdBytes) != kSuffix) {
    return Status::InvalidArgument("pickled ncclUniqueId has an unexpected layout");
  }
  UniqueIdBytes id{};
  std::memcpy(id.data(), pickled.data() + kPrefix.size(), id.size());
  RC_CHECK(PickleNcclUniqueId(id) == pickled);  // the layout above is all there is to it
  return id;
}

}  // namespace rc::effects::nccl
