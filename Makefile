# flashdraft: the README's two commands.
#   make run   installs what is missing, builds, runs experiments/quickstart.toml
#   make test  installs what is missing, builds, runs every test
#   make check AREA=masks  the tests of one area (seconds)
# Variables: BUILD (build folder), BUILD_TYPE, JOBS, TEST_JOBS, TORCH_PREFIX (another LibTorch),
# EXTRA_PREFIX (more CMake prefixes, e.g. an unpacked TOML++), RUN_ARGS.
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
# One more test than cores: several tests wait on child processes, servers and timeouts
# (ctest on 2 cores: -j2 174 s, -j3 167 s).
TEST_JOBS ?= $(shell echo $$(( $$(nproc) + 1 )))
EXTRA_PREFIX ?=
RUN_ARGS ?=
export TORCH_PREFIX

.PHONY: all deps configure build run test check clean

all: build

deps:
	@bash scripts/install-deps

$(BUILD)/CMakeCache.txt:
	@$(MAKE) --no-print-directory deps
	@# Ninja where install-deps put it (a fresh build 4 min vs Makefiles' 7, and no make
	@# recursion on every rebuild); Makefiles otherwise.
	G=$$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles"); \
	cmake -S . -B $(BUILD) -G "$$G" -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DCMAKE_PREFIX_PATH="$$(scripts/torch-prefix)$(if $(EXTRA_PREFIX),;$(EXTRA_PREFIX))"

configure: $(BUILD)/CMakeCache.txt

build: deps configure
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/bin/flashdraft run experiments/quickstart.toml --out runs/quickstart $(RUN_ARGS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 1200 -j $(TEST_JOBS)

# The tests of one area (a ctest label: a C++ suite's name without test_, e.g. masks, dflash,
# lm_head_loss; a Python file's, e.g. served_tau; or cpp / python for every one of a kind):
#   make check AREA=masks
AREA ?= cpp
check: build
	cd $(BUILD) && ctest --output-on-failure --timeout 1200 -j $(TEST_JOBS) -L '^$(AREA)$$'


clean:
	rm -rf $(BUILD)
