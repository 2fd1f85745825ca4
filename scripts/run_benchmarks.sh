#!/usr/bin/env bash
# Runs the CPU benchmarks (GPU ones: bench/gpu/README.md) and prints their side-by-side ratios.
# Usage: scripts/run_benchmarks.sh BUILD_DIR
set -euo pipefail
build=${1:-build}
echo "== load: $(uptime)"
echo "== journal (fold, replay, durable appends with and without group commit)"
"$build/bench/journal/journal_bench"
echo "== control plane (one update cycle against the vLLM double, journal fsync'd and not)"
"$build/bench/control_plane/control_plane_bench"
echo "== fleet (an all-mode update over 8 doubles against one engine's, interleaved)"
"$build/bench/control_plane/fleet_update_bench"
echo "== proxy (added latency and requests/s through rolloutcore serve versus direct)"
"$build/bench/service/service_proxy_bench"
