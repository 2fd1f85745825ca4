#!/bin/bash
# Format and lint checks of `make test`. Usage: scripts/lint.sh BUILD_DIR
#   1. every tracked C++ file is formatted as .clang-format says (clang-format-14);
#   2. every production translation unit passes .clang-tidy (clang-tidy-14, compile commands
#      of BUILD_DIR), in parallel on every core.
# Exits non-zero naming the files that fail.
set -euo pipefail
build=${1:?usage: scripts/lint.sh BUILD_DIR}
cd "$(dirname "$0")/.."
[ -f "$build/compile_commands.json" ] || { echo "lint: $build/compile_commands.json missing (configure first)" >&2; exit 2; }

mapfile -t sources < <(git ls-files '*.cc' '*.h')
if ! clang-format-14 --dry-run --Werror "${sources[@]}" 2> "$build/format.log"; then
  echo "lint: not formatted (clang-format-14 -i <file> fixes it):" >&2
  grep -o '^[^:]*:' "$build/format.log" | sort -u | sed 's/:$//' >&2
  exit 1
fi

# The production units this build compiled (a build without CUDA has no *_cuda.cc).
mapfile -t units < <(python3 - "$build/compile_commands.json" "$PWD" <<'PY'
import json, os, sys
root = sys.argv[2] + "/"
dirs = ("statemachine/", "encoding/", "journal/", "effects/", "replay/", "audit/", "service/",
        "cli/", "sim/")
seen = set()
for e in json.load(open(sys.argv[1])):
    f = os.path.normpath(os.path.join(e["directory"], e["file"]))
    rel = f[len(root):] if f.startswith(root) else ""
    if rel.startswith(dirs) and "/testing/" not in rel and rel not in seen:
        seen.add(rel)
        print(rel)
PY
)
printf '%s\n' "${units[@]}" |
  xargs -P "$(nproc)" -I{} sh -c 'clang-tidy-14 -p "$0" --quiet "$1" > "$0/tidy.$(echo "$1" | tr / _).log" 2>&1 || echo "$1"' "$build" {} \
  > "$build/tidy.failed"
if [ -s "$build/tidy.failed" ]; then
  echo "lint: clang-tidy failed for:" >&2
  while read -r f; do cat "$build/tidy.$(echo "$f" | tr / _).log" >&2; done < "$build/tidy.failed"
  exit 1
fi
echo "lint: ${#sources[@]} files formatted, ${#units[@]} translation units pass clang-tidy"
