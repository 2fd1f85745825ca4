// The bounds of an HTTP message head, applied read by read: the server's request heads
// (http_server.cc) and the proxy's engine answers (proxy_exchange.cc) are parsed with HeadRead
// rather than Beast's async_read_header.
//
// Why: Beast's header_limit counts only the bytes one parse has not consumed (Boost 1.81: the
// fields a parse takes leave the buffer, and the next parse counts from zero), so a head of many
// fields read in small pieces passed any limit; and nothing bounds a head's fields, each a node the
// parser allocates (about 80 bytes for a 4-byte "a:\r\n", 20 times its size). HeadRead counts
// every byte the parser consumed against a byte bound and the fields against a count, after
// every read.
#pragma once

#include <cstddef>
#include <cstdint>

#include <boost/beast/core/error.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/basic_parser.hpp>
#include <boost/beast/http/fields.hpp>
#include <boost/beast/http/parser.hpp>

namespace rc::service {

// Fields of one message, its trailer's included, beyond which it is refused (as Apache's
// LimitRequestFields and Tomcat's maxHeaderCount): a request is answered 431, an engine's answer
// ends its exchange as a protocol error.
inline constexpr std::size_t kHeaderFieldsMax = 100;

// More than `max` fields in `fields` (counted up to max + 1: each is a node the parser made).
bool FieldsOver(const boost::beast::http::fields& fields, std::size_t max);

enum class HeadState : std::uint8_t {
  kIncomplete,     // within the bounds so far: read more into the buffer, then Parse again
  kComplete,       // the whole head, within the bounds
  kTooManyFields,  // more than the field bound
  kFailed,         // `ec`: header_limit past the byte bound, or the parser's own error
};

// One message head being read. Parse after every read into the buffer, until it returns
// anything but kIncomplete.
class HeadRead {
 public:
  explicit HeadRead(std::size_t bytes_max, std::size_t fields_max = kHeaderFieldsMax)
      : bytes_max_(bytes_max), fields_max_(fields_max) {}

  // Feeds what `buffer` holds to `parser` (what it took leaves the buffer), then checks the
  // bounds: the bytes consumed, and while the head is incomplete every byte still buffered (its
  // end is not among them: the parser would have stopped there), at most bytes_max; its fields
  // at most fields_max.
  template <bool isRequest, class Body, class Allocator>
  HeadState Parse(boost::beast::http::parser<isRequest, Body, Allocator>& parser,
                  boost::beast::flat_buffer& buffer, boost::beast::error_code& ec) {
    return Step(parser, parser.get(), buffer, ec);
  }

  std::size_t bytes() const { return bytes_; }  // consumed by the parser so far

 private:
  template <bool isRequest>
  HeadState Step(boost::beast::http::basic_parser<isRequest>& parser,
                 const boost::beast::http::fields& fields, boost::beast::flat_buffer& buffer,
                 boost::beast::error_code& ec);

  std::size_t bytes_max_;
  std::size_t fields_max_;
  std::size_t bytes_ = 0;
};

// A read of a head that failed with `ec`, as Beast's own read reports it: the peer's close is
// end_of_stream before any byte of the message and partial_message after some.
boost::beast::error_code HeadReadError(boost::beast::error_code ec, bool got_some);

}  // namespace rc::service
