"""The module itself: its version, and the type stub of its extension."""
import ast
import inspect
import os
import re
import subprocess
import sys

import pytest

import devpickle

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_version_is_the_c_librarys_as_its_headers_give_it():
    text = open(os.path.join(REPO, "include", "devpickle", "base.h")).read()
    parts = [re.search(rf"#define DP_VERSION_{p}\s+(\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    assert devpickle.__version__ == ".".join(parts)
    assert "__version__" not in devpickle.__all__  # a dunder, not part of `from devpickle import *`


def test_version_is_the_one_the_cli_prints():
    cli = os.environ.get("DEVPICKLE")
    if not cli or not os.path.exists(cli):
        pytest.skip("the devpickle CLI is not built (DEVPICKLE unset)")
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True).stdout
    assert out == f"devpickle {devpickle.__version__} (frame format version 1)\n"


# ---- the type stub (_devpickle.pyi) says what the extension has ----

STUB = os.path.join(REPO, "python", "devpickle", "_devpickle.pyi")
KINDS = {
    "posonly": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "kwonly": inspect.Parameter.KEYWORD_ONLY,
}


def _stub():
    return ast.parse(open(STUB).read())


def _params(fn, drop_self):
    """(name, kind, default) of a stub function's parameters."""
    a = fn.args
    out = []
    positional = [(p, "posonly") for p in a.posonlyargs] + [(p, "args") for p in a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for (p, kind), d in zip(positional, defaults):
        out.append((p.arg, KINDS[kind], inspect.Parameter.empty if d is None else ast.literal_eval(d)))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, KINDS["kwonly"], inspect.Parameter.empty if d is None else ast.literal_eval(d)))
    return out[1:] if drop_self else out


def _runtime(obj):
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]


def test_the_stub_names_every_public_name_of_the_extension_and_nothing_else():
    ext = devpickle._devpickle
    stub = {n.name for n in _stub().body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stub |= {n.target.id for n in _stub().body if isinstance(n, ast.AnnAssign)}
    public = {n for n in dir(ext) if not n.startswith("_")} | {"__version__"}
    assert stub == public
    assert {n for n in devpickle.__all__ if hasattr(ext, n)} <= stub


def test_every_function_of_the_stub_has_the_parameters_of_the_extensions():
    for node in _stub().body:
        if isinstance(node, ast.FunctionDef):
            assert _params(node, False) == _runtime(getattr(devpickle, node.name)), node.name


def test_every_method_and_property_of_the_stub_is_the_classs_own_with_its_parameters():
    for cls in (n for n in _stub().body if isinstance(n, ast.ClassDef)):
        runtime = getattr(devpickle, cls.name)
        assert [ast.unparse(b) for b in cls.bases if not ast.unparse(b).startswith("Generic")] == [
            b.__name__ for b in runtime.__bases__ if b is not object], cls.name
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            assert fn.name in vars(runtime), f"{cls.name}.{fn.name}"
            if any(ast.unparse(d) == "property" for d in fn.decorator_list):
                assert inspect.isdatadescriptor(vars(runtime)[fn.name]), f"{cls.name}.{fn.name}"
            elif fn.name == "__init__":  # the class's own signature (a C type's __init__ has none)
                assert _params(fn, True) == _runtime(runtime), cls.name
            else:
                try:
                    want = _runtime(getattr(runtime, fn.name))
                except ValueError:  # a slot wrapper (__len__, ...): CPython gives it no signature
                    assert fn.name.startswith("__"), f"{cls.name}.{fn.name} has no signature"
                    continue
                assert _params(fn, False) == want, f"{cls.name}.{fn.name}"


def test_every_function_of_the_extension_and_method_of_its_future_has_a_signature_private_ones_too():
    # _torch_adapter, which PYTHON.md names, had none (help() showed "_torch_adapter(...)"), nor had
    # _hash_work, Future._allocations, Future._devices and Future.__class_getitem__
    ext = devpickle._devpickle
    for name in dir(ext):
        fn = getattr(ext, name)
        if callable(fn) and not isinstance(fn, type):
            inspect.signature(fn)  # ValueError without one
    assert str(inspect.signature(ext._torch_adapter)) == "()"
    assert str(inspect.signature(ext._hash_work)) == "(items, memo, left, /)"
    for name, method in vars(devpickle.Future).items():
        if callable(method) and not name.startswith("__") or name == "__class_getitem__":
            inspect.signature(getattr(devpickle.Future, name))
    assert str(inspect.signature(devpickle.Future._devices)) == "(self, /)"
    assert str(inspect.signature(devpickle.Future.__class_getitem__)) == "(item, /)"


def test_the_attributes_the_stub_gives_exceptions_are_on_the_exceptions_raised():
    with pytest.raises(devpickle.WalkError) as walk:
        devpickle.scan({"g": (i for i in ())})
    assert (walk.value.type_name, walk.value.path) == ("generator", "$.g")
    with pytest.raises(devpickle.FrameError) as frame:
        devpickle.loads(b"not a frame")
    assert isinstance(frame.value.code, str) and isinstance(frame.value.offset, int)
    for cls in (n for n in _stub().body if isinstance(n, ast.ClassDef) and n.name in ("WalkError", "FrameError")):
        raised = walk.value if cls.name == "WalkError" else frame.value
        for a in (n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)):
            assert hasattr(raised, a), f"{cls.name}.{a}"


def test_an_exception_made_by_hand_reads_the_attributes_the_stub_gives_it_as_None():
    # as a caller's own code raises them (a wrapper re-raising a WalkError),
    # or a test double: the stub's attributes are there, None
    for cls in (n for n in _stub().body if isinstance(n, ast.ClassDef) and n.name in ("Error", "WalkError", "FrameError")):
        made = getattr(devpickle, cls.name)("why")
        assert str(made) == "why"
        for a in (n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)):
            assert getattr(made, a) is None, f"{cls.name}.{a}"
    assert devpickle.FrameError("why", 3).args == ("why", 3)


def test_an_argument_that_subscripts_but_cannot_be_iterated_is_named_in_the_error():
    # typing.List answers PySequence_Check (it subscripts) but iter() refuses
    # it: Python's "'_SpecialGenericAlias' object is not iterable" named no
    # argument; each now does, Python's error kept as the cause
    import typing

    class NoIter:  # subscripts, as typing.List does, but is no iterable
        __iter__ = None

        def __getitem__(self, i):
            return int

    frame = devpickle.dumps(1)
    cases = [
        # (opaque= says what to give for typing.List, a generic alias: its origin)
        (lambda: devpickle.scan([], opaque=NoIter()), "opaque= takes types: a type or an iterable of types, not"),
        (lambda: devpickle.Future(devices=typing.List), "devices must be a list of devices, not"),
        (lambda: devpickle.collect_all(typing.List), "collect_all takes an iterable of devpickle.Future objects"),
        (lambda: devpickle.wait_all(typing.List), "wait_all takes an iterable of devpickle.Future objects"),
        (lambda: devpickle.loads(frame, buffers=typing.List), "buffers= must be a sequence of buffers"),
    ]
    for call, head in cases:
        with pytest.raises(TypeError) as e:
            call()
        assert str(e.value).startswith(head) and ("a '_SpecialGenericAlias'" in str(e.value) or "NoIter" in str(e.value))
        assert isinstance(e.value.__cause__, TypeError) and "not iterable" in str(e.value.__cause__)

    def failing():  # an error while iterating stays the iterator's own
        yield int
        raise TypeError("the iterator's own")
    with pytest.raises(TypeError, match="^the iterator's own$"):
        devpickle.scan([], opaque=failing())


def test_the_stub_admits_None_wherever_the_extension_takes_it():
    # docs/PYTHON.md: scan's opaque= and loads' classes= take None as (),
    # buffers= and max_copies= default to None, buffer_callback= may be None
    frame = devpickle.dumps(1, buffer_callback=None)
    assert devpickle.loads(frame, buffers=None, classes=None, max_copies=None) == 1
    assert devpickle.scan([], opaque=None) == []
    takes_none = {"scan": {"opaque"}, "dumps": {"buffer_callback"}, "loads": {"buffers", "classes", "max_copies"}}
    for fn in (n for n in _stub().body if isinstance(n, ast.FunctionDef) and n.name in takes_none):
        for p in fn.args.args + fn.args.kwonlyargs:
            if p.arg in takes_none[fn.name]:
                text = ast.unparse(p.annotation)
                assert text.startswith("Optional[") or "None" in text, f"{fn.name}({p.arg}: {text})"


def test_the_stub_and_docstrings_say_what_then_and_set_exception_do():
    # docs/PYTHON.md: a then() child fails with torch's RuntimeError wrapping
    # what the callback raised, and set_exception takes an Exception instance
    # only (a KeyboardInterrupt is a TypeError): the stub and help() say so
    fut = devpickle.Future()
    with pytest.raises(TypeError):
        fut.set_exception(KeyboardInterrupt())
    fut.set_result(1)
    with pytest.raises(RuntimeError, match="Got the following error when running the callback") as e:
        fut.then(lambda f: 1 / 0).wait()
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    assert "Got the following error when running the callback" in devpickle.Future.then.__doc__
    assert "__cause__" in devpickle.Future.then.__doc__
    assert "Exception instance" in devpickle.Future.set_exception.__doc__
    cls = next(n for n in _stub().body if isinstance(n, ast.ClassDef) and n.name == "Future")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "set_exception")
    assert ast.unparse(fn.args.args[-1].annotation) == "Exception"


def test_help_of_each_function_says_what_each_of_its_parameters_does():
    # help(devpickle.loads) read "-> object", help(devpickle.scan) named
    # neither paths nor opaque: a user adopting the package from help()
    # learnt nothing of buffers=, classes= or buffer_callback=
    for fn in (devpickle.scan, devpickle.dumps, devpickle.loads, devpickle.collect_all, devpickle.wait_all):
        text = fn.__doc__
        for p in inspect.signature(fn).parameters:
            assert re.search(rf"\b{p}\b", text), f"{fn.__name__}: {p}"
        assert len(text.split()) >= 20, fn.__name__
    assert "Buffer" in devpickle.dumps.__doc__ and "inline=True" in devpickle.dumps.__doc__
    assert "collections.OrderedDict" in devpickle.loads.__doc__  # what a state_dict() needs listed
    assert "devpickle.Object" in devpickle.loads.__doc__ and "FrameError" in devpickle.loads.__doc__
    assert "WalkError" in devpickle.scan.__doc__ and "WalkError" in devpickle.dumps.__doc__


def test_the_pip_build_backend_outside_the_checkout_says_it_must_run_inside_it(tmp_path):
    # `pip install` of a copy of python/ failed with "No such file or
    # directory: '/tmp/include/devpickle/base.h'", from the metadata step,
    # before the check that says what to do
    import shutil

    shutil.copy(os.path.join(REPO, "python", "devpickle_build.py"), tmp_path / "devpickle_build.py")
    code = ("import sys, devpickle_build as b\n"
            "for step in (lambda: b.prepare_metadata_for_build_wheel(sys.argv[1]),\n"
            "             lambda: b.build_wheel(sys.argv[1])):\n"
            "    try: step()\n"
            "    except RuntimeError as e: print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    want = (f"devpickle: build from the repository (python/ inside its checkout): {os.path.dirname(tmp_path)} holds "
            "no devpickle tree (include/devpickle/base.h, Makefile)")
    assert out.stdout.splitlines() == [want, want], out.stderr


@pytest.mark.parametrize("doc", ["README.md", os.path.join("docs", "PYTHON.md")])
def test_every_python_example_of_the_docs_runs_as_written(doc):
    # the examples are what a user copies first; on a machine without CUDA
    # they run with device="cpu", as PYTHON.md's first line says
    import torch

    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert blocks, doc
    for i, code in enumerate(blocks):
        if not torch.cuda.is_available():
            code = code.replace('device="cuda"', 'device="cpu"')
        exec(compile(code, f"{doc} example {i + 1}", "exec"), {"__name__": f"doc_example_{i}"})


def test_the_readmes_pythonpath_line_imports_the_built_package_from_any_directory(tmp_path):
    # README's `PYTHONPATH=... /usr/bin/python3` is run from the repository
    # root; a relative path there would stop working once the user cd's away
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        m = re.search(r"^PYTHONPATH=(\S+) /usr/bin/python3", f.read(), re.M)
    assert m, "README.md shows no PYTHONPATH=... /usr/bin/python3 line"
    path = m.group(1).replace("$PWD", REPO)
    assert os.path.isabs(path), f"README's PYTHONPATH={m.group(1)} imports devpickle only from the repository root"
    assert path == os.path.join(REPO, "build", "python")
    if not os.path.isfile(os.path.join(path, "devpickle", "__init__.py")):
        pytest.skip("make python has not built build/python (another BUILD is under test)")
    out = subprocess.run([sys.executable, "-c", "import devpickle; print(devpickle.__file__)"], cwd=tmp_path,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path))
    assert out.stdout == os.path.join(path, "devpickle", "__init__.py") + "\n", out.stderr


def _make(target, check=False):
    """make TARGET in the checkout, as a user runs it: without the sanitizer
    runtime and options test-asan and test-tsan preload into this
    interpreter (make under ThreadSanitizer's preload crashes), and without
    the flags of the make running this suite (under make -j2 its jobserver's,
    whose descriptors are not passed on: make warns on stderr)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS", "TSAN_OPTIONS",
                        "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return subprocess.run(["make", "--no-print-directory", "-s", "-C", REPO, target], capture_output=True, text=True,
                          env=env, check=check)


def test_make_help_lists_every_target_the_readme_names():
    # a newcomer reads a target's name in README, then `make help` for it
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    named = set(re.findall(r"`make ([a-z][a-z-]*)", text))
    listed = text[text.index("`make help` lists every target"):text.index("The version is written once")]
    named |= {t for t in re.findall(r"`([^`]+)`", listed) if re.fullmatch(r"[a-z][a-z-]*", t)}
    assert {"all", "lib", "cli", "config", "check-install", "install", "uninstall", "clean", "python"} <= named
    out = _make("help", check=True).stdout
    helped = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert sorted(named - helped) == []
    for line in out.splitlines():
        assert len(line.split(None, 1)) == 2, f"make help lists {line.strip()!r} without saying what it does"


def test_make_deps_says_that_every_package_is_present():
    # the suite runs after make deps: with everything present, deps says so
    # (it printed nothing, and a newcomer could not tell it checked anything)
    out = _make("deps")
    missing = re.match(r"devpickle: installing (.*)\n", out.stdout)
    if missing:  # a machine the suite runs on without make deps (the GPU machine's bundle)
        pytest.skip(f"make deps has not run here: it would install {missing.group(1)}")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"devpickle: the Debian packages are present \((\S+ )+pkg-config\)\n", out.stdout), out.stdout
    assert out.stderr == ""


def test_python_run_inside_the_source_tree_says_its_package_shadows_the_built_one():
    # python/devpickle has no extension in it: imported from python/ (the
    # current directory first on sys.path), it shadowed the built package
    # and said only "cannot import name '_devpickle' ... circular import"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", "import devpickle"], cwd=os.path.join(REPO, "python"), env=env,
                       capture_output=True, text=True)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: devpickle's extension is not in " + os.path.join(REPO, "python", "devpickle"))
    assert "shadows a built one when Python runs inside python/" in last and "PYTHONPATH=$PWD/build/python" in last
