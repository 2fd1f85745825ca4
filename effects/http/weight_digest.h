// The engine's weight digest, read through the worker extension's `rc_weight_digest` RPC
// (python/rolloutcore/vllm_ext.py): each worker digests the parameters it holds, on its GPU.
//
// One worker: its tensors and combined digest as they are. Several (tensor or pipeline
// parallel): tensor names get an "r<rank>/" prefix and the combined digest is the SHA-256 of the
// workers' "<rank> <combined>" lines in rank order. When the tensors would not fit one journal
// record (kTensorDigestsMax entries, kDigestTensorBytesMax bytes of names and digests), each
// worker is named by one entry "r<rank>" holding its combined digest instead: a failed check
// then names the worker, not the tensor. The verdict always rests on the combined digest.
#pragma once

#include <cstddef>

#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "statemachine/types.h"

namespace rc::effects {

inline constexpr char kWeightDigestMethod[] = "rc_weight_digest";
inline constexpr std::size_t kDigestTensorBytesMax = 40 * 1024;

// The digest the engine computes now; absent (with `error` saying why) when the engine has no
// worker extension, an older one, or a worker failed.
WeightDigest ReadWeightDigest(EngineClient& client);

// Pure: the RPC's 2xx body {"results": [one object per worker]} -> the digest. Anything
// malformed gives an absent digest whose `error` says what (never an exception).
WeightDigest ParseWeightDigestReply(const nlohmann::json& body);

}  // namespace rc::effects
