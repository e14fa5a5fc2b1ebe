# Sourced by the device scripts: `device_build TARGET...` configures build-gpu against the GPU
# machine's torch (tests on, benchmarks off; .deps carries TOML++) and builds the targets with
# -j16, logs in $OUT/configure.log and $OUT/build.log; on failure it prints the errors and
# exits the script. Sets ROOT and BUILD.
ROOT=$(pwd)
BUILD=$ROOT/build-gpu
device_build() {
  local t0 rc prefix
  t0=$(date +%s)
  prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFLASHDRAFT_BUILD_TESTS=ON -DFLASHDRAFT_BUILD_BENCH=OFF \
    -DCMAKE_PREFIX_PATH="$prefix;$ROOT/.deps/usr" > "$OUT/configure.log" 2>&1 ||
    { tail -30 "$OUT/configure.log"; echo "CONFIGURE FAILED"; exit 1; }
  cmake --build "$BUILD" -j16 --target "$@" > "$OUT/build.log" 2>&1
  rc=$?
  echo "=== build of $*: rc $rc in $(( $(date +%s) - t0 )) s"
  [ $rc -eq 0 ] || { grep -B2 -A10 -E "error" "$OUT/build.log" | head -50; exit 1; }
}
