// Real RocksDB journals, and what the CLI tests read back from them, for the tests that run
// `rolloutcore replay` and `rolloutcore audit` as processes.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "journal/journal.h"
#include "journal/json.h"
#include "tests/journal/test_util.h"

namespace rc::cli_testing {

// `s` split at each '\n' (a last line without one included).
inline std::vector<std::string> Lines(const std::string& s) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (std::size_t at = s.find('\n'); at != std::string::npos; at = s.find('\n', start)) {
    out.push_back(s.substr(start, at - start));
    start = at + 1;
  }
  if (start < s.size()) out.push_back(s.substr(start));
  return out;
}

inline journal::Options ReadOnly() {
  journal::Options o;
  o.read_only = true;
  o.create_if_missing = false;
  return o;
}

// The hash of the record at `seq` (it must be there).
inline journal::Hash HashOf(const std::string& path, std::uint64_t seq) {
  auto j = journal::Journal::Open(path, ReadOnly());
  RC_CHECK(j.ok());
  Result<journal::Record> r = (*j)->Read(seq);
  RC_CHECK(r.ok());
  return r->hash;
}

// Bootstrap (seqs 1..4; seq 3 is an input whose decision is seq 4), then `admissions`
// admissions of one record each (seqs 5..: rollouts r0, r1, ...); closed cleanly.
inline void WriteCleanJournal(const std::string& path, int admissions,
                              std::uint64_t snapshot_every = journal::Options{}.snapshot_every) {
  journal::Options o;
  o.snapshot_every = snapshot_every;
  auto j = journal::Journal::Open(path, o);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  for (auto& g : journal::testing::BootstrapGroups()) {
    ASSERT_TRUE((*j)->Append(journal::testing::Group(g)).ok());
  }
  for (int i = 0; i < admissions; ++i) {
    ASSERT_TRUE((*j)->Append(journal::testing::Group(
                                 {make_admission((*j)->state(), "r" + std::to_string(i))}))
                    .ok());
  }
}

// A trajectories file's line for the rollout admitted at `seq`, as serve writes it (the fields
// the audit reads), as a document to edit.
inline nlohmann::json TrajectoryJson(const std::string& path, std::uint64_t seq) {
  auto j = journal::Journal::Open(path, ReadOnly());
  RC_CHECK(j.ok());
  Result<journal::Record> r = (*j)->Read(seq);
  RC_CHECK(r.ok());
  const auto& a = std::get<RolloutAdmitted>(r->event);
  return nlohmann::json{{"rollout_id", a.rollout_id},
                        {"admission_seq", seq},
                        {"version", journal::WeightVersionToJson(a.version)},
                        {"identity", journal::WeightIdentityToJson(a.identity)},
                        {"prompt_token_ids", {1, 2, 3}},
                        {"outputs", {{{"index", 0}, {"token_ids", {4, 5}}}}}};
}

// The same line as text.
inline std::string TrajectoryLine(const std::string& path, std::uint64_t seq) {
  return TrajectoryJson(path, seq).dump();
}

}  // namespace rc::cli_testing
