// Bytes that many holders share under one bound: the request and response bodies every
// connection and proxied exchange hold at once. Each bounds its own body too; this bounds their
// sum, so a few thousand large requests cannot take the host's memory between them.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

#include "statemachine/status.h"

namespace rc::service {

class ByteBudget {
 public:
  explicit ByteBudget(std::uint64_t bytes_max) : max_(bytes_max) { RC_CHECK(max_ > 0); }
  ByteBudget(const ByteBudget&) = delete;
  ByteBudget& operator=(const ByteBudget&) = delete;

  // Takes n bytes, or nothing (false) when they would pass the bound.
  [[nodiscard]] bool Take(std::uint64_t n) {
    std::uint64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (used > max_ || n > max_ - used) return false;  // past it only through TakePastBound
    } while (!used_.compare_exchange_weak(used, used + n, std::memory_order_relaxed));
    return true;
  }
  // Takes n bytes even past the bound, for what cannot be refused any more (the answer of a
  // request whose effects already ran): Take refuses everyone else until enough is given back.
  void TakePastBound(std::uint64_t n) { used_.fetch_add(n, std::memory_order_relaxed); }
  void Give(std::uint64_t n) {
    const std::uint64_t before = used_.fetch_sub(n, std::memory_order_relaxed);
    RC_CHECK(before >= n);  // never more than was taken
  }
  std::uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  std::uint64_t max() const { return max_; }

 private:
  const std::uint64_t max_;
  std::atomic<std::uint64_t> used_{0};
};

// What one holder took from a budget; all of it goes back when the hold is released or dies.
// Moving a hold hands what it holds over (no operation on the budget): the bytes it stands for
// change hands with it, as an answer handed to the connection that writes it.
class BudgetHold {
 public:
  BudgetHold() = default;
  explicit BudgetHold(ByteBudget* budget) : budget_(budget) {}
  BudgetHold(const BudgetHold&) = delete;
  BudgetHold& operator=(const BudgetHold&) = delete;
  BudgetHold(BudgetHold&& other) noexcept
      : budget_(other.budget_), held_(std::exchange(other.held_, 0)) {}
  BudgetHold& operator=(BudgetHold&& other) noexcept {
    if (this == &other) return *this;
    Release();
    budget_ = other.budget_;
    held_ = std::exchange(other.held_, 0);
    return *this;
  }
  ~BudgetHold() { Release(); }

  // Takes n more bytes; false (holding what it held) when the budget cannot give them.
  [[nodiscard]] bool Grow(std::uint64_t n) {
    RC_CHECK(budget_ != nullptr);
    if (!budget_->Take(n)) return false;
    held_ += n;
    return true;
  }
  // Takes n more bytes even past the budget's bound (ByteBudget::TakePastBound).
  void GrowPastBound(std::uint64_t n) {
    RC_CHECK(budget_ != nullptr);
    budget_->TakePastBound(n);
    held_ += n;
  }
  // Gives back what it holds beyond n bytes.
  void ShrinkTo(std::uint64_t n) {
    if (budget_ == nullptr || n >= held_) return;
    budget_->Give(held_ - n);
    held_ = n;
  }
  // Holds exactly n bytes: gives back the excess, or takes what is missing; false (holding what
  // it held) when the budget cannot give that.
  [[nodiscard]] bool ResizeTo(std::uint64_t n) {
    if (n <= held_) {
      ShrinkTo(n);
      return true;
    }
    return Grow(n - held_);
  }
  void Release() {
    if (budget_ != nullptr && held_ > 0) budget_->Give(held_);
    held_ = 0;
  }
  std::uint64_t held() const { return held_; }

 private:
  ByteBudget* budget_ = nullptr;
  std::uint64_t held_ = 0;
};

}  // namespace rc::service
