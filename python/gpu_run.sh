#!/bin/bash
# Builds the Python binding on the GPU machine (its python3, gcc) against the
# C library built and carried from a development machine, then runs the
# Python suite there (CUDA tests included) and the Python benchmarks.
#   bash python/gpu_run.sh OUTDIR        (docs/PYTHON.md, GPU.md)
# BENCH=0: the suite alone, without the benchmarks. TESTS="...": what pytest
# runs (default python/tests: the whole suite).
# Needs build/libdevpickle.a, build/gpu-libs/{libmsgpackc.a,libxxhash.a} and
# build/gpu-libs/include/xxhash.h (copied from /usr/include here: the GPU
# machine has no xxHash headers, and the extension reads the pointer set's
# table, core/table.h, which includes it).
set -euo pipefail
out=${1:?OUTDIR}
py=${PYTHON:-python3}
pkg=build/gpu-python/devpickle
for f in build/libdevpickle.a build/gpu-libs/libmsgpackc.a build/gpu-libs/libxxhash.a build/gpu-libs/include/xxhash.h; do
  [ -f "$f" ] || { echo "gpu_run.sh: $f is missing (see the top of this script)" >&2; exit 1; }
done
mkdir -p "$pkg"
cp python/devpickle/*.py python/devpickle/*.pyi python/devpickle/py.typed "$pkg/"
inc=$($py -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$($py -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -std=c11 -O2 -g -fPIC -shared -fvisibility=hidden -Wall -Wextra -Wno-missing-field-initializers \
  -Iinclude -Ibuild/gpu-libs/include -I"$inc" python/src/*.c build/libdevpickle.a -Wl,--exclude-libs,ALL \
  build/gpu-libs/libmsgpackc.a build/gpu-libs/libxxhash.a -L/usr/local/cuda/lib64 -lcudart_static -ldl -lrt \
  -lpthread -lm -o "$pkg/_devpickle$suffix"
$py python/build_torch_adapter.py --out "$pkg" 2>&1 | tail -3
export PYTHONPATH=$PWD/build/gpu-python
# the CLI carried with the binaries (run.sh sets LD_LIBRARY_PATH for it): the
# tests that pack frames with it, or compare with it, run here too
[ -n "${DEVPICKLE:-}" ] || [ ! -x build/gpu-bin/devpickle ] || export DEVPICKLE=$PWD/build/gpu-bin/devpickle
$py -c 'import devpickle, torch; torch.ones(1); print("adapter:", devpickle._devpickle._torch_adapter(), torch.__version__)'
$py -m pytest -q -rsx -p no:cacheprovider ${TESTS:-python/tests} 2>&1 | tee "$out/pytest.log" | tail -25 ||
  echo "pytest failed: the benchmarks run all the same" # a failure is in pytest.log
[ "${BENCH:-1}" = 0 ] || $py bench/py_bench.py "$out/py_bench.json" 2>&1 | tee "$out/py_bench.txt"
