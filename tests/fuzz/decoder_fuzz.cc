// libFuzzer target for the journal decoders. Input: one selector byte (even: record decoder;
// odd: snapshot decoder, of one engine's State when bit 1 is clear, of a fleet when it is set)
// followed by the bytes to decode. Hostile bytes must give a clean
// Corruption, never a crash, a sanitizer report or an out-of-range enum; whatever decodes must
// re-encode to bytes that decode to the same value.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "journal/codec.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((data[0] & 1) == 0) {
    rc::Result<rc::journal::Record> r = rc::journal::DecodeRecord(bytes);
    if (!r.ok()) {
      RC_CHECK(r.status().code() == rc::Code::kCorruption && !r.status().message().empty());
      return 0;
    }
    rc::Result<rc::journal::Record> again =
        rc::journal::DecodeRecord(rc::journal::EncodeRecord(*r));
    RC_CHECK(again.ok() && again->event == r->event && again->seq == r->seq &&
             again->prev_hash == r->prev_hash);
  } else if ((data[0] & 2) != 0) {
    rc::Result<rc::journal::FleetSnapshot> f = rc::journal::DecodeFleetState(bytes);
    if (!f.ok()) {
      RC_CHECK(f.status().code() == rc::Code::kCorruption);
      return 0;
    }
    rc::Result<rc::journal::FleetSnapshot> again =
        rc::journal::DecodeFleetState(rc::journal::EncodeFleetState(f->fleet, f->events));
    RC_CHECK(again.ok() && again->fleet == f->fleet && again->events == f->events);
  } else {
    rc::Result<rc::State> s = rc::journal::DecodeState(bytes);
    if (!s.ok()) {
      RC_CHECK(s.status().code() == rc::Code::kCorruption);
      return 0;
    }
    rc::Result<rc::State> again = rc::journal::DecodeState(rc::journal::EncodeState(*s));
    RC_CHECK(again.ok() && *again == *s);
  }
  return 0;
}
