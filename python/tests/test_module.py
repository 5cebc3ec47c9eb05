"""The module itself: what it says of its version."""
import os
import re
import subprocess

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
