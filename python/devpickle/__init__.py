"""devpickle: find the device memory any Python value references, a
stream-aware Future with torch.futures.Future's interface, and devpickle
frames with out-of-band buffers.

    scan(obj, *, paths=True, opaque=())      -> [Allocation(device, ptr, nbytes, refs, path)]
    Future(*, devices=None, opaque=())       torch.futures.Future's interface
    collect_all(futures), wait_all(futures)
    dumps(obj, *, inline=False, buffer_callback=None) -> bytes
    loads(data, *, buffers=None, classes=(), max_copies=None) -> object

See docs/PYTHON.md for the walk rules, the streams and the GIL.
__version__ is the version of the devpickle library the module is built on.
"""

try:
    from . import _devpickle  # noqa: F401
except ImportError as e:
    import importlib.util

    if importlib.util.find_spec(__name__ + "._devpickle") is not None:  # there, and failing to load: its own error
        raise
    # the source tree's package, with no extension built into it
    raise ImportError(
        f"devpickle's extension is not in {__path__[0]}: this is the source tree's package (python/devpickle), "
        "which shadows a built one when Python runs inside python/; run from another directory, with "
        "PYTHONPATH=$PWD/build/python after 'make python' in the checkout, or after 'pip install ./python'",
        name=__name__ + "._devpickle") from e

from ._devpickle import (  # noqa: F401
    __version__,
    Allocation,
    Error,
    FrameError,
    Future,
    WalkError,
    collect_all,
    dumps,
    loads,
    scan,
    wait_all,
)
from ._frames import Buffer  # noqa: F401
from ._object import Object  # noqa: F401

__all__ = [
    "Allocation",
    "Buffer",
    "Error",
    "FrameError",
    "Future",
    "Object",
    "WalkError",
    "collect_all",
    "dumps",
    "loads",
    "scan",
    "wait_all",
]

# An Allocation reads as a read-only mapping of its fields (keys, items, get,
# in, len, dict(a)): isinstance(a, Mapping) says so.
import collections.abc as _abc  # noqa: E402

_abc.Mapping.register(Allocation)
