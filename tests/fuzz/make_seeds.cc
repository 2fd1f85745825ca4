// Writes the decoder fuzz seed corpus: one encoded record per event alternative (selector 0), a
// few encoded snapshots of folded legal histories (selector 1), and fleet snapshots (selector 3:
// an empty fleet, and two engines bootstrapped). usage: make_seeds DIR
#include <cstdio>
#include <fstream>
#include <string>

#include "journal/codec.h"
#include "journal/testing/random_history.h"
#include "tests/journal/test_util.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  int n = 0;
  auto put = [&](char selector, const std::string& bytes) {
    std::ofstream(dir + "/seed-" + std::to_string(n++), std::ios::binary) << selector << bytes;
  };
  for (const rc::Event& e : rc::journal::testing::SampleEvents()) {
    rc::journal::Record r;
    r.seq = 7;
    r.cause_seq = 6;
    r.event = e;
    put('\0', rc::journal::EncodeRecord(r));
  }
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    rc::State s;
    rc::journal::testing::RandomHistory(seed, 60, &s);
    put('\1', rc::journal::EncodeState(s));
  }
  rc::FleetState fleet;
  put('\3', rc::journal::EncodeFleetState(fleet, 0));
  for (const char* engine : {"a", "b"}) {
    RC_CHECK(rc::fleet_step(fleet, rc::FleetEvent{"", rc::EngineJoined{engine}}).ok());
    for (const std::vector<rc::Event>& group : rc::journal::testing::BootstrapGroups()) {
      RC_CHECK(rc::fleet_step(fleet, rc::FleetEvent{engine, group[0]}).ok());
    }
  }
  put('\3', rc::journal::EncodeFleetState(fleet, fleet.events));
  std::printf("%d seeds in %s\n", n, dir.c_str());
  return 0;
}
