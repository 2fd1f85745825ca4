#!/bin/sh
# The CI smoke of one libFuzzer target: every committed input (corpus, regressions) is run, then
# the target fuzzes for a few seconds from them. New units go to a scratch directory in the build
# tree, never into the source tree. usage: run_smoke.sh BINARY SCRATCH MAX_LEN SECONDS [DIR...]
set -eu
bin=$1 scratch=$2 max_len=$3 seconds=$4
shift 4
rm -rf "$scratch"
mkdir -p "$scratch"
dirs=""
for d in "$@"; do
  if [ -d "$d" ]; then dirs="$dirs $d"; fi
done
# shellcheck disable=SC2086  # the directory list is split on purpose (no spaces in these paths)
exec "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len="$max_len" \
  -print_final_stats=1 "$scratch" $dirs
