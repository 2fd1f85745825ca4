// Version detection and the init_info / update_info bodies for each protocol line.
#include "effects/http/protocol.h"

#include <gtest/gtest.h>

namespace rc::effects {
namespace {

using nlohmann::json;

Manifest Two() {
  Manifest m;
  m.tensors.push_back({"model.embed_tokens.weight", DType::kBFloat16, {8, 4}});
  m.tensors.push_back({"lm_head.bias", DType::kFloat32, {8}});
  return m;
}

// Proves each released version maps to the right line and rendezvous support; would catch 0.28
// treated as old (packed keys in update_info break it) or uid mode offered to 0.29.
TEST(Protocol, VersionLines) {
  struct Case {
    const char* v;
    ProtocolLine line;
    bool uid;
  };
  const Case cases[] = {
      {"0.25.1", ProtocolLine::kPackedInUpdateInfo, false},
      {"v0.25.0", ProtocolLine::kPackedInUpdateInfo, false},
      {"0.27.3", ProtocolLine::kPackedInUpdateInfo, false},
      {"0.28.0", ProtocolLine::kPackedInInitInfo, false},
      {"0.29.2", ProtocolLine::kPackedInInitInfo, false},
      {"0.30.0", ProtocolLine::kPackedInInitInfo, true},
      {"0.33.0", ProtocolLine::kPackedInInitInfo, true},
      {"0.30.0.post1", ProtocolLine::kPackedInInitInfo, true},
      {"1.0.0", ProtocolLine::kPackedInInitInfo, true},
      // Build-variant local segments are the release's code (wheels for other CUDA/ROCm/CPU).
      {"0.25.1+cu129", ProtocolLine::kPackedInUpdateInfo, false},
      {"0.30.0+cpu", ProtocolLine::kPackedInInitInfo, true},
      {"0.30.0.post1+rocm6.3", ProtocolLine::kPackedInInitInfo, true},
      {"0.25.1+cu129-dirty", ProtocolLine::kUnknown, false},
      {"0.30.0+gabc123", ProtocolLine::kUnknown, false},
      {"0.24.9", ProtocolLine::kUnknown, false},
      {"0.23.1.dev2095+g0fe9a916e", ProtocolLine::kUnknown, false},
      {"0.31.0rc1", ProtocolLine::kUnknown, false},
      {"garbage", ProtocolLine::kUnknown, false},
      {"", ProtocolLine::kUnknown, false},
  };
  for (const Case& c : cases) {
    EngineProtocol p = detect_protocol(c.v);
    EXPECT_EQ(p.line, c.line) << c.v;
    EXPECT_EQ(p.unique_id_rendezvous, c.uid) << c.v;
  }
  EXPECT_TRUE(detect_protocol("0.23.1.dev2095+g0fe9a916e").dev_build);
}

// Proves parse_vllm_version reads X.Y[.Z] with an optional v, caps each number at six digits,
// and marks only suffixes other than .postN and build variants as dev; would catch a trailing
// dot accepted, a seven-digit number read whole, or ".post" read as a pre-release.
TEST(Protocol, ParsesVersionNumbers) {
  struct Case {
    const char* v;
    int major, minor, patch;
    bool dev;
  };
  const Case cases[] = {
      {"0.30.0", 0, 30, 0, false},        {"V1.2", 1, 2, 0, false},
      {"0.30.0.post12", 0, 30, 0, false}, {"0.30.0.post", 0, 30, 0, false},
      {"0.30.0rc1", 0, 30, 0, true},      {"0.30.0+xpu", 0, 30, 0, false},
      {"0.30.0+cu12-4", 0, 30, 0, true},  {"999999.999999.999999", 999999, 999999, 999999, false},
      {"0.1234567", 0, 123456, 0, true},  // the seventh digit is a suffix
  };
  for (const Case& c : cases) {
    Result<SemVer> v = parse_vllm_version(c.v);
    ASSERT_TRUE(v.ok()) << c.v;
    EXPECT_EQ(v->major, c.major) << c.v;
    EXPECT_EQ(v->minor, c.minor) << c.v;
    EXPECT_EQ(v->patch, c.patch) << c.v;
    EXPECT_EQ(v->dev, c.dev) << c.v;
  }
  for (const char* bad : {"0.30.", "0", "0.", ".1.2", "v", "1234567.0"}) {
    EXPECT_FALSE(parse_vllm_version(bad).ok()) << bad;
  }
  EXPECT_FALSE(parse_vllm_version("0.30.0" + std::string(123, 'x')).ok());
  EXPECT_TRUE(parse_vllm_version("0.30.0" + std::string(122, 'x')).ok());
}

// Proves the override wins over the rule; would catch a dev build that can never be used.
TEST(Protocol, OverrideWins) {
  ProtocolOverride o;
  o.line = ProtocolLine::kPackedInInitInfo;
  o.unique_id_rendezvous = true;
  EngineProtocol p = detect_protocol("0.23.1.dev2095+g0fe9a916e", o);
  EXPECT_EQ(p.line, ProtocolLine::kPackedInInitInfo);
  EXPECT_TRUE(p.unique_id_rendezvous);
  ProtocolOverride off;
  off.unique_id_rendezvous = false;
  EXPECT_FALSE(detect_protocol("0.31.0", off).unique_id_rendezvous);
}

// Proves the 0.25 line keeps init_info to four keys and puts packed* in update_info; would catch
// the >= 0.28 layout sent to 0.25 (unknown init_info keys are a TypeError there).
TEST(Protocol, V025Layout) {
  EngineProtocol p = detect_protocol("0.25.1");
  NcclInitParams init{"10.0.0.1", 29555, "", 1, 3};
  Result<json> i = build_init_info(p, init, PackingParams{});
  ASSERT_TRUE(i.ok()) << i.status().ToString();
  EXPECT_EQ(*i, json({{"master_address", "10.0.0.1"},
                      {"master_port", 29555},
                      {"rank_offset", 1},
                      {"world_size", 3}}));
  Result<json> u = build_update_info(p, Two(), PackingParams{true, 1024, 3});
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(*u, json({{"names", {"model.embed_tokens.weight", "lm_head.bias"}},
                      {"dtype_names", {"bfloat16", "float32"}},
                      {"shapes", {{8, 4}, {8}}},
                      {"packed", true},
                      {"packed_buffer_size_bytes", 1024},
                      {"packed_num_buffers", 3}}));
}

// Proves >= 0.28 sends all seven init keys and exactly three update keys; would catch
// packed_buffer_size_bytes left in update_info (a ValueError on >= 0.28, trl#7131).
TEST(Protocol, V028Layout) {
  EngineProtocol p = detect_protocol("0.28.0");
  Result<json> i = build_init_info(p, NcclInitParams{"h", 1234, "", 1, 2}, PackingParams{});
  ASSERT_TRUE(i.ok());
  EXPECT_EQ(*i, json({{"master_address", "h"},
                      {"master_port", 1234},
                      {"rank_offset", 1},
                      {"world_size", 2},
                      {"packed", true},
                      {"packed_buffer_size_bytes", 1073741824},
                      {"packed_num_buffers", 2}}));
  Result<json> u = build_update_info(p, Two(), PackingParams{});
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->size(), 3u);
  EXPECT_FALSE(u->contains("packed"));
}

// Proves uid rendezvous is emitted only where supported and without master_*; would catch
// nccl_unique_id_b64 sent to a 0.28 engine (unknown key) or both modes sent together.
TEST(Protocol, UniqueIdRendezvous) {
  const std::string uid(172, 'A');
  NcclInitParams init;
  init.nccl_unique_id_b64 = uid;
  init.world_size = 2;
  Result<json> ok = build_init_info(detect_protocol("0.30.0"), init, PackingParams{});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*ok)["nccl_unique_id_b64"], uid);
  EXPECT_FALSE(ok->contains("master_address"));
  EXPECT_FALSE(ok->contains("master_port"));
  EXPECT_FALSE(build_init_info(detect_protocol("0.28.0"), init, PackingParams{}).ok());
  init.master_address = "h";
  init.master_port = 1;
  EXPECT_FALSE(build_init_info(detect_protocol("0.30.0"), init, PackingParams{}).ok());
  NcclInitParams short_uid;
  short_uid.nccl_unique_id_b64 = "AAAA";
  short_uid.world_size = 2;
  EXPECT_FALSE(build_init_info(detect_protocol("0.30.0"), short_uid, PackingParams{}).ok());
}

// Proves builders refuse an unknown line and bad inputs; would catch a guess sent to an engine
// whose layout is unknown.
TEST(Protocol, RefusesUnknownAndInvalid) {
  EngineProtocol unknown = detect_protocol("0.23.1.dev1+gabc");
  EXPECT_FALSE(build_init_info(unknown, NcclInitParams{"h", 1, "", 1, 2}, PackingParams{}).ok());
  EXPECT_FALSE(build_update_info(unknown, Two(), PackingParams{}).ok());
  EngineProtocol p = detect_protocol("0.30.0");
  EXPECT_FALSE(build_init_info(p, NcclInitParams{"h", 1, "", 1, 1}, PackingParams{}).ok());
  EXPECT_FALSE(build_init_info(p, NcclInitParams{"", 0, "", 1, 2}, PackingParams{}).ok());
  Manifest dup = Two();
  dup.tensors.push_back(dup.tensors[0]);
  EXPECT_FALSE(build_update_info(p, dup, PackingParams{}).ok());
}

}  // namespace
}  // namespace rc::effects
