#!/usr/bin/env python3
"""Build devpickle's optional torch adapter, devpickle._torch.

    PYTHON build_torch_adapter.py [--dry-run] [--cxx CXX] OUTDIR

Run it with the interpreter the extension is for (or pass --python PY to
re-run under it): it asks that interpreter's torch for its headers, libraries
and C++ ABI, prints the compiler command, and (unless --dry-run) runs it,
writing OUTDIR/_torch<EXT_SUFFIX>. The CUDA functions are compiled in when
torch was built with CUDA, its c10/cuda headers are installed and the CUDA
runtime headers are found ($CUDA_HOME, /usr/local/cuda, or the nvidia pip
packages).

Exit status: 0 built; 3 torch, its C++ headers or Python's headers are
missing (the extension then uses torch's Python API); the compiler's status
when it fails.
"""
import argparse
import glob
import os
import shlex
import subprocess
import sys
import sysconfig

MISSING = 3
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "src", "torch_adapter.cpp")


def missing(msg):
    print("build_torch_adapter: %s; devpickle will use torch's Python API" % msg,
          file=sys.stderr)
    sys.exit(MISSING)


def cuda_include_dir(torch_mod):
    """A directory holding cuda_runtime_api.h, or None."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    # pip wheels of torch ship the CUDA runtime as nvidia-* packages.
    try:
        import nvidia  # noqa: F401  (a namespace package)
        for root in list(nvidia.__path__):
            candidates += sorted(glob.glob(os.path.join(root, "*", "include")))
    except ImportError:
        pass
    for d in candidates:
        if os.path.isfile(os.path.join(d, "cuda_runtime_api.h")):
            return d
    return None


def command(cxx, outdir):
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        missing("torch cannot be imported (%s)" % e)
    torch_dir = os.path.dirname(torch.__file__)
    try:
        from torch.utils import cpp_extension
        incs = list(cpp_extension.include_paths())
        libs = list(cpp_extension.library_paths())
    except Exception:  # cpp_extension needs setuptools; the layout is fixed
        incs = [os.path.join(torch_dir, "include"),
                os.path.join(torch_dir, "include", "torch", "csrc", "api", "include")]
        libs = [os.path.join(torch_dir, "lib")]
    if not any(os.path.isfile(os.path.join(d, "torch", "csrc", "autograd",
                                           "python_variable.h")) for d in incs):
        missing("torch's C++ headers are not installed (no torch/csrc/autograd/"
                "python_variable.h under %s)" % " ".join(incs))
    py_inc = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(py_inc, "Python.h")):
        missing("Python's headers are not installed (no %s/Python.h)" % py_inc)
    ext = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))

    cuda = False
    cuda_inc = None
    if getattr(torch.version, "cuda", None) is not None:
        has_c10_cuda = any(os.path.isfile(os.path.join(d, "c10", "cuda", "CUDAStream.h"))
                           for d in incs)
        cuda_inc = cuda_include_dir(torch)
        if has_c10_cuda and cuda_inc:
            cuda = True
        else:
            print("build_torch_adapter: torch has CUDA %s but %s: building the "
                  "adapter without its CUDA functions"
                  % (torch.version.cuda, "c10/cuda headers are missing"
                     if not has_c10_cuda else "cuda_runtime_api.h was not found"),
                  file=sys.stderr)

    cmd = [cxx, "-O2", "-fPIC", "-shared", "-std=c++17", "-fvisibility=hidden", "-fno-semantic-interposition",
           "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi]
    if cuda:
        cmd.append("-DDP_TORCH_CUDA")
    cmd += ["-I" + os.path.join(HERE, "src"), "-I" + py_inc]
    cmd += ["-isystem" + d for d in incs]
    if cuda:
        cmd.append("-isystem" + cuda_inc)
    cmd += [SOURCE, "-o", os.path.join(outdir, "_torch" + ext)]
    cmd += ["-L" + d for d in libs] + ["-Wl,-rpath," + d for d in libs]
    cmd += ["-ltorch_python", "-ltorch_cpu", "-lc10"]
    if cuda:
        cmd += ["-ltorch_cuda", "-lc10_cuda"]
    return cmd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", help="directory to write _torch<EXT_SUFFIX> into")
    ap.add_argument("--python", help="interpreter to build for (re-runs this script under it)")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--dry-run", action="store_true", help="print the command only")
    a = ap.parse_args()
    if a.python and os.path.realpath(a.python) != os.path.realpath(sys.executable):
        argv = [a.python, os.path.abspath(__file__), a.outdir, "--cxx", a.cxx]
        if a.dry_run:
            argv.append("--dry-run")
        sys.exit(subprocess.call(argv))
    cmd = command(a.cxx, os.path.abspath(a.outdir))
    print(" ".join(shlex.quote(c) for c in cmd))
    sys.stdout.flush()
    if a.dry_run:
        return 0
    os.makedirs(a.outdir, exist_ok=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
