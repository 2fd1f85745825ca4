// Outside text (ids, labels, paths) placed inside a line of output where quoting gives it its
// bounds: a field between single quotes in a report line, or one argument of a command line an
// operator copies into a shell. Standard library only.
#pragma once

#include <string>
#include <string_view>

namespace rc::text {

// `s` between single quotes with each single quote inside it doubled (`a'b` -> `'a''b'`), so a
// reader takes the field to end at the first quote not followed by another: no id can close its
// field and forge the rest of the line. Adds no escaping: give it text escape_line() already made
// one line (doubling a quote and escaping a control commute, so the order does not matter).
std::string quoted(std::string_view s);

// `s` as exactly one word of a POSIX shell command line (sh, dash, bash, ksh, zsh), for a command
// a tool prints for an operator to run. A word made only of `A-Z a-z 0-9 _ @ % + : , . / -` (and
// not empty) is left as is (`restore-rc-7`, `/var/lib/rc/journal`); anything else is put between
// single quotes, each single quote in it written `'\''` (close, an escaped quote, reopen), so
// no `;`, `|`, `$(...)`, backquote, glob, space or quote in it is read by the shell.
// The result is always one line of printable text and needs no escape_line() (which would double
// a backslash and so change the word): printable UTF-8 is quoted as is, and the shell hands the
// program exactly `s`; text that is not (a control character, a line break, ill-formed UTF-8) is
// quoted as escape_line() writes it, which stays one argument and one line but names the escaped
// text, not `s`.
std::string shell_quote(std::string_view s);

}  // namespace rc::text
