#!/usr/bin/env bash
# Installs flashdraft from the build tree into a temporary prefix, builds the kernel
# plugin of this folder out of tree against the installed package, drops it into a
# plugin folder, and checks that a run selects it and logs its variant name.
# Usage: run.sh BUILD_DIR SOURCE_DIR TORCH_PREFIX
set -euo pipefail
build=$1 src=$2 torch_prefix=$3
work=$(mktemp -d /tmp/flashdraft-oot.XXXXXX)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$src/tests/out_of_tree" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix;$torch_prefix" > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" -j 2 > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
mkdir -p "$work/my-plugins"
cp "$work/build/plugins/"*.so "$work/my-plugins/"
cat > "$work/exp.toml" <<TOML
[run]
name = "oot"
steps = 3
out = "$work/runs"
[drafter]
plugin = "toy_drafter"
[dataset]
plugin = "toy_data"
[mask]
plugin = "causal"
[attention]
kernels = ["my_kernel"]
[kernels.my_kernel]
max_len = 4096
TOML
"$work/prefix/bin/flashdraft" plugins --plugin-path "$work/my-plugins" | grep -q "my_kernel" \
  || { echo "installed flashdraft does not list my_kernel"; exit 1; }
"$work/prefix/bin/flashdraft" run "$work/exp.toml" --plugin-path "$work/my-plugins:$build/test-plugins"
"$work/prefix/bin/flashdraft" inspect "$work/runs/oot.h5" | tee "$work/inspect.txt"
grep -q "forward:  my_kernel/dense x6" "$work/inspect.txt" || { echo "log lacks my_kernel/dense forward calls"; exit 1; }
grep -q "backward:  my_kernel/dense x6" "$work/inspect.txt" || { echo "log lacks my_kernel/dense backward calls"; exit 1; }
echo "out-of-tree plugin: built against the installed package, selected, and logged"
