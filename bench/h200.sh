#!/bin/sh
# bench/h200.sh OUT — everything a GPU machine call runs, in one go, from
# binaries built here (make gpu-test; bundle-libs build/gpu-libs ...):
# the GPU suite, the future's suite on that host, the demo on cuda, every
# benchmark twice (ROUNDS=N: N times), and the libtorch/PyTorch anchors in the same call.
# Results: OUT/gpu.log, OUT/bench.json, OUT/anchors.json, OUT/machine.txt.
# Before/after: benchmarks of an older commit placed in build/base/ (built
# there, copied) run interleaved with these, into OUT/bench_base.json.
set -u
out=${1:?usage: bench/h200.sh OUT}
export LD_LIBRARY_PATH=build/gpu-libs
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; lscpu | grep 'Model name'; } > "$out/machine.txt" 2>&1
build/test_gpu --verbose -j1 > "$out/gpu.log" 2>&1; echo "test_gpu rc=$?" >> "$out/gpu.log"
build/test_future -j1 >> "$out/gpu.log" 2>&1; echo "test_future rc=$?" >> "$out/gpu.log"
build/devpickle demo >> "$out/gpu.log" 2>&1; echo "demo rc=$?" >> "$out/gpu.log"
for round in $(seq "${ROUNDS:-2}"); do
  for b in bench_future bench_pickler bench_device; do
    build/$b "$out/bench.json" > /dev/null 2>> "$out/bench.err" || echo "$b failed: $?" >> "$out/bench.err"
    if [ -x build/base/$b ]; then
      build/base/$b "$out/bench_base.json" > /dev/null 2>> "$out/bench.err" || echo "base $b failed: $?" >> "$out/bench.err"
    fi
  done
done
sh bench/anchors/run.sh "$out/anchors.json" > "$out/anchors.log" 2>&1
echo done
