// Where the bytes of a transfer come from. A source exposes its manifest (transfer order) and
// either device pointers (CUDA IPC from a trainer on this host, or buffers the caller owns) or
// host reads (a safetensors file, staged through pinned host memory by the sender).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "effects/manifest.h"
#include "statemachine/status.h"

namespace rc::effects::nccl {

class WeightSource {
 public:
  enum class Where : std::uint8_t { kHost, kDevice };
  virtual ~WeightSource() = default;
  virtual const Manifest& manifest() const = 0;
  virtual Where where() const = 0;
  // kDevice only: the CUDA device holding the tensors and tensor i's first byte there.
  virtual int device() const { return -1; }
  virtual const void* device_ptr(std::size_t /*i*/) const { return nullptr; }
  // kHost only: copies tensor i's nbytes() bytes into dst. The read goes in bounded chunks and
  // stops with Timeout once `deadline` has passed between two of them, so one large tensor cannot
  // hold its caller far past the deadline.
  [[nodiscard]] virtual Status ReadHost(std::size_t /*i*/, void* /*dst*/,
                                        std::chrono::steady_clock::time_point /*deadline*/) const {
    return Status::Internal("source has no host bytes");
  }
  // The same without a deadline.
  [[nodiscard]] Status ReadHost(std::size_t i, void* dst) const {
    return ReadHost(i, dst, std::chrono::steady_clock::time_point::max());
  }
};

// Device buffers owned by the caller (tests, benchmarks, an in-process trainer).
class DevicePointerSource final : public WeightSource {
 public:
  DevicePointerSource(Manifest manifest, std::vector<const void*> ptrs, int device)
      : manifest_(std::move(manifest)), ptrs_(std::move(ptrs)), device_(device) {
    RC_CHECK(ptrs_.size() == manifest_.tensors.size());
  }
  const Manifest& manifest() const override { return manifest_; }
  Where where() const override { return Where::kDevice; }
  int device() const override { return device_; }
  const void* device_ptr(std::size_t i) const override { return ptrs_.at(i); }

 private:
  Manifest manifest_;
  std::vector<const void*> ptrs_;
  int device_;
};

// ---- safetensors ----
//
// File := u64le header_len | header_len bytes of JSON | data
// JSON := { "__metadata__"?: {str: str}, name: {"dtype": str, "shape": [u64...],
//           "data_offsets": [begin, end]} ... }     offsets relative to the data section
// Accepted only if: 8 <= file, header_len <= kSafetensorsHeaderBytesMax and fits the file; the
// JSON parses to an object; dtypes are known; end - begin == numel * itemsize; the byte ranges,
// sorted, start at 0, touch each other (no gap, no overlap) and end exactly at the file's end.
inline constexpr std::uint64_t kSafetensorsHeaderBytesMax = 100u << 20;  // the format's own limit

struct SafetensorsIndex {
  Manifest manifest;                        // in data-offset order (the transfer order)
  std::vector<std::uint64_t> file_offsets;  // absolute offset of each tensor's first byte
  std::uint64_t file_bytes = 0;
  std::map<std::string, std::string> metadata;
};

// `prefix` holds the file's first bytes (at least 8 + header_len of them to succeed).
[[nodiscard]] Result<SafetensorsIndex> ParseSafetensorsHeader(const std::string& prefix,
                                                              std::uint64_t file_bytes);
[[nodiscard]] Result<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path);

class SafetensorsSource final : public WeightSource {
 public:
  [[nodiscard]] static Result<std::unique_ptr<SafetensorsSource>> Open(const std::string& path);
  ~SafetensorsSource() override;
  const Manifest& manifest() const override { return index_.manifest; }
  Where where() const override { return Where::kHost; }
  using WeightSource::ReadHost;
  [[nodiscard]] Status ReadHost(std::size_t i, void* dst,
                                std::chrono::steady_clock::time_point deadline) const override;

 private:
  SafetensorsSource(int fd, SafetensorsIndex index) : fd_(fd), index_(std::move(index)) {}
  int fd_ = -1;
  SafetensorsIndex index_;
};

// The whole of the regular file at `path`, at most `max_bytes` of it. One open, which does not
// wait for a FIFO's writer (O_NONBLOCK), and the opened descriptor must be a regular file, so a
// FIFO, socket or device at the path (swapped in at any moment) is refused, never read; a size
// over `max_bytes` is refused before reading. Errors name the path and sizes, never the content.
[[nodiscard]] Result<std::string> ReadSmallFile(const std::string& path, std::uint64_t max_bytes);

// ---- CUDA IPC handle file (written by a trainer process on this host; we only read) ----
//
// {"version": 1, "tensors": [{"name": str, "dtype": torch name, "shape": [u64...],
//   "ipc_handle_b64": base64 of the 64-byte cudaIpcMemHandle_t, "allocation_bytes": u64,
//   "offset": u64 (bytes into the allocation), "device": int}, ...]}
// Checked: every field present and typed, handle decodes to 64 bytes, offset + nbytes within
// allocation_bytes, one device for all tensors, manifest valid. Order = transfer order.
inline constexpr std::size_t kCudaIpcHandleBytes = 64;
inline constexpr std::uint64_t kIpcFileBytesMax = 256u << 20;

struct IpcTensorRef {
  std::string handle;  // 64 raw bytes
  std::uint64_t allocation_bytes = 0;
  std::uint64_t offset = 0;
};
struct IpcHandleFile {
  Manifest manifest;
  std::vector<IpcTensorRef> refs;
  int device = 0;
};
[[nodiscard]] Result<IpcHandleFile> ParseIpcHandleFile(const std::string& json_text);
[[nodiscard]] Result<IpcHandleFile> ReadIpcHandleFile(const std::string& path);

// ---- source URIs, checked before anything touches the engine ----
//
// uri := "synthetic:" N "x" DIM [":" SEED]      (bounds of effects/http/sequence_transfer.h)
//      | "safetensors:" PATH | "ipc:" PATH
// PATH is absolute and normal: it starts with "/", has no empty, "." or ".." component and no
// trailing "/". The whole URI is printable UTF-8 (no control bytes) of at most
// kSourceUriBytesMax bytes.
inline constexpr std::size_t kSourceUriBytesMax = 4096;

// Syntax and bounds only: no file is opened. InvalidArgument names what is wrong.
[[nodiscard]] Status ValidateSourceUri(const std::string& uri);

// The manifest digest of the source behind `uri`, computed without any engine call: the synthetic
// spec, the safetensors header (the file's data is not read) or the IPC handle file (not mapped).
// InvalidArgument for a bad URI or a malformed file, IOError/NotFound-like IOError when it cannot
// be read. Error messages never quote the file's content (only its path and size).
[[nodiscard]] Result<std::string> SourceManifestDigest(const std::string& uri);

// ---- opened sources, by URI ----
//
// A trainer typically updates from the same path again and again ("safetensors:/ckpt/latest"
// rewritten or renamed over each step). An opened source keeps its file descriptor (or its IPC
// mappings), so reusing it after the file changed would send the OLD bytes under the new
// identity. The cache therefore stats the file behind "scheme:PATH" on every Get and reopens when
// the device, inode, size or mtime differ. File-backed entries are bounded (least recently used
// evicted; a transfer still holding one keeps it alive). Registered sources (tests, benchmarks,
// an in-process trainer) are pinned: never stat'ed, reopened or evicted.
inline constexpr std::size_t kSourceCacheEntriesMax = 4;

class SourceCache {
 public:
  using Opener = std::function<Result<std::shared_ptr<WeightSource>>(const std::string& uri)>;
  explicit SourceCache(Opener opener, std::size_t entries_max = kSourceCacheEntriesMax);
  // The source for `uri`: pinned, or cached and unchanged on disk, or freshly opened.
  [[nodiscard]] Result<std::shared_ptr<WeightSource>> Get(const std::string& uri);
  void Register(const std::string& uri, std::shared_ptr<WeightSource> source);
  void Clear();
  std::size_t file_entries() const { return files_.size(); }
  std::uint64_t reopens() const { return reopens_; }  // opens of a URI already cached (tests)

 private:
  struct FileId {
    std::uint64_t dev = 0, ino = 0, size = 0;
    std::int64_t mtime_ns = 0;
    bool operator==(const FileId&) const = default;
  };
  struct Entry {
    std::string uri;
    FileId id;
    std::shared_ptr<WeightSource> source;
  };
  Opener opener_;
  std::size_t entries_max_;
  std::map<std::string, std::shared_ptr<WeightSource>> pinned_;
  std::vector<Entry> files_;  // most recently used last
  std::uint64_t reopens_ = 0;
};

}  // namespace rc::effects::nccl
