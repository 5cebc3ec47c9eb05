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
