// Human descriptions of events and states (demo timelines, replay output, logs). They hold text
// from outside verbatim: escape them (rc::text::escape_line) wherever they are printed.
#pragma once

#include <string>

#include "statemachine/events.h"
#include "statemachine/state.h"

namespace rc {

std::string describe(const Event& e);
std::string describe(const State& s);
std::string describe(const HttpEvidence& h);

}  // namespace rc
