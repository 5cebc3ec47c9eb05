# Types of the C extension devpickle._devpickle, for type checkers and
# editors (PEP 561; the package carries py.typed). docs/PYTHON.md says what
# each does. python/tests/test_module.py checks that every name and every
# parameter here is the module's own.
from typing import Any, Callable, Generic, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

from ._frames import Buffer

__version__: str

_T = TypeVar("_T")
_S = TypeVar("_S")

_Device = Union[int, str, Any]  # an int is a CUDA index; else its str(): "cuda:0", "cpu", "host:1", a torch.device


class Error(RuntimeError):
    """An error of the devpickle library."""
    code: Optional[str]  # the library's code: "DP_EDEVICE", ...; None on one made by hand


class WalkError(TypeError):
    """A value that cannot be walked."""
    type_name: Optional[str]  # None on one made by hand, as WalkError("why")
    path: Optional[str]


class FrameError(ValueError):
    """A frame loads() refuses."""
    code: Optional[str]
    offset: Optional[int]  # the byte of the frame where the refusal is; None on one made by hand


class Allocation:
    """One allocation scan() found; read-only, also a mapping of its five fields."""
    _fields: Tuple[str, str, str, str, str]

    @property
    def device(self) -> str: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def refs(self) -> int: ...
    @property
    def path(self) -> Optional[str]: ...
    def __getitem__(self, key: str, /) -> Any: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __iter__(self, /) -> Iterator[str]: ...
    def __len__(self, /) -> int: ...
    def get(self, key: str, default: Any = None, /) -> Any: ...
    def keys(self, /) -> Tuple[str, ...]: ...
    def values(self, /) -> Tuple[Any, ...]: ...
    def items(self, /) -> Tuple[Tuple[str, Any], ...]: ...
    def _asdict(self, /) -> dict: ...


class Future(Generic[_T]):
    """torch.futures.Future's interface, stream-aware."""

    def __init__(self, *, devices: Optional[Sequence[_Device]] = None,
                 opaque: Union[None, type, Iterable[type]] = ()) -> None: ...
    def done(self, /) -> bool: ...
    def wait(self, /) -> _T: ...
    def value(self, /) -> _T: ...
    def then(self, /, callback: Callable[["Future[_T]"], _S]) -> "Future[_S]": ...
    def add_done_callback(self, /, callback: Callable[["Future[_T]"], None]) -> None: ...
    def set_result(self, /, result: _T) -> None: ...
    def set_exception(self, /, result: Exception) -> None: ...  # an Exception instance: TypeError for others


def scan(obj: Any, *, paths: bool = True, opaque: Union[None, type, Iterable[type]] = ()) -> List[Allocation]: ...


def dumps(obj: Any, *, inline: bool = False, buffer_callback: Optional[Callable[[Buffer], Any]] = None) -> bytes: ...


def loads(data: Any, *, buffers: Optional[Sequence[Any]] = None,
          # a class, a function, an object dumps carries by name (torch.float16), or an iterable of them
          classes: Union[None, type, Callable[..., Any], Iterable[object], object] = (),
          max_copies: Optional[int] = None) -> Any: ...


def collect_all(futures: Iterable[Future[Any]]) -> Future[List[Future[Any]]]: ...


def wait_all(futures: Iterable[Future[Any]]) -> List[Any]: ...
