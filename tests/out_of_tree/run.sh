#!/usr/bin/env bash
# Installs flashdraft from the build tree into a temporary prefix, builds the plugins of this
# folder out of tree against the installed package and drops them into a plugin folder; checks
# that a run selects the kernel and logs its variant name, and that the drafter trains and owns
# its serving folder: written at the end of the run, written again by `flashdraft export` from
# the log, imported by [drafter] init, and a folder of another width refused with a sentence.
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
# (the listing to a file first: `| grep -q` under pipefail fails whenever grep's early exit cuts the listing off)
"$work/prefix/bin/flashdraft" plugins --plugin-path "$work/my-plugins" > "$work/plugins.txt"
grep -q "my_kernel" "$work/plugins.txt" || { echo "installed flashdraft does not list my_kernel"; exit 1; }
"$work/prefix/bin/flashdraft" run "$work/exp.toml" --plugin-path "$work/my-plugins:$build/test-plugins"
"$work/prefix/bin/flashdraft" inspect "$work/runs/oot.h5" | tee "$work/inspect.txt"
grep -q "forward:  my_kernel/dense x6" "$work/inspect.txt" || { echo "log lacks my_kernel/dense forward calls"; exit 1; }
grep -q "backward:  my_kernel/dense x6" "$work/inspect.txt" || { echo "log lacks my_kernel/dense backward calls"; exit 1; }
echo "out-of-tree plugin: built against the installed package, selected, and logged"

fd="$work/prefix/bin/flashdraft"
paths="$work/my-plugins:$build/test-plugins"
drafter_exp() {  # name steps heads init
  cat <<TOML
[run]
name = "$1"
steps = $2
out = "$work/runs"
[drafter]
plugin = "my_drafter"
heads = $3
init = "$4"
[dataset]
plugin = "toy_data"
[mask]
plugin = "causal"
[attention]
kernels = ["dense_ref"]
TOML
}
drafter_exp mine 3 2 "" > "$work/mine.toml"
"$fd" run "$work/mine.toml" --plugin-path "$paths" | tee "$work/mine.txt"
grep -q "drafter (my drafter folder, float32): $work/runs/mine.hf" "$work/mine.txt" \
  || { echo "the run did not write the drafter's own folder"; exit 1; }
grep -q '"architectures": \["MyDrafter"\]' "$work/runs/mine.hf/config.json" || { echo "config.json is not the drafter's"; exit 1; }
"$fd" export "$work/runs/mine.h5" --format hf "$work/again" --plugin-path "$paths"
cmp "$work/runs/mine.hf/model.safetensors" "$work/again/model.safetensors" \
  && cmp "$work/runs/mine.hf/config.json" "$work/again/config.json" \
  || { echo "flashdraft export wrote another folder than the run"; exit 1; }
if "$fd" export "$work/runs/mine.h5" --format hf "$work/nowhere" > "$work/noplugin.txt" 2>&1; then
  echo "export without the drafter's plugin folder succeeded"; exit 1
fi
grep 'the run trained the drafter plugin "my_drafter"' "$work/noplugin.txt" || { cat "$work/noplugin.txt"; exit 1; }
drafter_exp imported 1 2 "$work/runs/mine.hf" > "$work/imported.toml"
"$fd" run "$work/imported.toml" --plugin-path "$paths" | tee "$work/imported.txt"
grep -q "drafter: initial weights from $work/runs/mine.hf (my drafter folder)" "$work/imported.txt" \
  || { echo "init did not import the drafter's folder"; exit 1; }
drafter_exp wider 1 4 "$work/runs/mine.hf" > "$work/wider.toml"
if "$fd" run "$work/wider.toml" --plugin-path "$paths" > "$work/wider.txt" 2>&1; then
  echo "a folder of another width was imported"; exit 1
fi
grep 'init: cannot initialise the drafter from .*"width": 16' "$work/wider.txt" || { cat "$work/wider.txt"; exit 1; }
echo "out-of-tree drafter: trained, its own folder written by the run and by export, imported, a wrong one refused"
