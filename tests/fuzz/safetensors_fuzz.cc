// Proves that the safetensors header parser accepts only an index whose tensors tile the file's
// data section exactly (sorted, no gap, no overlap, sizes matching dtype x shape, inside the file)
// and that an accepted header re-serialised parses to the same index; catches an offset, overflow
// or bounds slip that would let the NCCL sender read outside the file or send a wrong layout.
//
// Input: one byte that picks how much data follows the header (the file size the parser is told),
// then the file's first bytes (u64le header length, JSON header).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "effects/nccl/weight_source.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

namespace nccl = rc::effects::nccl;

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

// The header an accepted index describes, written back in the format's own form.
std::string reserialise(const nccl::SafetensorsIndex& index, std::uint64_t data_start) {
  nlohmann::json h = nlohmann::json::object();
  if (!index.metadata.empty()) h["__metadata__"] = index.metadata;
  for (std::size_t i = 0; i < index.manifest.tensors.size(); ++i) {
    const rc::effects::TensorSpec& t = index.manifest.tensors[i];
    const std::uint64_t begin = index.file_offsets[i] - data_start;
    h[t.name] = {{"dtype", rc::effects::dtype_safetensors_name(t.dtype)},
                 {"shape", t.shape},
                 {"data_offsets", {begin, begin + t.nbytes()}}};
  }
  return h.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::string prefix(reinterpret_cast<const char*>(data + 1), size - 1);
  // The file is the prefix plus `extra` data bytes (the parser never reads them); a few values
  // near the prefix's own end reach the "header runs past the end" and "truncated" paths.
  static const std::uint64_t kExtra[] = {0, 0, 0, 1, 2, 4, 8, 16, 64, 256, 4096, 1u << 20};
  std::uint64_t file_bytes = prefix.size() + kExtra[data[0] % 12];
  if (data[0] >= 0xF0)
    file_bytes = prefix.size() - std::min<std::size_t>(prefix.size(), data[0] & 0x0F);

  rc::Result<nccl::SafetensorsIndex> r = nccl::ParseSafetensorsHeader(prefix, file_bytes);
  if (!r.ok()) {
    FUZZ_CHECK(r.status().code() == rc::Code::kInvalidArgument);
    FUZZ_CHECK(r.status().message().rfind("safetensors: ", 0) == 0);
    return 0;
  }
  const nccl::SafetensorsIndex& index = *r;
  FUZZ_CHECK(prefix.size() >= 8);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i)
    header_len = (header_len << 8) | static_cast<std::uint8_t>(prefix[i]);
  const std::uint64_t data_start = 8 + header_len;
  FUZZ_CHECK(index.file_bytes == file_bytes && data_start <= file_bytes);
  FUZZ_CHECK(index.file_offsets.size() == index.manifest.tensors.size());
  FUZZ_CHECK(index.manifest.Validate().ok());
  // The tensors tile [data_start, file_bytes) in order.
  std::uint64_t cursor = data_start;
  for (std::size_t i = 0; i < index.file_offsets.size(); ++i) {
    FUZZ_CHECK(index.file_offsets[i] == cursor);
    const std::uint64_t n = index.manifest.tensors[i].nbytes();
    FUZZ_CHECK(n <= file_bytes - cursor);
    cursor += n;
  }
  FUZZ_CHECK(cursor == file_bytes);
  FUZZ_CHECK(index.manifest.total_bytes() == file_bytes - data_start);

  // Round trip: the index written back as a header parses to the same index.
  const std::string header = reserialise(index, data_start);
  const std::string again_prefix = le64(header.size()) + header;
  const std::uint64_t again_bytes = again_prefix.size() + (file_bytes - data_start);
  rc::Result<nccl::SafetensorsIndex> again =
      nccl::ParseSafetensorsHeader(again_prefix, again_bytes);
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->manifest.tensors == index.manifest.tensors);
  FUZZ_CHECK(again->metadata == index.metadata);
  FUZZ_CHECK(again->manifest.digest() == index.manifest.digest());
  return 0;
}
