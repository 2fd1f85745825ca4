#include "service/trajectories.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string_view>

#include <spdlog/spdlog.h>

#include "statemachine/text.h"

namespace rc::service {
namespace {

// Every byte of `data` to `fd`, or as many as went before an error.
std::size_t WriteAll(int fd, std::string_view data) {
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

 private:
  bool OpenFd();
  void CloseFd();
  void Rotate();
  bool StartOnFreshLine();
  void CutBack(std::size_t partial_bytes);

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
  return Status::IOError("cannot open trajectories file '" + path + "': " + std::strerror(errno));
}

bool LineFile::OpenFd() {
  RC_CHECK(fd_ < 0);
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
  if (fd_ < 0) return false;
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
  const std::size_t done = WriteAll(fd_, line);
  if (done == line.size()) {
    bytes_ += done;
    return true;
  }
  CutBack(done);
  return false;
}

// Ends the fragment a failed write left as a line of its own (audit reports it alone).
bool LineFile::StartOnFreshLine() {
  if (WriteAll(fd_, "\n") != 1) return false;
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
  std::condition_variable wake;  // a line queued, or stopping
  std::condition_variable idle;  // a write finished
  std::deque<std::string> queue;
  std::uint64_t queued_bytes = 0;
  bool in_flight = false;
  bool stopping = false;   // nothing more is queued; the writer ends once the queue is empty
  bool abandoned = false;  // Close stopped waiting; it emptied the queue and counted the rest
  std::uint64_t written = 0;
  std::uint64_t dropped = 0;
};

namespace {

using Shared = TrajectoryLog::Shared;

bool Idle(const Shared& s) { return s.queue.empty() && !s.in_flight; }

// The next line to write, or nullopt once stopping with nothing queued.
std::optional<std::string> NextLine(Shared& s) {
  std::unique_lock<std::mutex> lock(s.mu);
  s.wake.wait(lock, [&s] { return s.stopping || !s.queue.empty(); });
  if (s.queue.empty()) return std::nullopt;
  std::string line = std::move(s.queue.front());
  s.queue.pop_front();
  s.queued_bytes -= line.size();
  s.in_flight = true;
  return line;
}

void FinishLine(Shared& s, bool written) {
  std::lock_guard<std::mutex> lock(s.mu);
  s.in_flight = false;
  // Once abandoned, Close has counted this line as dropped.
  if (!s.abandoned) ++(written ? s.written : s.dropped);
  s.idle.notify_all();
}

// The writer thread. It holds its own reference: a writer stuck past Close's deadline outlives
// the log and ends after its write.
void WriterLoop(std::shared_ptr<Shared> s) {
  for (;;) {
    std::optional<std::string> line = NextLine(*s);
    if (!line) return;
    const bool written = s->file.Write(*line);
    line.reset();  // freed before the lock is taken again
    FinishLine(*s, written);
  }
}

// Drops what the writer has not written (the queue and its write in flight); under s.mu.
std::uint64_t Abandon(Shared& s) {
  const std::uint64_t lost = s.queue.size() + (s.in_flight ? 1 : 0);
  s.queue.clear();
  s.queued_bytes = 0;
  s.abandoned = true;
  s.dropped += lost;
  return lost;
}

}  // namespace

TrajectoryLog::~TrajectoryLog() { Close(); }

Status TrajectoryLog::Open(const std::string& path, std::uint64_t bytes_max,
                           TrajectoryQueueLimits limits) {
  RC_CHECK(shared_ == nullptr);
  RC_CHECK(limits.lines_max > 0 && limits.bytes_max > 0);
  auto s = std::make_shared<Shared>();
  s->limits = limits;
  RC_RETURN_IF_ERROR(s->file.Open(path, bytes_max));
  shared_ = std::move(s);
  path_ = path;
  writer_ = std::thread(WriterLoop, shared_);
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
  s.wake.notify_one();
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
  return {s.written, s.dropped, s.queue.size(), s.queued_bytes, s.in_flight};
}

}  // namespace rc::service
