#!/usr/bin/env python3
"""Build devpickle's optional torch adapter, devpickle._torch.

    PYTHON build_torch_adapter.py [--dry-run] [--if-available] [--cxx CXX] [--out] OUTDIR

Run it with the interpreter the extension is for (or pass --python PY to
re-run under it): it asks that interpreter's torch for its headers, libraries
and C++ ABI, prints the compiler command, and (unless --dry-run) runs it,
writing OUTDIR/_torch<EXT_SUFFIX> (not again while it is newer than its
sources and the command is the same). The CUDA functions are compiled in when
torch was built with CUDA, its c10/cuda headers are installed and the CUDA
runtime headers are found ($CUDA_HOME, /usr/local/cuda, or the nvidia pip
packages).

Exit status: 0 built (or up to date); 3 torch, its C++ headers or Python's
headers are missing (the extension then uses torch's Python API) — 0 with
--if-available, which says so and builds nothing; the compiler's status when
it fails. When they are missing, an adapter an earlier build left in OUTDIR
is removed (saying so), so that OUTDIR's package never loads one built
against another torch.
"""
import argparse
import contextlib
import glob
import io
import os
import shlex
import subprocess
import sys
import sysconfig

MISSING = 3
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "src", "torch_adapter.cpp")
DEPENDS = [SOURCE, os.path.join(HERE, "src", "torch_api.h"), os.path.abspath(__file__)]
STAMP = ".torch_adapter.cmd"  # the command that built OUTDIR's adapter
if_available = False
stale = []  # what an earlier build left in OUTDIR: the adapter and its stamp


def missing(msg):
    # an adapter an earlier build left in OUTDIR (built against another
    # environment's torch) would otherwise be packaged and loaded as this one
    removed = []
    for path in stale:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    note = "; removed %s, an earlier build's" % stale[0] if stale and stale[0] in removed else ""
    print("build_torch_adapter: %s; devpickle will use torch's Python API%s" % (msg, note),
          file=sys.stderr)
    sys.exit(0 if if_available else MISSING)


def up_to_date(cmd, target, stamp):
    try:
        with open(stamp) as f:
            if f.read() != cmd:
                return False
        t = os.path.getmtime(target)
        return all(os.path.getmtime(d) < t for d in DEPENDS)
    except OSError:
        return False


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
        # importing cpp_extension prints torch's own notes on where it would
        # find CUDA for its extension builds ("No CUDA runtime is found, using
        # CUDA_HOME=..." on any machine without a GPU): not this build's, which
        # says below what it does about CUDA
        with contextlib.redirect_stderr(io.StringIO()):
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
    ap.add_argument("outdir", nargs="?", help="directory to write _torch<EXT_SUFFIX> into")
    ap.add_argument("--out", help="the same as OUTDIR")
    ap.add_argument("--if-available", action="store_true",
                    help="exit 0, building nothing, when torch or its headers are missing")
    ap.add_argument("--python", help="interpreter to build for (re-runs this script under it)")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--dry-run", action="store_true", help="print the command only")
    a = ap.parse_args()
    outdir = a.out or a.outdir
    if not outdir or (a.out and a.outdir and a.out != a.outdir):
        ap.error("give the output directory once, as OUTDIR or --out")
    if a.python and os.path.realpath(a.python) != os.path.realpath(sys.executable):
        argv = [a.python, os.path.abspath(__file__), outdir, "--cxx", a.cxx]
        argv += ["--dry-run"] * a.dry_run + ["--if-available"] * a.if_available
        sys.exit(subprocess.call(argv))
    global if_available
    if_available = a.if_available
    if not a.dry_run:
        ext = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        stale[:] = [os.path.join(outdir, "_torch" + ext), os.path.join(outdir, STAMP)]
    cmd = command(a.cxx, os.path.abspath(outdir))
    line = " ".join(shlex.quote(c) for c in cmd)
    target, stamp = cmd[cmd.index("-o") + 1], os.path.join(outdir, STAMP)
    if not a.dry_run and up_to_date(line, target, stamp):
        return 0
    print(line)
    sys.stdout.flush()
    if a.dry_run:
        return 0
    os.makedirs(outdir, exist_ok=True)
    try:
        os.unlink(stamp)
    except OSError:
        pass
    rc = subprocess.call(cmd)
    if rc == 0:
        with open(stamp, "w") as f:
            f.write(line)
    return rc


if __name__ == "__main__":
    sys.exit(main())
