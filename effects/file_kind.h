// What a file that is not a regular one is, as the refusals of files that must be regular name
// it (a FIFO with no writer blocks its reader for ever; a directory, socket or device is no file
// to read).
#pragma once

#include <sys/stat.h>

namespace rc::effects {

inline const char* NotRegularKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  return "a special file";
}

}  // namespace rc::effects
