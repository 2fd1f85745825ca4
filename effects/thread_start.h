// StartThread: a new thread, or the error value of the system's refusal.
//
// std::thread's constructor throws std::system_error when the system refuses a thread
// (RLIMIT_NPROC, the kernel's pid and thread limits, no memory for a stack) and std::bad_alloc
// when its state cannot be allocated. Every thread the effects, service and cli layers start
// goes through StartThread, so that a refusal is a Status its caller returns: never an exception
// through code that promises a Status, nor std::terminate from a noexcept path or from a
// joinable std::thread destroyed while the exception unwinds. (journal/ sits below this layer
// and catches its own.)
#pragma once

#include <functional>
#include <new>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "statemachine/status.h"

namespace rc::effects {

// How a thread is started, `what` naming it as StartThread was given it: std::thread's
// constructor when empty. Tests give one that throws for chosen threads, as the constructor does
// when the system refuses one (a process running as root is not held to RLIMIT_NPROC).
using ThreadStarter = std::function<std::thread(std::string_view what, std::function<void()> body)>;

// Runs `body` on a new thread, got from `starter` (std::thread's constructor when empty).
// Unavailable "cannot start <what>: <reason>" when the thread was refused; `body` then never ran.
[[nodiscard]] inline Result<std::thread> StartThread(std::string_view what,
                                                     std::function<void()> body,
                                                     const ThreadStarter& starter = {}) {
  try {
    std::thread t = starter ? starter(what, std::move(body)) : std::thread(std::move(body));
    RC_CHECK(t.joinable());  // a starter returns a running thread or throws
    return Result<std::thread>(std::move(t));
  } catch (const std::system_error& e) {
    return Status::Unavailable("cannot start " + std::string(what) + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return Status::Unavailable("cannot start " + std::string(what) + ": out of memory");
  }
}

}  // namespace rc::effects
