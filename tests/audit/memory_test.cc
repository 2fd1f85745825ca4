// What the whole-journal audit holds in memory, measured on a real RocksDB journal: every
// allocation of this test binary is counted (the global operator new and delete below), so the
// peak while AuditJournal runs is what the audit held, whatever structure held it.
#include <gtest/gtest.h>
#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "audit/audit.h"
#include "journal/journal.h"
#include "statemachine/text.h"
#include "tests/journal/test_util.h"

namespace {

std::atomic<std::int64_t> g_live_bytes{0};
std::atomic<std::int64_t> g_peak_bytes{0};

// Never null: a test that cannot allocate aborts (no exception leaves operator new).
void* Allocate(std::size_t bytes) {
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) std::abort();
  const std::int64_t live =
      g_live_bytes.fetch_add(static_cast<std::int64_t>(malloc_usable_size(p))) +
      static_cast<std::int64_t>(malloc_usable_size(p));
  std::int64_t peak = g_peak_bytes.load();
  while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live)) {
  }
  return p;
}

void Release(void* p) {
  if (p == nullptr) return;
  g_live_bytes.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(p)));
  std::free(p);
}

}  // namespace

void* operator new(std::size_t bytes) { return Allocate(bytes); }
void* operator new[](std::size_t bytes) { return Allocate(bytes); }
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept { return Allocate(bytes); }
void* operator new[](std::size_t bytes, const std::nothrow_t&) noexcept { return Allocate(bytes); }
void operator delete(void* p) noexcept { Release(p); }
void operator delete[](void* p) noexcept { Release(p); }
void operator delete(void* p, std::size_t) noexcept { Release(p); }
void operator delete[](void* p, std::size_t) noexcept { Release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { Release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { Release(p); }

namespace rc {
namespace {

using journal::testing::TempDir;

void SubmitOk(journal::Journal& j, const Event& e) {
  auto s = j.Submit(e, 1700000000000);
  ASSERT_TRUE(s.ok()) << text::escape_line(s.status().ToString());
  ASSERT_TRUE(j.Wait(s->ticket).ok());
}

// Bootstrap (4 records), then `rollouts` rollouts, each admitted, given `parts` trajectory parts
// of kTrajectoryTokensPerRecordMax output tokens with their logprobs, and finished; closed
// cleanly. Returns the bytes the parts' tokens and logprobs take in memory.
std::size_t WriteTrajectoryJournal(const std::string& path, int rollouts, int parts) {
  journal::Options o;
  o.sync = false;  // the test measures the audit, not the disk
  auto j = journal::Journal::Open(path, o);
  EXPECT_TRUE(j.ok()) << j.status().ToString();
  if (!j.ok()) return 0;
  for (auto& g : journal::testing::BootstrapGroups()) {
    EXPECT_TRUE((*j)->Append(journal::testing::Group(g)).ok());
  }
  const std::vector<std::int32_t> tokens(kTrajectoryTokensPerRecordMax, 7);
  const std::vector<float> logprobs(kTrajectoryTokensPerRecordMax, -0.5f);
  for (int r = 0; r < rollouts; ++r) {
    const std::string id = "r" + std::to_string(r);
    SubmitOk(**j, make_admission((*j)->state(), id));
    for (int p = 0; p < parts; ++p) {
      SubmitOk(**j, TrajectoryRecorded{id, static_cast<std::uint32_t>(p), {}, tokens, logprobs});
    }
    SubmitOk(**j, RolloutFinished{id, RolloutOutcome::kCompleted, 0,
                                  static_cast<std::uint32_t>(parts * tokens.size())});
  }
  EXPECT_TRUE((*j)->Close().ok());
  return static_cast<std::size_t>(rollouts) * parts *
         (tokens.size() * sizeof(std::int32_t) + logprobs.size() * sizeof(float));
}

// Proves the whole-journal audit of a journal holding 64 MiB of trajectory tokens (2,048 parts of
// 4,096 tokens and logprobs) holds less than a quarter of that at its peak, and still finds the
// journal intact with every record counted; catches the audit that kept every record whole for
// its history check, which held all of the journal's trajectories at once.
TEST(AuditMemory, TheWholeJournalAuditHoldsNoTrajectoryTokens) {
  TempDir dir;
  const int rollouts = 16;
  const int parts = 128;
  const std::size_t token_bytes = WriteTrajectoryJournal(dir.path(), rollouts, parts);
  ASSERT_GE(token_bytes, std::size_t{64} << 20);
  journal::Options ro;
  ro.read_only = true;
  ro.create_if_missing = false;
  auto j = journal::Journal::Open(dir.path(), ro);
  ASSERT_TRUE(j.ok()) << j.status().ToString();

  const std::int64_t before = g_live_bytes.load();
  g_peak_bytes.store(before);
  Result<audit::AuditReport> report = audit::AuditJournal(**j);
  const std::int64_t held_bytes = g_peak_bytes.load() - before;

  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->ok) << audit::FormatReport(*report);
  EXPECT_EQ(report->records, 4u + static_cast<std::uint64_t>(rollouts) * (parts + 2));
  EXPECT_LT(held_bytes, static_cast<std::int64_t>(token_bytes / 4))
      << "the audit held " << held_bytes << " bytes for " << token_bytes
      << " bytes of trajectory tokens";
}

}  // namespace
}  // namespace rc
