// Rendezvous payloads for vLLM's NCCL weight-transfer group (docs/vllm-protocol.md §5).
//
// TCPStore mode: the trainer (rank 0) stores, at key "broadcast_from/0/0" (wire key
// "/broadcast_from/0/0"), the pickle of vLLM's ctypes `ncclUniqueId`. We write protocol 3 by hand
// (223 bytes):
//   80 03                                                     PROTO 3
//   63 "_ctypes\n_unpickle\n"                                 GLOBAL
//   63 "vllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId\n"  GLOBAL
//   7D                                                        EMPTY_DICT
//   43 80 <128 raw id bytes>                                  SHORT_BINBYTES
//   86 86 52 2E                                               TUPLE2 TUPLE2 REDUCE STOP
// Unique-id mode (newer vLLM): init_info carries `nccl_unique_id_b64`, standard base64 (with
// padding, not URL-safe) of the 128 raw bytes (encoding/base64.h).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "statemachine/status.h"

namespace rc::effects::nccl {

inline constexpr std::size_t kNcclUniqueIdBytes = 128;
using UniqueIdBytes = std::array<std::uint8_t, kNcclUniqueIdBytes>;

inline constexpr std::string_view kUniqueIdStoreKey = "broadcast_from/0/0";  // as vLLM names it
inline constexpr std::string_view kUniqueIdWireKey = "/broadcast_from/0/0";  // as it travels
inline constexpr std::size_t kPickledUniqueIdBytes = 223;

// The protocol-3 pickle above, exactly kPickledUniqueIdBytes long.
std::string PickleNcclUniqueId(const UniqueIdBytes& id);
// Accepts only the exact layout PickleNcclUniqueId writes (tests and self-checks).
[[nodiscard]] Result<UniqueIdBytes> UnpickleNcclUniqueId(std::string_view pickled);

}  // namespace rc::effects::nccl
