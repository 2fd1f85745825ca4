#include "effects/nccl/weight_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <numeric>
#include <nlohmann/json.hpp>

#include "effects/clock.h"
#include "effects/http/response_parsers.h"
#include "effects/http/sequence_transfer.h"
#include "encoding/base64.h"
#include "statemachine/text.h"

namespace rc::effects::nccl {
namespace {

using json = nlohmann::json;

bool ReadU64(const json& j, std::uint64_t* out) {
  if (!j.is_number_unsigned()) return false;
  *out = j.get<std::uint64_t>();
  return true;
}

// Error messages about a file's content name a tensor by its position, never by its name or any
// value read from the file: the manifest route computes manifests of paths a caller names, and an
// error must not become a way to read a file's bytes (the first 8 of any file used to come back
// as a "header length").
std::string Nth(const char* what, std::size_t i) {
  return std::string(what) + " #" + std::to_string(i);
}

Status ReadShape(const json& j, const std::string& who, std::vector<std::uint64_t>* shape) {
  if (!j.is_array() || j.size() > kTensorRankMax) {
    return Status::InvalidArgument(
        who + ": shape must be an array of rank <= " + std::to_string(kTensorRankMax));
  }
  for (const auto& d : j) {
    std::uint64_t v = 0;
    if (!ReadU64(d, &v)) {
      return Status::InvalidArgument(who + ": shape holds a non-integer or negative");
    }
    shape->push_back(v);
  }
  return Status::OK();
}

// Reads exactly `bytes` at `offset`. Bounded: every pass either makes progress or returns, and
// interrupted calls are retried at most kEintrRetriesMax times in a row. The descriptor is a
// regular file (OpenRegularFile), so no pread here waits for a writer. The deadline is checked
// before every chunk: a read of many chunks ends within one chunk's read of it.
constexpr int kEintrRetriesMax = 64;
constexpr std::uint64_t kReadChunkBytesMax = 64u << 20;

Status ReadExact(int fd, std::uint64_t offset, void* dst, std::uint64_t bytes,
                 SteadyTime deadline = SteadyTime::max()) {
  RC_CHECK(fd >= 0 && (dst != nullptr || bytes == 0));
  auto* p = static_cast<char*>(dst);
  int interrupted = 0;
  while (bytes > 0) {
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::Timeout("read passed its deadline with " + std::to_string(bytes) +
                             " bytes left");
    }
    const std::size_t want = static_cast<std::size_t>(std::min(bytes, kReadChunkBytesMax));
    const ssize_t got = ::pread(fd, p, want, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR && ++interrupted <= kEintrRetriesMax) continue;
    if (got < 0) return Status::IOError(std::string("pread: ") + std::strerror(errno));
    if (got == 0) return Status::IOError("file truncated while reading");
    interrupted = 0;
    p += got;
    offset += static_cast<std::uint64_t>(got);
    bytes -= static_cast<std::uint64_t>(got);
  }
  return Status::OK();
}

// Opens `path` read-only as a regular file. O_NONBLOCK keeps open() of a FIFO from waiting
// forever for a writer; anything but a regular file (FIFO, socket, device, directory) is refused
// before a read could block on it. `st` receives the descriptor's fstat.
Result<int> OpenRegularFile(const std::string& path, struct stat* st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return Status::IOError("open " + path + ": " + std::strerror(errno));
  if (::fstat(fd, st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::IOError("fstat " + path + ": " + std::strerror(err));
  }
  if (!S_ISREG(st->st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + ": not a regular file");
  }
  return fd;
}

// The u64 little-endian at the start of `bytes` (at least 8 of them).
std::uint64_t LittleEndian64(const std::string& bytes) {
  RC_CHECK(bytes.size() >= 8);
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<std::uint8_t>(bytes[i]);
  return v;
}

// `what` of the file at `path` (escaped: one line), as a refusal names it; `path` "" when the
// bytes came from memory.
std::string InFile(const std::string& path, const std::string& what) {
  return path.empty() ? what : "'" + text::escape_line(path) + "': " + what;
}

Result<SafetensorsIndex> ParseHeaderOf(const std::string& prefix, std::uint64_t file_bytes,
                                       const std::string& path);

// The index of the safetensors file at `path`, open on `fd` (`file_bytes` from its fstat).
Result<SafetensorsIndex> ReadIndexFromFd(int fd, std::uint64_t file_bytes,
                                         const std::string& path) {
  std::string prefix(std::min<std::uint64_t>(file_bytes, 8), '\0');
  RC_RETURN_IF_ERROR(ReadExact(fd, 0, prefix.data(), prefix.size()));
  if (prefix.size() == 8) {
    const std::uint64_t header_len = LittleEndian64(prefix);
    // Bounded before the allocation: the format's limit and the file's size.
    if (header_len <= kSafetensorsHeaderBytesMax && header_len <= file_bytes - 8) {
      prefix.resize(8 + header_len);
      RC_RETURN_IF_ERROR(ReadExact(fd, 8, prefix.data() + 8, header_len));
    }
  }
  return ParseHeaderOf(prefix, file_bytes, path);
}

}  // namespace

Result<std::string> ReadSmallFile(const std::string& path, std::uint64_t max_bytes) {
  struct stat st {};
  Result<int> fd = OpenRegularFile(path, &st);
  if (!fd.ok()) return fd.status();
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes) {
    ::close(*fd);
    return Status::InvalidArgument(path + ": " + std::to_string(size) + " bytes, over the " +
                                   std::to_string(max_bytes) + "-byte bound");
  }
  std::string text(static_cast<std::size_t>(size), '\0');
  Status s = ReadExact(*fd, 0, text.data(), text.size());
  ::close(*fd);
  if (!s.ok()) return s;
  RC_CHECK(text.size() <= max_bytes);
  return text;
}

namespace {

// A tensor's header entry, kept until the byte ranges are checked against each other.
struct HeaderEntry {
  TensorSpec spec;
  std::uint64_t begin = 0, end = 0;  // relative to the data section
  std::string who;
};

// The header's length, checked against the format's limit, the file and the bytes at hand.
Result<std::uint64_t> ReadHeaderLength(const std::string& prefix, std::uint64_t file_bytes) {
  if (file_bytes < 8 || prefix.size() < 8) {
    return Status::InvalidArgument("safetensors: file shorter than the 8-byte header length");
  }
  const std::uint64_t header_len = LittleEndian64(prefix);
  // The length's value is the file's first 8 bytes: never echoed (see Nth).
  if (header_len > kSafetensorsHeaderBytesMax) {
    return Status::InvalidArgument("safetensors: header length exceeds " +
                                   std::to_string(kSafetensorsHeaderBytesMax) +
                                   " (not a safetensors file?)");
  }
  if (header_len > file_bytes - 8) {
    return Status::InvalidArgument("safetensors: header length runs past the end of a " +
                                   std::to_string(file_bytes) + "-byte file (truncated?)");
  }
  if (prefix.size() < 8 + header_len) {
    return Status::InvalidArgument("safetensors: header not fully read");
  }
  return header_len;
}

Status ReadMetadata(const json& j, std::map<std::string, std::string>* metadata) {
  if (!j.is_object()) return Status::InvalidArgument("safetensors: __metadata__ not an object");
  for (auto m = j.begin(); m != j.end(); ++m) {
    if (!m->is_string()) return Status::InvalidArgument("safetensors: metadata value not a string");
    (*metadata)[m.key()] = m->get<std::string>();
  }
  return Status::OK();
}

Status ReadDataOffsets(const json& off, std::uint64_t data_bytes, HeaderEntry* e) {
  if (!off.is_array() || off.size() != 2 || !ReadU64(off[0], &e->begin) ||
      !ReadU64(off[1], &e->end) || e->begin > e->end) {
    return Status::InvalidArgument(e->who + ": data_offsets must be [begin<=end]");
  }
  if (e->end > data_bytes) {
    return Status::InvalidArgument(e->who + ": data_offsets end beyond the data section (" +
                                   std::to_string(data_bytes) + " bytes; truncated?)");
  }
  return Status::OK();
}

// One tensor's entry: dtype, shape and a byte range inside the data section.
Result<HeaderEntry> ReadTensorEntry(const std::string& name, const json& t, std::string who,
                                    std::uint64_t data_bytes) {
  if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
      !t.contains("data_offsets")) {
    return Status::InvalidArgument(who + " lacks dtype, shape or data_offsets");
  }
  if (!t["dtype"].is_string()) return Status::InvalidArgument(who + ": dtype not a string");
  auto dtype = dtype_from_safetensors_name(t["dtype"].get<std::string>());
  if (!dtype.ok()) return Status::InvalidArgument(who + ": unsupported dtype");
  HeaderEntry e;
  e.spec.name = name;
  e.spec.dtype = *dtype;
  e.who = std::move(who);
  RC_RETURN_IF_ERROR(ReadShape(t["shape"], e.who, &e.spec.shape));
  RC_RETURN_IF_ERROR(ReadDataOffsets(t["data_offsets"], data_bytes, &e));
  RC_CHECK(e.begin <= e.end && e.end <= data_bytes);
  return e;
}

// Every tensor entry of the header, in the header's order; "__metadata__" goes to `metadata`.
Status ReadEntries(const json& header, std::uint64_t data_bytes,
                   std::map<std::string, std::string>* metadata,
                   std::vector<HeaderEntry>* entries) {
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    std::string who = "safetensors: " + Nth("tensor", entries->size());
    if (name == "__metadata__") {
      RC_RETURN_IF_ERROR(ReadMetadata(*it, metadata));
      continue;
    }
    if (entries->size() >= kTensorsMax)
      return Status::InvalidArgument("safetensors: too many tensors");
    Result<HeaderEntry> e = ReadTensorEntry(name, *it, std::move(who), data_bytes);
    if (!e.ok()) return e.status();
    entries->push_back(std::move(*e));
  }
  return Status::OK();
}

// Sorted by offset, the ranges must tile the data section: no gap, no overlap, nothing left over.
// Moves each entry's spec into the index, in that order.
Status PlaceEntries(std::vector<HeaderEntry>* entries, std::uint64_t data_start,
                    std::uint64_t data_bytes, SafetensorsIndex* index) {
  // Ties (zero-size tensors at one offset) are broken by name, so the order, and with it the
  // manifest digest, is one function of the header whatever the sort's implementation.
  std::sort(entries->begin(), entries->end(), [](const HeaderEntry& a, const HeaderEntry& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.spec.name < b.spec.name;
  });
  std::uint64_t cursor = 0;
  for (auto& e : *entries) {
    if (e.begin != cursor) {
      return Status::InvalidArgument(e.who +
                                     ": data does not start where the previous tensor's ends" +
                                     (e.begin < cursor ? " (overlap)" : " (gap)"));
    }
    cursor = e.end;
    index->file_offsets.push_back(data_start + e.begin);
    index->manifest.tensors.push_back(std::move(e.spec));
  }
  if (cursor != data_bytes) {
    return Status::InvalidArgument(
        "safetensors: tensors do not cover the data section (the file "
        "holds " +
        std::to_string(data_bytes) + " data bytes)");
  }
  return Status::OK();
}

// Validate() bounds the shapes first, so nbytes() cannot overflow here.
Status CheckRangeSizes(const std::vector<HeaderEntry>& entries, const Manifest& manifest) {
  RC_CHECK(entries.size() == manifest.tensors.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto& spec = manifest.tensors[i];
    if (entries[i].end - entries[i].begin != spec.nbytes()) {
      return Status::InvalidArgument(entries[i].who +
                                     ": byte range does not match its dtype and shape");
    }
  }
  return Status::OK();
}

// True when the tensors, in order, tile [data_start, file_bytes) exactly.
bool TilesDataSection(const SafetensorsIndex& index, std::uint64_t data_start) {
  if (index.file_offsets.size() != index.manifest.tensors.size()) return false;
  std::uint64_t cursor = data_start;
  for (std::size_t i = 0; i < index.file_offsets.size(); ++i) {
    if (index.file_offsets[i] != cursor) return false;
    cursor += index.manifest.tensors[i].nbytes();
  }
  return cursor == index.file_bytes;
}

// The header is bounded in bytes (kSafetensorsHeaderBytesMax) and, before it is parsed, in the
// tree it makes (kFileJsonTreeBytesMax): a refusal names the file at `path` and the bound.
Result<SafetensorsIndex> ParseHeaderOf(const std::string& prefix, std::uint64_t file_bytes,
                                       const std::string& path) {
  Result<std::uint64_t> header_len = ReadHeaderLength(prefix, file_bytes);
  if (!header_len.ok()) return header_len.status();
  const std::string_view text = std::string_view(prefix).substr(8, *header_len);
  RC_RETURN_IF_ERROR(check_file_json_tree(text, InFile(path, "safetensors: the header")));
  const json header = parse_outside_json(text);
  if (header.is_discarded() || !header.is_object()) {
    return Status::InvalidArgument("safetensors: header is not a JSON object");
  }
  SafetensorsIndex index;
  index.file_bytes = file_bytes;
  const std::uint64_t data_start = 8 + *header_len;
  const std::uint64_t data_bytes = file_bytes - data_start;
  std::vector<HeaderEntry> entries;
  RC_RETURN_IF_ERROR(ReadEntries(header, data_bytes, &index.metadata, &entries));
  RC_RETURN_IF_ERROR(PlaceEntries(&entries, data_start, data_bytes, &index));
  if (Status s = index.manifest.Validate(); !s.ok())
    return Status::InvalidArgument("safetensors: " + s.message());
  RC_RETURN_IF_ERROR(CheckRangeSizes(entries, index.manifest));
  RC_CHECK(TilesDataSection(index, data_start));
  return index;
}

}  // namespace

Result<SafetensorsIndex> ParseSafetensorsHeader(const std::string& prefix,
                                                std::uint64_t file_bytes) {
  return ParseHeaderOf(prefix, file_bytes, "");
}

Result<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path) {
  struct stat st {};
  Result<int> fd = OpenRegularFile(path, &st);
  if (!fd.ok()) return fd.status();
  Result<SafetensorsIndex> index =
      ReadIndexFromFd(*fd, static_cast<std::uint64_t>(st.st_size), path);
  ::close(*fd);
  return index;
}

Result<std::unique_ptr<SafetensorsSource>> SafetensorsSource::Open(const std::string& path) {
  // One open(): the index and every later ReadHost use this descriptor, so a rename onto `path`
  // at any point cannot pair one file's index with another file's bytes.
  struct stat st {};
  Result<int> fd = OpenRegularFile(path, &st);
  if (!fd.ok()) return fd.status();
  Result<SafetensorsIndex> index =
      ReadIndexFromFd(*fd, static_cast<std::uint64_t>(st.st_size), path);
  if (!index.ok()) {
    ::close(*fd);
    return index.status();
  }
  return std::unique_ptr<SafetensorsSource>(new SafetensorsSource(*fd, std::move(*index)));
}

SafetensorsSource::~SafetensorsSource() {
  if (fd_ >= 0) ::close(fd_);
}

Status SafetensorsSource::ReadHost(std::size_t i, void* dst, SteadyTime deadline) const {
  RC_CHECK(i < index_.manifest.tensors.size());
  return ReadExact(fd_, index_.file_offsets[i], dst, index_.manifest.tensors[i].nbytes(), deadline);
}

namespace {

// The document's envelope: an object of version 1 whose "tensors" is an array within bounds.
Status CheckIpcEnvelope(const json& doc) {
  if (doc.is_discarded() || !doc.is_object())
    return Status::InvalidArgument("ipc file: not a JSON object");
  if (!doc.contains("version") || doc["version"] != 1)
    return Status::InvalidArgument("ipc file: version must be 1");
  if (!doc.contains("tensors") || !doc["tensors"].is_array()) {
    return Status::InvalidArgument("ipc file: 'tensors' must be an array");
  }
  if (doc["tensors"].size() > kTensorsMax)
    return Status::InvalidArgument("ipc file: too many tensors");
  return Status::OK();
}

// An entry is an object holding every field, with the scalar fields typed.
Status CheckIpcFields(const json& t, const std::string& who) {
  if (!t.is_object()) return Status::InvalidArgument(who + ": entry not an object");
  for (const char* k :
       {"name", "dtype", "shape", "ipc_handle_b64", "allocation_bytes", "offset", "device"}) {
    if (!t.contains(k))
      return Status::InvalidArgument(std::string("ipc file: entry lacks '") + k + "'");
  }
  if (!t["name"].is_string() || !t["dtype"].is_string() || !t["ipc_handle_b64"].is_string() ||
      !t["device"].is_number_integer()) {
    return Status::InvalidArgument(
        "ipc file: name/dtype/ipc_handle_b64 must be strings, device an integer");
  }
  return Status::OK();
}

Result<TensorSpec> ReadIpcSpec(const json& t, const std::string& who) {
  TensorSpec spec;
  spec.name = t["name"].get<std::string>();
  auto dtype = dtype_from_torch_name(t["dtype"].get<std::string>());
  if (!dtype.ok()) return Status::InvalidArgument(who + ": unsupported dtype");
  spec.dtype = *dtype;
  RC_RETURN_IF_ERROR(ReadShape(t["shape"], who, &spec.shape));
  return spec;
}

Result<IpcTensorRef> ReadIpcRef(const json& t, const std::string& who) {
  IpcTensorRef ref;
  if (!ReadU64(t["allocation_bytes"], &ref.allocation_bytes) ||
      !ReadU64(t["offset"], &ref.offset)) {
    return Status::InvalidArgument(who + ": offset/allocation_bytes not unsigned");
  }
  const std::string& b64 = t["ipc_handle_b64"].get_ref<const std::string&>();
  if (b64.size() > 128) return Status::InvalidArgument("ipc file: handle text too long");
  auto handle = encoding::Base64Decode(b64);
  if (!handle.ok() || handle->size() != kCudaIpcHandleBytes) {
    return Status::InvalidArgument(who + ": handle is not base64 of 64 bytes");
  }
  ref.handle = std::move(*handle);
  return ref;
}

// A CUDA device ordinal: a JSON integer in [0, INT_MAX], checked as the integer it is before it
// becomes an int (get<int>() of 4294967296 would silently be device 0).
bool ReadDeviceOrdinal(const json& v, int* out) {
  if (!v.is_number_integer()) return false;
  const bool in_range = v.is_number_unsigned()
                            ? v.get<std::uint64_t>() <= static_cast<std::uint64_t>(INT_MAX)
                            : v.get<std::int64_t>() >= 0 && v.get<std::int64_t>() <= INT_MAX;
  if (in_range) *out = static_cast<int>(v.get<std::int64_t>());
  return in_range;
}

// Every tensor lives on one device: the first entry's (`first`), which the others must match.
Status ReadIpcDevice(const json& t, bool first, int* device) {
  int d = 0;
  if (!ReadDeviceOrdinal(t["device"], &d)) {
    return Status::InvalidArgument("ipc file: device must be an integer in [0, " +
                                   std::to_string(INT_MAX) + "]");
  }
  if (!first && d != *device)
    return Status::InvalidArgument("ipc file: tensors on several devices");
  *device = d;
  return Status::OK();
}

// Appends one entry's tensor and reference to `out`.
Status ReadIpcEntry(const json& t, IpcHandleFile* out) {
  const std::string who = "ipc file: " + Nth("tensor", out->refs.size());
  RC_RETURN_IF_ERROR(CheckIpcFields(t, who));
  Result<TensorSpec> spec = ReadIpcSpec(t, who);
  if (!spec.ok()) return spec.status();
  Result<IpcTensorRef> ref = ReadIpcRef(t, who);
  if (!ref.ok()) return ref.status();
  RC_RETURN_IF_ERROR(ReadIpcDevice(t, out->refs.empty(), &out->device));
  out->manifest.tensors.push_back(std::move(*spec));
  out->refs.push_back(std::move(*ref));
  RC_CHECK(out->refs.size() == out->manifest.tensors.size() &&
           out->refs.back().handle.size() == kCudaIpcHandleBytes);
  return Status::OK();
}

// Validate() bounds the shapes first, so nbytes() cannot overflow here.
Status CheckWithinAllocations(const IpcHandleFile& file) {
  RC_CHECK(file.refs.size() == file.manifest.tensors.size());
  for (std::size_t i = 0; i < file.refs.size(); ++i) {
    const auto& r = file.refs[i];
    const std::uint64_t n = file.manifest.tensors[i].nbytes();
    if (r.offset > r.allocation_bytes || n > r.allocation_bytes - r.offset) {
      return Status::InvalidArgument("ipc file: " + Nth("tensor", i) +
                                     " lies outside its allocation");
    }
  }
  return Status::OK();
}

// The file's text is bounded in bytes (kIpcFileBytesMax) and, before it is parsed, in the tree
// it makes (kFileJsonTreeBytesMax): a refusal names the file at `path` and the bound.
Result<IpcHandleFile> ParseIpcFileOf(const std::string& json_text, const std::string& path) {
  RC_RETURN_IF_ERROR(check_file_json_tree(json_text, InFile(path, "ipc file")));
  const json doc = parse_outside_json(json_text);
  RC_RETURN_IF_ERROR(CheckIpcEnvelope(doc));
  IpcHandleFile out;
  for (const auto& t : doc["tensors"]) RC_RETURN_IF_ERROR(ReadIpcEntry(t, &out));
  if (Status s = out.manifest.Validate(); !s.ok())
    return Status::InvalidArgument("ipc file: " + s.message());
  RC_RETURN_IF_ERROR(CheckWithinAllocations(out));
  return out;
}

}  // namespace

Result<IpcHandleFile> ParseIpcHandleFile(const std::string& json_text) {
  return ParseIpcFileOf(json_text, "");
}

Result<IpcHandleFile> ReadIpcHandleFile(const std::string& path) {
  auto text = ReadSmallFile(path, kIpcFileBytesMax);
  if (!text.ok()) return text.status();
  return ParseIpcFileOf(*text, path);
}

// ---- source URIs ----

namespace {

constexpr std::string_view kSyntheticScheme = "synthetic:";
constexpr std::string_view kSafetensorsScheme = "safetensors:";
constexpr std::string_view kIpcScheme = "ipc:";
constexpr std::size_t kPathBytesMax = 4095;  // PATH_MAX less its NUL

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

Status ValidatePath(std::string_view path) {
  if (path.empty() || path.front() != '/') {
    return Status::InvalidArgument("source path must be absolute");
  }
  if (path.size() > kPathBytesMax) return Status::InvalidArgument("source path too long");
  if (path.size() > 1 && path.back() == '/') {
    return Status::InvalidArgument("source path must name a file (trailing '/')");
  }
  for (std::size_t begin = 1; begin <= path.size();) {
    const std::size_t end = std::min(path.find('/', begin), path.size());
    const std::string_view part = path.substr(begin, end - begin);
    if (part.empty() || part == "." || part == "..") {
      return Status::InvalidArgument(
          "source path must be normal (no empty, '.' or '..' component)");
    }
    begin = end + 1;
  }
  return Status::OK();
}

}  // namespace

Status ValidateSourceUri(const std::string& uri) {
  if (uri.size() > kSourceUriBytesMax) {
    return Status::InvalidArgument("source longer than " + std::to_string(kSourceUriBytesMax) +
                                   " bytes");
  }
  if (!text::printable_utf8(uri)) {
    return Status::InvalidArgument("source must be UTF-8 without control characters");
  }
  if (StartsWith(uri, kSyntheticScheme)) {
    Result<Manifest> m = synthetic_manifest(uri);
    return m.ok() ? Status::OK() : m.status();
  }
  if (StartsWith(uri, kSafetensorsScheme)) {
    return ValidatePath(std::string_view(uri).substr(kSafetensorsScheme.size()));
  }
  if (StartsWith(uri, kIpcScheme))
    return ValidatePath(std::string_view(uri).substr(kIpcScheme.size()));
  return Status::InvalidArgument("source must start with synthetic:, safetensors: or ipc:");
}

Result<std::string> SourceManifestDigest(const std::string& uri) {
  RC_RETURN_IF_ERROR(ValidateSourceUri(uri));
  if (StartsWith(uri, kSyntheticScheme)) {
    Result<Manifest> m = synthetic_manifest(uri);
    if (!m.ok()) return m.status();
    return m->digest();
  }
  if (StartsWith(uri, kSafetensorsScheme)) {
    Result<SafetensorsIndex> index = ReadSafetensorsIndex(uri.substr(kSafetensorsScheme.size()));
    if (!index.ok()) return index.status();
    return index->manifest.digest();
  }
  Result<IpcHandleFile> file = ReadIpcHandleFile(uri.substr(kIpcScheme.size()));
  if (!file.ok()) return file.status();
  return file->manifest.digest();
}

// ---- SourceCache ----

SourceCache::SourceCache(Opener opener, std::size_t entries_max)
    : opener_(std::move(opener)), entries_max_(std::max<std::size_t>(entries_max, 1)) {}

Result<std::shared_ptr<WeightSource>> SourceCache::Get(const std::string& uri) {
  if (auto it = pinned_.find(uri); it != pinned_.end()) return it->second;
  const auto colon = uri.find(':');
  const std::string path = colon == std::string::npos ? uri : uri.substr(colon + 1);
  struct stat st {};
  const bool stat_ok = ::stat(path.c_str(), &st) == 0;
  const FileId id{static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino),
                  static_cast<std::uint64_t>(st.st_size),
                  static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
  auto it =
      std::find_if(files_.begin(), files_.end(), [&](const Entry& e) { return e.uri == uri; });
  const bool cached = it != files_.end();
  if (cached && stat_ok && it->id == id) {
    std::rotate(it, it + 1, files_.end());  // most recently used last
    return files_.back().source;
  }
  if (cached) {
    files_.erase(it);  // the file changed (or vanished): never reuse the old descriptor
    ++reopens_;
  }
  Result<std::shared_ptr<WeightSource>> opened = opener_(uri);
  if (!opened.ok()) return opened.status();
  if (stat_ok) {
    if (files_.size() >= entries_max_) files_.erase(files_.begin());
    files_.push_back(Entry{uri, id, *opened});
    RC_CHECK(files_.size() <= entries_max_);
  }
  return opened;
}

void SourceCache::Register(const std::string& uri, std::shared_ptr<WeightSource> source) {
  std::erase_if(files_, [&](const Entry& e) { return e.uri == uri; });
  pinned_[uri] = std::move(source);
}

void SourceCache::Clear() {
  pinned_.clear();
  files_.clear();
}

}  // namespace rc::effects::nccl
