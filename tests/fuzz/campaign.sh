#!/bin/bash
# Long fuzzing campaigns (make fuzz-campaign) and corpus minimisation (make fuzz-merge).
#   campaign.sh run   BUILD_DIR RUNS TARGET...  each target from its committed corpus for RUNS
#                                               executions, one process per target; the log, new
#                                               units and any crash go to BUILD_DIR/campaign/T/
#   campaign.sh merge BUILD_DIR TARGET...       minimises committed corpus + campaign units with
#                                               -merge=1, then keeps a greedy cover of at most 200
#                                               inputs (select_corpus.py) in tests/fuzz/corpus/T/
# The last lines of each log carry libFuzzer's final stats (executions, exec/s) for RESULTS.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mode=$1 build=$2
shift 2

max_len() {
  case $1 in
    decoder_fuzz) echo 65600 ;;
    api_fuzz | proxy_stream_fuzz) echo 2048 ;;
    *) echo 4096 ;;
  esac
}

run_one() {
  local t=$1 runs=$2 dir=$build/campaign/$1
  rm -rf "$dir" && mkdir -p "$dir/corpus" "$dir/artifacts"
  local start end rc=0
  start=$(date +%s)
  "$build/tests/fuzz/$t" -runs="$runs" -max_len="$(max_len "$t")" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$dir/artifacts/" "$dir/corpus" "$here/corpus/$t" \
    > "$dir/log" 2>&1 || rc=$?
  end=$(date +%s)
  local execs rate
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$dir/log" | grep -o '[0-9]*$' || echo 0)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$dir/log" | grep -o '[0-9]*$' || echo 0)
  local crashes
  crashes=$(find "$dir/artifacts" -type f | wc -l)
  echo "$t: rc=$rc executions=$execs seconds=$((end - start)) exec/s=$rate artifacts=$crashes" \
    | tee "$dir/summary"
}

case $mode in
  run)
    runs=$1
    shift
    for t in "$@"; do run_one "$t" "$runs"; done
    ;;
  merge)
    for t in "$@"; do
      tmp=$(mktemp -d)
      mkdir -p "$tmp/merged" "$build/campaign/$t/corpus"
      "$build/tests/fuzz/$t" -merge=1 -merge_control_file="$tmp/control" -max_len="$(max_len "$t")" \
        -timeout=10 "$tmp/merged" "$here/corpus/$t" "$build/campaign/$t/corpus" \
        > "$build/campaign/$t/merge.log" 2>&1
      # The control file lists every input's coverage; keep a small greedy cover of it.
      echo "$t: $(python3 "$here/select_corpus.py" "$tmp/control" "$tmp/selected")"
      rm -rf "${here:?}/corpus/$t" && mv "$tmp/selected" "$here/corpus/$t"
      rm -rf "$tmp"
    done
    ;;
  *) echo "usage: $0 run|merge BUILD_DIR ..." >&2; exit 2 ;;
esac
