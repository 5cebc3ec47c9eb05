"""python/build_torch_adapter.py: what it does when torch or its headers are
missing (exit 3, or 0 with --if-available, and a message saying why), and the
command it prints when they are there."""
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "build_torch_adapter.py")


def run(args, pythonpath):
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    return subprocess.run([sys.executable, SCRIPT] + args, env=env,
                          capture_output=True, text=True, timeout=120)


def fake_torch(root, body):
    pkg = root / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    return root


def test_exits_3_saying_so_when_torch_cannot_be_imported(tmp_path):
    path = fake_torch(tmp_path, "raise ImportError('no torch here')\n")
    r = run([str(tmp_path / "out")], path)
    assert r.returncode == 3, r.stderr
    assert "torch cannot be imported (no torch here); devpickle will use torch's Python API" in r.stderr
    assert not (tmp_path / "out").exists()


def test_exits_3_when_torch_has_no_cpp_headers_and_0_with_if_available(tmp_path):
    path = fake_torch(tmp_path, "class version:\n    cuda = None\nclass _C:\n    pass\n")
    r = run([str(tmp_path / "out")], path)
    assert r.returncode == 3, r.stderr
    assert "torch's C++ headers are not installed (no torch/csrc/autograd/python_variable.h" in r.stderr
    r = run(["--out", str(tmp_path / "out"), "--if-available"], path)
    assert r.returncode == 0, r.stderr
    assert "torch's C++ headers are not installed" in r.stderr
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_command_for_this_torch(tmp_path):
    torch = pytest.importorskip("torch")
    r = subprocess.run([sys.executable, SCRIPT, "--dry-run", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 3:
        pytest.skip("torch's headers are not installed: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.split()
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    assert "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi in cmd
    for flag in ("-O2", "-fPIC", "-shared", "-std=c++17", "-ltorch_python", "-ltorch_cpu", "-lc10"):
        assert flag in cmd
    import sysconfig
    assert cmd[cmd.index("-o") + 1] == os.path.join(
        str(tmp_path), "_torch" + sysconfig.get_config_var("EXT_SUFFIX"))
    assert ("-DDP_TORCH_CUDA" in cmd) == ("-ltorch_cuda" in cmd) == ("-lc10_cuda" in cmd)
    if torch.version.cuda is None:
        assert "-DDP_TORCH_CUDA" not in cmd
    assert list(tmp_path.iterdir()) == []


def test_torchs_note_on_cuda_home_at_import_is_not_printed_as_this_builds(tmp_path):
    # torch.utils.cpp_extension prints "No CUDA runtime is found, using
    # CUDA_HOME=..." when imported on a machine without a GPU: make python
    # showed it as if the build had a problem
    path = fake_torch(tmp_path, "class version:\n    cuda = None\nclass _C:\n    _GLIBCXX_USE_CXX11_ABI = True\n")
    (path / "torch" / "utils").mkdir()
    (path / "torch" / "utils" / "__init__.py").write_text("")
    inc = tmp_path / "include"
    (inc / "torch" / "csrc" / "autograd").mkdir(parents=True)
    (inc / "torch" / "csrc" / "autograd" / "python_variable.h").write_text("")
    (path / "torch" / "utils" / "cpp_extension.py").write_text(
        "import sys\n"
        "print(\"No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'\", file=sys.stderr)\n"
        f"def include_paths(): return [{str(inc)!r}]\n"
        f"def library_paths(): return [{str(tmp_path / 'lib')!r}]\n")
    r = run(["--dry-run", str(tmp_path / "out")], path)
    if r.returncode == 3:
        pytest.skip("Python's headers are not installed: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "-isystem" + str(inc) in r.stdout.split()


def test_an_earlier_builds_adapter_is_removed_when_torch_is_missing_now(tmp_path):
    # pip's isolated build and a --no-build-isolation one share the build
    # directory: the adapter built against one environment's torch was
    # packaged into the other's wheel, where torch was not even seen
    import sysconfig
    out = tmp_path / "out"
    out.mkdir()
    adapter = out / ("_torch" + sysconfig.get_config_var("EXT_SUFFIX"))
    adapter.write_bytes(b"built against another torch")
    (out / ".torch_adapter.cmd").write_text("g++ ...")
    (tmp_path / "site").mkdir()
    path = fake_torch(tmp_path / "site", "raise ImportError('no torch here')\n")
    r = run(["--out", str(out), "--if-available"], path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == (f"build_torch_adapter: torch cannot be imported (no torch here); devpickle will use torch's "
                        f"Python API; removed {adapter}, an earlier build's\n")
    assert sorted(os.listdir(out)) == []
    r = run(["--out", str(out), "--if-available"], path)
    assert r.stderr == ("build_torch_adapter: torch cannot be imported (no torch here); devpickle will use torch's "
                        "Python API\n")
