# RolloutCore — the two commands users run: `make demo` and `make test`.
# Both install the Debian 12 packages they need (apt, as root), configure, build and run.
SHELL := /bin/bash
BUILD ?= build
FUZZ_BUILD ?= build-fuzz
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

DEB_PACKAGES := cmake ninja-build g++ clang-14 libclang-rt-14-dev pkg-config \
  librocksdb-dev libsnappy-dev liblz4-dev libzstd-dev libbz2-dev zlib1g-dev libgflags-dev \
  flatbuffers-compiler libflatbuffers-dev libspdlog-dev libfmt-dev libcurl4-openssl-dev \
  libgtest-dev libgmock-dev libbenchmark-dev librapidcheck-dev nlohmann-json3-dev libsimdjson-dev \
  libcli11-dev libcpp-httplib-dev libssl-dev libbrotli-dev libboost1.81-dev libtcmalloc-minimal4 \
  clang-format-14 clang-tidy-14 python3 python3-pip python3-venv

.PHONY: all deps configure build lint test test-cpp test-fuzz fuzz-build fuzz-campaign fuzz-merge \
  test-python demo bench clean

all: build

deps:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "Installing Debian packages:" $$missing; \
	  SUDO=$$( [ $$(id -u) -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

configure: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test-cpp: build
	cd $(BUILD) && ctest -LE gpu --output-on-failure -j $(JOBS) --timeout 900

# libFuzzer targets (ASan + UBSan, clang-14) in their own build dir: tests/fuzz/.
FUZZ_TARGETS ?= decoder_fuzz api_fuzz engine_response_fuzz safetensors_fuzz tcp_store_fuzz \
  proxy_stream_fuzz text_fuzz
FUZZ_RUNS ?= 10000000
FUZZ_PARALLEL ?= 1

fuzz-build: deps
	cmake -S . -B $(FUZZ_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DRC_BUILD_FUZZ=ON -DRC_WITH_CUDA=OFF
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_targets

# CI smoke: every target over its committed corpus and regressions, then ~5 s of fuzzing each.
test-fuzz: fuzz-build
	cd $(FUZZ_BUILD) && ctest -L fuzz --output-on-failure

# Long campaigns (tests/fuzz/RESULTS.md): FUZZ_RUNS executions per target, FUZZ_PARALLEL targets
# at once (one core each). Summaries: $(FUZZ_BUILD)/campaign/<target>/summary.
fuzz-campaign: fuzz-build
	printf '%s\n' $(FUZZ_TARGETS) | xargs -P $(FUZZ_PARALLEL) -I{} \
	  tests/fuzz/campaign.sh run $(FUZZ_BUILD) $(FUZZ_RUNS) {}

# Minimises the committed corpora with what the last campaign found (-merge=1).
fuzz-merge:
	tests/fuzz/campaign.sh merge $(FUZZ_BUILD) $(FUZZ_TARGETS)

# The trainer's Python client and the official `openai` client against real `rolloutcore serve` +
# `vllm-double` processes.
# A virtual environment under the build dir: works with Debian's externally managed python3 too.
test-python: build
	python3 -m venv $(BUILD)/venv
	$(BUILD)/venv/bin/python -m pip install --quiet pytest openai ./python
	cd python && RC_BUILD=$(abspath $(BUILD)) $(abspath $(BUILD))/venv/bin/python -m pytest -q tests

# Formatting (.clang-format) and clang-tidy (.clang-tidy) over the tree: scripts/lint.sh.
lint: build
	scripts/lint.sh $(BUILD)

test: test-cpp test-fuzz test-python lint

# Crash loop of the real `rolloutcore serve` under proxied traffic and updates: SOAK_KILLS SIGKILLs
# at seeded random points, each followed by restart + recovery and a check of every answer against
# replay/audit (tests/soak/README.md; figures in tests/soak/RESULTS.md). Not part of `test`: one
# slow recovery (RESULTS.md, finding 1) costs 10 s + drain_timeout_ms, so a short run cannot
# promise to stay under a minute. The script copies the binaries before it starts.
SOAK_KILLS ?= 1000
SOAK_SEED ?= 1
soak-serve: build
	python3 tests/soak/crash_loop.py --build $(BUILD) --kills $(SOAK_KILLS) --seed $(SOAK_SEED)

demo: build
	rm -rf $(BUILD)/demo-journal $(BUILD)/demo-fleet-journal
	./$(BUILD)/cli/rolloutcore demo --journal $(BUILD)/demo-journal
	./$(BUILD)/cli/rolloutcore demo --fleet 3 --journal $(BUILD)/demo-fleet-journal

# The side-by-side proxy benchmark (bench/proxy/README.md): wrk and nginx, installed only for it.
BENCH_PACKAGES := wrk nginx-light
BENCH_PROXY_DURATION ?= 10
.PHONY: bench-deps bench-proxy

bench-deps:
	@missing=$$(for p in $(BENCH_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "Installing Debian packages for the benchmarks:" $$missing; \
	  SUDO=$$( [ $$(id -u) -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

# wrk against the double directly, through nginx and through `rolloutcore serve`, one run.
bench-proxy: build bench-deps
	python3 bench/proxy/compare.py --build $(BUILD) --duration $(BENCH_PROXY_DURATION)

bench: build bench-proxy
	./scripts/run_benchmarks.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(FUZZ_BUILD)

# The simulator's long campaign: disjoint seed ranges in parallel (figures in sim/RESULTS.md).
SOAK_SEEDS ?= 2500
soak: configure
	cmake --build $(BUILD) -j $(JOBS) --target rolloutcore-sim
	rc=0; pids=""; for i in 0 1 2 3; do \
	  ./$(BUILD)/sim/rolloutcore-sim --quiet --seeds $$((100000 + i * 100000)):$$((100000 + i * 100000 + $(SOAK_SEEDS))) & \
	  pids="$$pids $$!"; done; for p in $$pids; do wait $$p || rc=1; done; exit $$rc
