# flashdraft: the README's two commands.
#   make run   installs what is missing, builds, runs experiments/quickstart.toml
#   make test  installs what is missing, builds, runs every test
#   make check AREA=masks  the tests of one area (seconds)
# Variables: BUILD (build folder), BUILD_TYPE, JOBS, TORCH_PREFIX (another LibTorch),
# EXTRA_PREFIX (more CMake prefixes, e.g. an unpacked TOML++), RUN_ARGS.
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
EXTRA_PREFIX ?=
RUN_ARGS ?=
export TORCH_PREFIX

.PHONY: all deps configure build run test check clean

all: build

deps:
	@bash scripts/install-deps

$(BUILD)/CMakeCache.txt:
	@$(MAKE) --no-print-directory deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DCMAKE_PREFIX_PATH="$$(scripts/torch-prefix)$(if $(EXTRA_PREFIX),;$(EXTRA_PREFIX))"

configure: $(BUILD)/CMakeCache.txt

build: deps configure
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/bin/flashdraft run experiments/quickstart.toml --out runs/quickstart $(RUN_ARGS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 1200 -j $(JOBS)

# The tests of one area (a ctest label: a C++ suite's name without test_, e.g. masks, dflash,
# lm_head_loss; a Python file's, e.g. served_tau; or cpp / python for every one of a kind):
#   make check AREA=masks
AREA ?= cpp
check: build
	cd $(BUILD) && ctest --output-on-failure --timeout 1200 -j $(JOBS) -L '^$(AREA)$$'


clean:
	rm -rf $(BUILD)
