"""A PEP 517 build backend for devpickle's binding, with no dependencies, so
that `pip install ./python` works offline: it runs the repository's
`make python` for the interpreter that runs it and zips the package into a
wheel. Only wheels are built (an sdist would lose the C library)."""

import base64
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _repo():
    """REPO, once it is seen to be a devpickle tree: the version and the build
    come from it, so a copy of python/ elsewhere is refused saying so, never
    with a missing file's name."""
    if not all(os.path.isfile(os.path.join(REPO, *f)) for f in (("include", "devpickle", "base.h"), ("Makefile",))):
        raise RuntimeError(f"devpickle: build from the repository (python/ inside its checkout): {REPO} holds no "
                           "devpickle tree (include/devpickle/base.h, Makefile)")
    return REPO


def _version():
    text = open(os.path.join(_repo(), "include", "devpickle", "base.h")).read()
    parts = [re.search(rf"#define DP_VERSION_{p}\s+(\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def _tag():
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{py}-{py}-{plat}"


def _build_dir():
    return os.path.join(REPO, "build", f"pip-{sys.version_info.major}.{sys.version_info.minor}")


def _make():
    _repo()
    build = _build_dir()
    cmd = ["make", "-C", REPO, "python", f"PYTHON={sys.executable}", f"BUILD={build}"]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return os.path.join(build, "python", "devpickle")


def _metadata(version):
    return (f"Metadata-Version: 2.1\nName: devpickle\nVersion: {version}\n"
            "Summary: Find the device memory any Python value references; a stream-aware Future; frames\n"
            "Requires-Python: >=3.11\n")


def _record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    version = _version()
    info = os.path.join(metadata_directory, f"devpickle-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(_metadata(version))
    return os.path.basename(info)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = _version()
    pkg = _make()
    name = f"devpickle-{version}-{_tag()}.whl"
    info = f"devpickle-{version}.dist-info"
    records = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        def put(arc, data):
            z.writestr(arc, data)
            records.append(_record_line(arc, data))

        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        for f in sorted(os.listdir(pkg)):
            if f.endswith((".py", ".pyi", suffix)) or f == "py.typed":
                put(f"devpickle/{f}", open(os.path.join(pkg, f), "rb").read())
        put(f"{info}/METADATA", _metadata(version).encode())
        put(f"{info}/WHEEL", (f"Wheel-Version: 1.0\nGenerator: devpickle_build\nRoot-Is-Purelib: false\n"
                              f"Tag: {_tag()}\n").encode())
        z.writestr(f"{info}/RECORD", "\n".join(records + [f"{info}/RECORD,,"]) + "\n")
    return name
