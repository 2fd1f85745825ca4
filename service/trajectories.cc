#include "service/trajectories.h"

#include <pthread.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

#include <spdlog/spdlog.h>

#include "statemachine/text.h"

namespace rc::service {
namespace {

// Every byte of `data` to `fd`, or as many as went before an error.
std::size_t WriteBytes(int fd, std::string_view data) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  RC_CHECK(done <= data.size());
  return done;
}

// True when the file at `path`, `size` bytes long, ends inside a line (an earlier process was cut
// off mid-write): the next line must start on a fresh one.
bool EndsInsideLine(const std::string& path, std::uint64_t size) {
  if (size == 0) return false;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char last = '\n';
  const bool read = ::pread(fd, &last, 1, static_cast<off_t>(size - 1)) == 1;
  ::close(fd);
  return read && last != '\n';
}

// The file itself, written by the writer thread alone (Open runs before it starts). It has one
// writer, this log: its size is known without asking, and a failed write can be cut back off.
class LineFile {
 public:
  LineFile() = default;
  ~LineFile() { CloseFd(); }
  LineFile(const LineFile&) = delete;
  LineFile& operator=(const LineFile&) = delete;

  Status Open(const std::string& path, std::uint64_t bytes_max);
  // Appends `line` (ending in '\n'); false when it is not in the file whole.
  bool Write(const std::string& line);
  // Appends `lines` (each ending in '\n'), in one write when no rotation falls inside them;
  // returns how many are in the file whole. Once `stop` is set, no further write starts.
  std::size_t WriteLines(const std::vector<std::string>& lines, const std::atomic<bool>& stop);

 private:
  bool OpenFd();
  void CloseFd();
  void Resync();
  void Rotate();
  bool StartOnFreshLine();
  void CutBack(std::size_t partial_bytes);
  std::size_t WriteEach(const std::vector<std::string>& lines, std::size_t from,
                        const std::atomic<bool>& stop);

  int fd_ = -1;
  std::string path_;
  std::uint64_t bytes_max_ = 0;
  // The file's size. It ends on a line boundary unless fragment_open_: a failed write left part
  // of a line that could not be cut off, and the next write begins with its newline.
  std::uint64_t bytes_ = 0;
  bool fragment_open_ = false;
};

Status LineFile::Open(const std::string& path, std::uint64_t bytes_max) {
  path_ = path;
  bytes_max_ = bytes_max;
  if (OpenFd()) return Status::OK();
  return Status::IOError("cannot open trajectories file '" + text::escape_line(path) +
                         "': " + std::strerror(errno));
}

bool LineFile::OpenFd() {
  RC_CHECK(fd_ < 0);
  // Non-blocking only to open: a FIFO without a reader fails with ENXIO instead of blocking the
  // opening thread (serve's start, or the writer) for ever; writes block as on any file.
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0666);
  if (fd_ < 0) return false;
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) < 0) {
    const int saved = errno;
    CloseFd();
    errno = saved;
    return false;
  }
  struct stat st {};
  const bool stated = ::fstat(fd_, &st) == 0;
  bytes_ = stated ? static_cast<std::uint64_t>(st.st_size) : 0;
  fragment_open_ = stated && S_ISREG(st.st_mode) && EndsInsideLine(path_, bytes_);
  return true;
}

void LineFile::CloseFd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void LineFile::Rotate() {
  CloseFd();
  std::rename(path_.c_str(), (path_ + ".1").c_str());
  OpenFd();  // on failure every line is dropped until an open succeeds
}

bool LineFile::Write(const std::string& line) {
  RC_CHECK(!line.empty() && line.back() == '\n');
  if (fd_ >= 0 && bytes_max_ > 0 && bytes_ > 0 && bytes_ + line.size() > bytes_max_) Rotate();
  if (fd_ < 0 && !OpenFd()) return false;
  if (fragment_open_ && !StartOnFreshLine()) return false;
  const std::size_t done = WriteBytes(fd_, line);
  if (done == line.size()) {
    bytes_ += done;
    return true;
  }
  CutBack(done);
  return false;
}

// The file as it is now, once per batch: an operator may have truncated it (logrotate's
// copytruncate: a size kept from before would rotate early, and a cut-back would extend the file
// with zeros) or moved it away (the lines would follow it). A new file at the path is opened.
void LineFile::Resync() {
  if (fd_ < 0) return;
  struct stat at_fd {};
  struct stat at_path {};
  if (::fstat(fd_, &at_fd) != 0) return;
  if (::stat(path_.c_str(), &at_path) != 0 || at_path.st_ino != at_fd.st_ino ||
      at_path.st_dev != at_fd.st_dev) {
    CloseFd();
    OpenFd();  // on failure, the next batch tries again
    return;
  }
  const auto size = static_cast<std::uint64_t>(at_fd.st_size);
  if (!S_ISREG(at_fd.st_mode) || size == bytes_) return;
  bytes_ = size;
  fragment_open_ = EndsInsideLine(path_, size);
}

std::size_t LineFile::WriteLines(const std::vector<std::string>& lines,
                                 const std::atomic<bool>& stop) {
  Resync();
  std::size_t total = 0;
  for (const std::string& line : lines) total += line.size();
  const bool crosses_bound = bytes_max_ > 0 && bytes_ + total > bytes_max_;
  // One write per line where a rotation may fall between two, or where the open or the
  // fragment's newline failed (each line tries them again, as it would alone).
  if (crosses_bound || lines.size() == 1 || (fd_ < 0 && !OpenFd()) ||
      (fragment_open_ && !StartOnFreshLine())) {
    return WriteEach(lines, 0, stop);
  }
  if (stop.load()) return 0;
  std::string joined;
  joined.reserve(total);
  for (const std::string& line : lines) joined += line;
  const std::size_t done = WriteBytes(fd_, joined);
  std::size_t whole = 0, whole_bytes = 0;
  while (whole < lines.size() && whole_bytes + lines[whole].size() <= done) {
    whole_bytes += lines[whole++].size();
  }
  bytes_ += whole_bytes;
  if (whole == lines.size()) return whole;
  CutBack(done - whole_bytes);  // the line the write failed inside is dropped
  return whole + WriteEach(lines, whole + 1, stop);
}

// Lines from `from` on, one write each (a rotation may fall between any two); how many went in.
std::size_t LineFile::WriteEach(const std::vector<std::string>& lines, std::size_t from,
                                const std::atomic<bool>& stop) {
  std::size_t written = 0;
  for (std::size_t i = from; i < lines.size() && !stop.load(); ++i) {
    written += Write(lines[i]) ? 1 : 0;
  }
  return written;
}

// Ends the fragment a failed write left as a line of its own (audit reports it alone).
bool LineFile::StartOnFreshLine() {
  if (WriteBytes(fd_, "\n") != 1) return false;
  bytes_ += 1;
  fragment_open_ = false;
  return true;
}

// A write that failed after `partial_bytes`: cut them off the file, or, when it cannot be cut (a
// FIFO, a filesystem refusing), let the next write begin with the fragment's newline.
void LineFile::CutBack(std::size_t partial_bytes) {
  if (partial_bytes == 0) return;
  if (::ftruncate(fd_, static_cast<off_t>(bytes_)) == 0) return;
  bytes_ += partial_bytes;
  fragment_open_ = true;
}

}  // namespace

struct TrajectoryLog::Shared {
  TrajectoryQueueLimits limits;
  LineFile file;  // the writer thread's alone once it runs

  std::mutex mu;                 // everything below; never held across a write
  std::condition_variable wake;  // a line queued while the writer sleeps, a batch full, stopping
  std::condition_variable idle;  // a write finished
  std::deque<std::string> queue;
  std::uint64_t queued_bytes = 0;
  std::size_t in_flight_lines = 0;  // taken by the writer, not yet written or dropped
  bool writer_sleeping = false;     // waiting for a first line: Append wakes it
  bool stopping = false;   // nothing more is queued; the writer ends once the queue is empty
  bool abandoned = false;  // Close stopped waiting; it emptied the queue and counted the rest
  std::atomic<bool> stop_writing{false};  // set with abandoned: the writer starts no more writes
  std::uint64_t written = 0;
  std::uint64_t dropped = 0;
};

namespace {

using Shared = TrajectoryLog::Shared;

// One write carries the lines queued within kBatchLingerMs of the first (wake-ups and writes per
// line were a tenth of the proxy's CPU), up to kBatchBytes unless one line alone is larger.
constexpr std::uint64_t kBatchLingerMs = 2;
constexpr std::uint64_t kBatchBytes = std::uint64_t{1} << 20;

bool Idle(const Shared& s) { return s.queue.empty() && s.in_flight_lines == 0; }

// Enough queued to write now: a full batch, or half of what the queue may hold (a small queue
// must not drop lines while the writer lingers).
bool BatchReady(const Shared& s) {
  return s.queued_bytes >= std::min(kBatchBytes, s.limits.bytes_max / 2) ||
         s.queue.size() >= s.limits.lines_max / 2;
}

// Sleeps until a line is queued, then lingers until the batch is full, or stopping.
void WaitForBatch(Shared& s, std::unique_lock<std::mutex>& lock) {
  s.writer_sleeping = true;
  s.wake.wait(lock, [&s] { return s.stopping || !s.queue.empty(); });
  s.writer_sleeping = false;
  s.wake.wait_for(lock, std::chrono::milliseconds(kBatchLingerMs),
                  [&s] { return s.stopping || BatchReady(s); });
}

// The next lines to write, oldest first; empty once stopping with nothing queued.
std::vector<std::string> NextBatch(Shared& s) {
  std::unique_lock<std::mutex> lock(s.mu);
  WaitForBatch(s, lock);
  std::vector<std::string> batch;
  std::uint64_t bytes = 0;
  while (!s.queue.empty() && (batch.empty() || bytes + s.queue.front().size() <= kBatchBytes)) {
    bytes += s.queue.front().size();
    batch.push_back(std::move(s.queue.front()));
    s.queue.pop_front();
  }
  s.queued_bytes -= bytes;
  s.in_flight_lines = batch.size();
  return batch;
}

void FinishBatch(Shared& s, std::size_t lines, std::size_t written) {
  RC_CHECK(written <= lines);
  std::lock_guard<std::mutex> lock(s.mu);
  RC_CHECK(s.in_flight_lines == lines || s.abandoned);
  s.in_flight_lines = 0;
  // Once abandoned, Close has counted these lines as dropped.
  if (!s.abandoned) {
    s.written += written;
    s.dropped += lines - written;
  }
  s.idle.notify_all();
}

// The writer thread. It holds its own reference: a writer stuck past Close's deadline outlives
// the log and ends after its write.
void WriterLoop(std::shared_ptr<Shared> s) {
  pthread_setname_np(pthread_self(), "rc-trajectory");
  for (;;) {
    std::vector<std::string> batch = NextBatch(*s);
    if (batch.empty()) return;
    const std::size_t written = s->file.WriteLines(batch, s->stop_writing);
    const std::size_t lines = batch.size();
    batch = {};  // freed before the lock is taken again
    FinishBatch(*s, lines, written);
  }
}

// Drops what the writer has not written (the queue and its write in flight); under s.mu.
std::uint64_t Abandon(Shared& s) {
  const std::uint64_t lost = s.queue.size() + s.in_flight_lines;
  s.queue.clear();
  s.queued_bytes = 0;
  s.abandoned = true;
  s.stop_writing.store(true);
  s.dropped += lost;
  return lost;
}

}  // namespace

TrajectoryLog::~TrajectoryLog() { Close(); }

Status TrajectoryLog::Open(const std::string& path, std::uint64_t bytes_max,
                           TrajectoryQueueLimits limits, const effects::ThreadStarter& starter) {
  RC_CHECK(shared_ == nullptr && !writer_.joinable());
  RC_CHECK(limits.lines_max > 0 && limits.bytes_max > 0);
  auto s = std::make_shared<Shared>();
  s->limits = limits;
  RC_RETURN_IF_ERROR(s->file.Open(path, bytes_max));
  // Kept only once the writer runs: a log whose writer was refused queues nothing it never writes.
  Result<std::thread> writer = effects::StartThread(
      "the trajectories writer thread", [s] { WriterLoop(s); }, starter);
  if (!writer.ok()) return writer.status();
  shared_ = std::move(s);
  path_ = path;
  writer_ = std::move(writer).value();
  RC_CHECK(shared_ != nullptr && writer_.joinable());
  return Status::OK();
}

bool TrajectoryLog::Append(std::string text) {
  RC_CHECK(text.find('\n') == std::string::npos);  // one record, one line
  if (shared_ == nullptr) return false;
  Shared& s = *shared_;
  const bool fits_a_line = text.size() + 1 <= kTrajectoryLineBytesMax;
  if (fits_a_line) text.push_back('\n');
  std::lock_guard<std::mutex> lock(s.mu);
  const bool room =
      s.queue.size() < s.limits.lines_max && s.queued_bytes + text.size() <= s.limits.bytes_max;
  if (!fits_a_line || !room || s.stopping) {
    ++s.dropped;
    return false;
  }
  s.queued_bytes += text.size();
  s.queue.push_back(std::move(text));
  if (s.writer_sleeping || BatchReady(s)) s.wake.notify_one();
  RC_CHECK(s.queue.size() <= s.limits.lines_max && s.queued_bytes <= s.limits.bytes_max);
  return true;
}

bool TrajectoryLog::Drain(std::uint64_t timeout_ms) {
  if (shared_ == nullptr) return true;
  Shared& s = *shared_;
  std::unique_lock<std::mutex> lock(s.mu);
  return s.idle.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&s] { return Idle(s); });
}

std::uint64_t TrajectoryLog::Close(std::uint64_t drain_timeout_ms) {
  if (!writer_.joinable()) return 0;
  Shared& s = *shared_;
  std::unique_lock<std::mutex> lock(s.mu);
  s.stopping = true;
  s.wake.notify_all();
  const bool drained =
      s.idle.wait_for(lock, std::chrono::milliseconds(drain_timeout_ms), [&s] { return Idle(s); });
  const std::uint64_t lost = drained ? 0 : Abandon(s);
  lock.unlock();
  if (drained) {
    writer_.join();
  } else {
    writer_.detach();  // stuck in a write; it holds `s` and ends after that write
    spdlog::warn(
        "trajectories: the writer did not finish within {} ms; {} line(s) not written to {}",
        drain_timeout_ms, lost, text::escape_line(path_));
  }
  return lost;
}

TrajectoryLogStats TrajectoryLog::stats() const {
  if (shared_ == nullptr) return {};
  Shared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mu);
  return {s.written, s.dropped, s.queue.size(), s.queued_bytes, s.in_flight_lines > 0};
}

}  // namespace rc::service
