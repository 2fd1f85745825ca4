#include "effects/nccl/rendezvous.h"

#include <gtest/gtest.h>

namespace rc::effects::nccl {
namespace {

// Proves the pickle has the documented 223-byte protocol-3 layout (opcodes, qualified class
// name, SHORT_BINBYTES 128) with the id bytes at offset 91; catches a wrong module path or a
// length prefix that would make vLLM's unpickle fail or build the wrong class.
TEST(Rendezvous, PickleLayout) {
  UniqueIdBytes id;
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<std::uint8_t>(255 - i);
  const std::string p = PickleNcclUniqueId(id);
  ASSERT_EQ(p.size(), 223u);
  EXPECT_EQ(p.substr(0, 2), std::string("\x80\x03", 2));
  EXPECT_EQ(p.substr(2, 19), "c_ctypes\n_unpickle\n");
  EXPECT_EQ(p.substr(21, 67),
            "cvllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId\n");
  EXPECT_EQ(p[88], '}');
  EXPECT_EQ(p[89], 'C');
  EXPECT_EQ(static_cast<unsigned char>(p[90]), 128);
  EXPECT_EQ(std::string(p.begin() + 91, p.begin() + 219), std::string(id.begin(), id.end()));
  EXPECT_EQ(p.substr(219), std::string("\x86\x86R.", 4));
  auto back = UnpickleNcclUniqueId(p);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, id);
}

// Proves a corrupted or truncated pickle is refused; catches a reader that ignores the layout.
TEST(Rendezvous, UnpickleRejectsDamage) {
  UniqueIdBytes id{};
  std::string p = PickleNcclUniqueId(id);
  EXPECT_FALSE(UnpickleNcclUniqueId(p.substr(0, 222)).ok());
  p[30] = 'X';
  EXPECT_FALSE(UnpickleNcclUniqueId(p).ok());
}

}  // namespace
}  // namespace rc::effects::nccl
