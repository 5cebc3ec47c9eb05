import os
import sys

# `make test-python` puts build/python first on sys.path; say so plainly if
# the package was not built.
try:
    import devpickle  # noqa: F401
except ImportError as e:  # pragma: no cover
    sys.exit(f"devpickle is not importable ({e}): run `make python` and set PYTHONPATH=build/python")

os.environ.setdefault("DEVPICKLE_HOST_DEVICES", "2")
