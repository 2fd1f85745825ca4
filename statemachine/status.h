// Status and Result<T>: LevelDB-style error values. No exceptions in journal and fold code.
//
// A Status is either OK or carries a code and a human-readable message. Result<T> carries a T
// or a non-OK Status. Both are [[nodiscard]]: a dropped error is a compile warning (-Werror).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <variant>

namespace rc {

// Assertions that stay on in release builds (TigerStyle): an invariant violation is a programmer
// error and the only safe reaction is to stop.
[[noreturn]] inline void assert_fail(const char* expr, const char* file, int line) {
  std::fprintf(stderr, "rolloutcore: invariant violated: %s (%s:%d)\n", expr, file, line);
  std::abort();
}

#define RC_CHECK(expr) ((expr) ? (void)0 : ::rc::assert_fail(#expr, __FILE__, __LINE__))

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,  // Bad input from a caller; nothing changed.
  kRejected = 2,  // A legal input refused by the lifecycle rules (e.g. admit while DRAINING).
  kConflict = 3,  // Expected-seq or idempotency-key conflict.
  kNotFound = 4,
  kCorruption = 5,  // Stored bytes fail a check (hash chain, verifier, unknown type).
  kIOError = 6,
  kBusy = 7,  // Resource held elsewhere (journal open by another process).
  kTimeout = 8,
  kUnavailable = 9,  // Peer unreachable.
  kInternal = 10,
};

inline const char* code_name(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kInvalidArgument:
      return "InvalidArgument";
    case Code::kRejected:
      return "Rejected";
    case Code::kConflict:
      return "Conflict";
    case Code::kNotFound:
      return "NotFound";
    case Code::kCorruption:
      return "Corruption";
    case Code::kIOError:
      return "IOError";
    case Code::kBusy:
      return "Busy";
    case Code::kTimeout:
      return "Timeout";
    case Code::kUnavailable:
      return "Unavailable";
    case Code::kInternal:
      return "Internal";
  }
  return "Unknown";
}

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
  static Status Rejected(std::string m) { return {Code::kRejected, std::move(m)}; }
  static Status Conflict(std::string m) { return {Code::kConflict, std::move(m)}; }
  static Status NotFound(std::string m) { return {Code::kNotFound, std::move(m)}; }
  static Status Corruption(std::string m) { return {Code::kCorruption, std::move(m)}; }
  static Status IOError(std::string m) { return {Code::kIOError, std::move(m)}; }
  static Status Busy(std::string m) { return {Code::kBusy, std::move(m)}; }
  static Status Timeout(std::string m) { return {Code::kTimeout, std::move(m)}; }
  static Status Unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
  static Status Internal(std::string m) { return {Code::kInternal, std::move(m)}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const {
    if (ok()) return "OK";
    return std::string(code_name(code_)) + ": " + message_;
  }
  // Explicitly discards a status whose failure is already handled some other way.
  void IgnoreError() const {}

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design.
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    RC_CHECK(!std::get<Status>(v_).ok());
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    RC_CHECK(ok());
    return std::get<T>(v_);
  }
  const T& value() const& {
    RC_CHECK(ok());
    return std::get<T>(v_);
  }
  T&& value() && {
    RC_CHECK(ok());
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

#define RC_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::rc::Status rc_status_ = (expr);        \
    if (!rc_status_.ok()) return rc_status_; \
  } while (0)

}  // namespace rc
