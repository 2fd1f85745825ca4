// FaultEnv: a FileSystemWrapper that tracks, per writable file, the bytes appended and the bytes
// known synced, fails or stalls operations on command, and runs a hook before a read (see
// fault_env.h).
#include "journal/testing/fault_env.h"

#include <rocksdb/file_system.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

// Returns the IOStatus of `expr` when it is not OK.
#define RC_RETURN_IF_ROCKS(expr)      \
  do {                                \
    rocksdb::IOStatus rc_s_ = (expr); \
    if (!rc_s_.ok()) return rc_s_;    \
  } while (0)

namespace rc::journal::testing {

FileKind KindOf(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (ends_with(".log")) return FileKind::kWal;
  if (ends_with(".sst")) return FileKind::kSst;
  if (name.rfind("MANIFEST-", 0) == 0) return FileKind::kManifest;
  return FileKind::kOther;
}

const char* KindName(FileKind kind) {
  switch (kind) {
    case FileKind::kWal:
      return "WAL";
    case FileKind::kSst:
      return "SST";
    case FileKind::kManifest:
      return "MANIFEST";
    case FileKind::kOther:
      return "file";
    case FileKind::kDirectory:
      return "directory";
  }
  return "file";
}

namespace {

constexpr std::size_t kKinds = 5;
constexpr std::size_t kOps = 2;

struct Injection {
  bool armed = false;
  Fault fault = Fault::kEio;
  std::uint32_t skip = 0;  // successful operations still allowed before the fault fires
};

struct FileState {
  std::uint64_t size = 0;    // bytes appended (handed to the base file system)
  std::uint64_t synced = 0;  // size at the last successful Sync/Fsync
};

}  // namespace

class FaultEnv::Fs final : public rocksdb::FileSystemWrapper {
 public:
  explicit Fs(const std::shared_ptr<rocksdb::FileSystem>& base) : FileSystemWrapper(base) {}
  static const char* kClassName() { return "RolloutCoreFaultFs"; }
  const char* Name() const override { return kClassName(); }

  // Non-OK when this operation must fail (crash state or an armed injection).
  rocksdb::IOStatus Check(const std::string& path, FileOp op) {
    return CheckKind(KindOf(path), path, op);
  }
  rocksdb::IOStatus CheckKind(FileKind kind, const std::string& path, FileOp op) {
    std::lock_guard<std::mutex> l(mu_);
    if (crashed_) return Fail(Fault::kEio, "crashed", path);
    Injection& in = injections_[static_cast<std::size_t>(kind)][static_cast<std::size_t>(op)];
    if (!in.armed) return rocksdb::IOStatus::OK();
    if (in.skip > 0) {
      --in.skip;
      return rocksdb::IOStatus::OK();
    }
    if (in.fault == Fault::kCrash) crashed_ = true;
    return Fail(in.fault, op == FileOp::kAppend ? "append" : "sync", path);
  }
  rocksdb::IOStatus CheckAlive(const std::string& path) {
    std::lock_guard<std::mutex> l(mu_);
    return crashed_ ? Fail(Fault::kEio, "crashed", path) : rocksdb::IOStatus::OK();
  }
  std::uint32_t StallMs(FileKind kind) {
    std::lock_guard<std::mutex> l(mu_);
    return stall_ms_[static_cast<std::size_t>(kind)];
  }
  void Appended(const std::string& path, std::uint64_t bytes) {
    std::lock_guard<std::mutex> l(mu_);
    files_[path].size += bytes;
  }
  void Synced(const std::string& path) {
    std::lock_guard<std::mutex> l(mu_);
    FileState& f = files_[path];
    f.synced = f.size;
  }
  void Truncated(const std::string& path, std::uint64_t size) {
    std::lock_guard<std::mutex> l(mu_);
    FileState& f = files_[path];
    f.size = std::min(f.size, size);
    f.synced = std::min(f.synced, size);
  }
  void Track(const std::string& path, std::uint64_t size) {
    std::lock_guard<std::mutex> l(mu_);
    files_[path] = FileState{size, size};
  }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus NewDirectory(const std::string& name, const rocksdb::IOOptions& o,
                                 std::unique_ptr<rocksdb::FSDirectory>* r,
                                 rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus NewSequentialFile(const std::string& f, const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSSequentialFile>* r,
                                      rocksdb::IODebugContext* dbg) override {
    TakeReadHook(f)();
    return target()->NewSequentialFile(f, o, r, dbg);
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old,
                                      const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* dbg) override {
    (void)f, (void)old, (void)o, (void)r, (void)dbg;
    return rocksdb::IOStatus::NotSupported("FaultEnv does not recycle files");
  }
  rocksdb::IOStatus DeleteFile(const std::string& f, const rocksdb::IOOptions& o,
                               rocksdb::IODebugContext* dbg) override {
    RC_RETURN_IF_ROCKS(CheckAlive(f));
    rocksdb::IOStatus s = target()->DeleteFile(f, o, dbg);
    if (s.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      files_.erase(f);
    }
    return s;
  }
  rocksdb::IOStatus RenameFile(const std::string& src, const std::string& dst,
                               const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    RC_RETURN_IF_ROCKS(CheckAlive(src));
    rocksdb::IOStatus s = target()->RenameFile(src, dst, o, dbg);
    if (s.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      auto it = files_.find(src);
      if (it != files_.end()) {
        files_[dst] = it->second;
        files_.erase(it);
      } else {
        files_.erase(dst);
      }
    }
    return s;
  }

  void Inject(FileKind kind, FileOp op, Fault fault, std::uint32_t skip) {
    std::lock_guard<std::mutex> l(mu_);
    injections_[static_cast<std::size_t>(kind)][static_cast<std::size_t>(op)] = {true, fault, skip};
  }
  void Stall(FileKind kind, std::uint32_t ms) {
    std::lock_guard<std::mutex> l(mu_);
    stall_ms_[static_cast<std::size_t>(kind)] = ms;
  }
  void Clear() {
    std::lock_guard<std::mutex> l(mu_);
    injections_ = {};
    stall_ms_ = {};
    read_hook_prefix_.clear();
    read_hook_ = nullptr;
    directory_hook_ = nullptr;
  }
  void SetReadHook(const std::string& prefix, std::function<void()> hook) {
    std::lock_guard<std::mutex> l(mu_);
    read_hook_prefix_ = prefix;
    read_hook_ = std::move(hook);
  }
  // The read hook, taken (it runs once) when `path`'s name starts with its prefix; else a no-op.
  std::function<void()> TakeReadHook(const std::string& path) {
    const std::size_t slash = path.find_last_of('/');
    const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
    std::lock_guard<std::mutex> l(mu_);
    if (!read_hook_ || name.rfind(read_hook_prefix_, 0) != 0) return [] {};
    return std::exchange(read_hook_, nullptr);
  }
  void SetDirectoryHook(std::function<void()> hook) {
    std::lock_guard<std::mutex> l(mu_);
    directory_hook_ = std::move(hook);
  }
  // The directory hook, taken (it runs once); a no-op when none is set.
  std::function<void()> TakeDirectoryHook() {
    std::lock_guard<std::mutex> l(mu_);
    if (!directory_hook_) return [] {};
    return std::exchange(directory_hook_, nullptr);
  }
  std::uint64_t failures() const {
    std::lock_guard<std::mutex> l(mu_);
    return failures_;
  }
  std::uint64_t Unsynced(FileKind kind) const {
    std::lock_guard<std::mutex> l(mu_);
    std::uint64_t total = 0;
    for (const auto& [path, f] : files_) {
      if (KindOf(path) == kind) total += f.size - f.synced;
    }
    return total;
  }
  void SetCrashed(bool crashed) {
    std::lock_guard<std::mutex> l(mu_);
    crashed_ = crashed;
  }
  rocksdb::Status Drop(Torn torn, std::uint64_t seed, std::uint64_t* kept_unsynced_bytes);

 private:
  rocksdb::IOStatus Fail(Fault fault, const char* what, const std::string& path) {  // requires mu_
    ++failures_;
    const std::string msg = std::string("fault injected: ") + what + " of " + path;
    return fault == Fault::kEnospc ? rocksdb::IOStatus::NoSpace(msg)
                                   : rocksdb::IOStatus::IOError(msg);
  }
  mutable std::mutex mu_;
  bool crashed_ = false;
  std::array<std::array<Injection, kOps>, kKinds> injections_{};
  std::array<std::uint32_t, kKinds> stall_ms_{};
  std::uint64_t failures_ = 0;
  std::map<std::string, FileState> files_;
  std::string read_hook_prefix_;
  std::function<void()> read_hook_;
  std::function<void()> directory_hook_;
};

namespace {

// A writable file whose appends and syncs pass through the fault checks and are tracked.
class FaultFile final : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  FaultFile(std::unique_ptr<rocksdb::FSWritableFile> base, std::string path, FaultEnv::Fs* fs)
      : FSWritableFileOwnerWrapper(std::move(base)), path_(std::move(path)), fs_(fs) {}

  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                           rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->Check(path_, FileOp::kAppend);
    if (s.ok()) s = target()->Append(data, o, dbg);
    if (s.ok()) fs_->Appended(path_, data.size());
    return s;
  }
  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                           const rocksdb::DataVerificationInfo& info,
                           rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->Check(path_, FileOp::kAppend);
    if (s.ok()) s = target()->Append(data, o, info, dbg);
    if (s.ok()) fs_->Appended(path_, data.size());
    return s;
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, std::uint64_t offset,
                                     const rocksdb::IOOptions& o,
                                     rocksdb::IODebugContext* dbg) override {
    (void)data, (void)offset, (void)o, (void)dbg;
    return rocksdb::IOStatus::NotSupported("FaultEnv: positioned appends are not tracked");
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, std::uint64_t offset,
                                     const rocksdb::IOOptions& o,
                                     const rocksdb::DataVerificationInfo& info,
                                     rocksdb::IODebugContext* dbg) override {
    (void)info;
    return PositionedAppend(data, offset, o, dbg);
  }
  rocksdb::IOStatus Truncate(std::uint64_t size, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = fs_->CheckAlive(path_);
    if (s.ok()) s = target()->Truncate(size, o, dbg);
    if (s.ok()) fs_->Truncated(path_, size);
    return s;
  }
  rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    return DoSync([&] { return target()->Sync(o, dbg); });
  }
  rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    return DoSync([&] { return target()->Fsync(o, dbg); });
  }
  // A range sync promises nothing about the file's end: it is not a sync point here.
  rocksdb::IOStatus RangeSync(std::uint64_t offset, std::uint64_t nbytes,
                              const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    RC_RETURN_IF_ROCKS(fs_->CheckAlive(path_));
    return target()->RangeSync(offset, nbytes, o, dbg);
  }
  bool IsSyncThreadSafe() const override { return false; }

 private:
  template <typename F>
  rocksdb::IOStatus DoSync(F sync) {
    const std::uint32_t stall_ms = fs_->StallMs(KindOf(path_));
    if (stall_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
    rocksdb::IOStatus s = fs_->Check(path_, FileOp::kSync);
    if (s.ok()) s = sync();
    if (s.ok()) fs_->Synced(path_);
    return s;
  }

  const std::string path_;
  FaultEnv::Fs* const fs_;
};

// A directory whose fsyncs pass through the fault checks of FileKind::kDirectory.
class FaultDirectory final : public rocksdb::FSDirectoryWrapper {
 public:
  FaultDirectory(std::unique_ptr<rocksdb::FSDirectory> base, std::string path, FaultEnv::Fs* fs)
      : FSDirectoryWrapper(std::move(base)), path_(std::move(path)), fs_(fs) {}

  rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    RC_RETURN_IF_ROCKS(Check());
    return FSDirectoryWrapper::Fsync(o, dbg);
  }
  rocksdb::IOStatus FsyncWithDirOptions(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg,
                                        const rocksdb::DirFsyncOptions& dir_o) override {
    RC_RETURN_IF_ROCKS(Check());
    return FSDirectoryWrapper::FsyncWithDirOptions(o, dbg, dir_o);
  }

 private:
  rocksdb::IOStatus Check() {
    const std::uint32_t stall_ms = fs_->StallMs(FileKind::kDirectory);
    if (stall_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
    return fs_->CheckKind(FileKind::kDirectory, path_, FileOp::kSync);
  }

  const std::string path_;
  FaultEnv::Fs* const fs_;
};

}  // namespace

rocksdb::IOStatus FaultEnv::Fs::NewDirectory(const std::string& name, const rocksdb::IOOptions& o,
                                             std::unique_ptr<rocksdb::FSDirectory>* r,
                                             rocksdb::IODebugContext* dbg) {
  TakeDirectoryHook()();
  std::unique_ptr<rocksdb::FSDirectory> base;
  RC_RETURN_IF_ROCKS(target()->NewDirectory(name, o, &base, dbg));
  *r = std::make_unique<FaultDirectory>(std::move(base), name, this);
  return rocksdb::IOStatus::OK();
}

rocksdb::IOStatus FaultEnv::Fs::NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                                std::unique_ptr<rocksdb::FSWritableFile>* r,
                                                rocksdb::IODebugContext* dbg) {
  RC_RETURN_IF_ROCKS(CheckAlive(f));
  std::unique_ptr<rocksdb::FSWritableFile> base;
  RC_RETURN_IF_ROCKS(target()->NewWritableFile(f, o, &base, dbg));
  Track(f, 0);
  *r = std::make_unique<FaultFile>(std::move(base), f, this);
  return rocksdb::IOStatus::OK();
}

rocksdb::IOStatus FaultEnv::Fs::ReopenWritableFile(const std::string& f,
                                                   const rocksdb::FileOptions& o,
                                                   std::unique_ptr<rocksdb::FSWritableFile>* r,
                                                   rocksdb::IODebugContext* dbg) {
  RC_RETURN_IF_ROCKS(CheckAlive(f));
  std::uint64_t size = 0;
  if (!target()->GetFileSize(f, rocksdb::IOOptions(), &size, dbg).ok()) size = 0;
  std::unique_ptr<rocksdb::FSWritableFile> base;
  RC_RETURN_IF_ROCKS(target()->ReopenWritableFile(f, o, &base, dbg));
  Track(f, size);  // what existed before is taken as durable
  *r = std::make_unique<FaultFile>(std::move(base), f, this);
  return rocksdb::IOStatus::OK();
}

rocksdb::Status FaultEnv::Fs::Drop(Torn torn, std::uint64_t seed,
                                   std::uint64_t* kept_unsynced_bytes) {
  std::map<std::string, FileState> files;
  {
    std::lock_guard<std::mutex> l(mu_);
    files = files_;
  }
  std::mt19937_64 rng(seed);
  if (kept_unsynced_bytes != nullptr) *kept_unsynced_bytes = 0;
  rocksdb::Status first;
  for (auto& [path, f] : files) {
    if (f.size == f.synced) continue;
    std::uint64_t keep = f.synced;
    if (torn == Torn::kRandomPrefix) keep += rng() % (f.size - f.synced + 1);
    if (kept_unsynced_bytes != nullptr) *kept_unsynced_bytes += keep - f.synced;
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus s =
        target()->ReopenWritableFile(path, rocksdb::FileOptions(), &file, nullptr);
    if (s.ok()) s = file->Truncate(keep, rocksdb::IOOptions(), nullptr);
    if (s.ok()) s = file->Close(rocksdb::IOOptions(), nullptr);
    if (!s.ok() && first.ok()) first = s;
    if (s.ok()) Track(path, keep);
  }
  return first;
}

FaultEnv::FaultEnv(rocksdb::Env* base) {
  if (base == nullptr) base = rocksdb::Env::Default();
  fs_ = std::make_shared<Fs>(base->GetFileSystem());
  env_ = rocksdb::NewCompositeEnv(fs_);
}

FaultEnv::~FaultEnv() = default;

void FaultEnv::Inject(FileKind kind, FileOp op, Fault fault, std::uint32_t skip) {
  fs_->Inject(kind, op, fault, skip);
}
void FaultEnv::StallSync(FileKind kind, std::uint32_t stall_ms) { fs_->Stall(kind, stall_ms); }
void FaultEnv::BeforeNextRead(const std::string& name_prefix, std::function<void()> hook) {
  fs_->SetReadHook(name_prefix, std::move(hook));
}
void FaultEnv::BeforeNextDirectory(std::function<void()> hook) {
  fs_->SetDirectoryHook(std::move(hook));
}
void FaultEnv::Clear() { fs_->Clear(); }
std::uint64_t FaultEnv::failures() const { return fs_->failures(); }
std::uint64_t FaultEnv::UnsyncedBytes(FileKind kind) const { return fs_->Unsynced(kind); }
void FaultEnv::Crash() { fs_->SetCrashed(true); }
rocksdb::Status FaultEnv::DropUnsyncedData(Torn torn, std::uint64_t seed,
                                           std::uint64_t* kept_unsynced_bytes) {
  return fs_->Drop(torn, seed, kept_unsynced_bytes);
}
void FaultEnv::Restart() {
  fs_->Clear();
  fs_->SetCrashed(false);
}

}  // namespace rc::journal::testing
