// The engine's weight digest, read through the worker extension's `rc_weight_digest` RPC
// (python/rolloutcore/vllm_ext.py): each worker digests the parameters it holds, on its GPU.
//
// One worker: its tensors and combined digest as they are. Several (tensor or pipeline
// parallel): tensor names get an "r<rank>/" prefix and the combined digest is the SHA-256 of the
// workers' "<rank> <combined>" lines in rank order. When the tensors would not fit one journal
// record (kTensorDigestsMax entries, kDigestTensorBytesMax bytes as encoded), each worker is
// named by one entry "r<rank>" holding its combined digest instead: a failed check then names
// the worker, not the tensor. When those do not fit either, the digest names no tensor. The
// verdict always rests on the combined digest.
#pragma once

#include <cstddef>

#include <nlohmann/json.hpp>

#include "effects/http/engine_client.h"
#include "journal/journal.h"
#include "statemachine/types.h"

namespace rc::effects {

inline constexpr char kWeightDigestMethod[] = "rc_weight_digest";

// What one TensorDigest adds to an encoded record beyond its name's and digest's bytes: its
// offset in the vector (4), its table (the vtable offset and two string offsets: 12; the vtable
// itself is shared by every entry) and, per string, a length prefix, a NUL and up to 3 bytes of
// padding (8 each). Exact when both lengths are multiples of 4, an upper bound otherwise.
inline constexpr std::size_t kTensorDigestEntryOverheadBytes = 4 + 12 + 2 * 8;
// The tensors one digest names, as encoded: names, digests and kTensorDigestEntryOverheadBytes
// per entry; content alone understates it (1024 names "t0000".. with 32-hex digests: 37 KiB of
// content, 68 KiB encoded).
inline constexpr std::size_t kDigestTensorBytesMax = 36 * 1024;
// What else a record carrying a digest holds, each field at the fold's bound: EngineProbed's
// (the event with the most) five texts (http.error, engine_version, reported_label,
// engine_instance, label_before), the digest's error, algorithm and combined digest, the record's
// engine name, and the framing of record, event, evidence and digest (tables, vtables, scalars,
// length prefixes, the 32-byte prev_hash), well under kDigestRecordFramingBytesMax.
inline constexpr std::size_t kDigestRecordFramingBytesMax = 1024;
inline constexpr std::size_t kDigestRecordOtherBytesMax =
    6 * kTextBytesMax + 2 * kIdBytesMax + kDigestBytesMax + kDigestRecordFramingBytesMax;
static_assert(kDigestTensorBytesMax + kDigestRecordOtherBytesMax <= journal::kRecordBytesMax,
              "every digest the parser accepts must fit a journal record beside its event");

// How an absent digest's `error` begins when the read failed (a timeout, a dropped connection, a
// 5xx that is no "method not implemented"): the engine may compute one, it was not read. Any other
// absent digest says why the engine has none ("the engine computes no weight digest ...") or what
// was wrong with its answer. The fold reads neither (it reads a missing digest again within its
// attempts either way); the journal keeps the text for the operator.
inline constexpr char kDigestReadFailedPrefix[] = "the weight digest read failed";

// The digest the engine computes now, within `o`'s deadline; absent (with `error` saying why)
// when the read failed, the engine has no worker extension or an older one, or a worker failed.
WeightDigest ReadWeightDigest(EngineClient& client, const CallOptions& o = {});

// Pure: the RPC's 2xx body {"results": [one object per worker]} -> the digest. Anything
// malformed gives an absent digest whose `error` says what (never an exception).
WeightDigest ParseWeightDigestReply(const nlohmann::json& body);

}  // namespace rc::effects
