// SHA-256 through EVP: FIPS 180-2 known answers, one shot against streaming, the reused
// per-thread context, and the hex form.
#include "encoding/sha256.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "statemachine/hex.h"

namespace rc::encoding {
namespace {

constexpr char kEmptyHex[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr char kAbcHex[] = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
constexpr char kTwoBlockHex[] = "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1";
constexpr char kTwoBlockInput[] = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";

// Proves the one-shot digest gives the FIPS 180-2 answers for "", "abc" and the two-block
// message; would catch another algorithm, a truncated digest or the length of the wrong buffer.
TEST(Sha256, KnownAnswers) {
  EXPECT_EQ(Sha256Hex(""), kEmptyHex);
  EXPECT_EQ(Sha256Hex("abc"), kAbcHex);
  EXPECT_EQ(Sha256Hex(kTwoBlockInput), kTwoBlockHex);
  EXPECT_EQ(hex::encode(Sha256("abc")), kAbcHex);
}

// Proves the one-shot digest does not depend on what the thread hashed before (its context is
// reused); would catch state carried over from one digest into the next.
TEST(Sha256, ReusedContextStartsClean) {
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Sha256Hex(std::string(1000, 'x')), Sha256Hex(std::string(1000, 'x')));
    EXPECT_EQ(Sha256Hex("abc"), kAbcHex);
  }
}

// Proves every thread gets the same answers at once; would catch a context shared between
// threads (interleaved updates give wrong digests).
TEST(Sha256, ThreadsDoNotShareAContext) {
  std::vector<std::thread> threads;
  std::vector<int> wrong(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &wrong] {
      for (int i = 0; i < 2000; ++i) wrong[t] += Sha256Hex(kTwoBlockInput) != kTwoBlockHex;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong, std::vector<int>(4, 0));
}

// Proves streaming in pieces of any size equals the one-shot digest and that Finish() starts the
// hasher over; would catch a lost or repeated piece, or a second Finish() continuing the first.
TEST(Sha256, StreamingEqualsOneShot) {
  std::string input;
  for (int i = 0; i < 5000; ++i) input.push_back(static_cast<char>(i * 131 + 7));
  for (std::size_t piece : {1u, 3u, 63u, 64u, 65u, 4096u}) {
    Sha256Hasher h;
    for (std::size_t at = 0; at < input.size(); at += piece)
      h.Update(std::string_view(input).substr(at, piece));
    EXPECT_EQ(h.Finish(), Sha256(input)) << piece;
  }
  Sha256Hasher h;
  h.Update("ab");
  h.Update("c");
  EXPECT_EQ(hex::encode(h.Finish()), kAbcHex);
  EXPECT_EQ(hex::encode(h.Finish()), kEmptyHex);
}

}  // namespace
}  // namespace rc::encoding
