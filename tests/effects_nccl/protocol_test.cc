#include "effects/nccl/protocol.h"

#include <gtest/gtest.h>

#include <set>

namespace rc::effects::nccl {
namespace {

std::set<std::string> Keys(const nlohmann::json& j) {
  std::set<std::string> k;
  for (auto it = j.begin(); it != j.end(); ++it) k.insert(it.key());
  return k;
}

// Proves the version line is read as documented (0.25 -> packed in update_info, 0.28 -> init,
// >= 0.30 -> unique id; dev builds -> main layout); catches sending keys an engine rejects.
TEST(Protocol, DetectLine) {
  EXPECT_EQ(DetectProtocolLine("0.25.1"), ProtocolLine::kPackedInUpdateInfo);
  EXPECT_EQ(DetectProtocolLine("0.27.0"), ProtocolLine::kPackedInUpdateInfo);
  EXPECT_EQ(DetectProtocolLine("0.28.0"), ProtocolLine::kPackedInInitInfo);
  EXPECT_EQ(DetectProtocolLine("0.30.0"), ProtocolLine::kUniqueIdCapable);
  EXPECT_EQ(DetectProtocolLine("0.33.0"), ProtocolLine::kUniqueIdCapable);
  EXPECT_EQ(DetectProtocolLine("1.0.0"), ProtocolLine::kUniqueIdCapable);
  EXPECT_EQ(DetectProtocolLine("0.23.1rc1.dev2095+g0fe9a916e"), ProtocolLine::kPackedInInitInfo);
  EXPECT_EQ(DetectProtocolLine("garbage"), ProtocolLine::kPackedInInitInfo);
}

// Proves init_info carries exactly the keys each line/mode accepts (vLLM's cls(**dict) rejects
// extras): 4 on 0.25, 7 with packing, unique id without master_*; catches a stray key.
TEST(Protocol, InitInfoKeys) {
  PackingParams p{true, 1234, 3};
  auto old_line = BuildInitInfo(ProtocolLine::kPackedInUpdateInfo, Rendezvous::kTcpStore, "10.0.0.1", 29555, 2, "", p);
  EXPECT_EQ(Keys(old_line), (std::set<std::string>{"master_address", "master_port", "rank_offset", "world_size"}));
  auto main_line = BuildInitInfo(ProtocolLine::kPackedInInitInfo, Rendezvous::kTcpStore, "10.0.0.1", 29555, 3, "", p);
  EXPECT_EQ(Keys(main_line), (std::set<std::string>{"master_address", "master_port", "rank_offset", "world_size",
                                                    "packed", "packed_buffer_size_bytes", "packed_num_buffers"}));
  EXPECT_EQ(main_line["rank_offset"], 1);
  EXPECT_EQ(main_line["world_size"], 3);
  EXPECT_EQ(main_line["master_port"], 29555);
  EXPECT_EQ(main_line["packed_buffer_size_bytes"], 1234);
  EXPECT_EQ(main_line["packed_num_buffers"], 3);
  auto uid = BuildInitInfo(ProtocolLine::kUniqueIdCapable, Rendezvous::kUniqueId, "", 0, 2, "QUJD", p);
  EXPECT_EQ(Keys(uid), (std::set<std::string>{"nccl_unique_id_b64", "rank_offset", "world_size", "packed",
                                              "packed_buffer_size_bytes", "packed_num_buffers"}));
  EXPECT_EQ(uid["nccl_unique_id_b64"], "QUJD");
}

// Proves update_info lists names, torch dtype names and shapes in manifest order, with packing
// keys only on the 0.25 line; catches safetensors dtype names ("BF16") or reordered lists.
TEST(Protocol, UpdateInfo) {
  Manifest m;
  m.tensors = {{"x.weight", DType::kBFloat16, {3, 4}}, {"x.bias", DType::kFloat32, {}}};
  PackingParams p;
  auto j = BuildUpdateInfo(ProtocolLine::kPackedInInitInfo, m, p);
  EXPECT_EQ(Keys(j), (std::set<std::string>{"names", "dtype_names", "shapes"}));
  EXPECT_EQ(j["names"], (nlohmann::json{"x.weight", "x.bias"}));
  EXPECT_EQ(j["dtype_names"], (nlohmann::json{"bfloat16", "float32"}));
  EXPECT_EQ(j["shapes"].dump(), "[[3,4],[]]");
  auto old_line = BuildUpdateInfo(ProtocolLine::kPackedInUpdateInfo, m, p);
  EXPECT_EQ(old_line["packed"], true);
  EXPECT_EQ(old_line["packed_buffer_size_bytes"], 1073741824ull);
  EXPECT_EQ(old_line["packed_num_buffers"], 2);
}

}  // namespace
}  // namespace rc::effects::nccl
