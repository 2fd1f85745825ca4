// Message heads bounded read by read (see head_limits.h).
#include "service/head_limits.h"

#include <boost/asio/error.hpp>
#include <boost/beast/http/error.hpp>

namespace rc::service {

namespace bhttp = boost::beast::http;

bool FieldsOver(const bhttp::fields& fields, std::size_t max) {
  std::size_t n = 0;
  for (auto it = fields.begin(); it != fields.end(); ++it) {
    if (++n > max) return true;
  }
  return false;
}

template <bool isRequest>
HeadState HeadRead::Step(bhttp::basic_parser<isRequest>& parser, const bhttp::fields& fields,
                         boost::beast::flat_buffer& buffer, boost::beast::error_code& ec) {
  ec = {};
  if (buffer.size() > 0) {
    const std::size_t used = parser.put(buffer.data(), ec);
    buffer.consume(used);
    bytes_ += used;
    if (ec == bhttp::error::need_more) ec = {};
  }
  const std::size_t pending = parser.is_header_done() ? 0 : buffer.size();
  if (!ec && bytes_ + pending > bytes_max_) ec = bhttp::error::header_limit;
  if (ec) return HeadState::kFailed;
  if (FieldsOver(fields, fields_max_)) return HeadState::kTooManyFields;
  return parser.is_header_done() ? HeadState::kComplete : HeadState::kIncomplete;
}

template HeadState HeadRead::Step<true>(bhttp::basic_parser<true>&, const bhttp::fields&,
                                        boost::beast::flat_buffer&, boost::beast::error_code&);
template HeadState HeadRead::Step<false>(bhttp::basic_parser<false>&, const bhttp::fields&,
                                         boost::beast::flat_buffer&, boost::beast::error_code&);

boost::beast::error_code HeadReadError(boost::beast::error_code ec, bool got_some) {
  if (ec != boost::asio::error::eof) return ec;
  return got_some ? boost::beast::error_code(bhttp::error::partial_message)
                  : boost::beast::error_code(bhttp::error::end_of_stream);
}

}  // namespace rc::service
