# Sourced by the device scripts: `device_build TARGET...` gives the targets' programs in
# $BUILD. When the call carries build-device/ (scripts/stage-device-build, here) built from
# exactly these sources, against this machine's torch version, with every target staged, and
# its CLI loads every plugin and runs two quickstart steps here, it uses that (no build; the
# libraries from this torch; the staged tests find their plugins through FLASHDRAFT_PLUGIN_DIR).
# Otherwise it configures build-gpu against the GPU machine's torch (tests on, benchmarks off;
# .deps carries TOML++) and builds the targets with -j16; on failure it prints the errors and
# exits the script. Sets ROOT and BUILD. Its logs go to $BUILD_LOGS (/tmp/device-build, not
# $OUT: a call brings back at most 8 files from $OUT, which the scripts' own tables need), and
# whatever refuses the staged build or fails the build is printed from them.
ROOT=$(pwd)
BUILD=$ROOT/build-gpu
BUILD_LOGS=${BUILD_LOGS:-/tmp/device-build}
mkdir -p "$BUILD_LOGS"
# Sets why to the reason the staged build cannot be used, or to nothing (and LD_LIBRARY_PATH to
# its libraries and this torch's, ahead of the runpaths it was linked with) when it can.
staged_build_refusal() {
  local stage=$ROOT/build-device t torch_lib ld
  why=""
  [ -f "$stage/SOURCES.sha256" ] || { why="no build-device/ carried"; return; }
  [ "$(python3 -c 'import torch;print(torch.__version__)')" = "$(cat "$stage/TORCH_VERSION")" ] ||
    { why="staged against torch $(cat "$stage/TORCH_VERSION")"; return; }
  sha256sum --quiet -c "$stage/SOURCES.sha256" > "$BUILD_LOGS/staged-sources.log" 2>&1 ||
    { why="sources changed since it was staged ($(grep -c FAILED "$BUILD_LOGS/staged-sources.log") files)"; return; }
  for t in "$@"; do
    grep -qx "$t" "$stage/TARGETS" || { why="$t was not staged"; return; }
  done
  torch_lib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  ld="$stage/lib:$torch_lib:$(dirname "$torch_lib")/../nvidia/cu13/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  LD_LIBRARY_PATH=$ld "$stage/bin/flashdraft" plugins > "$BUILD_LOGS/staged-plugins.log" 2>&1 ||
    { why="its CLI does not run here: $(grep -m1 -iE "error|cannot|undefined" "$BUILD_LOGS/staged-plugins.log")"; return; }
  ! grep -q "^rejected files" "$BUILD_LOGS/staged-plugins.log" ||
    { why="a plugin does not load here: $(grep -A1 "^rejected files" "$BUILD_LOGS/staged-plugins.log" | tail -1)"; return; }
  # Built against HDF5 1.10.8's headers (Debian 12) and run on this machine's 1.10.10: one
  # soname (libhdf5_serial.so.103), one ABI, but HDF5 aborts on a release-level mismatch
  # unless told not to. The quickstart's first two steps (CPU, dense_ref) write a real log.
  LD_LIBRARY_PATH=$ld HDF5_DISABLE_VERSION_CHECK=2 OMP_NUM_THREADS=4 timeout 120 "$stage/bin/flashdraft" run \
    experiments/quickstart.toml --steps 2 --out /tmp/staged-check > "$BUILD_LOGS/staged-check.log" 2>&1 ||
    { why="its quickstart run failed here: $(grep -m1 -iE "error|abort|mismatch" "$BUILD_LOGS/staged-check.log")"; return; }
  export LD_LIBRARY_PATH=$ld HDF5_DISABLE_VERSION_CHECK=2 FLASHDRAFT_PLUGIN_DIR=$stage/plugins
}
device_build() {
  local t0 rc prefix why
  t0=$(date +%s)
  staged_build_refusal "$@"
  if [ -z "$why" ]; then
    BUILD=$ROOT/build-device
    echo "=== staged build of $* (build-device/, sources match; $(grep -m1 "^plugins (" "$BUILD_LOGS/staged-plugins.log")) in $(( $(date +%s) - t0 )) s"
    return
  fi
  echo "=== building here: the staged build is not used ($why)"
  BUILD=$ROOT/build-gpu
  prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFLASHDRAFT_BUILD_TESTS=ON -DFLASHDRAFT_BUILD_BENCH=OFF \
    -DCMAKE_PREFIX_PATH="$prefix;$ROOT/.deps/usr" > "$BUILD_LOGS/configure.log" 2>&1 ||
    { tail -30 "$BUILD_LOGS/configure.log"; echo "CONFIGURE FAILED"; exit 1; }
  cmake --build "$BUILD" -j16 --target "$@" > "$BUILD_LOGS/build.log" 2>&1
  rc=$?
  echo "=== build of $*: rc $rc in $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || { grep -B2 -A10 -E "error" "$BUILD_LOGS/build.log" | head -50; exit 1; }
}
