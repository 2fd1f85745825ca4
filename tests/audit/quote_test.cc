// text::shell_quote and text::quoted, read back as their readers read them: a command an operator
// copies, parsed by the real /bin/sh, and a report field between quotes, read by a reader that
// takes a doubled quote as one.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "statemachine/quote.h"
#include "statemachine/text.h"
#include "tests/audit/quoting.h"

namespace rc {
namespace {

using quoting_testing::ReadQuoted;
using quoting_testing::ShellWords;

// Printable text every shell gives a meaning to: quotes, separators, substitutions, globs,
// expansions, comments, spaces, a backslash, non-ASCII, and the label from the review. The
// commands they would smuggle in are harmless (echo).
const std::vector<std::string> kShellHostile = {
    "'",
    "''",
    "a'b",
    "rc-7'; echo INJECTED | cat; echo '",
    "$(echo INJECTED)",
    "`echo INJECTED`",
    "${HOME}",
    "a;b",
    "a|b",
    "a&b",
    "a>b",
    "*",
    "?",
    "[a]",
    "{a,b}",
    "~",
    "~root",
    "=ls",
    "a b",
    "  two  spaces  ",
    "\\",
    "a\\'b",
    "\\n",
    "\"",
    "\"$(echo INJECTED)\"",
    "!x",
    "#x",
    "-n",
    "--label",
    "rc-\xc3\xa9t\xc3\xa9",
    "",
};

// Proves every printable value, quotes and shell syntax included, comes back from /bin/sh as
// exactly one argument equal to the value; catches a value put between single quotes with its
// own quotes left as they are (`'a'b'`), which ends the quoting and lets the rest run.
TEST(ShellQuote, ThePrintableRoundTripsThroughTheShellAsOneArgument) {
  for (const std::string& value : kShellHostile) {
    const std::string word = text::shell_quote(value);
    EXPECT_EQ(ShellWords(word), std::vector<std::string>{value})
        << text::escape_line(value) << " printed as " << word;
    EXPECT_TRUE(text::printable_utf8(word)) << text::escape_line(word);
  }
}

// Proves plain words (ids, labels, paths) are printed as they are, and that anything else is
// quoted; catches a quoting that makes every hint unreadable (`'restore-rc-7'`) and one that left
// a leading `~` or `=` (expanded by the shell or zsh) or an empty value (no argument) bare.
TEST(ShellQuote, PlainWordsStayAsTheyAre) {
  for (const std::string plain : {"restore-rc-7", "rc-0", "/var/lib/rc/journal", "a_b@c%d+e:f,g.h",
                                  "safetensors:/ckpt/step-300"}) {
    EXPECT_EQ(text::shell_quote(plain), plain);
  }
  EXPECT_EQ(text::shell_quote(""), "''");
  EXPECT_EQ(text::shell_quote("~root"), "'~root'");
  EXPECT_EQ(text::shell_quote("=ls"), "'=ls'");
  EXPECT_EQ(text::shell_quote("/var/lib/my journal"), "'/var/lib/my journal'");
  EXPECT_EQ(text::shell_quote("rc-7'x"), "'rc-7'\\''x'");
}

// Proves a value that is not printable (a line break, a control, ill-formed UTF-8) is still one
// line and one argument, the escaped text, with its quote kept inside the word; catches a line
// break printed inside the quotes, which splits the line, and an escaping done after quoting.
TEST(ShellQuote, TheUnprintableIsOneEscapedLineAndOneArgument) {
  for (const std::string& value : {std::string("a\nb'; echo INJECTED; '"), std::string("\x1b[2K"),
                                   std::string("a\xff"), std::string("x\xe2\x80\xa8y")}) {
    const std::string word = text::shell_quote(value);
    EXPECT_TRUE(text::printable_utf8(word)) << text::escape_line(word);
    EXPECT_EQ(ShellWords(word), std::vector<std::string>{text::escape_line(value)})
        << text::escape_line(value) << " printed as " << text::escape_line(word);
  }
}

// Proves a field quoted with text::quoted is read back whole by a reader that ends the field at
// the first quote not doubled, whatever quotes it holds; catches `'` + id + `'` (the reader then
// stops at the id's own quote and takes the rest as the line's text).
TEST(Quoted, AFieldIsReadBackWholeAndEndsWhereItSays) {
  const std::vector<std::string> values = {
      "r1' took the engine back to 'rc-good", "'", "''", "", "a''b", "plain"};
  for (const std::string& value : values) {
    const std::string line = "restore " + text::quoted(value) + " took the engine back to 'rc-0'";
    std::size_t pos = std::string("restore ").size();
    EXPECT_EQ(ReadQuoted(line, pos), value) << line;
    EXPECT_EQ(line.substr(pos), " took the engine back to 'rc-0'") << line;
  }
  EXPECT_EQ(text::quoted("a'b"), "'a''b'");
}

}  // namespace
}  // namespace rc
