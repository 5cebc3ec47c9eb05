#!/bin/sh
# Builds and runs the libtorch anchors on the GPU machine (PyTorch installed
# there), appending their rows to the file given (default build/bench.json).
set -u
out=${1:-build/bench.json}
torch=$(python3 -c "import torch, os; print(os.path.dirname(torch.__file__))")
abi=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
mkdir -p build
if g++ -O2 -std=c++17 -D_GLIBCXX_USE_CXX11_ABI="$abi" bench/anchors/torch_future.cpp -o build/torch_future \
     -I"$torch/include" -I"$torch/include/torch/csrc/api/include" -I/usr/local/cuda/include \
     -L"$torch/lib" -Wl,-rpath,"$torch/lib" -ltorch -ltorch_cpu -ltorch_cuda -lc10 -lc10_cuda 2> build/torch_future.build.log; then
  build/torch_future | tee -a "$out"
else
  echo "anchor: libtorch C++ build failed (build/torch_future.build.log):"; tail -5 build/torch_future.build.log
fi
python3 bench/anchors/torch_future.py | tee -a "$out"
