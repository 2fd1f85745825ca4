// `rolloutcore demo --fleet N`: serve in front of N engine doubles (fleet_demo.cc).
#pragma once

#include <string>

namespace rc::cli {

// The fleet scenario; 0 when every step went as the contract says. Needs the service (serve).
int run_fleet_demo(const std::string& journal_path, int engines, int token_delay_ms);

}  // namespace rc::cli
