#include "service/trajectories.h"

#include <sys/stat.h>

#include <cstdio>

namespace rc::service {

TrajectoryLog::~TrajectoryLog() { Close(); }

Status TrajectoryLog::Open(const std::string& path, std::uint64_t bytes_max) {
  std::lock_guard<std::mutex> lock(mu_);
  RC_CHECK(file_ == nullptr);
  file_ = std::fopen(path.c_str(), "ab");
  if (file_ == nullptr) return Status::IOError("cannot open trajectories file '" + path + "'");
  struct stat st {};
  bytes_ = ::stat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
  path_ = path;
  bytes_max_ = bytes_max;
  return Status::OK();
}

bool TrajectoryLog::Append(std::string text) {
  RC_CHECK(text.find('\n') == std::string::npos);  // one record, one line
  if (text.size() + 1 > kTrajectoryLineBytesMax) return false;
  text.push_back('\n');
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr) return false;
  if (bytes_max_ > 0 && bytes_ + text.size() > bytes_max_ && bytes_ > 0) {
    std::fclose(file_);
    std::rename(path_.c_str(), (path_ + ".1").c_str());
    file_ = std::fopen(path_.c_str(), "ab");
    bytes_ = 0;
    if (file_ == nullptr) return false;
  }
  if (std::fwrite(text.data(), 1, text.size(), file_) != text.size()) return false;
  if (std::fflush(file_) != 0) return false;
  bytes_ += text.size();
  RC_CHECK(text.size() <= kTrajectoryLineBytesMax && bytes_ >= text.size());
  return true;
}

void TrajectoryLog::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ != nullptr) std::fclose(file_);
  file_ = nullptr;
}

}  // namespace rc::service
