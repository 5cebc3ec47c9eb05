#!/bin/sh
# bench/h200.sh OUT — everything a GPU machine call runs, in one go, from
# binaries built here and gathered in one folder (make gpu-bundle, or by hand:
# make gpu-test; copy the binaries to BIN; bundle-libs build/gpu-libs BIN/*):
# the GPU suite, the future's suite on that host, the demo on cuda, every
# benchmark twice (ROUNDS=N: N times), one_row's completion rows in five
# processes each, and the libtorch/PyTorch anchors in the same call.
# BIN (default build) holds test_gpu, test_future, devpickle, bench_future,
# bench_pickler, bench_device and one_row; build/gpu-libs their libraries.
# Results: OUT/gpu.log, OUT/bench.json, OUT/one_row.txt, OUT/anchors.json,
# OUT/machine.txt.
# Before/after: benchmarks of an older commit placed in build/base/ (built
# there, copied) run interleaved with these, into OUT/bench_base.json.
set -u
out=${1:?usage: bench/h200.sh OUT}
bin=${BIN:-build}
export LD_LIBRARY_PATH=build/gpu-libs
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; lscpu | grep 'Model name'; } > "$out/machine.txt" 2>&1
"$bin/test_gpu" --verbose -j1 > "$out/gpu.log" 2>&1; echo "test_gpu rc=$?" >> "$out/gpu.log"
"$bin/test_future" -j1 >> "$out/gpu.log" 2>&1; echo "test_future rc=$?" >> "$out/gpu.log"
"$bin/devpickle" demo >> "$out/gpu.log" 2>&1; echo "demo rc=$?" >> "$out/gpu.log"
for round in $(seq "${ROUNDS:-2}"); do
  for b in bench_future bench_pickler bench_device; do
    "$bin/$b" "$out/bench.json" > /dev/null 2>> "$out/bench.err" || echo "$b failed: $?" >> "$out/bench.err"
    if [ -x build/base/$b ]; then
      build/base/$b "$out/bench_base.json" > /dev/null 2>> "$out/bench.err" || echo "base $b failed: $?" >> "$out/bench.err"
    fi
  done
done
if [ -x "$bin/one_row" ]; then
  for row in "list 1000 40" "list 10000 15" "list 100000 5" "nested 1000 40"; do
    for p in 1 2 3 4 5; do
      # shellcheck disable=SC2086 # the row's words are one_row's arguments
      printf '%s process %s: %s\n' "$row" "$p" "$("$bin/one_row" $row cuda 2>&1)"
    done
  done > "$out/one_row.txt"
fi
sh bench/anchors/run.sh "$out/anchors.json" > "$out/anchors.log" 2>&1
echo done
